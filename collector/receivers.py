"""OTLP receivers (DESIGN §3): gRPC ``TraceService/Export`` and HTTP ``POST /v1/traces``.

Both follow the OTLP specification's response rules and feed one :class:`Pipeline`:
- undecodable request: gRPC INVALID_ARGUMENT / HTTP 400 with a ``google.rpc.Status`` body;
- oversize: gRPC RESOURCE_EXHAUSTED (grpc's own receive limit) / HTTP 413 (from Content-Length
  before the body is read, else while reading it, compressed and after gunzip alike);
- unusable spans inside a good request: success with ``partial_success.rejected_spans``;
- over capacity: gRPC UNAVAILABLE with ``RetryInfo`` / HTTP 503 with ``Retry-After``;
- a request that can never fit the configured capacity (more spans than ``max_spans_in_flight`` or
  more traces than ``max_traces_in_flight``): not retryable, gRPC INVALID_ARGUMENT / HTTP 413.

What a request carries is echoed back and logged only capped: a reason at :data:`MAX_REASON_BYTES`,
a whole message at :data:`MAX_MESSAGE_BYTES`. Slow HTTP clients are held to
``receivers.http.read_timeout``; :class:`HttpListener` copes with running out of file descriptors.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import socket
import ssl
import time
import zlib
from typing import Any

import grpc
import structlog
from aiohttp import web
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
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceResponse,
)

from collector.assembler import Backpressure
from collector.decode import Decoded, DecodeError, count_spans, decode_bytes, decode_otlp_json
from collector.journal import JournalError
from collector.pipeline import IngestResult, Pipeline
from collector.security import BearerAuth, grpc_authorization

log = structlog.get_logger("agenteval.collector")

TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
#: Longest single reason (one rejected span's) echoed to the client and logged.
MAX_REASON_BYTES = 256
#: Longest message (``partial_success.error_message``, an error's status message) echoed to a client.
MAX_MESSAGE_BYTES = 1024


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


def _never_fits(pipeline: Pipeline, decoded: Decoded, transport: str) -> str | None:
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

class GrpcTraceService:
    """``TraceService/Export`` over raw bytes, so a bad payload is INVALID_ARGUMENT, not INTERNAL."""

    def __init__(self, pipeline: Pipeline, auth: BearerAuth) -> None:
        self.pipeline = pipeline
        self.auth = auth

    async def export(self, payload: bytes, context: grpc.aio.ServicerContext) -> ExportTraceServiceResponse:
        if not self.auth.allows(grpc_authorization(context)):
            _count_unauthenticated(self.pipeline, "grpc")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
        try:
            try:  # a payload that is not a request is INVALID_ARGUMENT, refused or not
                self.pipeline.admit(lambda: count_spans(payload), "grpc")
                decoded = _clip_reasons(decode_bytes(payload, self.pipeline.matcher))
            except (ProtoDecodeError, RuntimeError) as exc:
                self._count_undecodable()
                log.warning("request_invalid", transport="grpc", error=clip(str(exc), 300), bytes=len(payload))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    clip(f"cannot decode ExportTraceServiceRequest: {exc}"))
            if reason := _never_fits(self.pipeline, decoded, "grpc"):
                # Not RESOURCE_EXHAUSTED: OTLP exporters retry that code, and this request can never succeed.
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason)
            result = self.pipeline.ingest_decoded(decoded, "grpc")
            del decoded  # the span records are taken: not held while the journal syncs (the payload is)
            await _durable(result)
        except Backpressure as exc:
            retry = _retry_info(exc.retry_after)
            status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message=exc.reason)
            status.details.add().Pack(retry)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"collector over capacity: {exc.reason}; retry later",
                trailing_metadata=(
                    ("google.rpc.retryinfo-bin", retry.SerializeToString()),
                    ("grpc-status-details-bin", status.SerializeToString()),
                ),
            )
        return _response(result)

    def _count_undecodable(self) -> None:
        if self.pipeline.metrics:
            self.pipeline.metrics.requests_rejected.add(1, {"transport": "grpc", "reason": "undecodable"})

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(TRACE_SERVICE, {
            "Export": grpc.unary_unary_rpc_method_handler(
                self.export, request_deserializer=None,
                response_serializer=ExportTraceServiceResponse.SerializeToString),
        })


def grpc_server(max_message_bytes: int, handshake_timeout: float) -> grpc.aio.Server:
    return grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
        # Connections that never finish the TLS / HTTP/2 handshake are closed (gRPC's default: 120 s).
        ("grpc.server_handshake_timeout_ms", max(1, int(handshake_timeout * 1000))),
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


class HttpTraceReceiver:
    """``POST /v1/traces``. Request headers and idle keep-alive are bounded by aiohttp's keep-alive
    timer (see :meth:`runner`), the body by ``read_timeout`` here."""

    def __init__(self, pipeline: Pipeline, max_body_bytes: int, auth: BearerAuth, read_timeout: float = 10.0) -> None:
        self.pipeline = pipeline
        self.max_body_bytes = max_body_bytes
        self.auth = auth
        self.read_timeout = read_timeout
        #: Connections with a request being handled (never shed by :class:`HttpListener`).
        self.busy: dict[web.RequestHandler, int] = {}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._track])
        app.router.add_post("/v1/traces", self.handle)
        return app

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

    async def handle(self, request: web.Request) -> web.Response:
        ctype = request.content_type
        if not self.auth.allows(request.headers.get("Authorization")):
            _count_unauthenticated(self.pipeline, "http")
            resp = self._error(401, "missing or invalid bearer token", ctype if ctype in (PROTOBUF, JSON) else JSON)
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        if ctype not in (PROTOBUF, JSON):
            return self._invalid(415, f"unsupported Content-Type {ctype!r}; use {PROTOBUF} or {JSON}", ctype, JSON)
        if (request.content_length or 0) > self.max_body_bytes:
            return self._too_large(f"Content-Length {request.content_length} is over the "
                                   f"{self.max_body_bytes}-byte limit", ctype)
        try:
            body = await self._body(request)
        except _TooLarge as exc:
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
        matcher = self.pipeline.matcher
        try:
            if ctype == PROTOBUF:
                self.pipeline.admit(lambda: count_spans(body), "http")
                decoded = decode_bytes(body, matcher)
            else:
                decoded = decode_otlp_json(json.loads(body), matcher, strict=False)
        except Backpressure as exc:
            return self._overloaded(exc, ctype)
        except (ProtoDecodeError, RuntimeError, ValueError, DecodeError, RecursionError) as exc:
            return self._invalid(400, f"cannot decode ExportTraceServiceRequest: {exc}", ctype)
        _clip_reasons(decoded)
        if reason := _never_fits(self.pipeline, decoded, "http"):
            return self._error(413, reason, ctype)
        try:
            result = self.pipeline.ingest_decoded(decoded, "http")
            del decoded  # the span records are taken: not held while the journal syncs (the body is)
            await _durable(result)
        except Backpressure as exc:
            return self._overloaded(exc, ctype)
        return self._message(200, _response(result), ctype)

    def _overloaded(self, exc: Backpressure, ctype: str) -> web.Response:
        resp = self._error(503, f"collector over capacity: {exc.reason}; retry later", ctype)
        resp.headers["Retry-After"] = str(max(1, round(exc.retry_after)))
        return resp

    async def _body(self, request: web.Request) -> bytes:
        try:
            async with asyncio.timeout(self.read_timeout):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise _TooLarge(f"request body over the {self.max_body_bytes}-byte limit") from exc
        encoding = request.headers.get("Content-Encoding", "identity").lower()
        if encoding in ("identity", ""):
            return raw
        if encoding != "gzip":
            raise _BadRequest(f"unsupported Content-Encoding {encoding!r}; use gzip or none")
        return gunzip(raw, self.max_body_bytes)

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


def gunzip(raw: bytes, limit: int) -> bytes:
    """Every member of a gzip body (``cat a.gz b.gz`` is valid gzip), at most ``limit`` bytes in all."""
    out = bytearray()
    data = raw
    while data:
        inflater = zlib.decompressobj(wbits=31)
        try:
            out += inflater.decompress(data, limit + 1 - len(out))
        except zlib.error as exc:
            raise _BadRequest(f"invalid gzip body: {exc}") from exc
        if len(out) > limit:
            raise _TooLarge(f"decompressed body over the {limit}-byte limit")
        if not inflater.eof:
            raise _BadRequest("invalid gzip body: truncated")
        data = inflater.unused_data.lstrip(b"\x00")  # gzip allows zero padding after a member
    return bytes(out)


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
            await loop.connect_accepted_socket(server, conn, ssl=self.ssl_context,
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
