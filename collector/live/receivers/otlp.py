"""OTLP receivers (docs/design.md §3): gRPC ``TraceService/Export`` and HTTP ``POST /v1/traces``.

Both follow the OTLP specification's response rules and feed one :class:`Pipeline`:
- undecodable request: gRPC INVALID_ARGUMENT / HTTP 400 with a ``google.rpc.Status`` body;
- oversize: gRPC RESOURCE_EXHAUSTED (grpc's own receive limit) / HTTP 413 (from Content-Length
  before the body is read, else while reading it, compressed and after gunzip alike);
- unusable spans inside a good request: success with ``partial_success.rejected_spans``;
- over capacity: gRPC UNAVAILABLE with ``RetryInfo`` / HTTP 503 with ``Retry-After``, including
  over the memory budget both receivers share (``receivers.max_inflight_bytes``, :mod:`collector.live.budget`),
  which a request is held to from before it reads its body until its spans are accepted;
- a request that can never fit the configured capacity (more spans than ``max_spans_in_flight``,
  more traces than ``max_traces_in_flight``, or more memory than the whole budget): not retryable,
  gRPC INVALID_ARGUMENT / HTTP 413.

Work per request is bounded too: a gzip body is inflated as it arrives, at most
:data:`MAX_GZIP_MEMBERS` members and ``max_body_bytes`` out, and a large request is decoded on a
worker thread (:data:`OFFLOAD_BYTES`), so one client's request never stalls the others'.

What a request carries is echoed back and logged only capped: a reason at :data:`MAX_REASON_BYTES`,
a whole message at :data:`MAX_MESSAGE_BYTES`. Slow HTTP clients are held to
``receivers.http.read_timeout``; :class:`HttpListener` copes with running out of file descriptors.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import logging
import socket
import ssl
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadHttpMethod,
    BadStatusLine,
    ContentEncodingError,
    ContentLengthError,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    TransferEncodingError,
)
from google.protobuf import json_format
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import DecodeError as ProtoDecodeError
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceResponse,
)

from collector.formats.decode import Decoded, DecodeError, count_spans, decode_bytes, decode_otlp_json
from collector.live.assembler import Backpressure
from collector.live.budget import Lease, MemoryBudget, NeverFits, decode_working_set
from collector.live.journal import JournalError
from collector.live.pipeline import IngestResult, Pipeline
from collector.security import BearerAuth, grpc_authorization

log = structlog.get_logger("agenteval.collector")

TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
#: Signals an application's OpenTelemetry setup sends to the same endpoint as its traces
#: (``opentelemetry-instrument``, MAF's ``configure_otel_providers()``): accepted, counted and
#: discarded (docs/design.md §3), so a default setup prints no export error. Per signal: its gRPC
#: service, its OTLP/HTTP path and its (empty) response.
DISCARDED_SIGNALS: dict[str, tuple[str, str, type[Message]]] = {
    "metrics": ("opentelemetry.proto.collector.metrics.v1.MetricsService", "/v1/metrics",
                ExportMetricsServiceResponse),
    "logs": ("opentelemetry.proto.collector.logs.v1.LogsService", "/v1/logs", ExportLogsServiceResponse),
}
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
#: Longest single reason (one rejected span's) echoed to the client and logged.
MAX_REASON_BYTES = 256
#: Longest message (``partial_success.error_message``, an error's status message) echoed to a client.
MAX_MESSAGE_BYTES = 1024
#: gzip members one body may have. Exporters send one (``cat a.gz b.gz`` makes two); each costs an
#: inflater of its own, and a 4 MiB body of 209,715 empty members was 10-38 s of CPU.
MAX_GZIP_MEMBERS = 64
#: Requests of at least this many bytes are decoded on a worker thread, so the event loop (both
#: receivers, the sweeper) keeps serving meanwhile; smaller ones take at most a few ms in place.
OFFLOAD_BYTES = 256 * 1024


def clip(text: str, limit: int = MAX_MESSAGE_BYTES, tail: int = 0) -> str:
    """``text`` in at most ``limit`` UTF-8 bytes: when longer, its start and its last ``tail`` bytes
    around a "…" (a reason quotes the offending value in the middle and says what is wrong last)."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text
    head = raw[:limit - 3 - tail].decode("utf-8", "ignore")
    return head + "…" + (raw[len(raw) - tail:].decode("utf-8", "ignore") if tail else "")


