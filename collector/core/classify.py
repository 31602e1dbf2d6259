"""Span classification (docs/design.md §3): compact span records in, one :class:`RunInput` per run out.

:class:`TraceState` is incremental so spans may arrive in any order and in any number of batches
(exporters send children before parents; late spans revise a run). A span is classified once its
parent is known; until then it waits in ``_pending``. Classification gives every span a *context*
that its children inherit: the run it belongs to (its outermost workflow-run span), the executor,
and the nearest agent (name and invocation span). From that context:

- a chat span is a turn of its nearest agent's unit (never an outer agent's); a chat span under another
  chat span of the unit (no agent span between) records the same call (stacked instrumentations), so
  each turn keeps its nearest chat-call ancestor and the run is built from outermost calls
  (:func:`_calls`);
- an AgentResponseEvent span (our MAF instrumentation) is a ledger entry of the agent it names;
- an agent span is the ledger only where the profile says the runtime's agent span is independent
  (MAF .NET); MAF Python's re-sums the chat spans under it, which makes the unit ``ledger_derived``.

A unit is (run, executor, agent), compared case-insensitively; its name is the executor id for the
executor's own agent and ``executor/agent`` for any other agent that ran there.
"""

from __future__ import annotations

import copy
import json
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from collector.core.model import (
    Announcement,
    ChatTurn,
    ExecutorRecord,
    LayerDisagreement,
    LedgerEntry,
    RunInput,
    UnattributedChat,
    Usage,
)
from collector.core.profiles import (
    AGENT,
    ANNOUNCEMENT_ATTRIBUTES,
    BRIDGE_EXECUTOR_ATTRIBUTE,
    EXECUTOR,
    LEDGER_SOURCE_ATTRIBUTE,
    LEDGER_SOURCE_BRIDGE,
    OTHER,
    RUN,
    Matcher,
)

LEDGER_SOURCE_AGENT_SPAN = "invoke_agent"


#: What classification reads of a span, worked out once as it is decoded (by the compiled decoder in
#: the same pass, else by :func:`span_facts` from its wanted attributes), so the classifier looks up
#: no attribute: its kind by name (:data:`RUN`, :data:`EXECUTOR`, :data:`AGENT` or :data:`OTHER`),
#: whether it is an AgentResponseEvent, whether it is a chat call, the agent, executor and bridge
#: executor names, whether its executor type hosts an agent, the subject, the error type, the input,
#: output and total tokens, the finish reason, the instrumentation's announcement (the MAF release,
#: its version and status), a chat call's model and provider, and the parts of its counts (cached
#: input read and written, reasoning output).
Facts = tuple[int, bool, bool, str | None, str | None, str | None, bool, str | None, str | None,
              int | None, int | None, int | None, str | None, str | None, str | None, str | None, str | None,
              str | None, int | None, int | None, int | None]
#: Positions in :data:`Facts` (the compiled decoder writes them in this order).
(KIND, BRIDGE, CHAT, AGENT_ID, EXECUTOR_ID, BRIDGE_EXECUTOR, HOSTS_AGENT, SUBJECT, ERROR_TYPE, INPUT, OUTPUT, TOTAL,
 FINISH, MAF_RELEASE, INSTRUMENTATION_VERSION, INSTRUMENTATION_STATUS, MODEL, PROVIDER, CACHE_READ, CACHE_WRITE,
 REASONING) = range(21)
FACTS = 21  # values in Facts
#: How many facts journals of earlier versions wrote (replayed with the later facts unknown).
EARLIER_FACTS = (13, 16, 18)


@dataclass(slots=True)
class SpanRecord:
    """The part of a span that classification reads."""

    trace_id: bytes
    span_id: bytes
    parent_id: bytes
    name: str
    start_ns: int
    #: What classification reads of the span's attributes (:data:`Facts`).
    facts: Facts
    resource_subject: str | None = None
    #: The span's error status description ("" when it has none); None when the status is not ERROR.
    status_error: str | None = None
    #: The resource's ``telemetry.sdk.language`` (which runtime, hence which profile, wrote it).
    sdk_language: str | None = None
    #: The span's end (Unix ns); None when unknown (unset on the wire, or journaled by an earlier version).
    end_ns: int | None = None


#: A chat call while its trace is assembled and in the late window: (input, output and total tokens,
#: finish reason, start, invocation, span id bytes, error, model, provider, the span id of the chat
#: span it is beneath in its unit (None: it is outermost), the parts of its counts (cache read, cache
#: write, reasoning; None: none known), its end where another record of the same call could lie beside
#: it (beneath a chat span, or directly under its agent span; else None), its span name): ~100 bytes
#: less than a ChatTurn with its Usage and hex id (the span id is the very object the trace keys the
#: span by; model, provider and span name strings are shared per trace), and a tuple of atoms the
#: garbage collector stops tracking. bench/late_memory.py: 286 -> 194 bytes a span held for agents of
#: 50 chat calls, 425 -> 377 for agents of 3 (before model, provider, outer call, parts, end and name:
#: six references and an end more now).
_Turn = tuple[int | None, int | None, int | None, str | None, int, str | None, bytes, str | None, str | None,
              str | None, bytes | None, tuple[int | None, int | None, int | None] | None, int | None, str]
#: Positions in :data:`_Turn`.
_T_FINISH, _T_START, _T_INVOCATION, _T_SPAN, _T_ERROR, _T_OUTER, _T_PARTS, _T_END, _T_NAME = 3, 4, 5, 6, 7, 10, 11, 12, 13

#: :attr:`_Unit.direct_name` once its direct chat spans have several names.
_NAMES = "\x00several"

#: Past every span start (a fixed64): a run's earliest start while none is known.
_NO_START = 2**64

#: What a span's children inherit: (run span id, executor key, agent key, agent invocation span id,
#: the nearest chat span above it in the same unit (an agent span starts afresh)). Keys are
#: case-folded; the first spelling seen is kept for display.
Context = tuple[str | None, str | None, str | None, str | None, bytes | None]
_NO_CONTEXT: Context = (None, None, None, None, None)


