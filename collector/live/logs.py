"""structlog configuration, applied once at the edge (the CLI). Events are snake_case names with
key-value context; no prompt or response text ever reaches a log line (none is decoded), nor raw
request bytes (header lines, tokens, bodies: :func:`redact`), nor a traceback's local variables."""

from __future__ import annotations

import atexit
import logging
import re
import sys
import threading
import time
import traceback
from typing import Any, BinaryIO

import structlog
from structlog.tracebacks import ExceptionDictTransformer
from structlog.typing import EventDict, WrappedLogger

from collector.core.serialize import to_json

#: Buffered info lines are written out at least when this many bytes wait.
_BUFFER_BYTES = 1 << 16


class _Output:
    """stderr with a line buffer of its own. Info and debug lines (one per run verdict, on the hot
    path) wait for :func:`flush` (the server calls it after every sweep, at start and at stop; also
    at exit) or a full buffer, so each costs no write(2) of its own; warnings and errors, and
    everything before :func:`configure`, are written at once."""

    def __init__(self) -> None:
        self.file: BinaryIO = sys.stderr.buffer
        self._lines: list[bytes] = []
        self._size = 0
        self._lock = threading.Lock()

    def write(self, line: bytes, now: bool) -> None:
        with self._lock:
            self._lines.append(line)
            self._size += len(line) + 1
            if now or self._size >= _BUFFER_BYTES:
                self._drain()

    def flush(self) -> None:
        with self._lock:
            self._drain()

    def _drain(self) -> None:
        if self._lines:
            self._lines.append(b"")
            lines, self._lines, self._size = self._lines, [], 0
            self.file.write(b"\n".join(lines))
            self.file.flush()


#: A Python bytes literal as ``repr`` writes one (closed, or cut short by a length cap; its quote
#: escaped when the literal is inside another repr): how HTTP parsers (llhttp, aiohttp's own, the
#: standard library's) quote the raw request bytes where they stopped.
_BYTES_LITERAL = re.compile(r"""\bb\\?(?:'(?:[^'\\]|\\.)*(?:'|$)|"(?:[^"\\]|\\.)*(?:"|$))""", re.S)
REDACTED = "b'<redacted>'"


def redact(text: str) -> str:
    """``text`` with every bytes literal it quotes replaced by :data:`REDACTED`: raw request bytes
    (a header line with its value, a token, a request line, body bytes) are never logged."""
    return _BYTES_LITERAL.sub(REDACTED, text) if "b'" in text or 'b"' in text or "b\\" in text else text


def _redacted(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: _redacted(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redacted(item) for item in value]
    return value


def _redact_event(logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    """structlog processor: :func:`redact` every string of the line, its traceback's included."""
    return _redacted(event)


def _repr(value: Any) -> str:
    """The JSON renderers' fallback for a value JSON has no type for (bytes, an exception...): its
    ``repr``, redacted."""
    return redact(repr(value))


_OUT = _Output()
atexit.register(_OUT.flush)


class _Logger:
    __slots__ = ()

    def later(self, message: bytes) -> None:
        _OUT.write(message, False)

    def now(self, message: bytes) -> None:
        _OUT.write(message, True)

    log = debug = info = msg = later
    warn = warning = err = error = exception = critical = fatal = failure = now


def flush() -> None:
    """Write out the log lines waiting in the buffer."""
    _OUT.flush()


#: The level :func:`configure` set (None: not configured, structlog's own defaults apply).
_level: int | None = None


def info(logger: Any, event: str, **fields: Any) -> None:
    """``logger.info(event, **fields)`` for the per-run hot path: under :func:`configure`, the line its
    processor chain writes (the fields, then event, level and timestamp), built without the chain:
    36-55 µs a line through it, 15-26 without (bench/RESULTS.md, fifth sitting). Otherwise (structlog
    configured by someone else) ``logger.info`` itself."""
    if _level is None:
        logger.info(event, **fields)
    elif _level <= logging.INFO:
        fields.update(event=event, level="info", timestamp=timestamp(time.time_ns() // 1000))
        _OUT.write(to_json(fields, default=_repr), False)  # the chain's fallback too


_second: tuple[int, str] = (-1, "")


def timestamp(micros: int) -> str:
    """A Unix time in microseconds as structlog's ``TimeStamper(fmt="iso", utc=True)`` writes the
    time (microseconds unless zero, then ``Z``), formatting the date and time once a second."""
    global _second
    whole, micro = divmod(micros, 1_000_000)
    second = _second  # one read: another thread may replace it meanwhile
    if second[0] != whole:
        second = _second = (whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)))
    return f"{second[1]}.{micro:06d}Z" if micro else f"{second[1]}Z"


class _LibraryRecords(logging.Handler):
    """Log records of libraries and the SDK (grpc, aiohttp, the OpenTelemetry exporters' "Transient
    error ..." lines, Python warnings) as JSON lines like ours, redacted: every line is JSON."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields: dict[str, Any] = {"event": redact(record.getMessage()), "logger": record.name,
                                      "level": record.levelname.lower(),
                                      "timestamp": timestamp(int(record.created * 1_000_000))}
            if record.exc_info and record.exc_info[1] is not None:
                fields["exception"] = redact("".join(traceback.format_exception_only(record.exc_info[1])).strip())
            _OUT.write(to_json(fields, default=_repr), record.levelno >= logging.WARNING)
        except Exception:  # a log line must never break the caller
            self.handleError(record)


def configure(level: str = "info") -> None:
    global _level
    _OUT.flush()
    _OUT.file = sys.stderr.buffer
    _level = logging.getLevelNamesMapping()[level.upper()]
    root = logging.getLogger()
    root.handlers[:] = [_LibraryRecords()]
    root.setLevel(_level)
    logging.captureWarnings(True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            # no locals: they hold request bodies, headers and tokens
            structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False)),
            _redact_event,
            structlog.processors.JSONRenderer(serializer=to_json, default=_repr),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_level),
        # bytes to stderr's buffer: no str round trip (a line per run is on the hot path)
        logger_factory=lambda *args: _Logger(),
        cache_logger_on_first_use=True,
    )