def _response(result: IngestResult) -> ExportTraceServiceResponse:
    if not result.rejected:
        return ExportTraceServiceResponse()
    return ExportTraceServiceResponse(
        partial_success=ExportTracePartialSuccess(rejected_spans=result.rejected, error_message=clip(result.message))
    )


async def _durable(result: IngestResult) -> None:
    """Answer only once the accepted spans are journaled; a failed journal write is retryable (the
    spans are in memory and will be reconciled; a retry is deduplicated)."""
    if result.durable is None:
        return
    try:
        await result.durable
    except JournalError as exc:
        raise Backpressure(str(exc), 1.0) from exc


def _retry_info(seconds: float) -> error_details_pb2.RetryInfo:
    delay = Duration()
    delay.FromNanoseconds(int(seconds * 1e9))
    return error_details_pb2.RetryInfo(retry_delay=delay)


def _clip_reasons(decoded: Decoded) -> Decoded:
    """Cap the rejection reasons (they quote span names and ids) before they are echoed or logged."""
    decoded.reasons = [clip(reason, MAX_REASON_BYTES, tail=64) for reason in decoded.reasons]
    return decoded


async def _decode(pipeline: Pipeline, lease: Lease, payload: bytes, json_doc: bool, transport: str) -> Decoded:
    """Decode ``payload`` (OTLP/JSON when ``json_doc``), holding its estimated working set on ``lease``
    first. Raises :class:`Backpressure` (journal, store backlog, budget) or :class:`NeverFits` before
    decoding, and the decoders' errors for a payload that is not a request."""
    matcher = pipeline.matcher
    spans = None if json_doc else count_spans(payload)
    if spans is not None:
        pipeline.admit(lambda: spans, transport)
    try:
        await lease.grow(decode_working_set(len(payload), spans), "decoding it")
    except Backpressure as exc:
        _count_refusal(pipeline, transport, exc)
        raise
    work: Callable[[], Decoded] = ((lambda: decode_otlp_json(json.loads(payload), matcher, strict=False))
                                   if json_doc else (lambda: decode_bytes(payload, matcher)))
    if len(payload) < OFFLOAD_BYTES:
        return _clip_reasons(work())
    future = asyncio.get_running_loop().run_in_executor(None, work)
    try:
        return _clip_reasons(await asyncio.shield(future))
    except asyncio.CancelledError:  # (gRPC: the client went away) the thread still holds the bytes
        lease.close_when_done(future)
        raise


def _hold(pipeline: Pipeline, lease: Lease, size: int, what: str, transport: str) -> None:
    """:meth:`Lease.hold`, counting and logging a refusal over the budget (by request: its spans are
    not known, it is not decoded)."""
    try:
        lease.hold(size, what)
    except Backpressure as exc:
        _count_refusal(pipeline, transport, exc)
        raise


async def _reserve_read(pipeline: Pipeline, lease: Lease, size: int, wait: float) -> None:
    """:meth:`Lease.reserve` for a gRPC message, counting and logging a refusal over the budget."""
    try:
        await lease.reserve(size, "the request message", wait)
    except Backpressure as exc:
        _count_refusal(pipeline, "grpc", exc)
        raise


def _count_refusal(pipeline: Pipeline, transport: str, exc: Backpressure) -> None:
    if pipeline.metrics:
        pipeline.metrics.requests_rejected.add(1, {"transport": transport, "reason": "memory_budget"})
    log.warning("request_refused", transport=transport, reason=exc.reason)


def never_fits(pipeline: Pipeline, decoded: Decoded, transport: str) -> str | None:
    """Why even an idle collector could not accept this request (retrying it is then pointless)."""
    cfg = pipeline.config.assembly
    spans = len(decoded.spans)
    if spans > cfg.max_spans_in_flight:
        reason = f"{spans} spans, more than assembly.max_spans_in_flight ({cfg.max_spans_in_flight})"
    elif spans <= cfg.max_traces_in_flight:  # no more traces than spans
        return None
    else:
        traces = len({span.trace_id for span in decoded.spans})
        if traces <= cfg.max_traces_in_flight:
            return None
        reason = f"{traces} traces, more than assembly.max_traces_in_flight ({cfg.max_traces_in_flight})"
    if pipeline.metrics:
        pipeline.metrics.rejected.add(spans, {"transport": transport, "reason": "never_fits"})
    log.warning("request_never_fits", transport=transport, spans=spans, reason=reason)
    return f"request can never be accepted: it holds {reason}; send smaller batches"


