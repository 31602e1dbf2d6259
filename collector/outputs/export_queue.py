"""A span exporter that survives downstream outages: batches wait in a bounded backlog and a sender
thread of its own delivers them in order, retrying while the endpoint is down. The SDK's batch
worker only ever appends, so it never blocks behind a dead endpoint. The store stays the source of
truth for anything that had to be dropped from a full backlog (counted in :attr:`dropped`, which the
collector exports as ``agenteval_verdict_spans_dropped_total``, and logged)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import structlog
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = structlog.get_logger("agenteval.collector")


class RetryingSpanExporter(SpanExporter):
    def __init__(self, inner: SpanExporter, max_spans: int = 100_000, retry_interval: float = 2.0,
                 shutdown_timeout: float = 2.0) -> None:
        self._inner = inner
        self._shutdown_timeout = shutdown_timeout
        self._max_spans = max_spans
        self._retry_interval = retry_interval
        self._backlog: deque[list[ReadableSpan]] = deque()
        self._spans = 0
        #: Spans dropped from a full backlog since the start.
        self.dropped = 0
        self._lock = threading.Lock()  # guards the backlog and ``dropped``; held only briefly
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stopping = False
        self._thread = threading.Thread(target=self._send_forever, name="otlp-sender", daemon=True)
        self._thread.start()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        dropped = 0
        with self._lock:
            self._backlog.append(list(spans))
            self._spans += len(spans)
            self._idle.clear()
            while self._spans > self._max_spans and len(self._backlog) > 1:
                old = self._backlog.popleft()
                self._spans -= len(old)
                dropped += len(old)
            self.dropped += dropped
        if dropped:
            log.warning("verdict_spans_dropped", spans=dropped, reason="export backlog full")
        self._wake.set()
        return SpanExportResult.SUCCESS

    def _send_forever(self) -> None:
        while True:
            self._wake.wait(self._retry_interval)
            self._wake.clear()
            delivered = self._drain()
            if self._stopping and (delivered or not self._backlog):
                return

    def _drain(self) -> bool:
        """Send the backlog oldest first; stop at the first failure. True when it is empty."""
        while True:
            with self._lock:
                if not self._backlog:
                    self._idle.set()
                    return True
                batch = self._backlog[0]
            try:
                result = self._inner.export(batch)
            except Exception as exc:  # e.g. the OTLP/gRPC exporter's channel, closed by its
                # shutdown under a call past its checks: a failed try, never the end of this thread
                log.warning("verdict_spans_export_failed", error=f"{type(exc).__name__}: {exc}"[:200],
                            spans=len(batch))
                return False
            if result is not SpanExportResult.SUCCESS:
                return False
            with self._lock:
                if self._backlog and self._backlog[0] is batch:
                    self._backlog.popleft()
                    self._spans -= len(batch)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        self._wake.set()
        return self._idle.wait(timeout_millis / 1000)

    def shutdown(self) -> None:
        """Deliver what can be delivered within ``shutdown_timeout``, then stop: the inner exporter's
        shutdown cuts short a delivery still retrying against a dead endpoint."""
        self._stopping = True
        self._wake.set()
        self._thread.join(self._shutdown_timeout)
        if self._spans:
            log.warning("verdict_spans_undelivered", spans=self._spans, reason="endpoint down at shutdown")
        self._inner.shutdown()  # (the OTLP exporters' own shutdown cuts their retry backoff short)
        self._thread.join(self._shutdown_timeout)
