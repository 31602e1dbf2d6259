"""The run store's writer: verdicts and parts of traces handed over (docs/scale-out.md) are written on
a thread of its own, in batches, so the event loop never waits on the database."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from functools import partial

import structlog

from collector.live.retry import Backoff, until_stored
from collector.store import RunStore, StoredRun, StoreError
from collector.store.base import Part

log = structlog.get_logger("agenteval.collector")


class StoreWriter:
    """Writes verdicts on a thread of its own (:meth:`start`), in batches, so the event loop never
    waits on SQLite.

    A batch the database refuses (StoreError: down, locked) is retried with backoff until it lands
    (:meth:`close` waits for that at most its timeout). While the store is not open yet (it could
    not be reached at start), batches wait for it, unlogged (its opener logs why). Any other failure
    is about the data: the batch is then written run by run and a run the store cannot take is
    reported to ``on_failed``, so it never stops the others. ``on_stored`` is called once per batch
    written. :meth:`flush` waits for what was handed to it, :meth:`close` stops it.
    """

    #: Runs written per transaction at most; also the smallest backlog :meth:`queue_limit` allows.
    BATCH = 256
    #: Seconds between attempts at a write the database refused: first, most.
    RETRY = (0.05, 5.0)

    def __init__(self, store: RunStore, on_stored: Callable[[list[tuple[StoredRun, float | None]]], None],
                 on_error: Callable[[], None] = lambda: None,
                 on_failed: Callable[[StoredRun, str], None] = lambda run, error: None,
                 on_handed: Callable[[list[Part]], None] = lambda parts: None) -> None:
        self.store = store
        self._on_handed = on_handed
        #: Parts of traces to hand over (docs/scale-out.md), written before the runs queued with them.
        self._parts: deque[Part] = deque()
        #: Runs per second the store took in recent full batches (EWMA): how fast it clears a
        #: backlog; None until the first full batch.
        self.rate: float | None = None
        self._on_stored = on_stored
        self._on_error = on_error
        self._on_failed = on_failed
        self._queue: deque[tuple[StoredRun, float | None]] = deque()
        lock = threading.Lock()
        #: Something was queued, or the writer is closing.
        self._ready = threading.Condition(lock)
        #: Something handed to the writer left it (:meth:`flush`).
        self._left = threading.Condition(lock)
        #: Runs and parts handed to the writer so far, and how many of them left it (written, or
        #: failed for good): the difference is the backlog, the batch being written included.
        self._handed = 0
        self._done = 0
        self._closing = False
        #: Whether the last write failed (StoreError) and is being retried: the store is not reachable.
        self.failing = False
        self._thread = threading.Thread(target=self._run, name="store-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def backlog(self) -> int:
        """Runs and parts not yet durable: queued, or being written."""
        return self._handed - self._done

    def queue_limit(self, seconds: float, cap: int) -> int:
        """The backlog the store clears in ``seconds`` at its measured rate, within [BATCH, cap]."""
        if self.rate is None:
            return cap
        return min(cap, max(self.BATCH, int(self.rate * seconds)))

    def _measured(self, runs: int, elapsed: float) -> None:
        """Only a full batch measures the rate: a smaller one is written as soon as it is queued
        (no backlog to clear), and its time is mostly the transaction's fixed cost (a cold store, a
        wait behind the sweeper's batch), which read as a store ten times slower (issue 42)."""
        if runs == self.BATCH and elapsed > 0:
            rate = runs / elapsed
            self.rate = rate if self.rate is None else 0.7 * self.rate + 0.3 * rate

    def put_parts(self, parts: list[Part]) -> None:
        with self._ready:
            self._parts.extend(parts)
            self._handed += len(parts)
            self._ready.notify()

    def put(self, runs: list[tuple[StoredRun, float | None]]) -> None:
        """Queue verdicts, each with the monotonic time its verdict latency counts from."""
        with self._ready:
            self._queue.extend(runs)
            self._handed += len(runs)
            self._ready.notify()

    def flush(self, timeout: float) -> bool:
        """Wait until everything handed to the writer so far has left it (written, or reported to
        ``on_failed``); False when ``timeout`` seconds passed first."""
        with self._left:
            handed = self._handed
            return self._left.wait_for(lambda: self._done >= handed, timeout)

    def _left_writer(self, count: int) -> None:
        with self._left:
            self._done += count
            self._left.notify_all()

    def _until_stored(self, attempt: Callable[[], object], **context: int) -> float | None:
        """:func:`until_stored`, each refusal logged and counted; None: closing with the store not open."""
        def refused(exc: StoreError, delay: float) -> None:
            log.error("store_write_failed", error=str(exc), **context, retry_in=delay)
            self.failing = True
            self._on_error()

        return until_stored(attempt, self.store, lambda: self._closing, refused, Backoff(*self.RETRY))

    def _write_parts(self) -> bool:
        """Hand over the queued parts, retried like a batch of runs; False: closing with the store
        not open (the journal keeps their spans)."""
        with self._ready:
            parts = list(self._parts)
            self._parts.clear()
        try:
            if self._until_stored(partial(self.store.hand_over, parts), parts=len(parts)) is None:
                return False
        except Exception:  # parts the store cannot take: their spans stay journaled
            log.exception("handover_failed", parts=len(parts))
        else:
            try:
                self._on_handed(parts)
            except Exception:
                log.exception("store_callback_failed", parts=len(parts))
        self._left_writer(len(parts))
        return True

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._parts and not self._closing:
                    self._ready.wait()
            if self._parts and not self._write_parts():
                return
            with self._ready:
                if not self._queue:
                    if self._closing and not self._parts:
                        return  # closing, and everything queued before is written
                    continue
                batch = [self._queue.popleft() for _ in range(min(self.BATCH, len(self._queue)))]
            if not self._write(batch):
                return  # closing with nothing to flush to: the journal keeps these runs' spans

    def _write(self, batch: list[tuple[StoredRun, float | None]]) -> bool:
        """Write a batch; False: closing with the store not open."""
        handed = len(batch)
        while batch:
            try:
                elapsed = self._until_stored(partial(self.store.save_many, [run for run, _ in batch]), runs=len(batch))
            except Exception:  # a run the store cannot take: find it, keep the rest
                batch = self._one_by_one(batch)
                continue
            if elapsed is None:
                return False
            self.failing = False
            self._measured(len(batch), elapsed)
            self._stored(batch)
            batch = []
        self._left_writer(handed)
        return True

    def _stored(self, batch: list[tuple[StoredRun, float | None]]) -> None:
        """``on_stored``, once: a failure there is logged, never taken for a failed write (which
        would write the batch again and report it stored twice)."""
        try:
            self._on_stored(batch)
        except Exception:
            log.exception("store_callback_failed", runs=len(batch))

    def _one_by_one(self, batch: list[tuple[StoredRun, float | None]]) -> list[tuple[StoredRun, float | None]]:
        """Write runs singly; returns what is left to retry when the database itself fails."""
        for index, item in enumerate(batch):
            try:
                self.store.save_many([item[0]])
            except StoreError:
                return batch[index:]
            except Exception as exc:
                self._on_failed(item[0], f"{type(exc).__name__}: {exc}"[:200])
                continue
            self._stored([item])
        return []

    def close(self, timeout: float = 30.0) -> None:
        """Flush everything queued, then stop (within a second if the store is not open yet)."""
        with self._ready:
            self._closing = True
            self._ready.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