# --- gRPC -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Refusal:
    """A gRPC status to abort a call with."""
    code: grpc.StatusCode
    message: str
    trailers: tuple[tuple[str, bytes], ...] = ()


def _overloaded(exc: Backpressure) -> _Refusal:
    """UNAVAILABLE with the delay to retry after, as RetryInfo (OTLP exporters read it) and in the
    rich status details."""
    retry = _retry_info(exc.retry_after)
    status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message=exc.reason)
    status.details.add().Pack(retry)
    return _Refusal(grpc.StatusCode.UNAVAILABLE, f"collector over capacity: {exc.reason}; retry later",
                    (("google.rpc.retryinfo-bin", retry.SerializeToString()),
                     ("grpc-status-details-bin", status.SerializeToString())))


class GrpcTraceService:
    """``TraceService/Export`` over raw bytes, so a bad payload is INVALID_ARGUMENT, not INTERNAL.

    Registered as client-streaming (the same call on the wire as unary): grpc then reads the message
    only when :meth:`export` asks for it, after the call has taken twice ``max_message_bytes`` of the
    memory budget, so what grpc holds of messages being read is within the budget. grpc.aio tells a
    handler nothing of the message's size before it has read all of it (the length prefix stays in
    grpc's transport; a raw deserializer is handed the whole message), so the call holds the largest
    allowed until it has read, then only what its message needs; calls take turns for that room
    (:meth:`Lease.reserve`: waiting at most ``read_timeout``, then refused before their messages are
    read). (A unary handler gets its message read first, and grpc's ``maximum_concurrent_rpcs``
    would count the long-lived FidelityService watch streams.)"""

    def __init__(self, pipeline: Pipeline, auth: BearerAuth, budget: MemoryBudget, max_message_bytes: int,
                 read_timeout: float) -> None:
        self.pipeline = pipeline
        self.auth = auth
        self.budget = budget
        self.max_message_bytes = max_message_bytes
        #: Held while a message is read: grpc's receive buffer and the bytes it hands over exist
        #: together then (with one copy held, 400 calls of 4 MiB at once grew RSS 1.4x the budget).
        self.read_hold = 2 * max_message_bytes
        self.read_timeout = read_timeout

    async def export(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> ExportTraceServiceResponse:
        if not self.auth.allows(grpc_authorization(context)):
            _count_unauthenticated(self.pipeline, "grpc")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
        lease = self.budget.lease()
        try:
            answer = await self._export(requests, lease)
        finally:
            lease.close()
        if isinstance(answer, _Refusal):
            # Aborted here, not where it was decided: the abort's traceback keeps the frames it is
            # raised through alive until the call is cleaned up, and with them the message they
            # hold, which the budget has already let go of (RSS grew 28x the budget so).
            await context.abort(answer.code, answer.message, trailing_metadata=answer.trailers)
        return answer

    async def _export(self, requests: AsyncIterator[bytes], lease: Lease) -> ExportTraceServiceResponse | _Refusal:
        try:
            await _reserve_read(self.pipeline, lease, self.read_hold, self.read_timeout)
            messages = aiter(requests)
            try:
                async with asyncio.timeout(self.read_timeout):
                    payload = await anext(messages, None)
            except TimeoutError:
                log.warning("request_timeout", transport="grpc", read_timeout=self.read_timeout)
                if self.pipeline.metrics:
                    self.pipeline.metrics.requests_rejected.add(1, {"transport": "grpc", "reason": "read_timeout"})
                return _Refusal(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"request message not received within {self.read_timeout}s")
            finally:
                # Unfinished, grpc's message generator would keep the message until a full collection.
                await messages.aclose()
            if payload is None:  # the client went away, or half-closed without a message
                self._count_undecodable()
                return _Refusal(grpc.StatusCode.INVALID_ARGUMENT, "no ExportTraceServiceRequest received")
            lease.free(self.read_hold - len(payload))
            try:  # a payload that is not a request is INVALID_ARGUMENT, refused or not
                decoded = await _decode(self.pipeline, lease, payload, False, "grpc")
            except (ProtoDecodeError, RuntimeError) as exc:
                self._count_undecodable()
                log.warning("request_invalid", transport="grpc", error=clip(str(exc), 300), bytes=len(payload))
                return _Refusal(grpc.StatusCode.INVALID_ARGUMENT, clip(f"cannot decode ExportTraceServiceRequest: {exc}"))
            if reason := never_fits(self.pipeline, decoded, "grpc"):
                # Not RESOURCE_EXHAUSTED: OTLP exporters retry that code, and this request can never succeed.
                return _Refusal(grpc.StatusCode.INVALID_ARGUMENT, reason)
            result = self.pipeline.ingest_decoded(decoded, "grpc")
            del decoded, payload  # the span records are taken: nothing held while the journal syncs
            lease.close()
            await _durable(result)
        except NeverFits as exc:
            self._count_too_large(str(exc))
            return _Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Backpressure as exc:
            return _overloaded(exc)
        return _response(result)

    def _count_undecodable(self) -> None:
        if self.pipeline.metrics:
            self.pipeline.metrics.requests_rejected.add(1, {"transport": "grpc", "reason": "undecodable"})

    def _count_too_large(self, message: str) -> None:
        if self.pipeline.metrics:
            self.pipeline.metrics.requests_rejected.add(1, {"transport": "grpc", "reason": "too_large"})
        log.warning("request_too_large", transport="grpc", error=clip(message, 300))

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(TRACE_SERVICE, {
            "Export": grpc.stream_unary_rpc_method_handler(
                self.export, request_deserializer=None,
                response_serializer=ExportTraceServiceResponse.SerializeToString),
        })


class GrpcDiscardService:
    """``MetricsService/Export`` and ``LogsService/Export``: authenticated, read within the memory
    budget as traces are, counted and discarded."""

    def __init__(self, signal: str, traces: GrpcTraceService) -> None:
        self.signal = signal
        self.traces = traces

    async def export(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Message:
        traces = self.traces
        if not traces.auth.allows(grpc_authorization(context)):
            _count_unauthenticated(traces.pipeline, "grpc")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
        lease = traces.budget.lease()
        try:
            await _reserve_read(traces.pipeline, lease, traces.read_hold, traces.read_timeout)
            messages = aiter(requests)
            try:
                async with asyncio.timeout(traces.read_timeout):
                    await anext(messages, None)
            finally:
                await messages.aclose()
        except Backpressure as exc:
            refusal = _overloaded(exc)
            await context.abort(refusal.code, refusal.message, trailing_metadata=refusal.trailers)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"request message not received within {traces.read_timeout}s")
        finally:
            lease.close()
        _count_discarded(traces.pipeline, self.signal, "grpc")
        return DISCARDED_SIGNALS[self.signal][2]()

    def handler(self) -> grpc.GenericRpcHandler:
        service, _, response = DISCARDED_SIGNALS[self.signal]
        return grpc.method_handlers_generic_handler(service, {
            "Export": grpc.stream_unary_rpc_method_handler(self.export, request_deserializer=None,
                                                          response_serializer=response.SerializeToString)})


def _count_discarded(pipeline: Pipeline, signal: str, transport: str) -> None:
    if pipeline.metrics:
        pipeline.metrics.discarded.add(1, {"signal": signal, "transport": transport})


def grpc_server(max_message_bytes: int, handshake_timeout: float) -> grpc.aio.Server:
    return grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
        # Connections that never finish the TLS / HTTP/2 handshake are closed (gRPC's default: 120 s).
        ("grpc.server_handshake_timeout_ms", max(1, int(handshake_timeout * 1000))),
        # No flow-control window grown from bandwidth estimates: a call's message is then received only
        # as far as the default window (64 KiB) until GrpcTraceService reads it (which opens the window
        # to the message's size), so calls waiting to be handled do not each buffer up to several MiB.
        ("grpc.http2.bdp_probe", 0),
    ])


