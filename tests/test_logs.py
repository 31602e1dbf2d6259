"""The collector's log lines: the per-run line built without structlog's processor chain is the line
the chain writes."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import datetime, timezone

import pytest
import structlog

from collector import logs

FIELDS = {"run_id": "0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7", "trace_id": "0af7651916cd43dd",
          "subject": "ünïcode \u2028 subject", "status": "FAIL", "score": 0.25, "revision": 2, "incomplete": True,
          "checked": 2, "unchecked": 1, "executors": {"writer": "Both", "critic": "NoTruth"},
          "no_truth": {"critic": "response_missing"}}


@pytest.fixture
def output() -> Iterator[io.BytesIO]:
    """structlog and this module configured as the CLI does, writing to a buffer; restored after."""
    config, level, file = structlog.get_config(), logs._level, logs._OUT.file
    try:
        yield _configured("info")
    finally:
        logs.flush()
        structlog.configure(**config)
        logs._level, logs._OUT.file = level, file


def _configured(level: str) -> io.BytesIO:
    logs.configure(level)
    logs._OUT.file = buffer = io.BytesIO()
    return buffer


def _lines(buffer: io.BytesIO) -> list[dict]:
    logs.flush()
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def test_the_per_run_line_is_the_line_the_chain_writes(output: io.BytesIO) -> None:
    log = structlog.get_logger("agenteval.collector")
    log.info("run_verdict", **FIELDS)
    logs.info(log, "run_verdict", **FIELDS)
    chain, direct = _lines(output)
    assert list(direct) == list(chain) == [*FIELDS, "event", "level", "timestamp"]
    assert {**direct, "timestamp": None} == {**chain, "timestamp": None}
    stamps = [datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")) for line in (chain, direct)]
    assert 0 <= (stamps[1] - stamps[0]).total_seconds() < 5


def test_the_per_run_line_follows_the_level(output: io.BytesIO) -> None:
    buffer = _configured("warning")
    log = structlog.get_logger("agenteval.collector")
    logs.info(log, "run_verdict", **FIELDS)
    log.warning("request_refused", spans=3)
    assert [line["event"] for line in _lines(buffer)] == ["request_refused"]


def test_unconfigured_it_is_the_loggers_own_info(output: io.BytesIO) -> None:
    logs._level = None  # structlog configured by someone else (a library caller, a test)
    with structlog.testing.capture_logs() as captured:
        logs.info(structlog.get_logger("agenteval.collector"), "run_verdict", **FIELDS)
    assert captured == [{**FIELDS, "event": "run_verdict", "log_level": "info"}]


@pytest.mark.parametrize("now", [0.0, 1_764_806_400.0, 1_764_806_400.000001, 1_764_806_400.5, 1_764_806_459.999999,
                                 1_764_806_460.0, 1_764_806_460.123456, 4_102_444_800.25])
def test_timestamps_are_structlogs(now: float) -> None:
    expected = datetime.fromtimestamp(now, timezone.utc).isoformat().replace("+00:00", "Z")
    assert logs.timestamp(now) == expected
    assert logs.timestamp(now) == expected  # the cached second gives the same
