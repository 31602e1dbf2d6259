"""Where accepted spans stay until their runs are stored (docs/design.md §3 Durability): the crash
journal (:class:`~collector.live.journal.Journal`), or with the kafka receiver Kafka itself, whose
offsets are committed only past what is stored (:class:`~collector.live.receivers.kafka_offsets.KafkaOffsets`,
docs/scale-out.md "Kafka, exact")."""

from __future__ import annotations

import asyncio
from typing import Protocol, runtime_checkable

from collector.core.facts import SpanRecord


@runtime_checkable
class SpanLog(Protocol):
    def append(self, spans: list[SpanRecord], line: bytes | None = None, idle: frozenset[bytes] = frozenset(),
               at: tuple[int, int] | None = None) -> asyncio.Future | None:
        """Keep the spans of an accepted request until their traces are released. ``line``: the
        spans already encoded (:func:`collector.live.journal.encode`); ``idle``: their traces that
        nothing will release (not kept for); ``at``: the (partition, offset) of the Kafka message
        they came in. Returns what resolves once they are durable; None: nothing to wait for."""
        ...

    def mark(self) -> int:
        """The appends so far: what a release of traces settled now covers."""
        ...

    def release(self, done: list[tuple[bytes, int]]) -> None:
        """These traces' runs are stored, each as of a :meth:`mark`: what was appended of them up to
        it is let go; what was appended later stays until a later release."""
        ...
