"""What a receiver counts and logs (docs/live-collector.md): one :class:`Telemetry` per transport,
naming it in every metric and log line."""

from __future__ import annotations

import structlog

from collector.live.assembler import Backpressure
from collector.live.receivers.limits import MAX_LOGGED_BYTES, clip
from collector.outputs.metrics import Metrics

log = structlog.get_logger("agenteval.collector")


class Telemetry:
    """The self-metrics and log lines of one transport (``grpc``, ``http``, ``kafka``); ``metrics``
    is None when the collector exports none."""

    def __init__(self, transport: str, metrics: Metrics | None) -> None:
        self.transport = transport
        self.metrics = metrics

    def rejected(self, reason: str) -> None:
        """A request refused whole, counted by ``reason``."""
        if self.metrics is not None:
            self.metrics.requests_rejected.add(1, {"transport": self.transport, "reason": reason})

    def invalid(self, error: str, **context: object) -> None:
        """A request that is not OTLP (its content type, encoding or payload)."""
        self.rejected("undecodable")
        log.warning("request_invalid", transport=self.transport, **context, error=clip(error, MAX_LOGGED_BYTES))

    def malformed(self, error: str) -> None:
        """A request the HTTP parser could not read (``error``: why, never its bytes)."""
        self.rejected("malformed_http")
        log.warning("request_invalid", transport=self.transport, error=clip(error, MAX_LOGGED_BYTES))

    def too_large(self, error: str) -> None:
        """A request over a size limit: its sender's exporter drops that batch."""
        self.rejected("too_large")
        log.warning("request_too_large", transport=self.transport, error=clip(error, MAX_LOGGED_BYTES))

    def unauthenticated(self) -> None:
        log.warning("request_unauthenticated", transport=self.transport)
        self.rejected("unauthenticated")

    def timed_out(self, read_timeout: float) -> None:
        """A request not received within ``read_timeout`` seconds."""
        log.warning("request_timeout", transport=self.transport, read_timeout=read_timeout)
        self.rejected("read_timeout")

    def over_budget(self, exc: Backpressure) -> None:
        """A request refused (retryably) over the receivers' memory budget, before it was decoded."""
        self.rejected("memory_budget")
        log.warning("request_refused", transport=self.transport, reason=exc.reason)

    def never_fits(self, spans: int, reason: str) -> None:
        """A request holding more than the assembly could ever take in flight: its spans are rejected."""
        if self.metrics is not None:
            self.metrics.rejected.add(spans, {"transport": self.transport, "reason": "never_fits"})
        log.warning("request_never_fits", transport=self.transport, spans=spans, reason=reason)

    def discarded(self, signal: str) -> None:
        """A request of a signal the collector accepts and discards (metrics, logs)."""
        if self.metrics is not None:
            self.metrics.discarded.add(1, {"signal": signal, "transport": self.transport})

    def shed(self, connections: int) -> None:
        """Idle connections closed to accept new ones (out of file descriptors)."""
        if self.metrics is not None and connections:
            self.metrics.shed.add(connections)

    def skipped(self, reason: str, detail: str, topic: str, partition: int, offset: int) -> None:
        """A Kafka message skipped (its partition goes on)."""
        if self.metrics is not None:
            self.metrics.kafka_skipped.add(1, {"reason": reason})
        log.warning("kafka_message_skipped", reason=reason, detail=detail, topic=topic, partition=partition,
                    offset=offset)
