"""Span classification (DESIGN §3): compact span records in, a :class:`RunInput` out.

:class:`TraceState` is incremental so spans may arrive in any order and in any number of batches
(exporters send children before parents; late spans revise a run). It keeps only what
classification needs: per span id the executor it is attributed to, plus per executor the ledger
entries and chat turns already extracted. Spans whose parent has not arrived yet wait in
``_pending`` and are resolved the moment their parent is.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from collector.model import ChatTurn, ExecutorRecord, LedgerEntry, RunInput, Usage
from collector.profiles import (
    BRIDGE_EXECUTOR_ATTRIBUTE,
    LEDGER_INVOCATION_ATTRIBUTE,
    LEDGER_SOURCE_ATTRIBUTE,
    LEDGER_SOURCE_BRIDGE,
    Matcher,
)

LEDGER_SOURCE_AGENT_SPAN = "invoke_agent"


@dataclass(slots=True)
class SpanRecord:
    """The part of a span that classification reads (attributes filtered to the wanted keys)."""

    trace_id: bytes
    span_id: bytes
    parent_id: bytes
    name: str
    start_ns: int
    attrs: dict[str, Any]
    resource_subject: str | None = None


#: (executor id, invocation key): the executor a span belongs to and which invocation of it.
Attribution = tuple[str, str]


@dataclass(slots=True)
class _Executor:
    span_ids: list[tuple[int, str]] = field(default_factory=list)
    bridge: list[tuple[LedgerEntry, int | None]] = field(default_factory=list)
    agent: list[LedgerEntry] = field(default_factory=list)
    turns: list[ChatTurn] = field(default_factory=list)


@lru_cache(maxsize=256)
def _finish_from_text(text: str) -> str | None:
    text = text.strip()
    if not text.startswith("["):
        return text or None
    try:
        return finish_reason(json.loads(text))
    except ValueError:
        return text or None


def finish_reason(value: Any) -> str | None:
    """First finish reason from a string array or its JSON-encoded form (MAF Python sends the latter)."""
    if value is None:
        return None
    if isinstance(value, str):
        return _finish_from_text(value)  # a handful of distinct values: parse each once
    if isinstance(value, (list, tuple)):
        for item in value:
            if item is not None and str(item).strip():
                return str(item).strip()
    return None


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def _first(attrs: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        value = attrs.get(key)
        if value is not None:
            return value
    return None


class TraceState:
    """Everything known about one trace, updated span batch by span batch."""

    __slots__ = ("matcher", "trace_id", "root_span_id", "subject", "_attribution", "_pending",
                 "_pending_ids", "_executors", "_bridge_seen", "_fallback_subject", "_unattributed")

    def __init__(self, matcher: Matcher, trace_id: bytes) -> None:
        self.matcher = matcher
        self.trace_id = trace_id
        self.root_span_id: bytes | None = None
        self.subject: str | None = None
        self._fallback_subject: str | None = None
        self._attribution: dict[bytes, Attribution | None] = {}
        self._pending: dict[bytes, list[SpanRecord]] = defaultdict(list)
        self._pending_ids: set[bytes] = set()
        self._executors: dict[str, _Executor] = defaultdict(_Executor)
        self._bridge_seen = False
        self._unattributed = 0

    def add(self, span: SpanRecord) -> bool:
        """Classify one span now if its parent is known (or it has none), else park it.

        Returns False for a span id already seen in this trace (exporters retry).
        """
        sid = span.span_id
        if sid in self._attribution or sid in self._pending_ids:
            return False
        if not span.parent_id:
            if self.root_span_id is None:
                self.root_span_id = sid
                self.subject = _root_subject(span, self.matcher)
            self._resolve(span, None)
        elif span.parent_id in self._attribution:
            self._resolve(span, self._attribution[span.parent_id])
        else:
            self._pending[span.parent_id].append(span)
            self._pending_ids.add(sid)
        if self._fallback_subject is None and span.resource_subject:
            self._fallback_subject = span.resource_subject
        return True

    def _resolve(self, span: SpanRecord, inherited: Attribution | None) -> None:
        # Iterative so that absurdly deep parent chains cannot exhaust the stack.
        stack = [(span, inherited)]
        while stack:
            s, parent_attr = stack.pop()
            attribution = self._classify(s, parent_attr)
            self._attribution[s.span_id] = attribution
            for child in self._pending.pop(s.span_id, ()):
                self._pending_ids.discard(child.span_id)
                stack.append((child, attribution))

    def _classify(self, s: SpanRecord, parent: Attribution | None) -> Attribution | None:
        m, attrs, span_hex = self.matcher, s.attrs, s.span_id.hex()
        if attrs.get(LEDGER_SOURCE_ATTRIBUTE) == LEDGER_SOURCE_BRIDGE:
            executor_id = attrs.get(BRIDGE_EXECUTOR_ATTRIBUTE)
            if isinstance(executor_id, str) and executor_id:
                self._bridge_seen = True
                ordinal = _int(attrs.get(LEDGER_INVOCATION_ATTRIBUTE))
                entry = LedgerEntry(self._usage(attrs), self._finish(attrs), s.start_ns, None, span_hex)
                self._executors[executor_id].bridge.append((entry, ordinal))
            return parent
        if m.is_executor(s.name):
            executor_id = _first(attrs, m.executor_id_keys) or _suffix(s.name, m.executor_prefixes)
            if executor_id:
                self._executors[str(executor_id)].span_ids.append((s.start_ns, span_hex))
                return (str(executor_id), span_hex)
            return parent
        if m.is_agent(s.name):
            attribution = parent
            if attribution is None:
                agent_id = _first(attrs, m.agent_id_keys) or _suffix(s.name, m.agent_prefixes)
                if not agent_id:
                    return None
                attribution = (str(agent_id), span_hex)
            entry = LedgerEntry(self._usage(attrs), self._finish(attrs), s.start_ns, attribution[1], span_hex)
            self._executors[attribution[0]].agent.append(entry)
            return attribution
        if m.is_chat(s.name, attrs):
            if parent is None:
                self._unattributed += 1
            else:
                turn = ChatTurn(self._usage(attrs), self._finish(attrs), s.start_ns, parent[1], span_hex)
                self._executors[parent[0]].turns.append(turn)
        return parent

    def _usage(self, attrs: dict[str, Any]) -> Usage:
        m = self.matcher
        return Usage(
            _int(_first(attrs, m.input_keys)),
            _int(_first(attrs, m.output_keys)),
            _int(_first(attrs, m.total_keys)),
        )

    def _finish(self, attrs: dict[str, Any]) -> str | None:
        return finish_reason(_first(attrs, self.matcher.finish_keys))

    def _resolve_orphans(self) -> None:
        """Spans whose parent never arrived are classified as if they had none (executor spans still
        name their executor; chat spans without an executor ancestor count as unattributed)."""
        for parent_id in [p for p in self._pending if p not in self._pending_ids]:
            for child in self._pending.pop(parent_id, ()):
                self._pending_ids.discard(child.span_id)
                self._resolve(child, None)

    def run_input(self, incomplete: bool = False) -> RunInput:
        """The classification as reconciler input, once the trace is (considered) complete.

        The ledger is the bridge's AgentResponseEvent spans when the trace has any (the framework's
        own accounting), else the agent-boundary spans.
        """
        self._resolve_orphans()
        records = []
        for executor_id, ex in self._executors.items():
            span_ids = [sid for _, sid in sorted(ex.span_ids)]
            if self._bridge_seen:
                ledger, source = self._bridge_ledger(ex, span_ids), LEDGER_SOURCE_BRIDGE
            else:
                ledger, source = tuple(ex.agent), LEDGER_SOURCE_AGENT_SPAN
            records.append(
                ExecutorRecord(
                    executor_id=executor_id,
                    ledger=ledger,
                    turns=tuple(ex.turns),
                    ledger_source=source if ledger else "none",
                    span_ids=tuple(span_ids),
                )
            )
        return RunInput(
            executors=tuple(records),
            trace_id=self.trace_id.hex(),
            root_span_id=self.root_span_id.hex() if self.root_span_id else None,
            subject=self.subject or self._fallback_subject,
            incomplete=incomplete or self.root_span_id is None,
            unattributed_chat_spans=self._unattributed,
        )

    @staticmethod
    def _bridge_ledger(ex: _Executor, span_ids: list[str]) -> tuple[LedgerEntry, ...]:
        """Align bridge entries to executor invocations by ordinal when both sides count the same."""
        entries = sorted(ex.bridge, key=lambda p: p[0].seq)
        ordinals = [o for _, o in entries]
        alignable = len(entries) == len(span_ids) and sorted(o for o in ordinals if o is not None) == list(
            range(len(span_ids))
        )
        out = []
        for entry, ordinal in entries:
            invocation = span_ids[ordinal] if alignable and ordinal is not None else None
            out.append(LedgerEntry(entry.usage, entry.finish_reason, entry.seq, invocation, entry.span_id))
        return tuple(out)


def _root_subject(root: SpanRecord, matcher: Matcher) -> str | None:
    value = _first(root.attrs, matcher.subject_keys)
    return str(value) if value is not None else None


def _suffix(name: str, prefixes: tuple[str, ...]) -> str | None:
    for prefix in prefixes:
        if name.startswith(prefix):
            rest = name[len(prefix):].strip()
            return rest or None
    return None
