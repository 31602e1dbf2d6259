"""What the store keeps (``store.retention``, docs/store.md): the oldest runs are deleted in small
batches, by age and by the store's size, never a run still within its late window.

:class:`Retainer` sweeps one store a pass at a time and keeps the figures the metrics read;
:class:`RetentionSweeper` runs its passes on a thread of its own, from ``start()`` to ``stop()``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from collector.store.errors import StoreError
from collector.store.sql import Database, marks

log = structlog.get_logger("agenteval.collector")


@dataclass(frozen=True, slots=True)
class Retention:
    """What the store keeps (``store.retention``, docs/store.md): runs written within ``max_age``
    seconds, the newest first within ``max_size`` bytes; never one written within ``late_window``
    seconds (``assembly.late_window``), which may still get a revision. None: no such bound."""

    max_age: float | None = 14 * 86400.0
    max_size: int | None = None
    late_window: float = 300.0
    #: Seconds between the sweeper's passes.
    interval: float = 60.0
    #: Runs deleted per transaction: the longest the sweeper holds the write lock (measured in
    #: bench/store_size.py and logged by each pass as ``longest_batch_ms``).
    batch: int = 200


#: Over ``max_size``, the sweeper deletes down to this share of it, so the runs written until its
#: next pass fit under the cap too.
LOW_WATER = 0.9
#: Seconds the sweeper waits between two batches of a pass, so writers and readers queued on the
#: store go first.
BATCH_PAUSE = 0.005

#: The oldest runs last written before a time (an index walk: runs_by_time), and their deletion,
#: which checks the time again: a revision written meanwhile made the run young.
_OLDEST = "SELECT run_id FROM runs WHERE updated_at < :before ORDER BY updated_at LIMIT :limit"
_DELETE = "DELETE FROM runs WHERE run_id IN ({ids}) AND updated_at < {mark}"


def _days(seconds: float) -> str:
    """A span of time in days, hours or minutes, whichever reads best."""
    for unit, size in (("days", 86400), ("hours", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.3g} {unit}"
    return f"{max(seconds, 0):.0f} s"


class Retainer:
    """Applies a :class:`Retention` to one store, says how far back its history goes, and keeps
    retention's figures: runs deleted, the longest batch (s), and, as of the last
    :meth:`sweep_pass`, the store's size on disk and when its oldest run was last written (0 / None
    before one)."""

    def __init__(self, db: Database, closing: threading.Event) -> None:
        self._db = db
        #: Set when the store closes: a sweep stops between batches.
        self._closing = closing
        #: Told how many runs each batch deleted (the metric keeps up with the store).
        self.on_deleted: Callable[[int], None] | None = None
        self.runs_deleted = 0
        self.size = 0
        self.oldest_kept: float | None = None
        self.longest_batch = 0.0

    def oldest(self) -> float | None:
        rows = self._db._query("SELECT MIN(updated_at) AS oldest FROM runs", {})
        return rows[0]["oldest"] if rows else None

    def history(self, max_age: float | None, now: float | None) -> str:
        oldest = self.oldest()
        kept = f"; runs are kept {_days(max_age)} (store.retention.max_age)" if max_age else ""
        if oldest is None:
            return f"no runs stored{kept}"
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(oldest))
        return f"history goes back to {since} ({_days((time.time() if now is None else now) - oldest)} ago){kept}"

    def sweep(self, retention: Retention, now: float | None = None, stop: threading.Event | None = None) -> int:
        """One pass of retention: delete the runs last written more than ``max_age`` ago, then the
        oldest runs until the store is within :data:`LOW_WATER` of ``max_size``; never a run written
        within the late window. In batches of ``retention.batch`` runs, a transaction each, so a
        writer or reader waits at most one batch; ``stop`` (else the store closing) ends it between
        two. Returns how many runs it deleted."""
        now = time.time() if now is None else now
        stop = self._closing if stop is None else stop
        young = now - retention.late_window
        deleted = 0
        if retention.max_age is not None:
            deleted += self._delete_before(min(now - retention.max_age, young), retention.batch, None, stop)
        if retention.max_size is not None:
            used, runs = self._db._usage()
            if used > retention.max_size and runs:
                excess = used - retention.max_size * LOW_WATER
                wanted = min(runs, -int(-excess * runs // used))  # runs of the average size, rounded up
                gone = self._delete_before(young, retention.batch, wanted, stop)
                deleted += gone
                if gone < wanted:
                    log.warning("store_over_max_size", store=self._db.display, max_size=retention.max_size, used=used,
                                detail="every run left is within its late window (assembly.late_window)")
        return deleted

    def _delete_before(self, before: float, batch: int, at_most: int | None, stop: threading.Event) -> int:
        db = self._db
        deleted = 0
        while at_most is None or deleted < at_most:
            limit = batch if at_most is None else min(batch, at_most - deleted)
            ids: list[str] = [r["run_id"] for r in db._query(_OLDEST, {"before": before, "limit": limit})]
            if not ids:
                break
            started = time.perf_counter()
            with db._transaction() as execute:
                db._lock_keys(execute, ids)  # a revision being written finishes first (then is young)
                gone: int = execute(_DELETE.format(ids=marks(db._mark, len(ids)), mark=db._mark),
                                    [*ids, before]).rowcount
            db._reclaim()
            self.longest_batch = max(self.longest_batch, time.perf_counter() - started)
            deleted += gone
            self.runs_deleted += gone
            if gone and self.on_deleted is not None:
                self.on_deleted(gone)
            if len(ids) < limit or stop.wait(BATCH_PAUSE):
                break
        return deleted

    def sweep_pass(self, retention: Retention, stop: threading.Event) -> None:
        """A sweeper's pass: :meth:`sweep`, then the store measured for the metrics; a store that
        fails is logged, for the next pass to try again."""
        started, self.longest_batch = time.perf_counter(), 0.0
        try:
            deleted = self.sweep(retention, stop=stop)
            self.size, self.oldest_kept = self._db.size_bytes(), self.oldest()
        except StoreError as exc:
            log.warning("store_sweep_failed", store=self._db.display, error=str(exc), retry_in=retention.interval)
        else:
            if deleted:
                log.info("store_swept", store=self._db.display, deleted=deleted, size_bytes=self.size,
                         oldest_kept=self.oldest_kept, seconds=round(time.perf_counter() - started, 3),
                         longest_batch_ms=round(self.longest_batch * 1000, 1))


class RetentionSweeper:
    """Sweeps every ``retention.interval`` seconds on a thread of its own, started by :meth:`start`
    (once the store is open: ``wait_open(timeout)`` says when) and ended by :meth:`stop`, which
    interrupts a pass between two batches. Constructing one starts nothing."""

    def __init__(self, retainer: Retainer, retention: Retention, wait_open: Callable[[float], bool]) -> None:
        self._retainer = retainer
        self._retention = retention
        self._wait_open = wait_open
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sweeping, once: a second call, or one after :meth:`stop`, changes nothing."""
        if self._thread is not None or self._stopping.is_set():
            return
        self._thread = threading.Thread(target=self._sweep_forever, name="store-sweeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sweeping and wait for the thread to end."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    def _sweep_forever(self) -> None:
        while not self._wait_open(0.5):
            if self._stopping.is_set():
                return
        while not self._stopping.is_set():
            self._retainer.sweep_pass(self._retention, self._stopping)
            self._stopping.wait(self._retention.interval)
