"""structlog configuration, applied once at the edge (the CLI). Events are snake_case names with
key-value context; no prompt or response text ever reaches a log line (none is decoded)."""

from __future__ import annotations

import logging
import sys

import structlog

from collector.serialize import to_json


def configure(level: str = "info") -> None:
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(serializer=to_json),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        # bytes straight to stderr's buffer: no str round trip (a line per run is on the hot path)
        logger_factory=structlog.BytesLoggerFactory(file=sys.stderr.buffer),
        cache_logger_on_first_use=True,
    )
