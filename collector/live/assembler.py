"""Trace assembly (docs/design.md §3 "Assembly"): spans grouped by trace id until the trace is complete.

Spans are classified as they arrive (:class:`~collector.core.classify.TraceState` keeps only compact
data), so "assembly" is mostly bookkeeping of time and counts:

- ready: the trace was quiet for ``quiet_period`` and its parentless root, or a workflow-run span,
  has arrived (a run is complete when its workflow-run span has ended; a parent that may never be
  exported, such as .NET's streaming ``workflow.session``, is not waited for);
- or, with neither, ``max_trace_wait`` after its first span: finalized and flagged incomplete;
- a trace may hold several runs (one per workflow-run span); each is finalized once, and again as a
  new revision only when late spans changed it; the compact state stays for ``late_window``;
- capacity (spans in unfinalized traces, traces in flight) is checked *before* a request is
  accepted, so over the bound the receiver refuses the whole request (retryable) and nothing that
  was accepted is ever dropped.

Not thread-safe by design: the receivers and the sweeper all run on one asyncio loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from collector.config import Assembly
from collector.core.classify import TraceState
from collector.core.facts import KIND, SpanRecord
from collector.core.model import Failure, RunInput
from collector.core.profiles import RUN, Matcher


class Backpressure(Exception):
    """Over capacity: refuse the request with a retryable status; nothing of it was accepted."""

    def __init__(self, reason: str, retry_after: float) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


@dataclass(slots=True)
class Offer:
    accepted: int = 0
    duplicates: int = 0
    expired: int = 0
    #: The expired spans by why their traces no longer take spans (see :meth:`Assembler._let_go`).
    expired_why: dict[str, int] = field(default_factory=dict)
    #: Traces of the request that nothing will settle: all their spans were duplicates of a
    #: finalized trace, or expired (the journal must not wait for them).
    idle: frozenset[bytes] = frozenset()


@dataclass(slots=True)
class Finalized:
    run: RunInput
    revision: int
    #: Monotonic time the trace became ready (first revision only): the verdict-latency origin.
    root_arrived: float | None
    #: Parts of its trace other replicas handed over, merged into it: replica -> spans (None: none).
    merged: dict[str, int] | None = None
    #: Made of parts no replica holding the trace's root claimed (reconciled apart: split).
    adopted: bool = False
    #: Parts claimed from the store and merged since the trace's last finalization (on its last run):
    #: they leave the store once this run is stored.
    parts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Sweep:
    """What one :meth:`Assembler.sweep` found, for the pipeline to act on (filled by that sweep)."""

    #: Runs finalized, each a new revision.
    finalized: list[Finalized] = field(default_factory=list)
    #: Traces that could not be finalized (the pipeline reports them).
    failures: list[Failure] = field(default_factory=list)
    #: Traces whose first finalization held no run (no agent ran).
    ignored: list[bytes] = field(default_factory=list)
    #: Traces finalized with nothing left waiting: once their runs are stored, the span log may let
    #: their spans go.
    settled: list[bytes] = field(default_factory=list)
    #: Traces cut short by a forced sweep (shutdown) at their first finalization: the journal keeps
    #: their spans, so the spans that reach the next collector (a rolling restart) complete their
    #: runs. One re-opened by late spans is not: its earlier spans are gone.
    cut: list[bytes] = field(default_factory=list)
    #: Traces handed over (the pipeline stores them as parts): a trace held without its root or any
    #: workflow-run span, once quiet for ``handover_after``, or at shutdown. Their span records, in
    #: arrival order.
    handed: list[tuple[bytes, list[SpanRecord]]] = field(default_factory=list)
    #: Parts merged whose trace's finalization made no run (or failed): the pipeline drops them from
    #: the store.
    spent: list[str] = field(default_factory=list)


#: Memory a finalized trace keeps per span it received (its compact state for late spans), as
#: measured by bench/late_memory.py (194-377 B); the late-window byte bound counts with this.
LATE_BYTES_PER_SPAN = 400

#: Why a run is flagged incomplete when the assembler, not the trace, ended it (in the run's notes).
_SHUTDOWN = "the collector stopped before the trace's quiet period ended"
_LATE_WINDOW_CLOSED = "spans of it still waited for their parent span when the trace left the late window"
#: Why spans of a trace that takes no more are rejected, besides leaving the late window (``_let_go``).
_NO_LATE_WINDOW = ("already finalized, with no late window kept (assembly.late_window or "
                   "assembly.max_late_traces is 0)")
_FAILED = "that could not be finalized (run_failed in the collector's log says why)"


@dataclass(slots=True)
class _Trace:
    state: TraceState
    first_seen: float
    last_seen: float
    spans: int = 0  # accepted and not yet finalized
    held: int = 0  # accepted in all (what its compact state grows with)
    root_arrived: float | None = None
    #: When a root or workflow-run span first arrived since the trace was re-opened: where the
    #: verdict latency of a run first seen in this revision counts from (a later turn of a
    #: human-in-the-loop session), as ``root_arrived`` is for the first.
    reopened: float | None = None
    revision: int = 0
    finalized_at: float = 0.0
    #: Its span records while it may be handed over (see :meth:`Assembler._hand_over`): kept until
    #: its root or a workflow-run span arrives, None after (or when hand-over is off).
    records: list[SpanRecord] | None = None
    #: Parts of it handed over by other replicas and merged here: replica -> spans.
    merged: dict[str, int] | None = None
    #: Made of parts no replica with its root claimed (docs/scale-out.md): finalized once quiet,
    #: never handed over again.
    adopted: bool = False
    #: Parts claimed from the store and merged since its last finalization (their ids).
    parts: list[str] | None = None


class Assembler:
    def __init__(self, config: Assembly, matcher: Matcher, clock: Callable[[], float] = time.monotonic,
                 handover: bool = False) -> None:
        self.config = config
        #: Traces without their root are handed over (:attr:`handed`) instead of finalized as runs.
        self.handover = handover
        self.matcher = matcher
        self.clock = clock
        # Open traces, least recently updated first, so a sweep stops at the first non-quiet one.
        self._open: OrderedDict[bytes, _Trace] = OrderedDict()
        self._late: OrderedDict[bytes, _Trace] = OrderedDict()  # by first finalization time
        self._late_spans = 0  # spans held by late traces (their estimated memory bounds the window)
        #: Bounded memory of closed trace ids, each with why it takes no more spans.
        self._expired: OrderedDict[bytes, str] = OrderedDict()
        self._last_timeout_scan = 0.0
        self.spans_in_flight = 0

    @property
    def traces_in_flight(self) -> int:
        return len(self._open)

    @property
    def late_traces(self) -> int:
        return len(self._late)

    def check_capacity(self, spans: int, traces: Iterable[bytes]) -> None:
        """Raise :class:`Backpressure` if accepting this request would exceed a bound."""
        cfg = self.config
        if self.spans_in_flight + spans > cfg.max_spans_in_flight:
            raise Backpressure(f"max_spans_in_flight ({cfg.max_spans_in_flight}) reached", cfg.retry_after)
        if len(self._open) + spans <= cfg.max_traces_in_flight:
            return  # a request holds no more traces than spans: its trace ids need no set
        new = sum(1 for t in set(traces) if t not in self._open and t not in self._late)
        if new and len(self._open) + new > cfg.max_traces_in_flight:
            raise Backpressure(f"max_traces_in_flight ({cfg.max_traces_in_flight}) reached", cfg.retry_after)

    def offer(self, spans: list[SpanRecord]) -> Offer:
        """Accept a request's spans (capacity must have been checked)."""
        now = self.clock()
        result = Offer()
        skipped: set[bytes] = set()
        tid: bytes | None = None
        trace: _Trace | None = None
        for span in spans:
            if span.trace_id != tid:
                tid = span.trace_id
                trace = self._trace_for(tid, now)
            if trace is None:
                result.expired += 1
                why = self._expired[span.trace_id]
                result.expired_why[why] = result.expired_why.get(why, 0) + 1
                skipped.add(span.trace_id)
                continue
            if not trace.state.add(span):
                result.duplicates += 1
                skipped.add(span.trace_id)
                continue
            if trace.records is not None:
                trace.records.append(span)
            if trace.root_arrived is None and (not span.parent_id or trace.state.run_spans_seen):
                trace.root_arrived = now
                trace.records = None  # held with its root: this replica publishes it
            elif trace.revision and trace.reopened is None and (not span.parent_id or span.facts[KIND] == RUN):
                trace.reopened = now
            trace.spans += 1
            trace.held += 1
            trace.last_seen = now
            result.accepted += 1
        self.spans_in_flight += result.accepted
        if skipped:
            result.idle = frozenset(t for t in skipped if (open_ := self._open.get(t)) is None or not open_.spans)
        return result

    def _trace_for(self, tid: bytes, now: float) -> _Trace | None:
        """The open trace for ``tid`` (re-opening a finalized one for a new revision, creating a new
        one otherwise); None when its late window has passed."""
        trace = self._open.get(tid)
        if trace is not None:
            self._open.move_to_end(tid)
            return trace
        trace = self._late.pop(tid, None)
        if trace is not None:
            self._late_spans -= trace.held
            trace.reopened = None
        else:
            if tid in self._expired:
                return None
            trace = _Trace(TraceState(self.matcher, tid), now, now, records=[] if self.handover else None)
        self._open[tid] = trace
        return trace

    def next_deadline(self, now: float) -> float:
        """When a sweep can next finalize something: the earliest quiet-period end still ahead, and
        at the latest ``sweep_interval`` from now (rootless timeouts, the late window's expiry)."""
        cap = now + self.config.sweep_interval
        for trace in self._open.values():  # oldest activity first
            due = trace.last_seen + self.config.quiet_period
            if due > now:
                return min(due, cap)
            if trace.root_arrived is not None or trace.revision or trace.adopted:
                return now  # quiet and ready: sweep at once
            # quiet but rootless: it waits for max_trace_wait (within the cap), later ones may be due
        return cap

    def sweep(self, force: bool = False, hold: frozenset[bytes] = frozenset()) -> Sweep:
        """Finalize every trace that is complete (every open trace when ``force``); ``hold``: traces
        not finalized yet (parts of them are being claimed)."""
        now = self.clock()
        cfg = self.config
        ready = []
        for tid, trace in self._open.items():
            if force:
                ready.append(tid)
            elif now - trace.last_seen < cfg.quiet_period:
                break  # everything after this one was updated more recently still
            elif (trace.root_arrived is not None or trace.revision or trace.adopted
                  or now - trace.first_seen >= cfg.max_trace_wait
                  or (trace.records is not None and now - trace.last_seen >= cfg.handover_after)):
                ready.append(tid)
        if not force and now - self._last_timeout_scan >= 1.0:
            # Rootless traces that keep receiving spans never become quiet: time them out too.
            self._last_timeout_scan = now
            ready.extend(
                tid for tid, t in self._open.items()
                if t.root_arrived is None and not t.revision and now - t.first_seen >= cfg.max_trace_wait
                and now - t.last_seen < cfg.quiet_period
            )
        if hold and not force:
            ready = [tid for tid in ready if tid not in hold]
        swept = Sweep()
        if self.handover:
            ready = self._hand_over(ready, swept)
        out = swept.finalized
        for tid in ready:
            trace = self._open[tid]
            if trace.revision and not trace.spans and not trace.parts:  # re-opened by duplicates only
                self._to_late(tid, self._open.pop(tid))
                continue
            quiet = now - trace.last_seen >= cfg.quiet_period
            complete = quiet and trace.state.root_span_id is not None
            timed_out = trace.root_arrived is None and now - trace.first_seen >= cfg.max_trace_wait
            cut = force and not complete
            try:
                out.extend(self._finalize(tid, now, swept, cut=_SHUTDOWN if cut else None,
                                          everything=force or complete or timed_out or trace.adopted))
                if cut and trace.revision == 1:
                    swept.cut.append(tid)
            except Exception as exc:  # one trace that cannot be finalized costs no other
                self._drop(tid, trace, swept)
                swept.failures.append(Failure(tid.hex(), "finalize", f"{type(exc).__name__}: {exc}"[:200]))
        out.extend(self._expire(now, swept))
        return swept

    def _hand_over(self, ready: list[bytes], swept: Sweep) -> list[bytes]:
        """Of the traces ``ready``, hand over those still without their root (:attr:`Sweep.handed`);
        returns the rest, to finalize. A part is handed over once quiet for ``handover_after``, or
        its trace's ``max_trace_wait`` passed, or at shutdown: its spans may be the first of a trace
        whose root another replica gets (a scale event moved the trace). Not kept in the late window
        nor remembered: spans of it that come later make a part of their own."""
        rest = []
        for tid in ready:  # a rootless trace is ready only once quiet for handover_after, or timed out
            trace = self._open[tid]
            if trace.records is None or trace.revision or trace.adopted or not trace.records:
                rest.append(tid)
                continue
            del self._open[tid]
            self.spans_in_flight -= trace.spans
            swept.handed.append((tid, trace.records))
            swept.settled.append(tid)
        return rest

    def merge(self, tid: bytes, spans: list[SpanRecord], held_by: str, adopt: bool, part_id: str) -> int | None:
        """Merge a part another replica handed over (``part_id``, claimed from the store) into the
        trace (re-opened from the late window for a new revision, as late spans are); ``adopt``:
        spans no replica with the trace's root claimed, merged into a trace of their own that is
        finalized once quiet, even one that left the late window here. Its next finalization
        publishes every run holding spans of the part, even ones known here already (replayed from
        the journal after a kill -9: the store lacks them while it holds the part), and carries the
        part (:attr:`Finalized.parts`). Returns the spans accepted; None when the trace takes no
        more spans. Capacity is not checked: they were accepted by a replica already."""
        if adopt:
            self._expired.pop(tid, None)
        now = self.clock()
        trace = self._trace_for(tid, now)
        if trace is None:
            return None
        trace.records = None
        trace.adopted = trace.adopted or (adopt and trace.root_arrived is None and not trace.revision)
        trace.parts = [*(trace.parts or ()), part_id]
        accepted = 0
        for span in spans:
            if trace.state.add(span):
                accepted += 1
        if accepted < len(spans):
            trace.state.touch()
        trace.spans += accepted
        trace.held += accepted
        trace.last_seen = now
        self.spans_in_flight += accepted
        if accepted:
            trace.merged = trace.merged or {}
            trace.merged[held_by] = trace.merged.get(held_by, 0) + accepted
        return accepted

    def holds_root(self, tid: bytes) -> bool:
        """Whether this replica holds the trace with its root or a workflow-run span (open, or
        finalized and still in the late window): the replica that merges its parts."""
        trace = self._open.get(tid) or self._late.get(tid)
        return trace is not None and (trace.root_arrived is not None or trace.revision > 0) and not trace.adopted

    def _drop(self, tid: bytes, trace: _Trace, swept: Sweep) -> None:
        self._open.pop(tid, None)
        self.spans_in_flight -= trace.spans
        swept.spent.extend(trace.parts or ())
        self._remember_expired(tid, _FAILED)
        swept.settled.append(tid)

    def _finalize(self, tid: bytes, now: float, swept: Sweep, cut: str | None, everything: bool) -> list[Finalized]:
        """The runs of a trace that changed, as new revisions; without ``everything`` only runs whose
        workflow-run span has arrived (spans still waiting for a parent keep waiting). ``cut``: why
        the trace is finalized before it could be complete."""
        trace = self._open.pop(tid)
        self.spans_in_flight -= trace.spans
        trace.spans = 0
        trace.revision += 1
        late = self.config.late_window > 0 and self.config.max_late_traces > 0
        # Without a late window nothing will come for spans still waiting for a parent: now or never.
        # With one, spans still waiting for a parent are reconciled as if parentless, provisionally:
        # the parent may come within the late window, and is then attached where it belongs.
        runs = trace.state.run_inputs(cut=cut, everything=everything or not late, final=not late)
        parts, trace.parts = trace.parts, None
        if trace.revision == 1:
            trace.finalized_at = now
            if not runs:  # no agent ran in it (e.g. MAF's separate workflow.build trace)
                swept.ignored.append(tid)
        if late:
            self._to_late(tid, trace)
        else:
            self._remember_expired(tid, _NO_LATE_WINDOW)
        if not trace.state.waiting or trace.state.provisional:  # published whole, as far as it can be
            swept.settled.append(tid)
        arrived = trace.root_arrived if trace.revision == 1 else trace.reopened
        out = [Finalized(run, revision, arrived if revision == 1 else None, trace.merged, trace.adopted)
               for run, revision in runs]
        if parts and out:
            out[-1].parts = tuple(parts)
        elif parts:
            swept.spent.extend(parts)
        return out

    def discard(self, tids: Iterable[bytes]) -> int:
        """Forget these traces, open or in the late window, without finalizing them: another
        collector reconciles them whole (the kafka receiver, when a partition moves away). Their
        spans are taken again if they come back. Returns how many were open."""
        dropped = 0
        for tid in tids:
            if (trace := self._open.pop(tid, None)) is not None:
                self.spans_in_flight -= trace.spans
                dropped += 1
            if (trace := self._late.pop(tid, None)) is not None:
                self._late_spans -= trace.held
        return dropped

    def revise(self, tid: bytes, run_id: str, revision: int) -> None:
        """See :meth:`TraceState.revise`."""
        trace = self._open.get(tid) or self._late.get(tid)
        if trace is not None:
            trace.state.revise(run_id, revision)

    def _to_late(self, tid: bytes, trace: _Trace) -> None:
        self._late[tid] = trace
        self._late_spans += trace.held

    @property
    def late_bytes(self) -> int:
        """Estimated memory of the late window's state."""
        return self._late_spans * LATE_BYTES_PER_SPAN

    def _expire(self, now: float, swept: Sweep) -> list[Finalized]:
        """Traces leaving the late window (by age, count or estimated bytes, oldest first); spans of
        theirs still waiting for a parent that never came are reconciled now (flagged incomplete)."""
        out: list[Finalized] = []
        while self._late:
            tid, trace = next(iter(self._late.items()))
            why = self._let_go(trace, now)
            if why is None:
                break
            del self._late[tid]
            self._late_spans -= trace.held
            self._remember_expired(tid, why)
            if trace.state.waiting and not trace.state.provisional:
                runs = trace.state.run_inputs(cut=_LATE_WINDOW_CLOSED, everything=True)
                out.extend(Finalized(run, revision, None) for run, revision in runs)
                swept.settled.append(tid)
        return out

    def _let_go(self, trace: _Trace, now: float) -> str | None:
        """Why the oldest late trace leaves the late window now (what its late spans are told), or None."""
        cfg = self.config
        if now - trace.finalized_at >= cfg.late_window:
            return f"finalized longer ago than assembly.late_window ({cfg.late_window:g} s)"
        if len(self._late) > cfg.max_late_traces:
            return ("evicted from the late window before assembly.late_window ran out, to keep it within "
                    f"assembly.max_late_traces ({cfg.max_late_traces} traces)")
        if self.late_bytes > cfg.max_late_bytes:
            return ("evicted from the late window before assembly.late_window ran out, to keep its memory within "
                    f"assembly.max_late_bytes ({cfg.max_late_bytes} bytes, ~{LATE_BYTES_PER_SPAN} a span)")
        return None

    def _remember_expired(self, tid: bytes, why: str) -> None:
        self._expired[tid] = why
        while len(self._expired) > max(self.config.max_late_traces, 1_000):
            self._expired.popitem(last=False)

    def drain(self) -> Sweep:
        """Shutdown: finalize everything still open; incomplete where it was not yet complete."""
        return self.sweep(force=True)
