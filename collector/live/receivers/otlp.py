"""What the OTLP receivers (gRPC and HTTP) share (docs/design.md §3): the signals they accept and
discard, their trace responses, and a request held to the memory budget both receivers share
(``receivers.max_inflight_bytes``, :mod:`collector.live.budget`) from before its body is read until
its spans are accepted.

Both follow the OTLP specification's response rules and feed one :class:`Pipeline`:
- a request that can never be accepted (:class:`Undecodable`): gRPC INVALID_ARGUMENT / HTTP 400 or
  413 with a ``google.rpc.Status`` body (gRPC's own receive limit answers RESOURCE_EXHAUSTED);
- unusable spans inside a good request: success with ``partial_success.rejected_spans``;
- over capacity (:class:`Backpressure`): gRPC UNAVAILABLE with ``RetryInfo`` / HTTP 503 with
  ``Retry-After``, over the memory budget too.

A large request is decoded on a worker thread (:data:`OFFLOAD_BYTES`), so one client's request never
stalls the others'. What a request carries is echoed back and logged only capped
(:mod:`collector.live.receivers.limits`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from contextlib import contextmanager

from google.protobuf.message import Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceResponse,
)

from collector.formats.decode import Decoded
from collector.live.assembler import Backpressure
from collector.live.budget import Lease, NeverFits, decode_working_set
from collector.live.journal import JournalError
from collector.live.pipeline import IngestResult, Pipeline
from collector.live.receivers.decoding import Fault, Undecodable, decode, spans_in
from collector.live.receivers.limits import MAX_REASON_BYTES, OFFLOAD_BYTES, clip
from collector.live.receivers.telemetry import Telemetry

#: Signals an application's OpenTelemetry setup sends to the same endpoint as its traces
#: (``opentelemetry-instrument``, MAF's ``configure_otel_providers()``): accepted, counted and
#: discarded (docs/design.md §3), so a default setup prints no export error. Per signal: its gRPC
#: service, its OTLP/HTTP path and its (empty) response.
DISCARDED_SIGNALS: dict[str, tuple[str, str, type[Message]]] = {
    "metrics": ("opentelemetry.proto.collector.metrics.v1.MetricsService", "/v1/metrics",
                ExportMetricsServiceResponse),
    "logs": ("opentelemetry.proto.collector.logs.v1.LogsService", "/v1/logs", ExportLogsServiceResponse),
}


def response(result: IngestResult) -> ExportTraceServiceResponse:
    if not result.rejected:
        return ExportTraceServiceResponse()
    return ExportTraceServiceResponse(
        partial_success=ExportTracePartialSuccess(rejected_spans=result.rejected, error_message=clip(result.message))
    )


async def durable(result: IngestResult) -> None:
    """Answer only once the accepted spans are journaled; a failed journal write is retryable (the
    spans are in memory and will be reconciled; a retry is deduplicated)."""
    if result.durable is None:
        return
    try:
        await result.durable
    except JournalError as exc:
        raise Backpressure(str(exc), 1.0) from exc


@contextmanager
def budgeted(telemetry: Telemetry) -> Iterator[None]:
    """Around taking a request's memory on its :class:`Lease`: a refusal over the budget is counted and
    logged (the request is not decoded: by request, not spans); a request that could never fit the
    whole budget is :class:`Undecodable` (too large)."""
    try:
        yield
    except Backpressure as exc:
        telemetry.over_budget(exc)
        raise
    except NeverFits as exc:
        raise Undecodable(Fault.TOO_LARGE, str(exc)) from exc


async def decode_request(pipeline: Pipeline, telemetry: Telemetry, lease: Lease, payload: bytes,
                         json_doc: bool) -> Decoded:
    """``payload`` decoded (OTLP/JSON when ``json_doc``), holding its estimated working set on ``lease``
    first. Raises :class:`Backpressure` (journal, store backlog, budget) before decoding, and
    :class:`Undecodable`. The rejection reasons are capped: they quote span names and ids, and are
    echoed and logged."""
    spans = None if json_doc else spans_in(payload)
    if spans is not None:
        pipeline.admit(lambda: spans, telemetry.transport)
    with budgeted(telemetry):
        await lease.grow(decode_working_set(len(payload), spans), "decoding it")
    work = functools.partial(decode, payload, pipeline.matcher, json_doc)
    if len(payload) < OFFLOAD_BYTES:
        decoded = work()
    else:
        future = asyncio.get_running_loop().run_in_executor(None, work)
        try:
            decoded = await asyncio.shield(future)
        except asyncio.CancelledError:  # (gRPC: the client went away) the thread still holds the bytes
            lease.close_when_done(future)
            raise
    decoded.reasons = [clip(reason, MAX_REASON_BYTES, tail=64) for reason in decoded.reasons]
    return decoded
