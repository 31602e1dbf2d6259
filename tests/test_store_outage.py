"""A collector whose run store cannot be reached when it starts (PostgreSQL down, SQLite locked by
another process) starts anyway: it listens, journals and acknowledges spans, reports not ready on
/readyz, answers reads "retry later", and once the store is back opens it and stores every
acknowledged trace's run; a kill -9 meanwhile loses nothing (the journal replays). Before, it exited
1 at start (PostgreSQL after 11 s, SQLite after 5.6 s)."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import pairwise

import grpc
import pytest

from collector.api.v1 import fidelity_pb2 as pb
from collector.api.v1.fidelity_pb2_grpc import FidelityServiceStub
from collector.store import open_store

from conftest import AGENTEVAL, CollectorProcess, export_spans
from mafshape import SCENARIOS, record, run_id

NAMES = ["pass", "fail_under_report", "path2_pending", "partial_warn"]


@contextmanager
def outage(postgres) -> Iterator[Callable[[], None]]:
    """PostgreSQL stopped; the callable starts it again (and the end of the block, if a test failed)."""
    postgres.stop()
    up = False

    def back() -> None:
        nonlocal up
        postgres.start()
        up = True

    try:
        yield back
    finally:
        if not up:
            postgres.start()


def get(url: str) -> tuple[int, dict]:
    """(status, JSON body) of a GET, whatever the status."""
    try:
        with urllib.request.urlopen(url, timeout=15) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def send(proc: CollectorProcess) -> dict[str, str]:
    """One acknowledged trace per scenario, alternating transports; trace id -> expected status."""
    expected = {}
    for index, name in enumerate(NAMES):
        spans, (trace_id,) = record([SCENARIOS[name][0]])
        export_spans(proc, spans, "grpc" if index % 2 else "http")  # asserts SUCCESS: acknowledged
        expected[trace_id] = SCENARIOS[name][1]
    return expected


def assert_not_ready_and_reads_say_retry_later(proc: CollectorProcess, trace_id: str) -> None:
    assert get(f"{proc.http}/healthz") == (200, {"status": "alive"})
    status, body = get(f"{proc.http}/readyz")
    assert status == 503 and body["ready"] is False and body["store"] == "unavailable", body
    stub = FidelityServiceStub(grpc.insecure_channel(proc.grpc))
    for call in (lambda: stub.GetRun(pb.GetRunRequest(run_id=run_id(trace_id))),
                 lambda: stub.ListRuns(pb.ListRunsRequest())):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE and "retry later" in err.value.details()
    for path in ("/runs", f"/runs/{run_id(trace_id)}"):
        with pytest.raises(urllib.error.HTTPError) as page:
            urllib.request.urlopen(f"{proc.http}{path}", timeout=15)
        assert page.value.code == 503 and "retry later" in page.value.read().decode()
        assert int(page.value.headers["Retry-After"]) > 0


def assert_stored_and_ready(proc: CollectorProcess, expected: dict[str, str]) -> None:
    for trace_id, status in expected.items():
        assert proc.run(trace_id, timeout=60)["status"] == status
    deadline = time.monotonic() + 30
    while (ready := get(f"{proc.http}/readyz")) != (200, {"ready": True, "store": "open"}):
        assert time.monotonic() < deadline, ready
        time.sleep(0.1)
    assert sorted(r["trace_id"] for r in proc.store().list_runs(limit=1000)) == sorted(expected)
    assert FidelityServiceStub(grpc.insecure_channel(proc.grpc)).GetRun(
        pb.GetRunRequest(run_id=run_id(next(iter(expected))))).run_id
    # store_opened is an info line: written out after the sweep that follows it (live/logs.py), which
    # may come after the store has answered the reads above
    deadline = time.monotonic() + 30
    while (events := [e for e in proc.log_events() if e.get("event") in ("store_unavailable", "store_opened")]
           )[-1]["event"] != "store_opened" and time.monotonic() < deadline:
        time.sleep(0.1)
    # One line per change of state, not one per retry.
    assert events[0]["event"] == "store_unavailable" and events[-1]["event"] == "store_opened", events
    errors = [e["error"] for e in events if e["event"] == "store_unavailable"]
    assert all(a != b for a, b in pairwise(errors)) and len(events) == len(errors) + 1, events
    assert "Traceback" not in proc.stderr_path.read_text()


def test_collector_starts_while_postgres_is_down_and_stores_every_run_once_it_is_back(postgres, tmp_path):
    url = postgres.database()
    proc = None
    try:
        with outage(postgres) as back:
            proc = CollectorProcess(tmp_path, store_url=url)
            expected = send(proc)
            assert_not_ready_and_reads_say_retry_later(proc, next(iter(expected)))
            listed = subprocess.run([AGENTEVAL, "runs", "list", "--store", url], capture_output=True, text=True,
                                timeout=60)
            assert listed.returncode == 1 and "retry later" in listed.stderr and "Traceback" not in listed.stderr
            time.sleep(2)  # the collector retries meanwhile: still one log line
            back()
        assert_stored_and_ready(proc, expected)
    finally:
        if proc is not None:
            assert proc.stop() == 0


def test_collector_starts_while_sqlite_is_locked_and_stores_every_run_once_it_is_released(tmp_path):
    path = tmp_path / "runs.db"
    open_store(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process's long write transaction
    proc = None
    try:
        proc = CollectorProcess(tmp_path)
        expected = send(proc)
        assert_not_ready_and_reads_say_retry_later(proc, next(iter(expected)))
        holder.execute("ROLLBACK")
        assert_stored_and_ready(proc, expected)
    finally:
        holder.close()
        if proc is not None:
            assert proc.stop() == 0


def test_kill_9_while_postgres_is_down_at_start_loses_no_acknowledged_span(postgres, tmp_path):
    """The spans acknowledged while the store was down are in the journal only: a kill -9 then, a
    restart with the store still down, and the store back: every run is stored, once."""
    url = postgres.database()
    proc = None
    try:
        with outage(postgres) as back:
            proc = CollectorProcess(tmp_path, store_url=url)
            expected = send(proc)
            deadline = time.monotonic() + 30  # their verdicts made and queued for the store
            while proc.metrics().get(("agenteval_store_queued_runs", ()), 0) < len(expected):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            proc.proc.send_signal(signal.SIGKILL)
            proc.stop()
            (tmp_path / "collector.log").rename(tmp_path / "life0.log")
            proc = CollectorProcess(tmp_path, store_url=url)
            assert any(e.get("event") == "journal_replayed" for e in proc.log_events())
            assert_not_ready_and_reads_say_retry_later(proc, next(iter(expected)))
            back()
        assert_stored_and_ready(proc, expected)
        for trace_id in expected:
            assert proc.run(trace_id)["revision"] == 1
    finally:
        if proc is not None:
            assert proc.stop() == 0