def _count_unauthenticated(pipeline: Pipeline, transport: str) -> None:
    log.warning("request_unauthenticated", transport=transport)
    if pipeline.metrics:
        pipeline.metrics.requests_rejected.add(1, {"transport": transport, "reason": "unauthenticated"})


# --- HTTP -----------------------------------------------------------------------------------------

class _ServerLog(logging.Handler):
    """aiohttp's server log for the OTLP/HTTP port, as the collector's JSON lines. A request aiohttp
    cannot parse is the client's error (a gRPC exporter on this port, a broken Content-Length):
    logged as ``request_invalid`` and counted, without the traceback aiohttp logs for each one."""

    def __init__(self, pipeline: Pipeline) -> None:
        super().__init__()
        self.pipeline = pipeline

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            log.error("http_server_error", message=record.getMessage(), exc_info=record.exc_info)
            return
        if self.pipeline.metrics:
            self.pipeline.metrics.requests_rejected.add(1, {"transport": "http", "reason": "malformed_http"})
        error = parse_error(exc)
        if error.startswith("Pause on PRI"):  # HTTP/2's connection preface
            error = "an HTTP/2 connection preface: a gRPC client? OTLP/gRPC has a port of its own (receivers.grpc)"
        log.warning("request_invalid", transport="http", error=clip(error, 300))