@dataclass(slots=True)
class _Unit:
    ledger: list[LedgerEntry] = field(default_factory=list)
    #: Its agent's first invocation's start (Unix ns): unnamed agents are numbered in this order.
    started: int = _NO_START
    #: Agent spans of a runtime whose agent span is an independent ledger (.NET).
    agent_spans: list[LedgerEntry] = field(default_factory=list)
    #: Agent spans that only re-sum the chat spans (MAF Python): never a ledger, only counted.
    derived_agent_spans: int = 0
    #: One of them carried usage or a finish reason (with no chat span below it, MAF puts the
    #: AgentResponse's own there): the agent answered something, so it is no idle call.
    derived_reported: bool = False
    #: Chat calls as plain tuples (:data:`_Turn`); they become ChatTurns when the run is built.
    turns: list[_Turn] = field(default_factory=list)
    #: The agent ran directly in its executor (no other agent between): a candidate for "own agent".
    top_level: bool = False
    #: A chat span of the unit lies beneath another (stacked instrumentations): see :func:`_calls`.
    stacked: bool = False
    #: The name of the chat spans directly under the unit's agent span (:data:`_NAMES`: several, which
    #: may be two records of one call side by side: see :func:`_calls`; the usual case, one name, is
    #: built without looking).
    direct_name: str | None = None


@dataclass(slots=True)
class _Executor:
    spans: list[tuple[int, str]] = field(default_factory=list)  # (start, span id) per invocation
    hosts_agent: bool = False  # its type hosts one agent of its own (AgentExecutor)
    #: A workflow ran inside it (a workflow used as its agent): judged by that workflow's agents.
    composite: bool = False
    #: Its ids that carried a per-process id (MAF .NET's ``{Name}_{Id}``), case-folded: the agent
    #: instance's identity, which a caller's ledger span naming the same id joins by.
    instances: set[str] | None = None


@dataclass(slots=True)
class _Run:
    """One workflow run (a workflow-run span and its subtree), or the trace's direct-agent run."""

    span_id: str | None
    subject: str | None = None
    seen: bool = False  # its workflow-run span has arrived (ended)
    executors: dict[str, _Executor] = field(default_factory=lambda: defaultdict(_Executor))
    units: dict[tuple[str | None, str | None], _Unit] = field(default_factory=lambda: defaultdict(_Unit))
    errors: list[str] = field(default_factory=list)
    #: The instrumentation's announcement, from the first span of the run that carries one.
    announcement: Announcement | None = None
    #: The parent of its workflow-run span (callers' ledger spans join the run under the same parent).
    parent_id: bytes = b""
    #: Its workflow-run span's start (Unix ns; None: none arrived, or it had none).
    start_ns: int | None = None
    dirty: bool = False
    revision: int = 0


#: MAF's id of an agent without a name (``str(uuid4())``, also as 32 hex digits): a per-process id
#: that never names a unit (docs/design.md §1).
_PER_PROCESS_ID = re.compile(r"[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}", re.IGNORECASE)


def is_per_process_id(name: str) -> bool:
    return len(name) in (32, 36) and _PER_PROCESS_ID.fullmatch(name) is not None


#: MAF .NET names an agent's host executor ``{Name}_{Id}`` (``GetDescriptiveId``), where the agent's
#: ``Id`` is a per-process uuid unless set: the executor is named by its agent's name (docs/maf.md).
_DOTNET_AGENT_EXECUTOR = re.compile(r"(.+?)_[0-9a-f]{32}", re.IGNORECASE)


def _said(s: SpanRecord) -> Announcement | None:
    """The instrumentation's announcement on a span, if it carries one."""
    if s.facts[INSTRUMENTATION_VERSION] or s.facts[MAF_RELEASE]:
        return Announcement(*s.facts[MAF_RELEASE:INSTRUMENTATION_STATUS + 1])
    return None


def stable_executor(name: str) -> str:
    """An executor id as a unit may carry it: never with a per-process id."""
    found = _DOTNET_AGENT_EXECUTOR.fullmatch(name)
    return found.group(1) if found else name


def workflow_name(name: str | None) -> str | None:
    """A subject, unless it holds a per-process id (MAF 1.23 names an unnamed workflow
    ``WorkflowBuilder-{uuid}``): the run is then named by what comes next (docs/design.md §1)."""
    return None if name is None or _PER_PROCESS_ID.search(name) else name


@lru_cache(maxsize=256)
def _finish_from_text(text: str) -> str | None:
    text = text.strip()
    if not text.startswith("["):
        return text or None
    try:
        return finish_reason(json.loads(text))
    except (ValueError, RecursionError):
        return text or None


def finish_reason(value: Any) -> str | None:
    """First finish reason from a string array or its JSON-encoded form (both MAF runtimes send the latter)."""
    if value is None:
        return None
    if isinstance(value, str):
        return _finish_from_text(value)  # a handful of distinct values: parse each once
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, str) and item.strip():
                return item.strip()
    return None


#: Largest token count kept for one span: more is absurd, and clamping keeps every sum far inside
#: int64 (the store, the proto and the metrics hold int64) while still showing an absurd value.
MAX_TOKENS = 10**12


def _int(value: Any) -> int | None:
    """A token count: a non-negative integer (or integral double, or ASCII digits), clamped."""
    if type(value) is int:  # the usual case (bool is a subclass, not this type)
        return None if value < 0 else value if value <= MAX_TOKENS else MAX_TOKENS
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float):
        value = int(value) if value.is_integer() else None  # nan and inf are not integers
    elif isinstance(value, str):
        text = value.strip()
        value = int(text) if text.isascii() and text.isdigit() and len(text) <= 32 else None
    if not isinstance(value, int) or value < 0:
        return None
    return min(value, MAX_TOKENS)


