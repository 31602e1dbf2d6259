"""Retrying calls to the run store: a database that is down or locked (:class:`StoreError`) is waited
for with backoff, never given up on while the collector runs."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from collector.store import RunStore, StoreError


@dataclass(slots=True)
class Backoff:
    """Delays between attempts: ``first``, doubled after each failure up to ``most``."""

    first: float
    most: float
    delay: float = field(init=False)

    def __post_init__(self) -> None:
        self.delay = self.first

    def failed(self) -> float:
        """The delay to wait now; the next failure waits twice as long."""
        delay, self.delay = self.delay, min(self.delay * 2, self.most)
        return delay

    def reset(self) -> None:
        self.delay = self.first


def until_stored(attempt: Callable[[], object], store: RunStore, stopping: Callable[[], bool],
                 on_error: Callable[[StoreError, float], None], backoff: Backoff) -> float | None:
    """Call ``attempt`` until the store takes it. While the store is not open yet, wait for it (and
    give up once ``stopping()``); a :class:`StoreError` is told to ``on_error`` with the delay
    before the next attempt. Any other exception is about the data: raised. Returns how long the
    attempt that succeeded took, or None when it gave up."""
    while True:
        if not store.wait_open(1.0):
            if stopping():
                return None
            continue
        try:
            started = time.monotonic()
            attempt()
            return time.monotonic() - started
        except StoreError as exc:
            delay = backoff.failed()
            on_error(exc, delay)
            time.sleep(delay)