#: What each of aiohttp's parse errors whose message is (or quotes) part of the request says, most
#: specific class first.
_PARSE_ERRORS: tuple[tuple[type[HttpProcessingError], str], ...] = (
    (InvalidHeader, "invalid header"),
    (BadHttpMethod, "invalid request method"),
    (BadStatusLine, "invalid request line"),
    (InvalidURLError, "invalid request target"),
    (ContentLengthError, "body shorter than its Content-Length"),
    (TransferEncodingError, "invalid chunked body"),
    (ContentEncodingError, "undecodable Content-Encoding"),
)


def parse_error(exc: HttpProcessingError) -> str:
    """Why aiohttp refused a request, never with the request bytes its message quotes (a header line
    with its value, the request line, body bytes). llhttp's messages are ``<reason>:\\n\\n  b'<bytes>'``
    with a fixed reason, which is kept; aiohttp's own parser puts the bytes in messages of the
    classes in :data:`_PARSE_ERRORS`, which get a fixed text; plain :class:`BadHttpMessage` messages
    are aiohttp's fixed sentences (at most a header's name)."""
    message = str(exc.message)
    reason, quoted, _ = message.partition(":\n\n  b")
    if quoted:
        return " ".join(reason.split())
    if isinstance(exc, LineTooLong):
        return f"request line or header line over the {exc.args[1]}-byte limit"
    if type(exc) is BadHttpMessage:
        return " ".join(message.split())
    return next((text for cls, text in _PARSE_ERRORS if isinstance(exc, cls)), type(exc).__name__)


class _AnswerWithoutEcho(RequestHandler):
    """aiohttp's connection handler, answering a request it cannot parse with the reason
    (:func:`parse_error`) instead of the parser's message, which quotes the request's bytes (a header
    line with its token): a proxy or client that logs response bodies would keep them."""

    __slots__ = ()

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if isinstance(exc, HttpProcessingError):
            message = f"{status}, message: {parse_error(exc)}"
        return super().handle_error(request, status, exc, message)


def _answering_without_echo(server: web.Server) -> RequestHandler:
    """The handler ``server`` makes for a connection, as :class:`_AnswerWithoutEcho` (aiohttp has no
    option for the handler's class; the subclass adds no state)."""
    handler = server()
    handler.__class__ = _AnswerWithoutEcho
    return handler


