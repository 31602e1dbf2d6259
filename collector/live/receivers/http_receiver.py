"""The ``http`` receiver (docs/design.md §3): OTLP/HTTP ``POST /v1/traces`` on
``receivers.http.endpoint`` (``/v1/metrics`` and ``/v1/logs`` beside it, discarded), and whatever
other routes the collector serves on that port (health, the run page).

- a body that is not OTLP (:class:`Undecodable`): 400 with a ``google.rpc.Status`` body, 415 for a
  content type that is not OTLP's;
- oversize: 413, from Content-Length before the body is read, else while reading it, compressed and
  after gunzip alike; also a request that can never fit the capacity (more spans than
  ``max_spans_in_flight``, more traces than ``max_traces_in_flight``, more memory than the budget);
- over capacity: 503 with ``Retry-After``.

A gzip body is inflated as it arrives, at most :data:`MAX_GZIP_MEMBERS` members and
``max_body_bytes`` out. Slow clients are held to ``read_timeout``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import Message
from google.rpc import code_pb2, status_pb2

from collector.config import HttpReceiver as HttpConfig
from collector.config import Tls, split_endpoint
from collector.live.assembler import Backpressure
from collector.live.budget import Lease, MemoryBudget
from collector.live.pipeline import Pipeline
from collector.live.receivers.decoding import Fault, Undecodable, check_fits
from collector.live.receivers.http_listener import HttpListener, ServerLog
from collector.live.receivers.limits import MAX_GZIP_MEMBERS, clip
from collector.live.receivers.otlp import DISCARDED_SIGNALS, budgeted, decode_request, durable, response
from collector.live.receivers.telemetry import Telemetry
from collector.security import BearerAuth, ssl_context

TRANSPORT = "http"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"


class HttpTraceReceiver:
    """The HTTP server: :meth:`start` builds the app (with the routes each of ``routes`` adds), binds
    its :class:`HttpListener`; :meth:`stop` closes both."""

    def __init__(self, config: HttpConfig, tls: Tls, pipeline: Pipeline, auth: BearerAuth, budget: MemoryBudget,
                 routes: Sequence[Callable[[web.Application], None]] = ()) -> None:
        self.config = config
        self.tls = tls
        self.traces = HttpTraceService(pipeline, config.max_body_bytes, auth, budget, config.read_timeout)
        self.routes = routes
        #: host:port, the port bound (once started).
        self.address: str | None = None
        self._runner: web.AppRunner | None = None
        self._listener: HttpListener | None = None

    async def start(self) -> None:
        app = self.traces.app()
        for add in self.routes:
            add(app)
        runner = self.traces.runner(app)
        await runner.setup()
        host, port = split_endpoint(self.config.endpoint)
        listener = HttpListener(runner, (host, port), ssl_context(self.tls) if self.tls.enabled else None,
                                self.config.read_timeout, self.traces.busy, self.traces.telemetry)
        try:
            await listener.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner, self._listener = runner, listener
        self.address = f"{host}:{listener.port}"

    async def stop(self) -> None:
        """Stop accepting, then close the connections."""
        if self._listener is not None:
            await self._listener.stop()
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class HttpTraceService:
    """``POST /v1/traces``. Request headers and idle keep-alive are bounded by aiohttp's keep-alive
    timer (see :meth:`runner`), the body by ``read_timeout`` here."""

    def __init__(self, pipeline: Pipeline, max_body_bytes: int, auth: BearerAuth, budget: MemoryBudget,
                 read_timeout: float) -> None:
        self.pipeline = pipeline
        self.max_body_bytes = max_body_bytes
        self.auth = auth
        self.budget = budget
        self.read_timeout = read_timeout
        self.telemetry = Telemetry(TRANSPORT, pipeline.metrics)
        #: Connections with a request being handled (never shed by :class:`HttpListener`).
        self.busy: dict[web.RequestHandler, int] = {}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._track])
        app.router.add_post("/v1/traces", self.handle)
        for signal, (_, path, _) in DISCARDED_SIGNALS.items():
            app.router.add_post(path, functools.partial(self.discard, signal))
        return app

    def runner(self, app: web.Application) -> web.AppRunner:
        """The app's runner. aiohttp's keep-alive timer (armed from the moment a connection is made,
        aiohttp >= 3.14.4) closes a connection that has not sent a whole request head within
        ``read_timeout``, idle or half-way through; an unread body is drained for as long at most."""
        server_log = logging.Logger("agenteval.collector.http")
        server_log.addHandler(ServerLog(self.telemetry))
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

    async def discard(self, signal: str, request: web.Request) -> web.Response:
        """``POST /v1/metrics`` and ``/v1/logs``: authenticated and read as traces are (bounded, within
        the memory budget), counted, discarded."""
        ctype = request.content_type
        if (refused := self._refused(request, ctype)) is not None:
            return refused
        lease = self.budget.lease()
        try:
            await self._body(request, lease)
        except (Backpressure, Undecodable) as exc:
            return self._refusal(exc, ctype)
        except (ConnectionError, TimeoutError):
            return self._closing(self._error(400, "request body not received", ctype))
        finally:
            lease.close()
        self.telemetry.discarded(signal)
        return self._message(200, DISCARDED_SIGNALS[signal][2](), ctype)

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

    def _refused(self, request: web.Request, ctype: str) -> web.Response | None:
        """401 without the token, 415 for a body that is not OTLP; None: go on."""
        if not self.auth.allows(request.headers.get("Authorization")):
            self.telemetry.unauthenticated()
            resp = self._error(401, "missing or invalid bearer token", ctype if ctype in (PROTOBUF, JSON) else JSON)
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        if ctype not in (PROTOBUF, JSON):
            return self._invalid(415, f"unsupported Content-Type {ctype!r}; use {PROTOBUF} or {JSON}", ctype, JSON)
        return None

    async def _receive(self, request: web.Request, ctype: str, lease: Lease) -> web.Response:
        try:
            body = await self._body(request, lease)
        except (Backpressure, Undecodable) as exc:  # (the rest of the body is drained: a clean answer)
            return self._refusal(exc, ctype)
        except ConnectionError:  # the client went away mid-body: nobody to answer
            return self._closing(self._error(400, "connection lost while reading the body", ctype))
        except TimeoutError:
            self.telemetry.timed_out(self.read_timeout)
            return self._closing(self._error(408, f"request body not received within {self.read_timeout}s", ctype))
        try:
            decoded = await decode_request(self.pipeline, self.telemetry, lease, body, ctype == JSON)
            check_fits(decoded, self.pipeline.config.assembly, self.telemetry)
            result = self.pipeline.ingest_decoded(decoded, TRANSPORT)
            del decoded, body  # the span records are taken: nothing held while the journal syncs
            lease.close()
            await durable(result)
        except (Backpressure, Undecodable) as exc:
            return self._refusal(exc, ctype)
        return self._message(200, response(result), ctype)

    async def _body(self, request: web.Request, lease: Lease) -> bytes:
        """The body, decompressed, holding on ``lease`` what is held of it as it is read: all of a
        Content-Length before reading it, else each chunk as it arrives; gzip is inflated chunk by chunk."""
        encoding = request.headers.get("Content-Encoding", "identity").lower()
        if encoding not in ("identity", "", "gzip"):
            raise Undecodable(Fault.INVALID, f"unsupported Content-Encoding {encoding!r}; use gzip or none")

        def hold(size: int, what: str) -> None:
            with budgeted(self.telemetry):
                lease.hold(size, what)

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
                    raise Undecodable(Fault.TOO_LARGE, f"request body over the {self.max_body_bytes}-byte limit")
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

    def _refusal(self, exc: Backpressure | Undecodable, ctype: str) -> web.Response:
        if isinstance(exc, Backpressure):
            resp = self._error(503, f"collector over capacity: {exc.reason}; retry later", ctype)
            resp.headers["Retry-After"] = str(max(1, round(exc.retry_after)))
            return resp
        if exc.fault is Fault.INVALID:
            return self._invalid(400, exc.message, ctype)
        if exc.fault is Fault.TOO_LARGE:
            return self._too_large(exc.message, ctype)
        return self._error(413, exc.message, ctype)  # never fits: counted where that was found

    def _invalid(self, status: int, message: str, ctype: str, answer_as: str | None = None) -> web.Response:
        """A request that is not OTLP (content type, encoding, payload): counted, logged, answered."""
        self.telemetry.invalid(message, content_type=clip(ctype, 100), status=status)
        return self._error(status, message, answer_as or ctype)

    def _too_large(self, message: str, ctype: str) -> web.Response:
        """413 for a body over ``max_body_bytes``: the sender's exporter drops that batch, so it is
        counted and logged; the connection is closed (the body was not, or not wholly, read)."""
        self.telemetry.too_large(message)
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
    def _message(status: int, message: Message, ctype: str) -> web.Response:
        if ctype == PROTOBUF:
            return web.Response(status=status, body=message.SerializeToString(), content_type=PROTOBUF)
        return web.Response(status=status, text=json_format.MessageToJson(message, indent=None), content_type=JSON)


_RPC_CODES = {400: code_pb2.INVALID_ARGUMENT, 401: code_pb2.UNAUTHENTICATED, 408: code_pb2.DEADLINE_EXCEEDED,
              413: code_pb2.RESOURCE_EXHAUSTED, 415: code_pb2.INVALID_ARGUMENT, 503: code_pb2.UNAVAILABLE}


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
                    raise Undecodable(Fault.INVALID, f"gzip body of more than {MAX_GZIP_MEMBERS} members")
                self._inflater = zlib.decompressobj(wbits=31)
            try:
                out = self._inflater.decompress(data, self.limit + 1 - self.size)
            except zlib.error as exc:
                raise Undecodable(Fault.INVALID, f"invalid gzip body: {exc}") from exc
            if self.size + len(out) > self.limit:
                raise Undecodable(Fault.TOO_LARGE, f"decompressed body over the {self.limit}-byte limit")
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
            raise Undecodable(Fault.INVALID, "invalid gzip body: truncated")
        return _joined(self._pieces, self.size, self.hold, lease)
