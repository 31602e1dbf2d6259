"""Parts of traces handed over between replicas through the shared store (docs/scale-out.md, "Load
balancer, honest").

Behind a load balancer a scale event moves traces in flight from one replica to another. A replica
that holds spans of a trace without its root hands them over as a *part* (the journal's span
records) instead of publishing them as a run; the replica holding the root claims the parts it finds
and merges them into its run, as late spans are merged. Parts no replica with the root claims within
``assembly.max_trace_wait`` are adopted by any replica and reconciled apart, flagged ``split``, and
the runs stored for their trace are flagged ``split`` too.

The store is asked on a thread of its own: one cheap query per ``assembly.sweep_interval`` (the
parts table is empty while nothing is split) and the claims the event loop asks for. Nothing per
span touches the store in the steady state.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import structlog

from collector.store import RunStore, StoreError
from collector.store.base import Part

log = structlog.get_logger("agenteval.collector")


def split_note(parts: list[Part], finalized_by: str) -> str:
    """What a run flagged ``split`` says: which replica held which part."""
    held = ", ".join(f"{p.spans} span(s) held by {p.held_by}" for p in parts)
    return (f"Split across replicas: {held} reached no replica holding this trace's root in time (a scale event "
            f"moved the trace): they are reconciled apart by {finalized_by}, flagged split; units may be missing "
            "from each run of this trace.")


def merged_note(merged: dict[str, int], finalized_by: str) -> str:
    held = ", ".join(f"{n} span(s) held by {replica}" for replica, n in sorted(merged.items()))
    return f"Merged across replicas: {held} were handed over and merged into this run by {finalized_by}."


class Handover:
    """The claims and the poll of waiting parts, on a thread of their own."""

    def __init__(self, store: RunStore, instance: str, interval: float) -> None:
        self.store = store
        self.instance = instance
        self.interval = interval
        #: Trace (hex) -> its waiting parts (without records), as of the last poll.
        self.waiting: dict[str, list[Part]] = {}
        #: Traces whose claim was asked for and not yet answered (held from finalization meanwhile).
        self.pending: set[str] = set()
        self._requests: deque[tuple[str, bool]] = deque()
        self._claimed: deque[tuple[str, list[Part], bool]] = deque()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="handover", daemon=True)
        self._thread.start()

    def request(self, trace_id: str, adopt: bool) -> None:
        """Claim the trace's waiting parts (``adopt``: as orphans, reconciled apart). Event loop."""
        if trace_id in self.pending:
            return
        self.pending.add(trace_id)
        self._requests.append((trace_id, adopt))
        self._wake.set()

    def claimed(self) -> list[tuple[str, list[Part], bool]]:
        """Claims answered since the last look: (trace, its parts with records, adopted). Event loop."""
        out = []
        while self._claimed:
            trace_id, parts, adopt = self._claimed.popleft()
            self.pending.discard(trace_id)
            out.append((trace_id, parts, adopt))
        return out

    def _run(self) -> None:
        while not self._closing.is_set():
            if not self.store.is_open:
                self._closing.wait(self.interval)
                continue
            try:
                self._claim()
                waiting: dict[str, list[Part]] = {}
                for part in self.store.waiting_parts():
                    waiting.setdefault(part.trace_id, []).append(part)
                self.waiting = waiting
            except StoreError as exc:
                log.warning("handover_poll_failed", error=str(exc))
            self._wake.wait(self.interval)
            self._wake.clear()

    def _claim(self) -> None:
        while self._requests:
            trace_id, adopt = self._requests[0]
            parts = self.store.claim_parts([trace_id])
            if parts and adopt:
                flagged = self.store.flag_split(trace_id, split_note(parts, self.instance))
                log.warning("trace_split", trace_id=trace_id, parts=[(p.held_by, p.spans) for p in parts],
                            runs_flagged=flagged)
            elif parts:
                log.info("trace_parts_merged", trace_id=trace_id, parts=[(p.held_by, p.spans) for p in parts])
            self._requests.popleft()
            self._claimed.append((trace_id, parts, adopt))

    def orphaned(self, parts: list[Part], wait: float) -> bool:
        """Whether the newest of a trace's waiting parts has waited ``wait`` seconds unclaimed."""
        return time.time() - max(p.created_at for p in parts) >= wait

    def close(self) -> None:
        self._closing.set()
        self._wake.set()
        self._thread.join(10)