class HttpTraceReceiver:
    """``POST /v1/traces``. Request headers and idle keep-alive are bounded by aiohttp's keep-alive
    timer (see :meth:`runner`), the body by ``read_timeout`` here."""

    def __init__(self, pipeline: Pipeline, max_body_bytes: int, auth: BearerAuth, budget: MemoryBudget,
                 read_timeout: float = 10.0) -> None:
        self.pipeline = pipeline
        self.max_body_bytes = max_body_bytes
        self.auth = auth
        self.budget = budget
        self.read_timeout = read_timeout
        #: Connections with a request being handled (never shed by :class:`HttpListener`).
        self.busy: dict[web.RequestHandler, int] = {}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._track])
        app.router.add_post("/v1/traces", self.handle)
        for signal, (_, path, _) in DISCARDED_SIGNALS.items():
            app.router.add_post(path, functools.partial(self.discard, signal))
        return app

    async def discard(self, signal: str, request: web.Request) -> web.Response:
        """``POST /v1/metrics`` and ``/v1/logs``: authenticated and read as traces are (bounded, within
        the memory budget), counted, discarded."""
        ctype = request.content_type
        if (refused := self._refused(request, ctype)) is not None:
            return refused
        lease = self.budget.lease()
        try:
            await self._body(request, lease)
        except Backpressure as exc:
            return self._overloaded(exc, ctype)
        except (_TooLarge, NeverFits) as exc:
            return self._too_large(str(exc), ctype)
        except _BadRequest as exc:
            return self._invalid(400, str(exc), ctype)
        except (ConnectionError, TimeoutError):
            return self._closing(self._error(400, "request body not received", ctype))
        finally:
            lease.close()
        _count_discarded(self.pipeline, signal, "http")
        return self._message(200, DISCARDED_SIGNALS[signal][2](), ctype)

    def runner(self, app: web.Application) -> web.AppRunner:
        """The app's runner. aiohttp's keep-alive timer (armed from the moment a connection is made,
        aiohttp >= 3.14.4) closes a connection that has not sent a whole request head within
        ``read_timeout``, idle or half-way through; an unread body is drained for as long at most."""
        server_log = logging.Logger("agenteval.collector.http")
        server_log.addHandler(_ServerLog(self.pipeline))
        return web.AppRunner(app, access_log=None, auto_decompress=False, keepalive_timeout=self.read_timeout,
                             lingering_time=self.read_timeout, logger=server_log)

    @web.middleware
    async def _track(self, request: web.Request, handler: Any) -> web.StreamResponse:
        conn = request.protocol
        self.busy[conn] = self.busy.get(conn, 0) + 1
        try:
            return await handler(request)
        finally:
            if self.busy[conn] <= 1:
                del self.busy[conn]
            else:
                self.busy[conn] -= 1

    def _refused(self, request: web.Request, ctype: str) -> web.Response | None:
        """401 without the token, 415 for a body that is not OTLP; None: go on."""
        if not self.auth.allows(request.headers.get("Authorization")):
            _count_unauthenticated(self.pipeline, "http")
            resp = self._error(401, "missing or invalid bearer token", ctype if ctype in (PROTOBUF, JSON) else JSON)
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        if ctype not in (PROTOBUF, JSON):
            return self._invalid(415, f"unsupported Content-Type {ctype!r}; use {PROTOBUF} or {JSON}", ctype, JSON)
        return None

    async def handle(self, request: web.Request) -> web.Response:
        ctype = request.content_type
        if (refused := self._refused(request, ctype)) is not None:
            return refused
        if (request.content_length or 0) > self.max_body_bytes:
            return self._too_large(f"Content-Length {request.content_length} is over the "
                                   f"{self.max_body_bytes}-byte limit", ctype)
        lease = self.budget.lease()
        try:
            return await self._receive(request, ctype, lease)
        finally:
            lease.close()

    async def _receive(self, request: web.Request, ctype: str, lease: Lease) -> web.Response:
        try:
            body = await self._body(request, lease)
        except Backpressure as exc:  # (the rest of the body is drained: the client reads a clean answer)
            return self._overloaded(exc, ctype)
        except (_TooLarge, NeverFits) as exc:
            return self._too_large(str(exc), ctype)
        except _BadRequest as exc:
            return self._invalid(400, str(exc), ctype)
        except ConnectionError:  # the client went away mid-body: nobody to answer
            return self._closing(self._error(400, "connection lost while reading the body", ctype))
        except TimeoutError:
            log.warning("request_timeout", transport="http", read_timeout=self.read_timeout)
            if self.pipeline.metrics:
                self.pipeline.metrics.requests_rejected.add(1, {"transport": "http", "reason": "read_timeout"})
            return self._closing(self._error(408, f"request body not received within {self.read_timeout}s", ctype))
        try:
            decoded = await _decode(self.pipeline, lease, body, ctype == JSON, "http")
        except Backpressure as exc:
            return self._overloaded(exc, ctype)
        except NeverFits as exc:
            return self._too_large(str(exc), ctype)
        except (ProtoDecodeError, RuntimeError, ValueError, DecodeError, RecursionError) as exc:
            return self._invalid(400, f"cannot decode ExportTraceServiceRequest: {exc}", ctype)
        if reason := never_fits(self.pipeline, decoded, "http"):
            return self._error(413, reason, ctype)
        try:
            result = self.pipeline.ingest_decoded(decoded, "http")
            del decoded, body  # the span records are taken: nothing held while the journal syncs
            lease.close()
            await _durable(result)
        except Backpressure as exc:
            return self._overloaded(exc, ctype)
        return self._message(200, _response(result), ctype)

    def _overloaded(self, exc: Backpressure, ctype: str) -> web.Response:
        resp = self._error(503, f"collector over capacity: {exc.reason}; retry later", ctype)
        resp.headers["Retry-After"] = str(max(1, round(exc.retry_after)))
        return resp

    async def _body(self, request: web.Request, lease: Lease) -> bytes:
        """The body, decompressed, holding on ``lease`` what is held of it as it is read: all of a
        Content-Length before reading it, else each chunk as it arrives; gzip is inflated chunk by chunk."""
        encoding = request.headers.get("Content-Encoding", "identity").lower()
        if encoding not in ("identity", "", "gzip"):
            raise _BadRequest(f"unsupported Content-Encoding {encoding!r}; use gzip or none")
        hold = lambda size, what: _hold(self.pipeline, lease, size, what, "http")  # noqa: E731
        declared = request.content_length
        if declared:
            hold(declared, "the body")
        inflater = _Gunzip(self.max_body_bytes, hold) if encoding == "gzip" else None
        chunks: list[bytes] = []
        size = 0
        async with asyncio.timeout(self.read_timeout):
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise _TooLarge(f"request body over the {self.max_body_bytes}-byte limit")
                if declared is None:
                    hold(len(chunk), "the body")
                if inflater is None:
                    chunks.append(chunk)
                else:
                    inflater.feed(chunk)
        if inflater is None:
            return _joined(chunks, size, hold, lease)
        body = inflater.finish(lease)
        lease.free(size)  # the compressed body is gone
        return body

    def _invalid(self, status: int, message: str, ctype: str, answer_as: str | None = None) -> web.Response:
        """A request that is not OTLP (content type, encoding, payload): counted, logged, answered."""
        if self.pipeline.metrics:
            self.pipeline.metrics.requests_rejected.add(1, {"transport": "http", "reason": "undecodable"})
        log.warning("request_invalid", transport="http", content_type=clip(ctype, 100), status=status,
                    error=clip(message, 300))
        return self._error(status, message, answer_as or ctype)

    def _too_large(self, message: str, ctype: str) -> web.Response:
        """413 for a body over ``max_body_bytes``: the sender's exporter drops that batch, so it is
        counted and logged; the connection is closed (the body was not, or not wholly, read)."""
        if self.pipeline.metrics:
            self.pipeline.metrics.requests_rejected.add(1, {"transport": "http", "reason": "too_large"})
        log.warning("request_too_large", transport="http", error=clip(message, 300))
        return self._closing(self._error(413, message, ctype))

    def _error(self, status: int, message: str, ctype: str) -> web.Response:
        return self._message(status, status_pb2.Status(code=_RPC_CODES.get(status, code_pb2.UNKNOWN),
                                                       message=clip(message)), ctype)

    @staticmethod
    def _closing(resp: web.Response) -> web.Response:
        """``resp``, then close the connection (its request body was not, or not wholly, read)."""
        resp.force_close()
        return resp

    @staticmethod
    def _message(status: int, message: Any, ctype: str) -> web.Response:
        if ctype == PROTOBUF:
            return web.Response(status=status, body=message.SerializeToString(), content_type=PROTOBUF)
        return web.Response(status=status, text=json_format.MessageToJson(message, indent=None), content_type=JSON)


