"""Connections to the ``http`` receiver: accepted by :class:`HttpListener` (which copes with running
out of file descriptors), and a request aiohttp cannot parse answered and logged with the reason,
never with its bytes (:func:`parse_error`)."""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
import ssl
import time
from collections.abc import Container

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
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from collector.live.receivers.limits import clip
from collector.live.receivers.telemetry import Telemetry

log = structlog.get_logger("agenteval.collector")


class HttpListener:
    """Accepts connections for the HTTP receiver's aiohttp runner.

    Used instead of ``web.TCPSite`` because asyncio's own accept loop, when the process is out of
    file descriptors, logs a traceback and schedules a retry once per pending connection, and every
    retry does the same again (CPython gh-151615; Python 3.11 and 3.12 get no fix): megabytes of log
    a second and a starved event loop. Here a failed accept instead closes the oldest connections
    not in a request (idle keep-alive, or still sending headers: slowloris; never one in ``busy``),
    waits a moment and retries; failures are counted and logged at most once every :attr:`LOG_EVERY`
    seconds.
    """

    LOG_EVERY = 10.0

    def __init__(self, runner: web.AppRunner, endpoint: tuple[str, int], ssl_context: ssl.SSLContext | None,
                 handshake_timeout: float, busy: Container[RequestHandler], telemetry: Telemetry) -> None:
        self.runner = runner
        self.endpoint = endpoint
        self.ssl_context = ssl_context
        self.handshake_timeout = handshake_timeout
        self.busy = busy
        self.telemetry = telemetry
        #: The port bound (once started).
        self.port: int | None = None
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._connecting: set[asyncio.Task[None]] = set()
        self._failed = self._shed = 0
        self._logged = 0.0

    async def start(self) -> None:
        """Bind and start accepting."""
        host, port = self.endpoint
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        self._sock = socket.create_server((host, port), family=family, backlog=128)
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._task = asyncio.create_task(self._accept_forever(), name="http-accept")

    async def stop(self) -> None:
        """Stop accepting (connections already made are the runner's to close)."""
        tasks = [task for task in (self._task, *self._connecting) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
        self._sock = self._task = None

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
            await loop.connect_accepted_socket(
                functools.partial(_answering_without_echo, server), conn, ssl=self.ssl_context,
                ssl_handshake_timeout=self.handshake_timeout if self.ssl_context else None)
        except OSError as exc:  # e.g. a failed or timed-out TLS handshake: that connection's problem only
            log.debug("http_connection_failed", error=clip(str(exc), 200))
            conn.close()

    def _accept_failed(self, exc: OSError) -> None:
        """Out of descriptors (or buffers): close the oldest quarter of the idle connections."""
        server = self.runner.server
        shed: list[RequestHandler] = []
        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            idle = [c for c in (server.connections if server else ()) if c not in self.busy and c.transport]
            shed = idle[:max(1, len(idle) // 4)]
        for conn in shed:
            conn.force_close()
        self._failed += 1
        self._shed += len(shed)
        self.telemetry.shed(len(shed))
        now = time.monotonic()
        if now - self._logged >= self.LOG_EVERY:
            log.warning("http_accept_failed", error=exc.strerror or str(exc), failed_accepts=self._failed,
                        closed_idle_connections=self._shed, open_connections=len(server.connections) if server else 0)
            self._logged, self._failed, self._shed = now, 0, 0


class ServerLog(logging.Handler):
    """aiohttp's server log for the OTLP/HTTP port, as the collector's JSON lines. A request aiohttp
    cannot parse is the client's error (a gRPC exporter on this port, a broken Content-Length):
    logged as ``request_invalid`` and counted, without the traceback aiohttp logs for each one."""

    def __init__(self, telemetry: Telemetry) -> None:
        super().__init__()
        self.telemetry = telemetry

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            log.error("http_server_error", message=record.getMessage(), exc_info=record.exc_info)
            return
        error = parse_error(exc)
        if error.startswith("Pause on PRI"):  # HTTP/2's connection preface
            error = "an HTTP/2 connection preface: a gRPC client? OTLP/gRPC has a port of its own (receivers.grpc)"
        self.telemetry.malformed(error)


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
