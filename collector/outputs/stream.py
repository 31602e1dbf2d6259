"""Fan-out of stored run documents to live watchers (``WatchVerdicts``).

The store writer thread publishes; each watcher owns a bounded queue on the event loop. A watcher
that falls a whole buffer behind is cut off (its stream ends with RESOURCE_EXHAUSTED and the client
reconnects, replaying from the store) rather than letting one slow consumer grow memory without bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class RunFilter:
    subject: str | None = None
    statuses: frozenset[str] = frozenset()

    def matches(self, doc: dict[str, Any]) -> bool:
        return ((self.subject is None or doc.get("subject") == self.subject)
                and (not self.statuses or doc["status"] in self.statuses))


class WatcherLagged(Exception):
    """The watcher fell a whole buffer behind and was cut off."""


class WatcherClosed(Exception):
    """The collector is shutting down: the stream ends cleanly."""


@dataclass(eq=False)
class Watcher:
    filter: RunFilter
    queue: asyncio.Queue[dict[str, Any]]
    lagged: bool = False
    closed: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    async def next(self) -> dict[str, Any]:
        while self.queue.empty():
            if self.closed:
                raise WatcherClosed
            if self.lagged:
                raise WatcherLagged
            self.wake.clear()
            await self.wake.wait()
        return self.queue.get_nowait()


class VerdictHub:
    def __init__(self, loop: asyncio.AbstractEventLoop, max_watchers: int, buffer: int) -> None:
        self._loop = loop
        self._watchers: set[Watcher] = set()
        self.max_watchers = max_watchers
        self.buffer = buffer
        self.lagged_total = 0

    @property
    def watchers(self) -> int:
        return len(self._watchers)

    def subscribe(self, run_filter: RunFilter) -> Watcher | None:
        """A new watcher, or None when ``max_watchers`` are already attached."""
        if len(self._watchers) >= self.max_watchers:
            return None
        watcher = Watcher(run_filter, asyncio.Queue(self.buffer))
        self._watchers.add(watcher)
        return watcher

    def unsubscribe(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    def close(self) -> None:
        """End every stream (on shutdown), so stopping does not wait out the gRPC grace period."""
        for watcher in self._watchers:
            watcher.closed = True
            watcher.wake.set()

    def publish_threadsafe(self, docs: Iterable[dict[str, Any]]) -> None:
        """Called from the store writer thread once a batch is durable."""
        batch = list(docs)
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fanout, batch)

    def _fanout(self, docs: list[dict[str, Any]]) -> None:
        for watcher in list(self._watchers):
            for doc in docs:
                if watcher.lagged or not watcher.filter.matches(doc):
                    continue
                try:
                    watcher.queue.put_nowait(doc)
                except asyncio.QueueFull:
                    watcher.lagged = True
                    self.lagged_total += 1
            watcher.wake.set()