def _joined(pieces: list[bytes], size: int, hold: Callable[[int, str], None], lease: Lease) -> bytes:
    """``pieces`` (``size`` bytes) as one bytes object, as the decoders take them; the copy is held
    on the budget while both exist. ``pieces`` is emptied."""
    if len(pieces) <= 1:
        return pieces.pop() if pieces else b""
    hold(size, "the body")
    joined = b"".join(pieces)
    pieces.clear()
    lease.free(size)
    return joined


class _Gunzip:
    """Every member of a gzip body (``cat a.gz b.gz`` is valid gzip), inflated chunk by chunk as the
    body arrives: at most ``limit`` bytes out (so a high-ratio bomb costs at most that much work) and
    :data:`MAX_GZIP_MEMBERS` members; ``hold`` takes each piece of output on the budget."""

    def __init__(self, limit: int, hold: Callable[[int, str], None]) -> None:
        self.limit = limit
        self.hold = hold
        self.size = 0
        self.members = 0
        self._pieces: list[bytes] = []
        self._inflater: Any = None

    def feed(self, data: bytes) -> None:
        while data:
            if self._inflater is None:
                if self.members:
                    data = data.lstrip(b"\x00")  # gzip allows zero padding after a member
                    if not data:
                        return
                self.members += 1
                if self.members > MAX_GZIP_MEMBERS:
                    raise _BadRequest(f"gzip body of more than {MAX_GZIP_MEMBERS} members")
                self._inflater = zlib.decompressobj(wbits=31)
            try:
                out = self._inflater.decompress(data, self.limit + 1 - self.size)
            except zlib.error as exc:
                raise _BadRequest(f"invalid gzip body: {exc}") from exc
            if self.size + len(out) > self.limit:
                raise _TooLarge(f"decompressed body over the {self.limit}-byte limit")
            if out:
                self.hold(len(out), "the decompressed body")
                self.size += len(out)
                self._pieces.append(out)
            if not self._inflater.eof:  # all of ``data`` was taken (the output stayed under the limit)
                return
            data = self._inflater.unused_data  # at most the rest of this chunk
            self._inflater = None

    def finish(self, lease: Lease) -> bytes:
        if self._inflater is not None:
            raise _BadRequest("invalid gzip body: truncated")
        return _joined(self._pieces, self.size, self.hold, lease)


