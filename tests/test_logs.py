"""The collector's log lines: the per-run line built without structlog's processor chain is the line
the chain writes."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import PurePosixPath

import pytest
import structlog

from collector.live import logs

FIELDS = {"run_id": "0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7", "trace_id": "0af7651916cd43dd",
          "subject": "ünïcode \u2028 subject", "status": "FAIL", "score": 0.25, "revision": 2, "incomplete": True,
          "checked": 2, "unchecked": 1, "executors": {"writer": "Both", "critic": "NoTruth"},
          "no_truth": {"critic": "response_missing"}, "odd": PurePosixPath("/no/json/type")}


@pytest.fixture
def output() -> Iterator[io.BytesIO]:
    """structlog and this module configured as the CLI does, writing to a buffer; restored after,
    the root logger and the warnings hook (which configure also takes over) included, so the tests
    that run next in this process log to pytest again, not into an ``_Output`` left behind."""
    config, level, file = structlog.get_config(), logs._level, logs._OUT.file
    root = logging.getLogger()
    handlers, root_level = root.handlers[:], root.level
    try:
        yield _configured("info")
    finally:
        logs.flush()
        structlog.configure(**config)
        logs._level, logs._OUT.file = level, file
        root.handlers[:] = handlers
        root.setLevel(root_level)
        logging.captureWarnings(False)


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


def test_a_value_json_has_no_type_for_is_written_as_the_chain_writes_it(output: io.BytesIO) -> None:
    log = structlog.get_logger("agenteval.collector")
    log.info("run_verdict", **FIELDS)
    logs.info(log, "run_verdict", **FIELDS)
    assert [line["odd"] for line in _lines(output)] == ["PurePosixPath('/no/json/type')"] * 2


def test_the_bytes_a_line_quotes_are_redacted(output: io.BytesIO) -> None:
    """Parsers quote the raw request (a header line with its token) as a bytes literal, closed or cut short."""
    log = structlog.get_logger("agenteval.collector")
    log.warning("request_invalid", error="Invalid header value char: b'Authorization: Bearer s3cr3t\\x00' ^",
                cut="Got more than 8190 bytes when reading: b'Bearer s3cr3txxxxx", raw=b"Bearer s3cr3t",
                nested={"lines": ["b\"Cookie: s3cr3t'\""]})
    logs.info(log, "run_verdict", raw=b"Bearer s3cr3t")
    line, fast = _lines(output)
    assert "s3cr3t" not in output.getvalue().decode()
    assert line["error"] == "Invalid header value char: b'<redacted>' ^"
    assert line["cut"] == "Got more than 8190 bytes when reading: b'<redacted>'"
    assert line["raw"] == fast["raw"] == line["nested"]["lines"][0] == "b'<redacted>'"


def test_a_traceback_carries_neither_locals_nor_the_bytes_its_exception_quotes(output: io.BytesIO) -> None:
    def handle(body: bytes, token: str) -> None:
        raise ValueError(f"cannot parse {body!r}")

    try:
        handle(b"body-s3cr3t", "token-s3cr3t")
    except ValueError:
        structlog.get_logger("agenteval.collector").exception("http_server_error")
    (line,) = _lines(output)
    assert "s3cr3t" not in output.getvalue().decode()
    (exc,) = line["exception"]
    assert exc["exc_type"] == "ValueError" and exc["exc_value"] == "cannot parse b'<redacted>'"
    assert exc["frames"][-1]["name"] == "handle" and "locals" not in exc["frames"][-1]


@pytest.mark.parametrize("micros", [0, 1_764_806_400_000_000, 1_764_806_400_000_001, 1_764_806_400_500_000,
                                    1_764_806_459_999_999, 1_764_806_460_000_000, 1_764_806_460_123_456,
                                    4_102_444_800_250_000])
def test_timestamps_are_written_as_structlogs_time_stamper_writes_them(micros: int) -> None:
    """TimeStamper writes ``datetime.now(timezone.utc).isoformat()`` with ``Z`` for ``+00:00``."""
    expected = (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=micros)).isoformat()
    assert logs.timestamp(micros) == logs.timestamp(micros) == expected.replace("+00:00", "Z")


# --- every line JSON, a bounded shutdown, the level set from outside the file (docs/design.md §6) -------

def test_with_the_push_endpoint_down_every_line_is_json_and_the_stop_is_bounded(tmp_path):
    import signal

    from conftest import CollectorProcess, export_spans, free_port
    from mafshape import SCENARIOS, record

    down = f"127.0.0.1:{free_port()}"  # nothing listens: every export fails, retries, backs off
    proc = CollectorProcess(tmp_path, overrides={"exporters": {"otlp": {
        "endpoint": down, "metrics_interval": 0.5, "retry_interval": 0.2, "shutdown_timeout": 1.0}}})
    spans, (trace_id,) = record([SCENARIOS["pass"][0]])
    export_spans(proc, spans)
    assert proc.run(trace_id)["status"] == "PASS"
    assert proc.stop(signal.SIGTERM, timeout=8) == 0  # the SDK's retries took ~17 s here before
    lines = [line for line in proc.stderr_path.read_text().splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]  # every line JSON: ours, the SDK's, grpc's
    stopped = next(i for i, e in enumerate(events) if e["event"] == "collector_stopped")
    assert all(e.get("level") in ("debug", "info", "warning", "error", "critical") for e in events)
    assert any(e.get("logger", "").startswith("opentelemetry") for e in events), "the SDK's export errors"
    assert any(e["event"] == "verdict_spans_undelivered" for e in events[stopped:])


def test_the_log_level_comes_from_the_flag_else_the_environment(tmp_path):
    import os
    import socket
    import subprocess

    from conftest import AGENTEVAL, free_port

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()  # a port the collector cannot bind: it stops once its store is open (an info line)
    config = tmp_path / "c.yaml"
    config.write_text(f"receivers:\n  grpc:\n    endpoint: 127.0.0.1:{busy.getsockname()[1]}\n"
                      f"  http:\n    endpoint: 127.0.0.1:{free_port()}\n"
                      f"exporters:\n  prometheus:\n    endpoint: 127.0.0.1:{free_port()}\n")
    base = [AGENTEVAL, "collector", "serve", "--config", str(config)]
    try:
        quiet = subprocess.run(base + ["--log-level", "error", "--store", str(tmp_path / "q.db")],
                               capture_output=True, text=True, timeout=60)
        chatty = subprocess.run(base + ["--store", str(tmp_path / "c.db")], capture_output=True, text=True,
                                timeout=60, env={**os.environ, "AGENTEVAL_LOG_LEVEL": "debug"})
    finally:
        busy.close()
    assert quiet.returncode == chatty.returncode == 1
    info = '"level":"info"'
    assert info not in quiet.stderr and info in chatty.stderr
    bad = subprocess.run(base + ["--log-level", "loud", "--store", str(tmp_path / "b.db")], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 1 and "--log-level / $AGENTEVAL_LOG_LEVEL: 'loud'" in bad.stderr
