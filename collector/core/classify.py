"""Run assembly (docs/design.md §3): compact span records in, one :class:`RunInput` per run out.

Its neighbours in core/ hold the other jobs of classification: :mod:`~collector.core.facts` what a
span says, :mod:`~collector.core.units` what a run holds while assembled,
:mod:`~collector.core.ledger_join` which run a ledger span beside the runs belongs to, and
:mod:`~collector.core.chat_calls` one truth entry per model call.

:class:`TraceState` is incremental so spans may arrive in any order and in any number of batches
(exporters send children before parents; late spans revise a run). A span is classified once its
parent is known; until then it waits in ``_pending``. Classification gives every span a *context*
that its children inherit: the run it belongs to (its outermost workflow-run span), the executor,
and the nearest agent (name and invocation span). From that context:

- a chat span is a turn of its nearest agent's unit (never an outer agent's); a chat span under another
  chat span of the unit (no agent span between) records the same call (stacked instrumentations), so
  each turn keeps its nearest chat-call ancestor and the run is built from outermost calls
  (:func:`~collector.core.chat_calls.calls`);
- an AgentResponseEvent span (our MAF instrumentation) is a ledger entry of the agent it names (one
  beside the runs joins a run at publication: :func:`~collector.core.ledger_join.share_out`);
- an agent span is the ledger only where the profile says the runtime's agent span is independent
  (MAF .NET); MAF Python's re-sums the chat spans under it, which makes the unit ``ledger_derived``.

A unit is (run, executor, agent), compared case-insensitively; the executor's own agent is named by
its agent's name where a span names it (MAF makes the executor id from it), else by the executor id,
and any other agent that ran there ``executor/agent``. An agent call beneath which a workflow runs,
reporting no more than that workflow holds, is no unit: the workflow's agents are.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Sequence

from collector.core.chat_calls import T_START, Turn, unattributed_chat
from collector.core.chat_calls import calls as chat_calls
from collector.core.facts import (
    AGENT_ID,
    BRIDGE,
    BRIDGE_EXECUTOR,
    FINISH,
    KIND,
    SUBJECT,
    SpanRecord,
    announcement,
    descriptive_ids,
    is_per_process_id,
    name_suffix,
    span_error,
    stable_executor,
    workflow_name,
)
from collector.core.ledger_join import NO_JOINS, CallerLedger, Joins, event_ledgers, reports, share_out
from collector.core.model import ChatTurn, ExecutorRecord, LedgerEntry, RunInput, Usage
from collector.core.profiles import AGENT, EXECUTOR, LEDGER_SOURCE_BRIDGE, OTHER, RUN, Matcher
from collector.core.units import NO_START, SEVERAL_NAMES, Run, Unit

LEDGER_SOURCE_AGENT_SPAN = "invoke_agent"

#: What a span's children inherit: (run span id, executor key, agent key, agent invocation span id,
#: the nearest chat span above it in the same unit (an agent span starts afresh)). Keys are
#: case-folded; the first spelling seen is kept for display.
Context = tuple[str | None, str | None, str | None, str | None, bytes | None]
_NO_CONTEXT: Context = (None, None, None, None, None)


class TraceState:
    """Everything known about one trace, updated span batch by span batch."""

    __slots__ = ("matcher", "trace_id", "root_span_id", "subject", "_context", "_pending", "_pending_ids",
                 "_runs", "_names", "_fallback_subject", "run_spans_seen", "unusable", "orphaned", "_callers",
                 "_published", "_provisional", "_shared", "_times", "_outside", "_runtime", "_joins", "_direct",
                 "_instances", "_event_instances",
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
        self._runs: dict[str | None, Run] = {}
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
        self._callers: list[CallerLedger] = []
        #: What each run was last published with of the callers' ledger spans
        #: (:func:`~collector.core.ledger_join.share_out`).
        self._joins: dict[str | None, tuple[object, ...]] = {}
        #: Parent ids of the plain spans outside every workflow run (a caller's, .NET's
        #: ``workflow.session``): how far up a run a caller's ledger span may sit and still join it.
        self._outside: dict[bytes, bytes] = {}
        #: Agent spans outside every workflow run (direct agent calls) -> their unit's key in the trace's
        #: run of no workflow: which of them a workflow run lies beneath is worked out at publication.
        self._direct: dict[bytes, tuple[str | None, str]] = {}
        #: Executor spans whose id carries an agent instance's per-process id (MAF .NET) -> that id,
        #: case-folded; and workflow-event ledger spans (span id, hex) -> the instance they name.
        self._instances: dict[bytes, str] = {}
        self._event_instances: dict[str, str] = {}
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
        #: :data:`NO_START` and 0 while none is known), kept apart from the runs: a span outside any
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
            except Exception:  # one span that cannot be classified is ignored on its own
                self.unusable += 1
                context = parent
            self._context[s.span_id] = context
            times = run_times.get(context[0])
            if times is None:
                times = run_times[context[0]] = [NO_START, 0]
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

    def _run(self, key: str | None) -> Run:
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = Run(key, revision=self._published.get(key, 0))
        run.dirty = True
        return run

    def _classify(self, s: SpanRecord, parent: Context) -> Context:
        (kind, bridge, chat, agent_id, executor_id, _, hosts_agent, subject, _, i, o, t, finish, _, _, _, model,
         provider, cache_read, cache_write, reasoning) = s.facts
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
                _announce(run, s)
                if error := span_error(s):
                    run.errors.append(f"workflow: {error}")
                return (run.span_id, None, None, None, None)
            run = self._run(run_key)
            if executor is not None:  # a workflow run as an executor's agent (workflow.AsAIAgent())
                run.executors[executor].composite = True
            if agent is not None:  # ... beneath that agent's own span (wrapped in OpenTelemetryAgent)
                run.units[(executor, agent)].wraps = True
            if error := span_error(s):
                run.errors.append(f"sub-workflow: {error}")
            return parent
        if kind == EXECUTOR:
            name = executor_id or name_suffix(s.name, self.matcher.executor_prefixes)
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
                self._instances[s.span_id] = name.casefold()
            seen.spans.append((s.start_ns, s.span_id.hex()))
            seen.hosts_agent = seen.hosts_agent or hosts_agent
            if error := span_error(s):
                run.errors.append(f"{name}: {error}")
            return (run_key, key, None, None, None)
        if kind == AGENT:
            name = agent_id or name_suffix(s.name, self.matcher.agent_prefixes)
            if not name:
                return parent
            key = self._key(name)  # an unnamed agent's per-process id: told apart, named at publication
            run = self._run(run_key)
            if run_key is None:
                self._direct[s.span_id] = (executor, key)
            _announce(run, s)
            unit = run.units[(executor, key)]
            unit.top_level = unit.top_level or agent is None
            if agent is None and (instance := self._instances.get(s.parent_id)) is not None:
                if unit.instances is None:
                    unit.instances = set()
                unit.instances.add(instance)
            if 0 < s.start_ns < unit.started:
                unit.started = s.start_ns
            if span_error(s) is None:  # an agent that raised reported nothing
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
                    unit.direct_name = SEVERAL_NAMES
            else:
                end = None
            unit.turns.append((i, o, t, finish, s.start_ns, invocation, s.span_id, span_error(s), model, provider,
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
            if stable_executor(bridge_executor) is not bridge_executor:
                self._event_instances[entry.span_id or ""] = bridge_executor.casefold()
            if run_key is None:  # beside the workflow run, not in it: joins it at publication, if it can
                self._callers.append((s.parent_id, self._key(stable_executor(bridge_executor)),
                                      bridge_executor.casefold(), entry, announcement(s)))
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
        _announce(run, s)
        run.units[(executor, key)].ledger.append(entry)

    def _joins_now(self) -> Joins:
        """Callers' ledger spans by the run each joins, as of every span known now (:func:`share_out`)."""
        waiting = [self._key(stable_executor(named)) for spans in self._pending.values() for w in spans
                   if w.facts[BRIDGE] and w.facts[AGENT_ID] is None and (named := w.facts[BRIDGE_EXECUTOR]) is not None]
        return share_out(self._callers, self._runs, self._outside, waiting, self._joins)

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
        joins = self._joins_now() if self._callers or self._joins or self._pending else NO_JOINS
        if self._direct:
            self._find_wrappers()
        if self.orphaned > orphaned:  # spans are missing: runs already published cannot pass either
            for run in self._runs.values():
                run.dirty = True
        out: list[tuple[RunInput, int]] = []
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
        # Nor while its own agents made no chat call: each may be a workflow agent's wrapper whose
        # workflow is among the spans still waiting (no unit then, and no run).
        direct = self._runs.get(None)
        made_calls = direct is not None and any(unit.turns for unit in direct.units.values())
        self._withheld = self.root_span_id is not None and not made_calls and None in trial._runs
        if self._withheld:
            direct_id = trial._run_id(trial._runs[None])
            out = [(run, revision) for run, revision in out if run.run_id != direct_id]
            trial._published[None] = self._published.get(None, 0)
        self._published, self._joins = trial._published, trial._joins
        for key, run in self._runs.items():
            run.revision, run.dirty = trial._runs[key].revision, trial._runs[key].dirty
        self._provisional = True
        return out

    def _run_id(self, run: Run) -> str:
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

    def _find_wrappers(self) -> None:
        """Mark the direct agent calls beneath which workflow runs lie (through spans outside every run:
        .NET's ``workflow.session``) as no unit, where what they report is no more than those runs hold
        (a workflow used as an agent: its wrapper's usage is its agents' sum), and note the wrapper on
        each such run. Worked out anew from every span known at each publication, so the order spans
        arrived in changes nothing; a run or unit whose part changed is published again."""
        beneath: dict[tuple[str | None, str | None], list[Run]] = defaultdict(list[Run])
        for run in self._runs.values():
            span_id, seen = run.parent_id, set[bytes]()
            while span_id and span_id not in seen:
                seen.add(span_id)
                if (wrapper := self._direct.get(span_id)) is not None:
                    beneath[wrapper].append(run)
                    break
                span_id = self._outside.get(span_id, b"")
        direct = self._runs.get(None)
        wrapped: dict[str, str] = {}  # run key -> its wrapper's agent key
        if direct is not None:
            for (executor, agent), unit in direct.units.items():
                runs = beneath.get((executor, agent), []) if agent is not None else []
                wraps = bool(runs) and not unit.turns and _covered(
                    unit.ledger or unit.agent_spans, [u for run in runs for u in run.units.values()])
                if wraps != unit.wraps:
                    unit.wraps = wraps
                    direct.dirty = True
                if wraps and agent is not None:
                    wrapped.update((run.span_id, agent) for run in runs if run.span_id is not None)
        for key, run in self._runs.items():
            if key is not None and run.wrapper != wrapped.get(key):
                run.wrapper = wrapped.get(key)
                run.dirty = True

    def _own_agents(self, run: Run) -> dict[str, str]:
        """Executor key -> the agent (key) that is its own by name where their keys differ: the one agent
        that ran directly in it whose name MAF makes the executor's id of (MAF .NET ``{Name}_{Id}``,
        the name's other characters turned into ``_``: docs/verdicts.md "How a unit is named")."""
        top: dict[str, list[str]] = defaultdict(list)
        for (executor, agent), unit in run.units.items():
            if executor is not None and agent is not None and unit.top_level:
                top[executor].append(agent)
        return {executor: agent for executor, (agent, *others) in top.items()
                if not others and agent != executor and executor in descriptive_ids(self._names[agent])}

    def _run_input(self, run: Run, cut: str | None, partial: bool, joins: Joins) -> RunInput:
        own_agents = self._own_agents(run)
        events, unjoined = event_ledgers(run, joins, own_agents, self._event_instances)
        # each unit's record with the keys it is named by: named once the names shown are known (unnamed
        # agents are numbered among those shown)
        records: list[tuple[tuple[str, ...], ExecutorRecord]] = []
        units_by_executor: dict[str | None, list[str | None]] = defaultdict(list)
        for executor, agent in run.units:
            units_by_executor[executor].append(agent)
        idle: list[tuple[str, ...]] = []
        composite: list[tuple[str, ...]] = []
        scored: set[str | None] = set()
        unattributed: list[tuple[str | None, list[Turn]]] = []
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
            if unit.wraps and not unit.turns and run.span_id is None:
                continue  # a workflow used as an agent, called directly: that workflow's agents are the units
            calls, stacked, disagree = (chat_calls(unit.turns) if unit.stacked or unit.direct_name is SEVERAL_NAMES
                                        else (unit.turns, 0, ()))
            if agent is None and not ledger and not hosts_agent:
                # chat calls with no agent above them, by an executor that hosts none (a function
                # executor calling a chat client itself) or by none: a run note, not a unit (docs/design.md §1)
                unattributed.append((executor, calls))
                continue
            keys = self._unit_keys(run, executor, agent, unit, units_by_executor[executor], own_agents)
            if (not unit.turns and (unit.wraps or executor in run.executors and run.executors[executor].composite)
                    and _covered(ledger, [u for u in run.units.values() if u is not unit])):
                composite.append(keys)  # a workflow as its agent: that workflow's agents are the units
                continue
            if not unit.turns and not unit.derived_reported and not any(reports(e) for e in ledger):
                idle.append(keys)  # an agent call that made no model call and reported nothing: not scored
                continue
            scored.add(executor)
            spans = run.executors[executor].spans if executor in run.executors else []
            turns = tuple([ChatTurn(Usage(i, o, t, *parts) if parts else Usage(i, o, t), finish, start, invocation,
                                    sid.hex(), error, model, provider)
                           for i, o, t, finish, start, invocation, sid, error, model, provider, _, parts, _, _
                           in calls])
            # positional, in field order (per unit of every run: keywords cost 2.5x the call)
            records.append((keys, ExecutorRecord("", ledger, turns, source, tuple([sid for _, sid in sorted(spans)]),
                                                 derived, stacked, disagree, unjoined.get(key, 0), duplicates)))
        apart = [(k,) for k in run.executors if k not in scored]
        names = (self._display_names(run, [keys for keys, _ in records] + idle + composite + apart) if self._unnamed
                 else self._names)
        if own_agents:  # an executor named by its agent's descriptive id is shown by the agent's own name
            names = {**names, **{executor: self._names[agent] for executor, agent in own_agents.items()}}

        def name(keys: tuple[str, ...]) -> str:
            return names[keys[0]] if len(keys) == 1 else "/".join(names[k] for k in keys) or "(no executor)"

        for keys, record in records:
            record.executor_id = name(keys)
        non_agent = tuple(sorted({name(keys) for keys in idle + composite + apart}, key=str.casefold))
        notes = [f"Trace incomplete: {cut}; spans that had not arrived are not in this verdict."] if cut else []
        notes += [f"{shown} ran a workflow as its agent: it is judged by that workflow's own agents, each a unit."
                  for shown in sorted({name((k,)) for k, e in run.executors.items() if e.composite and k not in scored},
                                      key=str.casefold)]
        if run.wrapper is not None:
            wrapper = self._names[run.wrapper]
            notes.append(f"This run ran inside the agent '{wrapper}' (a workflow used as an agent): it is judged by "
                         f"its own agents, each a unit; '{wrapper}' itself is no unit and no run.")
        if joins.stray:
            stray = ", ".join(self._names.get(e, e) for e in joins.stray)
            notes.append(f"Ledger span(s) recorded beside the workflow runs named executor(s) {stray}, which no run "
                         "of this trace ran: not compared with anything.")
        trace_id = self.trace_id.hex()
        earliest, latest = self._times.get(run.span_id, (NO_START, 0))
        return RunInput(
            executors=tuple([record for _, record in records]),
            trace_id=trace_id,
            root_span_id=run.span_id or (self.root_span_id.hex() if self.root_span_id else None),
            subject=self._subject(run),
            incomplete=cut is not None,
            partial=partial,
            unattributed_chat=tuple([unattributed_chat(names[e] if e is not None else None, calls)
                                     for e, calls in unattributed]),
            non_agent_executors=non_agent,
            workflow_errors=tuple(run.errors),
            run_id=self._run_id(run),
            notes=tuple(notes),
            announcement=run.announcement or next((s for e, s in joins.said.items() if e in run.executors), None),
            service_name=self._fallback_subject,
            runtime=self._runtime,
            start_ns=run.start_ns or (earliest if earliest < NO_START else None),
            end_ns=latest or None,
        )

    def _subject(self, run: Run) -> str | None:
        """The workflow's name, else the root's, else the service's; a builder's default name (every
        unnamed Sequential workflow is "Sequential") qualified by the service."""
        named = run.subject or self.subject
        if named in self.matcher.default_workflow_names and self._fallback_subject:
            return f"{self._fallback_subject}/{named}"
        return named or self._fallback_subject

    def _display_names(self, run: Run, shown: list[tuple[str, ...]]) -> dict[str, str]:
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
        agents: set[str] = set()
        for (_, agent), unit in run.units.items():
            if agent is not None and is_per_process_id(agent):
                agents.add(agent)
                started = min((unit.started, *(e.seq for e in unit.ledger), *(t[T_START] for t in unit.turns)))
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
    def _unit_keys(run: Run, executor: str | None, agent: str | None, unit: Unit,
                   siblings: list[str | None], own: dict[str, str]) -> tuple[str, ...]:
        """What a unit is named by: the executor for the executor's own agent (shown by that agent's
        name where it is known, ``own``), ``executor/agent`` for any other agent (none: no executor
        and no agent)."""
        if executor is None:
            return (agent,) if agent else ()
        if agent is None or agent == executor or own.get(executor) == agent:
            return (executor,)
        hosts_agent = executor in run.executors and run.executors[executor].hosts_agent
        own_candidates = [a for a in siblings if a is not None and run.units[(executor, a)].top_level]
        if hosts_agent and unit.top_level and len(own_candidates) == 1 and None not in siblings:
            return (executor,)
        return (executor, agent)


def _covered(reported_by: Sequence[LedgerEntry], units: list[Unit]) -> bool:
    """What an agent beneath which a workflow ran reports (``reported_by``) is no more than the
    ``units`` of that workflow hold, their chat calls' or their own reports: so it only sums theirs (an
    agent that reports more, one calling a model untraced beside running a workflow, stays a unit).
    Inside a run, the workflow's units are not told apart from the run's others: all of them count."""
    reported = sum(e.usage.total or 0 for e in reported_by)
    if not reported:
        return True
    truth = sum(Usage(i, o, t).total or 0 for unit in units for i, o, t, *_ in unit.turns)
    ledgers = sum(e.usage.total or 0 for unit in units for e in (unit.ledger or unit.agent_spans))
    return reported <= max(truth, ledgers)


def _announce(run: Run, s: SpanRecord) -> None:
    if run.announcement is None:
        run.announcement = announcement(s)