_RPC_CODES = {400: code_pb2.INVALID_ARGUMENT, 401: code_pb2.UNAUTHENTICATED, 408: code_pb2.DEADLINE_EXCEEDED,
              413: code_pb2.RESOURCE_EXHAUSTED, 415: code_pb2.INVALID_ARGUMENT, 503: code_pb2.UNAVAILABLE}


class _TooLarge(Exception):
    pass


class _BadRequest(Exception):
    pass


class HttpListener:
    """Accepts connections for the HTTP receiver's aiohttp runner.

    Used instead of ``web.TCPSite`` because asyncio's own accept loop, when the process is out of
    file descriptors, logs a traceback and schedules a retry once per pending connection, and every
    retry does the same again (CPython gh-151615; Python 3.11 and 3.12 get no fix): megabytes of log
    a second and a starved event loop. Here a failed accept instead closes the oldest connections
    not in a request (idle keep-alive, or still sending headers: slowloris), waits a moment and
    retries; failures are counted and logged at most once every :attr:`LOG_EVERY` seconds.
    """

    LOG_EVERY = 10.0

    def __init__(self, runner: web.AppRunner, receiver: HttpTraceReceiver, endpoint: tuple[str, int],
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.runner = runner
        self.receiver = receiver
        self.endpoint = endpoint
        self.ssl_context = ssl_context
        self._sock: socket.socket | None = None
        self._task: asyncio.Task | None = None
        self._connecting: set[asyncio.Task] = set()
        self._failed = self._shed = 0
        self._logged = 0.0

    async def start(self) -> int:
        """Bind and start accepting; returns the bound port."""
        host, port = self.endpoint
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        self._sock = socket.create_server((host, port), family=family, backlog=128)
        self._sock.setblocking(False)
        self._task = asyncio.create_task(self._accept_forever(), name="http-accept")
        return self._sock.getsockname()[1]

    async def stop(self) -> None:
        """Stop accepting (connections already made are the runner's to close)."""
        for task in (self._task, *self._connecting):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._task, *self._connecting) if t is not None), return_exceptions=True)
        if self._sock is not None:
            self._sock.close()

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except (ConnectionAbortedError, InterruptedError):
                continue  # the client gave up before it was accepted
            except OSError as exc:
                self._accept_failed(exc)
                await asyncio.sleep(0.05)  # closed connections release their descriptors meanwhile
                continue
            task = asyncio.create_task(self._connect(conn))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)

    async def _connect(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        server = self.runner.server
        if server is None:  # shutting down
            conn.close()
            return
        try:
            await loop.connect_accepted_socket(functools.partial(_answering_without_echo, server), conn,
                                               ssl=self.ssl_context,
                                               ssl_handshake_timeout=self.receiver.read_timeout
                                               if self.ssl_context else None)
        except OSError as exc:  # e.g. a failed or timed-out TLS handshake: that connection's problem only
            log.debug("http_connection_failed", error=clip(str(exc), 200))
            conn.close()

    def _accept_failed(self, exc: OSError) -> None:
        """Out of descriptors (or buffers): close the oldest quarter of the idle connections."""
        server = self.runner.server
        shed: list[web.RequestHandler] = []
        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            idle = [c for c in (server.connections if server else ()) if c not in self.receiver.busy and c.transport]
            shed = idle[:max(1, len(idle) // 4)]
        for conn in shed:
            conn.force_close()
        self._failed += 1
        self._shed += len(shed)
        metrics = self.receiver.pipeline.metrics
        if metrics is not None and shed:
            metrics.shed.add(len(shed))
        now = time.monotonic()
        if now - self._logged >= self.LOG_EVERY:
            log.warning("http_accept_failed", error=exc.strerror or str(exc), failed_accepts=self._failed,
                        closed_idle_connections=self._shed, open_connections=len(server.connections) if server else 0)
            self._logged, self._failed, self._shed = now, 0, 0