def _first(attrs: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        value = attrs.get(key)
        if value is not None:
            return value
    return None


def _text(value: Any) -> str | None:
    """An attribute used as a name: strings only (an array or kvlist is no name)."""
    if isinstance(value, str):
        value = value.strip()
        return value or None
    return None


def span_facts(m: Matcher, name: str, attrs: dict[str, Any]) -> Facts:
    """A span's :data:`Facts` from its wanted attributes (the reference the compiled decoder matches)."""
    return (
        m.kind(name),
        attrs.get(LEDGER_SOURCE_ATTRIBUTE) == LEDGER_SOURCE_BRIDGE,
        m.is_chat(name, attrs),
        _text(_first(attrs, m.agent_id_keys)),
        _text(_first(attrs, m.executor_id_keys)),
        _text(attrs.get(BRIDGE_EXECUTOR_ATTRIBUTE)),
        m.is_agent_executor_type(_first(attrs, m.executor_type_keys)),
        _text(_first(attrs, m.subject_keys)),
        _text(_first(attrs, m.error_keys)),
        _int(_first(attrs, m.input_keys)),
        _int(_first(attrs, m.output_keys)),
        _int(_first(attrs, m.total_keys)),
        finish_reason(_first(attrs, m.finish_keys)),
        *(_text(attrs.get(key)) for key in ANNOUNCEMENT_ATTRIBUTES),
        _text(_first(attrs, m.model_keys)),
        _text(_first(attrs, m.provider_keys)),
        _int(_first(attrs, m.cache_read_keys)),
        _int(_first(attrs, m.cache_write_keys)),
        _int(_first(attrs, m.reasoning_keys)),
    )


class TraceState:
    """Everything known about one trace, updated span batch by span batch."""

    __slots__ = ("matcher", "trace_id", "root_span_id", "subject", "_context", "_pending", "_pending_ids",
                 "_runs", "_names", "_fallback_subject", "run_spans_seen", "unusable", "orphaned", "_callers",
                 "_published", "_provisional", "_shared", "_times", "_outside", "_runtime", "_joins",
                 "_withheld", "_unnamed")

    def __init__(self, matcher: Matcher, trace_id: bytes) -> None:
        self.matcher = matcher
        self.trace_id = trace_id
        self.root_span_id: bytes | None = None
        self.subject: str | None = None
        self._fallback_subject: str | None = None
        #: The first ``telemetry.sdk.language`` of the trace's spans (the run's MAF runtime).
        self._runtime: str | None = None
        self._context: dict[bytes, Context] = {}
        self._pending: dict[bytes, list[SpanRecord]] = defaultdict(list)
        self._pending_ids: set[bytes] = set()
        self._runs: dict[str | None, _Run] = {}
        self._names: dict[str, str] = {}  # case-folded key -> first spelling
        #: Some key is a per-process id (an agent without a name, an executor named by one).
        self._unnamed = False
        #: Workflow-run spans received (a trace holding one is ready once quiet, root or not).
        self.run_spans_seen = 0
        #: Spans whose classification failed: ignored on their own (their children inherit around them).
        self.unusable = 0
        #: Spans classified as if parentless because their parent never arrived (a workflow-run
        #: span's parent aside, which may never be exported): spans of the trace are missing.
        self.orphaned = 0
        #: Ledger spans outside any workflow run that name their executor (a caller recording the
        #: workflow's AgentResponseEvents under its own span): (parent id, executor key, its id as
        #: named case-folded, entry, what it announced). Kept: which run each joins is worked out anew
        #: at every publication.
        self._callers: list[tuple[bytes, str, str, LedgerEntry, Announcement | None]] = []
        #: What each run was last published with of the callers' ledger spans (:meth:`_caller_joins`).
        self._joins: dict[str | None, tuple[Any, ...]] = {}
        #: Parent ids of the plain spans outside every workflow run (a caller's, .NET's
        #: ``workflow.session``): how far up a run a caller's ledger span may sit and still join it.
        self._outside: dict[bytes, bytes] = {}
        #: The revision last published of every run, including runs that only a provisional
        #: finalization made (spans classified as if parentless): the next numbers on from it.
        self._published: dict[str | None, int] = {}
        #: Runs were last published provisionally: orphans were resolved on a copy and still wait.
        self._provisional = False
        #: What the orphans alone made of the trace's run of no workflow was withheld from that publication.
        self._withheld = False
        #: One object per distinct model or provider name of the trace, shared by its chat calls.
        self._shared: dict[str, str] = {}
        #: Per run key, the earliest known start and the latest known end of its spans (Unix ns;
        #: :data:`_NO_START` and 0 while none is known), kept apart from the runs: a span outside any
        #: run makes none.
        self._times: dict[str | None, list[int]] = {}

    def add(self, span: SpanRecord) -> bool:
        """Classify one span now if its parent is known (or it has none), else park it.

        Returns False for a span id already seen in this trace (exporters retry).
        """
        sid = span.span_id
        if sid in self._context or sid in self._pending_ids:
            return False
        if span.parent_id == sid:  # self-parented: treat as a root rather than wait for itself
            span.parent_id = b""
        if span.facts[KIND] == RUN:
            self.run_spans_seen += 1
        if not span.parent_id:
            if self.root_span_id is None:
                self.root_span_id = sid
                self.subject = workflow_name(span.facts[SUBJECT])
            self._resolve(span, _NO_CONTEXT)
        elif span.parent_id in self._context:
            self._resolve(span, self._context[span.parent_id])
        else:
            self._pending[span.parent_id].append(span)
            self._pending_ids.add(sid)
        if self._fallback_subject is None and span.resource_subject:
            self._fallback_subject = span.resource_subject
        if self._runtime is None and span.sdk_language:
            self._runtime = span.sdk_language.casefold()
        return True

    def _resolve(self, span: SpanRecord, inherited: Context) -> None:
        # Iterative so that absurdly deep parent chains cannot exhaust the stack.
        stack = [(span, inherited)]
        run_times = self._times
        while stack:
            s, parent = stack.pop()
            try:
                context = self._classify(s, parent)
            except Exception:  # noqa: BLE001 - one span that cannot be classified is ignored on its own
                self.unusable += 1
                context = parent
            self._context[s.span_id] = context
            times = run_times.get(context[0])
            if times is None:
                times = run_times[context[0]] = [_NO_START, 0]
            if 0 < s.start_ns < times[0]:  # 0: unset
                times[0] = s.start_ns
            if s.end_ns is not None and s.end_ns > times[1]:
                times[1] = s.end_ns
            children = self._pending.pop(s.span_id, ())
            if children and self._provisional:  # spans published as parentless got their parent
                self._provisional = False
                for run in self._runs.values():
                    run.dirty = True
            for child in children:
                self._pending_ids.discard(child.span_id)
                stack.append((child, context))

    def _key(self, name: str) -> str:
        key = name.casefold()
        if key not in self._names:
            self._names[key] = name
            self._unnamed = self._unnamed or is_per_process_id(key)
        return key

    def _run(self, key: str | None) -> _Run:
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = _Run(key, revision=self._published.get(key, 0))
        run.dirty = True
        return run

    def _classify(self, s: SpanRecord, parent: Context) -> Context:
        (kind, bridge, chat, agent_id, executor_id, _, hosts_agent, subject, _, i, o, t, finish, _, _, _, model, provider,
         cache_read, cache_write, reasoning) = s.facts
        run_key, executor, agent, invocation, outer = parent
        if bridge:
            self._ledger_span(s, parent)
            return parent
        if run_key is None and kind == OTHER and not chat:  # a caller's span, .NET's workflow.session
            self._outside[s.span_id] = s.parent_id
        if kind == RUN:
            if run_key is None:  # an outermost workflow run; a nested one (sub-workflow) is its outer run's
                run = self._run(s.span_id.hex())
                run.seen = True
                run.subject = workflow_name(subject)
                run.start_ns = s.start_ns or None
                run.parent_id = s.parent_id
                self._announce(run, s)
                if error := self._error(s):
                    run.errors.append(f"workflow: {error}")
                return (run.span_id, None, None, None, None)
            run = self._run(run_key)
            if executor is not None:  # a workflow run as an executor's agent (workflow.AsAIAgent())
                run.executors[executor].composite = True
            if error := self._error(s):
                run.errors.append(f"sub-workflow: {error}")
            return parent
        if kind == EXECUTOR:
            name = executor_id or _suffix(s.name, self.matcher.executor_prefixes)
            if not name:
                return parent
            stable = stable_executor(name)
            key = self._key(stable)
            run = self._run(run_key)
            seen = run.executors[key]
            if stable is not name:
                if seen.instances is None:
                    seen.instances = set()
                seen.instances.add(name.casefold())
            seen.spans.append((s.start_ns, s.span_id.hex()))
            seen.hosts_agent = seen.hosts_agent or hosts_agent
            if error := self._error(s):
                run.errors.append(f"{name}: {error}")
            return (run_key, key, None, None, None)
        if kind == AGENT:
            name = agent_id or _suffix(s.name, self.matcher.agent_prefixes)
            if not name:
                return parent
            key = self._key(name)  # an unnamed agent's per-process id: told apart, named at publication
            run = self._run(run_key)
            self._announce(run, s)
            unit = run.units[(executor, key)]
            unit.top_level = unit.top_level or agent is None
            if 0 < s.start_ns < unit.started:
                unit.started = s.start_ns
            if self._error(s) is None:  # an agent that raised reported nothing
                if self.matcher.agent_span_is_ledger(s.sdk_language):
                    sid = s.span_id.hex()
                    unit.agent_spans.append(LedgerEntry(Usage(i, o, t), finish, s.start_ns, sid, sid))
                else:
                    unit.derived_agent_spans += 1
                    unit.derived_reported = unit.derived_reported or bool(i or o or t) or finish is not None
            return (run_key, executor, key, s.span_id.hex(), None)
        if chat:  # with no agent above it, the unit (executor, None) is a run note, not a unit
            shared = self._shared
            if model is not None:
                model = shared.setdefault(model, model)
            if provider is not None:
                provider = shared.setdefault(provider, provider)
            parts = (None if cache_read is None and cache_write is None and reasoning is None
                     else (cache_read, cache_write, reasoning))
            run = self._runs.get(run_key)
            if run is None:
                run = self._run(run_key)
            else:
                run.dirty = True
            unit = run.units[(executor, agent)]
            name = shared.setdefault(s.name, s.name)
            if outer is not None:
                end = s.end_ns
                unit.stacked = True
            elif invocation is not None and s.parent_id.hex() == invocation:
                end = s.end_ns
                if unit.direct_name is None:
                    unit.direct_name = name
                elif unit.direct_name != name:
                    unit.direct_name = _NAMES
            else:
                end = None
            unit.turns.append((i, o, t, finish, s.start_ns, invocation, s.span_id, self._error(s), model, provider,
                               outer, parts, end, name))
            return (run_key, executor, agent, invocation, s.span_id)  # a chat span beneath is this call
        return parent

    def _ledger_span(self, s: SpanRecord, parent: Context) -> None:
        """An AgentResponseEvent: the response the agent's caller received, where that agent ran."""
        run_key, executor, agent, invocation, _ = parent
        _, _, _, name, _, bridge_executor, _, _, _, i, o, t, finish = s.facts[:FINISH + 1]
        entry = LedgerEntry(Usage(i, o, t), finish, s.start_ns, None, s.span_id.hex())
        if name is None:  # written by the caller (the seed's bridge): names its executor instead
            if bridge_executor is None:
                return
            if run_key is None:  # beside the workflow run, not in it: joins it at publication, if it can
                self._callers.append((s.parent_id, self._key(stable_executor(bridge_executor)),
                                      bridge_executor.casefold(), entry, _said(s)))
                return
            executor, key = self._key(stable_executor(bridge_executor)), None
        elif invocation is not None and s.parent_id.hex() == invocation:
            # under its agent's own span: that agent's, whatever either side calls it (an older .NET
            # package named an unnamed agent by its class), aligned to that invocation
            key = agent
            entry.invocation = invocation
        else:
            key = self._key(name)
            if key == agent:  # deeper under the agent span: aligned to that invocation
                entry.invocation = invocation
        run = self._run(run_key)
        self._announce(run, s)
        run.units[(executor, key)].ledger.append(entry)

    @staticmethod
    def _announce(run: _Run, s: SpanRecord) -> None:
        if run.announcement is None:
            run.announcement = _said(s)

    def _caller_joins(self) -> _Joins:
        """Callers' ledger spans (outside every run, naming only their executor: MAF .NET's workflow
        events read without their run, the seed's hand-built traces) by the run each joins
        (docs/verdicts.md "Which run a ledger belongs to"): the one run beneath its parent (directly,
        or through spans outside every run, .NET's ``workflow.session``) that has its executor, the
        same agent instance where the executor id names one (MAF .NET's ``{Name}_{Id}``). Where
        several runs could own it, or none, or its own parent has not arrived, it joins none and its
        executor's units are NoTruth ``ledger_unjoined``: never a guess, never by time. Worked out
        anew from every span known at each publication, so arrival order changes nothing; a run whose
        share changed is published again."""
        joined: dict[str | None, list[tuple[str, LedgerEntry]]] = defaultdict(list)
        unjoined: dict[str, int] = defaultdict(int)
        announced: dict[str, Announcement] = {}
        for parent_id, executor, named, entry, said in self._callers:
            if said is not None:
                announced.setdefault(executor, said)
            owners = [key for key, r in self._runs.items()
                      if r.span_id is not None and executor in r.executors and parent_id in self._above(r)
                      and named in (r.executors[executor].instances or (named,))]
            if len(owners) == 1:
                joined[owners[0]].append((executor, entry))
            else:
                unjoined[executor] += 1
        for waiting in self._pending.values():  # not yet classified: which run's is not known yet
            for w in waiting:
                if w.facts[BRIDGE] and w.facts[AGENT_ID] is None and w.facts[BRIDGE_EXECUTOR] is not None:
                    unjoined[self._key(stable_executor(w.facts[BRIDGE_EXECUTOR]))] += 1
        stray = tuple(sorted(e for e in unjoined if not any(e in r.executors for r in self._runs.values())))
        for key, run in self._runs.items():
            share = (tuple(sorted(entry.span_id or "" for _, entry in joined.get(key, ()))),
                     tuple(sorted((e, n) for e, n in unjoined.items() if e in run.executors)), stray)
            if self._joins.get(key) != share:
                self._joins[key] = share
                run.dirty = True
        return _Joins(joined, unjoined, stray, announced)

    def _above(self, run: _Run) -> set[bytes]:
        """The run's parent and, above it, every ancestor outside all runs (cycles cut)."""
        above: set[bytes] = set()
        span_id = run.parent_id
        while span_id and span_id not in above:
            above.add(span_id)
            span_id = self._outside.get(span_id, b"")
        return above

    @staticmethod
    def _error(s: SpanRecord) -> str | None:
        """The span's error (its ``error.type``, its status description, or "error"), or None."""
        kind = s.facts[ERROR_TYPE]
        if s.status_error is None:
            return kind
        detail = " ".join(p for p in (kind, s.status_error) if p)
        return detail or "error"

    def resolve_orphans(self, everything: bool) -> None:
        """Classify spans whose parent has not arrived as if they had none.

        Workflow-run spans are always resolved (their parent may never be exported: .NET's streaming
        ``workflow.session``, a caller's span around several runs); with ``everything`` (the trace
        is complete or timed out) so is every other orphan. Parent cycles are broken first, always.
        """
        self._break_cycles()
        orphans = [p for p in self._pending if p not in self._pending_ids and p not in self._context]
        for parent_id in orphans:
            children = self._pending.get(parent_id, [])
            keep = [c for c in children if not (everything or c.facts[KIND] == RUN)]
            for child in children:
                if child not in keep:
                    self._pending_ids.discard(child.span_id)
                    self.orphaned += child.facts[KIND] != RUN
                    self._resolve(child, _NO_CONTEXT)
            if keep:
                self._pending[parent_id] = keep
            else:
                self._pending.pop(parent_id, None)

    def _break_cycles(self) -> None:
        """Parent cycles: nothing outside them can ever resolve them (a span's parent is fixed), so
        each is broken at once, at one span classified as if parentless; the rest of the cycle
        resolves beneath it. A span waiting on a parent that is not pending waits on."""
        if not self._pending:
            return
        parent_of = {c.span_id: parent for parent, children in self._pending.items() for c in children}
        acyclic: set[bytes] = set()
        for start in parent_of:
            walk: dict[bytes, None] = {}
            sid = start
            while sid in self._pending_ids and sid not in walk and sid not in acyclic:
                walk[sid] = None
                sid = parent_of[sid]
            if sid in walk:  # back on this walk: a cycle, broken at its workflow-run span if it has one
                cycle = list(walk)[list(walk).index(sid):]
                sid = next((c for c in cycle if self._record(parent_of[c], c).facts[KIND] == RUN), sid)
                siblings = self._pending[parent_of[sid]]
                child = self._record(parent_of[sid], sid)
                siblings.remove(child)
                if not siblings:
                    del self._pending[parent_of[sid]]
                self._pending_ids.discard(sid)
                self.orphaned += 1
                self._resolve(child, _NO_CONTEXT)
            acyclic.update(walk)

    def _record(self, parent_id: bytes, span_id: bytes) -> SpanRecord:
        return next(c for c in self._pending[parent_id] if c.span_id == span_id)

    @property
    def waiting(self) -> bool:
        """Spans still wait for a parent (a run not yet finalized may need them)."""
        return bool(self._pending)

    @property
    def provisional(self) -> bool:
        """Runs were last published with the waiting spans resolved as if parentless: nothing new
        would come of resolving them for good (unless some were withheld)."""
        return self._provisional and not self._withheld

    def run_inputs(self, cut: str | None = None, everything: bool = True,
                   final: bool = True) -> list[tuple[RunInput, int]]:
        """Reconciler inputs for every run that changed since the last call, with its revision.

        ``cut``: why the caller finalizes the trace before it could be complete (the runs are then
        flagged incomplete, with that reason in their notes). ``everything``: the trace is complete
        (or timed out), so orphans are resolved too; otherwise only runs whose workflow-run span has
        arrived are finalized, the rest keep waiting. Runs in which no agent ran and no chat call was
        made are not runs; nor are chat calls outside any workflow and agent (an application's own).
        Every run of a trace some of whose spans are known never to have arrived (its root, or the
        parent of a span) is :attr:`RunInput.partial`: which run a lost span belonged to is unknown.
        ``final`` false (a late parent may still come): orphans are resolved on a copy and keep
        waiting here, so a parent that arrives later is attached as if it had come in order, and the
        next revision is what in-order delivery gives (docs/design.md §3: delivery order never decides).
        """
        self._break_cycles()
        if everything and not final and self._pending:
            return self._provisional_inputs(cut)
        orphaned = self.orphaned
        self.resolve_orphans(everything)
        joins = self._caller_joins() if self._callers or self._joins or self._pending else _NO_JOINS
        if self.orphaned > orphaned:  # spans are missing: runs already published cannot pass either
            for run in self._runs.values():
                run.dirty = True
        out = []
        for key, run in self._runs.items():
            if not run.dirty or not (everything or run.seen):
                continue
            run.dirty = False
            rootless = key is None and self.root_span_id is None
            if rootless:
                cut_short = "its root span never arrived"
            elif self.orphaned and cut is None:
                cut_short = f"{self.orphaned} span(s) of it never got their parent span"
            else:
                cut_short = cut
            built = self._run_input(run, cut_short, rootless or self.orphaned > 0, joins)
            if built.is_workflow and (built.executors or run.span_id is not None or run.executors):
                run.revision += 1
                self._published[key] = run.revision
                out.append((built, run.revision))
        if not self._pending:
            # a set or dict never shrinks as it empties, but clear() lets go of its table: a finalized
            # trace kept for its late spans would hold what its parked spans grew (~2.4 KB of ~19 KB
            # a bench trace)
            self._pending.clear()
            self._pending_ids.clear()
        return out

    def _provisional_inputs(self, cut: str | None) -> list[tuple[RunInput, int]]:
        trial = copy.deepcopy(self, {id(self.matcher): self.matcher})
        out = trial.run_inputs(cut, everything=True)
        # The trace's run of no workflow made only of spans still waiting for their parent is not
        # published while that parent may come: those spans would then join their real run and leave
        # it behind, a run of its own that is not one. It is published if the parent never comes.
        self._withheld = self.root_span_id is not None and None not in self._runs and None in trial._runs
        if self._withheld:
            direct = trial._run_id(trial._runs[None])
            out = [(run, revision) for run, revision in out if run.run_id != direct]
            trial._published[None] = self._published.get(None, 0)
        self._published, self._joins = trial._published, trial._joins
        for key, run in self._runs.items():
            run.revision, run.dirty = trial._runs[key].revision, trial._runs[key].dirty
        self._provisional = True
        return out

    def _run_id(self, run: _Run) -> str:
        trace_id = self.trace_id.hex()
        return f"{trace_id}-{run.span_id}" if run.span_id else trace_id

    def touch(self) -> None:
        """Every run is published again at the next :meth:`run_inputs`, changed or not."""
        for run in self._runs.values():
            run.dirty = True

    def revise(self, run_id: str, revision: int) -> None:
        """The store holds ``run_id`` at ``revision`` (a replayed trace, whose count began again at
        1): its next revision numbers on from there, or the store would refuse it as stale."""
        for run in self._runs.values():
            if self._run_id(run) == run_id:
                run.revision = max(run.revision, revision)
                self._published[run.span_id] = run.revision

    def _run_input(self, run: _Run, cut: str | None, partial: bool, joins: _Joins) -> RunInput:
        joined = joins.joined.get(run.span_id, ())
        events, unjoined = _event_ledgers(run, joined, joins.unjoined)
        # each unit's record with the keys it is named by: named once the names shown are known (unnamed
        # agents are numbered among those shown)
        records: list[tuple[tuple[str, ...], ExecutorRecord]] = []
        units_by_executor: dict[str | None, list[str | None]] = defaultdict(list)
        for executor, agent in run.units:
            units_by_executor[executor].append(agent)
        idle: list[tuple[str, ...]] = []
        composite: list[tuple[str, ...]] = []
        scored: set[str | None] = set()
        unattributed: list[tuple[str | None, list[_Turn]]] = []
        for key, unit in run.units.items():
            executor, agent = key
            hosts_agent = executor in run.executors and run.executors[executor].hosts_agent
            # an executor's workflow events go to its own agent's unit; the agent's own ledger spans (the
            # decorator) record the same responses a second way: counted once (docs/verdicts.md)
            named = unit.ledger if agent is not None else []
            own = events.get(key, [])
            duplicates = len(named) if own and named else 0
            if own or named:
                ledger, source, derived = tuple(own or named), LEDGER_SOURCE_BRIDGE, False
            elif unit.agent_spans:
                ledger, source, derived = tuple(unit.agent_spans), LEDGER_SOURCE_AGENT_SPAN, False
            else:
                ledger, source, derived = (), "none", unit.derived_agent_spans > 0
            if agent is None and not ledger and not unit.turns and not unit.agent_spans:
                continue  # its executor's workflow events went to the executor's own agent's unit
            calls, stacked, disagree = (_calls(unit.turns) if unit.stacked or unit.direct_name is _NAMES
                                        else (unit.turns, 0, ()))
            if agent is None and not ledger and not hosts_agent:
                # chat calls with no agent above them, by an executor that hosts none (a function
                # executor calling a chat client itself) or by none: a run note, not a unit (docs/design.md §1)
                unattributed.append((executor, calls))
                continue
            keys = self._unit_keys(run, executor, agent, unit, units_by_executor[executor])
            if not unit.turns and executor in run.executors and run.executors[executor].composite:
                composite.append(keys)  # a workflow as its agent: that workflow's agents are the units
                continue
            if not unit.turns and not unit.derived_reported and not any(_reports(e) for e in ledger):
                idle.append(keys)  # an agent call that made no model call and reported nothing: not scored
                continue
            scored.add(executor)
            spans = run.executors[executor].spans if executor in run.executors else []
            turns = tuple([ChatTurn(Usage(i, o, t, *parts) if parts else Usage(i, o, t), finish, start, invocation,
                                    sid.hex(), error, model, provider)
                           for i, o, t, finish, start, invocation, sid, error, model, provider, _, parts, _, _ in calls])
            # positional, in field order (per unit of every run: keywords cost 2.5x the call)
            records.append((keys, ExecutorRecord("", ledger, turns, source, tuple([sid for _, sid in sorted(spans)]),
                                                 derived, stacked, disagree, unjoined.get(key, 0), duplicates)))
        apart = [(k,) for k in run.executors if k not in scored]
        names = (self._display_names(run, [keys for keys, _ in records] + idle + composite + apart) if self._unnamed
                 else self._names)

        def name(keys: tuple[str, ...]) -> str:
            return names[keys[0]] if len(keys) == 1 else "/".join(names[k] for k in keys) or "(no executor)"

        for keys, record in records:
            record.executor_id = name(keys)
        non_agent = tuple(sorted({name(keys) for keys in idle + composite + apart}, key=str.casefold))
        notes = [f"Trace incomplete: {cut}; spans that had not arrived are not in this verdict."] if cut else []
        notes += [f"{shown} ran a workflow as its agent: it is judged by that workflow's own agents, each a unit."
                  for shown in sorted({name(keys) for keys in composite}, key=str.casefold)]
        if joins.stray:
            stray = ", ".join(self._names.get(e, e) for e in joins.stray)
            notes.append(f"Ledger span(s) recorded beside the workflow runs named executor(s) {stray}, which no run "
                         "of this trace ran: not compared with anything.")
        trace_id = self.trace_id.hex()
        earliest, latest = self._times.get(run.span_id, (_NO_START, 0))
        return RunInput(
            executors=tuple([record for _, record in records]),
            trace_id=trace_id,
            root_span_id=run.span_id or (self.root_span_id.hex() if self.root_span_id else None),
            subject=self._subject(run),
            incomplete=cut is not None,
            partial=partial,
            unattributed_chat=tuple([_unattributed(names[e] if e is not None else None, calls)
                                     for e, calls in unattributed]),
            non_agent_executors=non_agent,
            workflow_errors=tuple(run.errors),
            run_id=self._run_id(run),
            notes=tuple(notes),
            announcement=run.announcement or next((s for e, s in joins.said.items() if e in run.executors), None),
            service_name=self._fallback_subject,
            runtime=self._runtime,
            start_ns=run.start_ns or (earliest if earliest < _NO_START else None),
            end_ns=latest or None,
        )

    def _subject(self, run: _Run) -> str | None:
        """The workflow's name, else the root's, else the service's; a builder's default name (every
        unnamed Sequential workflow is "Sequential") qualified by the service."""
        named = run.subject or self.subject
        if named in self.matcher.default_workflow_names and self._fallback_subject:
            return f"{self._fallback_subject}/{named}"
        return named or self._fallback_subject

    def _display_names(self, run: _Run, shown: list[tuple[str, ...]]) -> dict[str, str]:
        """First spellings, but an agent known only by its per-process id (an agent without a name)
        and an executor named by one (MAF names the executor of an unnamed agent by the agent's id)
        are ``unnamed-agent-{n}`` (``unnamed-executor-{n}`` for an executor that hosts no agent),
        numbered together, of those ``shown`` (the keys units and listed executors are named by), in the
        order the run first ran them: distinct agents stay apart, and the names are the same in every
        process for the same workflow (docs/verdicts.md)."""
        first: dict[str, int] = {}
        for key, ran in run.executors.items():
            if is_per_process_id(key):
                first[key] = min(ran.spans, default=(0, ""))[0]
        agents = set()
        for (_, agent), unit in run.units.items():
            if agent is not None and is_per_process_id(agent):
                agents.add(agent)
                started = min((unit.started, *(e.seq for e in unit.ledger), *(t[_T_START] for t in unit.turns)))
                first[agent] = min(first.get(agent, started), started)
        if not first:
            return self._names
        names = dict(self._names)
        used = {key for keys in shown for key in keys}
        for n, key in enumerate(sorted((k for k in first if k in used), key=lambda key: (first[key], key)), 1):
            hosts = key in agents or run.executors[key].hosts_agent
            names[key] = f"unnamed-{'agent' if hosts else 'executor'}-{n}"
        return names

    @staticmethod
    def _unit_keys(run: _Run, executor: str | None, agent: str | None, unit: _Unit,
                   siblings: list[str | None]) -> tuple[str, ...]:
        """What a unit is named by: the executor id for the executor's own agent, ``executor/agent`` for
        any other agent (none: no executor and no agent)."""
        if executor is None:
            return (agent,) if agent else ()
        if agent is None or agent == executor:
            return (executor,)
        hosts_agent = executor in run.executors and run.executors[executor].hosts_agent
        own_candidates = [a for a in siblings if a is not None and run.units[(executor, a)].top_level]
        if hosts_agent and unit.top_level and len(own_candidates) == 1 and None not in siblings:
            return (executor,)
        return (executor, agent)


@dataclass(slots=True)
class _Joins:
    """Callers' ledger spans as one publication shares them out (:meth:`TraceState._caller_joins`)."""

    #: Run key -> (executor key, entry) of the spans that joined it.
    joined: dict[str | None, list[tuple[str, LedgerEntry]]]
    #: Executor key -> how many ledger spans naming it joined no run.
    unjoined: dict[str, int]
    #: Executors named by unjoined spans that no run of the trace ran.
    stray: tuple[str, ...]
    #: Executor key -> what the first ledger span naming it announced (the package, its MAF release),
    #: joined or not: a run whose ledger could not be joined still says which package recorded it.
    said: dict[str, Announcement]


_NO_JOINS = _Joins({}, {}, (), {})


def _own_unit(run: _Run, executor: str) -> tuple[str | None, str | None]:
    """The unit of an executor's own agent: the agent named as the executor, else the one agent that
    ran there; (executor, None) where that cannot be told."""
    agents = [a for e, a in run.units if e == executor and a is not None]
    own = [a for a in agents if a == executor] or agents
    return (executor, own[0]) if len(own) == 1 else (executor, None)


def _event_ledgers(run: _Run, joined: Iterable[tuple[str, LedgerEntry]], unjoined: dict[str, int]
                   ) -> tuple[dict[tuple[str | None, str | None], list[LedgerEntry]], dict[tuple[str | None, str | None], int]]:
    """Per unit, the workflow-event ledger entries it holds: a ledger span that names only its executor
    (recorded in the run under the executor's span, or joined from beside the run) is that executor's
    own agent's, so one unit holds the entry and the agent's spans and the entry, the framework's own
    ledger, is what is compared. And per unit, the ledger spans of its executor that joined no run."""
    by_executor: dict[str, list[LedgerEntry]] = defaultdict(list)
    for (executor, agent), unit in run.units.items():
        if agent is None and executor is not None and unit.ledger:
            by_executor[executor] += unit.ledger
    for executor, entry in joined:
        by_executor[executor].append(entry)
    events = {_own_unit(run, executor): entries for executor, entries in by_executor.items()}
    return events, {_own_unit(run, e): n for e, n in unjoined.items() if e in run.executors}


def _reports(entry: LedgerEntry) -> bool:
    """The framework reported something for this response: tokens or a finish reason."""
    return bool(entry.usage.total) or entry.finish_reason is not None


def _responded(turn: _Turn) -> bool:
    """The turn carries a response of its own: usage or a finish reason."""
    return turn[0] is not None or turn[1] is not None or turn[2] is not None or turn[_T_FINISH] is not None


def _tokens(turn: _Turn) -> int | None:
    return Usage(*turn[:3]).total


def _calls(turns: list[_Turn]) -> tuple[list[_Turn], int, tuple[LayerDisagreement, ...]]:
    """One truth entry per model call (docs/design.md §1): the unit's turns as calls, how many chat
    spans were folded into a call another records, and where two records of a call disagree.

    A turn beneath another (stacked instrumentations) records that call. The outermost is the call:
    its response is its own where it carries one, else the responses of its nearest records beneath
    (a retried or fallen-back call: each attempt once), never both. A failed call stays failed: what
    its attempts beneath saw without an answer is part of that failure, never a bare request (so
    never the Path-2 gap). Count parts a call lacks are taken from beneath (shown, never counted).
    Records side by side are one (:func:`_side_by_side`): beneath one call, or directly under one
    agent invocation.
    """
    ids = {t[_T_SPAN] for t in turns}
    beneath: dict[bytes, list[_Turn]] = defaultdict(list)
    for t in turns:
        if t[_T_OUTER] in ids:
            beneath[t[_T_OUTER]].append(t)
    disagree: list[tuple[int, LayerDisagreement]] = []  # (the call's start, what disagrees)
    resolved: dict[bytes, list[_Turn]] = {}
    # A turn is classified after its parent, so in reverse the records beneath come first.
    for t in reversed(turns):
        inner = beneath.get(t[_T_SPAN])
        if not inner:
            resolved[t[_T_SPAN]] = [t]
            continue
        records = _side_by_side([(turn, resolved.pop(turn[_T_SPAN])) for turn in inner], disagree)
        if _responded(t):
            total = _total(records)
            own = _tokens(t)
            if own is not None and total is not None and total != own:
                disagree.append((t[_T_START], LayerDisagreement(t[_T_SPAN].hex(), own,
                                                                 tuple(r[_T_SPAN].hex() for r in records), total)))
            if t[_T_PARTS] is None:
                t = (*t[:_T_PARTS], _sum_parts(records), *t[_T_END:])
            resolved[t[_T_SPAN]] = [t]
        elif t[_T_ERROR] is not None:
            resolved[t[_T_SPAN]] = [r for r in records if _responded(r) or r[_T_ERROR] is not None] or [t]
        else:
            resolved[t[_T_SPAN]] = records
    calls: list[_Turn] = []
    direct: dict[str | None, list[tuple[_Turn, list[_Turn]]]] = defaultdict(list)
    for t in turns:
        if t[_T_SPAN] in resolved:
            if t[_T_END] is None:
                calls += resolved[t[_T_SPAN]]
            else:  # directly under its agent span
                direct[t[_T_INVOCATION]].append((t, resolved[t[_T_SPAN]]))
    for pairs in direct.values():
        calls += _side_by_side(pairs, disagree) if len(pairs) > 1 else pairs[0][1]
    disagree.sort(key=lambda found: (found[0], found[1].span_id or ""))  # the same in any arrival order
    return calls, len(turns) - len(calls), tuple(found for _, found in disagree)


def _total(records: list[_Turn]) -> int | None:
    """The token total of a call's records (failed attempts add 0); None where a response or a record
    without one has no count."""
    totals = [_tokens(r) for r in records if _responded(r) or r[_T_ERROR] is None]
    return sum(totals) if totals and None not in totals else None


def _side_by_side(pairs: list[tuple[_Turn, list[_Turn]]], disagree: list[tuple[int, LayerDisagreement]]
                  ) -> list[_Turn]:
    """Sibling records (each turn with what it resolved to) as calls, two records of one request once.

    One call's attempts follow one another, and an agent's model calls too: sibling chat spans whose
    times overlap and whose names differ are two instrumentations of one request (Anthropic's SDK's
    span beside OpenLLMetry's `anthropic.chat`), counted once: the one that says most (a token count
    and a finish reason, else a token count, else a response; the first such). Same-named spans side
    by side stay apart (a client's concurrent calls each get their own span: merging them would
    under-count the truth)."""
    pairs.sort(key=lambda pair: pair[0][_T_START])
    out: list[_Turn] = []
    group: list[tuple[_Turn, list[_Turn]]] = []
    group_end = -1
    for pair in pairs:
        turn = pair[0]
        if group and turn[_T_START] < group_end and all(turn[_T_NAME] != g[0][_T_NAME] for g in group):
            group.append(pair)
        else:
            if group:
                out += _one_record(group, disagree)
            group, group_end = [pair], -1
        if turn[_T_END] is not None and turn[_T_END] > group_end:
            group_end = turn[_T_END]
    if group:
        out += _one_record(group, disagree)
    return out


def _one_record(group: list[tuple[_Turn, list[_Turn]]], disagree: list[tuple[int, LayerDisagreement]]
                ) -> list[_Turn]:
    """One request's records side by side: the one that counts, and any other total that differs."""
    if len(group) == 1:
        return group[0][1]
    chosen = (next((p for p in group if any(_tokens(r) is not None and r[_T_FINISH] is not None for r in p[1])), None)
              or next((p for p in group if any(_tokens(r) is not None for r in p[1])), None)
              or next((p for p in group if any(_responded(r) for r in p[1])), group[0]))
    total = _total(chosen[1])
    for other in group:
        theirs = _total(other[1]) if other is not chosen else None
        if total is not None and theirs is not None and theirs != total:
            disagree.append((chosen[0][_T_START], LayerDisagreement(
                chosen[0][_T_SPAN].hex(), total, tuple(r[_T_SPAN].hex() for r in other[1]), theirs)))
    return chosen[1]


def _sum_parts(records: list[_Turn]) -> tuple[int | None, int | None, int | None] | None:
    known = [r[_T_PARTS] for r in records if r[_T_PARTS] is not None]
    if not known:
        return None
    read, write, reasoning = ([p[n] for p in known if p[n] is not None] for n in range(3))
    return (sum(read) if read else None, sum(write) if write else None, sum(reasoning) if reasoning else None)


def _unattributed(executor: str | None, turns: list[_Turn]) -> UnattributedChat:
    totals = [Usage(i, o, t).total for i, o, t, *_ in turns]
    known = [total for total in totals if total is not None]
    return UnattributedChat(executor, len(turns), sum(known) if known else None)


def _suffix(name: str, prefixes: tuple[str, ...]) -> str | None:
    for prefix in prefixes:
        if name.startswith(prefix):
            rest = name[len(prefix):].strip()
            return rest or None
    return None
