"""Parts of traces handed over between replicas through the shared store (docs/scale-out.md, "Load
balancer, honest").

Behind a load balancer a scale event moves traces in flight from one replica to another. A replica
that holds spans of a trace without its root hands them over as a *part* (the journal's span
records) instead of publishing them as a run; the replica holding the root claims the parts it finds
and merges them into its run, as late spans are merged. Parts no replica with the root claims within
``assembly.max_trace_wait`` are adopted by any replica and reconciled apart, flagged ``split``, and
the runs stored for their trace are flagged ``split`` too.

The store is asked on a thread of its own: one cheap query per ``assembly.sweep_interval`` (the
parts table is empty while nothing is split), the claims the event loop asks for, and while parts
are claimed here, one renewal of their claims per poll. Nothing per span touches the store in the
steady state. A claimed part stays in the store until the run that merged it is stored, so a
claimer killed or stopped before that loses none (:class:`Handover`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable

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
    """The claims and the poll of waiting parts, on a thread of their own.

    A claim marks the parts in the store (:meth:`RunStore.claim_parts`); they leave it with the run
    that merged them (:attr:`StoredRun.parts`), or are dropped (:meth:`spend`) or released
    (:meth:`release`). Meanwhile this thread renews the claims every poll, so they go stale, for any
    replica to claim after ``lease`` seconds, only when their claimer is gone for good (killed, its
    node lost); a replica started again under its name releases its earlier life's claims at once.
    """

    def __init__(self, store: RunStore, instance: str, interval: float, lease: float) -> None:
        self.store = store
        self.instance = instance
        self.interval = interval
        self.lease = lease
        #: Trace (hex) -> its waiting parts (without records), as of the last poll.
        self.waiting: dict[str, list[Part]] = {}
        #: Traces whose claim was asked for and not yet answered (held from finalization meanwhile).
        self.pending: set[str] = set()
        self._requests: deque[tuple[str, bool]] = deque()
        self._claimed: deque[tuple[str, list[Part], bool]] = deque()
        #: Parts claimed here that have not left the store yet (renewed), and those to drop or
        #: release (under the lock: the event loop and the store writer add to them).
        self._held: set[str] = set()
        self._drop: set[str] = set()
        self._release: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="handover", daemon=True)

    def start(self) -> None:
        """Start polling the store (the thread)."""
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

    def stored(self, part_ids: Iterable[str]) -> None:
        """These parts left the store with the runs that merged them (the store writer)."""
        with self._lock:
            self._held.difference_update(part_ids)

    def spend(self, part_ids: Iterable[str]) -> None:
        """These parts were merged into no run to store (their spans make none, or their run
        failed): dropped from the store."""
        with self._lock:
            self._drop.update(part_ids)
        self._wake.set()

    def release(self, part_ids: Iterable[str]) -> None:
        """These parts were not merged here (their trace left this replica): back to waiting."""
        with self._lock:
            self._release.update(part_ids)
        self._wake.set()

    def _run(self) -> None:
        earlier = True  # an earlier life's claims (this replica was killed) are still to be released
        while not self._closing.is_set():
            if not self.store.is_open:
                self._closing.wait(self.interval)
                continue
            try:
                if earlier:
                    self.store.release_claims(self.instance)
                    earlier = False
                self._claim()
                self._settle(renew=True)
                waiting: dict[str, list[Part]] = {}
                for part in self.store.waiting_parts(self.lease):
                    waiting.setdefault(part.trace_id, []).append(part)
                self.waiting = waiting
            except StoreError as exc:
                log.warning("handover_poll_failed", error=str(exc))
            self._wake.wait(self.interval)
            self._wake.clear()
        try:  # the claims asked for last: the stopping replica merges them into the runs it stores
            if self._requests and not earlier:
                self._claim()
        except StoreError as exc:
            log.warning("handover_poll_failed", error=str(exc))

    def _claim(self) -> None:
        while self._requests:
            trace_id, adopt = self._requests[0]
            parts = self.store.claim_parts([trace_id], self.instance, self.lease)
            with self._lock:
                self._held.update(p.part_id for p in parts)
            if parts and adopt:
                flagged = self.store.flag_split(trace_id, split_note(parts, self.instance))
                log.warning("trace_split", trace_id=trace_id, parts=[(p.held_by, p.spans) for p in parts],
                            runs_flagged=flagged)
            elif parts:
                log.info("trace_parts_merged", trace_id=trace_id, parts=[(p.held_by, p.spans) for p in parts])
            self._requests.popleft()
            self._claimed.append((trace_id, parts, adopt))

    def _settle(self, renew: bool) -> None:
        """Drop and release what was asked for; ``renew`` the claims still held."""
        with self._lock:
            drop, release = list(self._drop), list(self._release)
        if drop:
            self.store.drop_parts(drop)
        if release:
            self.store.release_claims(self.instance, release)
        with self._lock:
            self._drop.difference_update(drop)
            self._release.difference_update(release)
            self._held.difference_update(drop + release)
            held = list(self._held)
        if renew and held:
            self.store.renew_claims(held, self.instance)

    def orphaned(self, parts: list[Part], wait: float) -> bool:
        """Whether the newest of a trace's waiting parts has waited ``wait`` seconds unclaimed."""
        return time.time() - max(p.created_at for p in parts) >= wait

    def close(self) -> None:
        """Stop polling, once the claims asked for are answered (:meth:`claimed`)."""
        self._closing.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def finish(self) -> None:
        """Last, once the store writer has stored what it could: what was spent is dropped, and the
        claims whose runs were not stored are released, for another replica to claim at once (a
        store that cannot be reached now leaves them to go stale after the lease)."""
        try:
            self._settle(renew=False)
            self.store.release_claims(self.instance)
        except StoreError as exc:
            log.warning("handover_release_failed", error=str(exc), claims=len(self._held))
