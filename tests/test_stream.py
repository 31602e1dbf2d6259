"""FidelityService (WatchVerdicts / GetRun / ListRuns), its committed generated code, and `agenteval watch`."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_tools import protoc
from rich.console import Console

from collector.api.v1 import fidelity_pb2 as pb
from collector.api.v1.fidelity_pb2_grpc import FidelityServiceStub
from collector.config import load_config
from collector.core.reconcile import reconcile
from collector.core.serialize import run_to_dict
from collector.formats.loader import iter_runs
from collector.outputs.stream import RunFilter, VerdictHub, WatcherClosed, WatcherLagged
from collector.outputs.wire import run_message, to_doc
from collector.ui.watch import Board

from conftest import AGENTEVAL, CollectorProcess, export_spans, free_port
from mafshape import SCENARIOS, record, run_id

ROOT = Path(__file__).resolve().parent.parent


def test_committed_generated_code_matches_the_proto(tmp_path):
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    assert protos, "no .proto files under proto/"
    include = Path(protoc.__file__).parent / "_proto"
    rc = protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={tmp_path}",
                      f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                      *[str(ROOT / "proto" / p) for p in protos]])
    assert rc == 0
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated
    for rel in generated:
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is generated but not committed: run `make proto`"
        assert committed.read_text() == (tmp_path / rel).read_text(), f"{rel} is stale: run `make proto`"


def _example_docs() -> list[dict]:
    cfg = load_config(None)
    docs = []
    for path in sorted((ROOT / "examples").glob("*.json")):
        for run_input in iter_runs(path, cfg.matcher()):
            verdict = reconcile(run_input, cfg.scoring.policy(), "standard")
            docs.append(run_to_dict(verdict, run_id=path.stem, source=f"file:{path}", created_at=1.5, updated_at=2.25,
                                    finalized_by="replica-1"))
    return docs


@pytest.mark.parametrize("doc", _example_docs(), ids=lambda d: d["run_id"])
def test_run_documents_round_trip_through_the_wire_message(doc):
    message = run_message(doc)
    assert pb.RunVerdict.FromString(message.SerializeToString()) == message
    assert to_doc(message) == json.loads(json.dumps(doc))
    assert pb.Status.Name(message.status) == f"STATUS_{doc['status']}"


def test_hub_filters_and_cuts_off_a_watcher_that_falls_a_buffer_behind():
    async def scenario():
        hub = VerdictHub(asyncio.get_running_loop(), max_watchers=2, buffer=3)
        fails = hub.subscribe(RunFilter(statuses=frozenset({"FAIL"})))
        slow = hub.subscribe(RunFilter())
        assert hub.subscribe(RunFilter()) is None  # max_watchers
        docs = [{"run_id": str(i), "revision": 1, "status": "FAIL" if i % 2 else "PASS", "subject": "s"}
                for i in range(6)]
        hub.publish_threadsafe(docs)
        await asyncio.sleep(0.01)
        assert [(await fails.next())["run_id"] for _ in range(3)] == ["1", "3", "5"]
        assert [(await slow.next())["run_id"] for _ in range(3)] == ["0", "1", "2"]
        with pytest.raises(WatcherLagged):
            await slow.next()
        hub.close()
        with pytest.raises(WatcherClosed):
            await fails.next()
    asyncio.run(scenario())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    proc = CollectorProcess(tmp_path_factory.mktemp("stream"), {"stream": {"max_watchers": 3}})
    channel = grpc.insecure_channel(proc.grpc)
    yield proc, FidelityServiceStub(channel)
    channel.close()
    proc.stop()


class Follower:
    """A WatchVerdicts stream read on a thread, as a dashboard backend would."""

    def __init__(self, stub: FidelityServiceStub, request: pb.WatchRequest) -> None:
        self.call = stub.WatchVerdicts(request)
        self.got: list[pb.RunVerdict] = []
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                self.got.append(message)
        except grpc.RpcError as exc:
            self.error = exc

    def wait(self, n: int, timeout: float = 15) -> list[pb.RunVerdict]:
        deadline = time.monotonic() + timeout
        while len(self.got) < n and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.02)
        return self.got


def _watchers(proc) -> float:
    return proc.metrics().get(("agenteval_watchers", ()), 0)


def _wait_watchers(proc, n: int) -> None:
    deadline = time.monotonic() + 10
    while _watchers(proc) < n:
        assert time.monotonic() < deadline, "watchers never attached"
        time.sleep(0.05)


def test_watch_verdicts_streams_stored_runs_with_status_and_subject_filters(served):
    proc, stub = served
    everything = Follower(stub, pb.WatchRequest())
    failing = Follower(stub, pb.WatchRequest(statuses=[pb.STATUS_FAIL, pb.STATUS_PENDING]))
    loop_only = Follower(stub, pb.WatchRequest(subject="loop"))
    _wait_watchers(proc, 3)
    ids = {}
    for name in ("pass", "fail_under_report", "path2_pending", "loop"):
        spans, (trace_id,) = record([SCENARIOS[name][0]])
        ids[name] = run_id(trace_id)
        export_spans(proc, spans)
    got = {m.run_id: m for m in everything.wait(4)}
    assert set(got) == set(ids.values())
    for name, rid in ids.items():
        doc = to_doc(got[rid])
        assert doc["status"] == SCENARIOS[name][1]
        assert {e["executor_id"]: e["verdict"] for e in doc["executors"]} == SCENARIOS[name][2]
        assert doc == {**proc.run(rid), "created_at": None, "updated_at": doc["updated_at"]}
    assert {m.run_id for m in failing.wait(2)} == {ids["fail_under_report"], ids["path2_pending"]}
    pending = next(m for m in failing.got if m.status == pb.STATUS_PENDING)
    assert {e.no_truth_reason for e in pending.executors} == {pb.NO_TRUTH_REASON_RESPONSE_MISSING}
    assert "Path-2 gap" in pending.executors[0].no_truth_explanation
    assert [m.run_id for m in loop_only.wait(1)] == [ids["loop"]]
    # A fourth stream is over stream.max_watchers.
    extra = Follower(stub, pb.WatchRequest())
    extra.thread.join(10)
    assert extra.error is not None and extra.error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    for f in (everything, failing, loop_only):
        f.call.cancel()
    time.sleep(0.5)
    assert len(failing.got) == 2 and len(loop_only.got) == 1  # nothing unfiltered leaked through
    replay = Follower(stub, pb.WatchRequest(replay=2, statuses=[pb.STATUS_PASS]))
    assert [m.run_id for m in replay.wait(2)] == [ids["pass"], ids["loop"]]  # oldest first, then live
    replay.call.cancel()


def test_get_run_and_list_runs(served):
    proc, stub = served
    spans, (trace_id,) = record([SCENARIOS["partial_warn"][0]])
    export_spans(proc, spans)
    stored = proc.run(trace_id)
    run = stub.GetRun(pb.GetRunRequest(run_id=trace_id[:12]))
    assert to_doc(run) | {"created_at": None, "updated_at": None} == stored | {"created_at": None, "updated_at": None}
    assert run.created_at.seconds > 0
    listed = stub.ListRuns(pb.ListRunsRequest(statuses=[pb.STATUS_WARN], limit=5))
    assert run_id(trace_id) in [r.run_id for r in listed.runs]
    assert all(r.status == pb.STATUS_WARN and not r.executors for r in listed.runs)
    full = stub.ListRuns(pb.ListRunsRequest(subject="partial", include_executors=True))
    assert full.runs[0].run_id == run_id(trace_id) and len(full.runs[0].executors) == 2
    with pytest.raises(grpc.RpcError) as missing:
        stub.GetRun(pb.GetRunRequest(run_id="ffffffffffff"))
    assert missing.value.code() is grpc.StatusCode.NOT_FOUND
    assert "no run" in missing.value.details() and "runs.db" not in missing.value.details()
    with pytest.raises(grpc.RpcError) as empty:
        stub.GetRun(pb.GetRunRequest())
    assert empty.value.code() is grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("method", ["GetRun", "ListRuns", "WatchVerdicts"])
def test_bytes_that_are_not_a_request_are_an_invalid_argument(served, method):
    """gRPC's generated server parsed the request before our code ran, and answered UNKNOWN
    ("Unexpected DecodeError") to a client sending something else than the message."""
    proc, _ = served
    with grpc.insecure_channel(proc.grpc) as channel:
        path = f"/agenteval.fidelity.v1.FidelityService/{method}"
        call = channel.unary_stream(path) if method == "WatchVerdicts" else channel.unary_unary(path)
        with pytest.raises(grpc.RpcError) as bad:
            list(call(b"\xff\xff\xff")) if method == "WatchVerdicts" else call(b"\xff\xff\xff")
    assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert bad.value.details().startswith("the request is not an agenteval.fidelity.v1.")


def test_fidelity_service_needs_the_bearer_token_when_auth_is_on(tmp_path):
    token = "watch-token-value"
    proc = CollectorProcess(tmp_path, {"receivers": {"auth": {"bearer_token_env": "AGENTEVAL_TOKEN"}}},
                            env={"AGENTEVAL_TOKEN": token})
    try:
        with grpc.insecure_channel(proc.grpc) as channel:
            stub = FidelityServiceStub(channel)
            with pytest.raises(grpc.RpcError) as denied:
                stub.ListRuns(pb.ListRunsRequest())
            assert denied.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert stub.ListRuns(pb.ListRunsRequest(), metadata=(("authorization", f"Bearer {token}"),)).runs == []
        # `agenteval watch` without the token: a clear error and exit 1, not an endless retry loop.
        res = subprocess.run([AGENTEVAL, "watch", "--endpoint", proc.grpc, "--token-env", "NO_SUCH_TOKEN_VAR"],
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 1 and "UNAUTHENTICATED" in res.stderr
    finally:
        proc.stop()


def test_watch_cli_prints_verdicts_and_reconnects_after_the_collector_restarts(tmp_path):
    port = free_port()
    overrides = {"receivers": {"grpc": {"endpoint": f"127.0.0.1:{port}"}}}
    first = CollectorProcess(tmp_path, overrides)
    watcher = subprocess.Popen([AGENTEVAL, "watch", "--endpoint", first.grpc, "--count", "2", "--replay", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_watchers(first, 1)
        spans, (fail_id,) = record([SCENARIOS["fail_under_report"][0]])
        export_spans(first, spans)
        first.run(fail_id)
        assert first.stop() == 0
        second = CollectorProcess(tmp_path, overrides)  # same port and store
        try:
            _wait_watchers(second, 1)
            spans, (pending_id,) = record([SCENARIOS["path2_pending"][0]])
            export_spans(second, spans)
            out, err = watcher.communicate(timeout=30)
        finally:
            second.stop()
    finally:
        if watcher.poll() is None:
            watcher.kill()
    assert watcher.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) == 2
    assert "FAIL" in lines[0] and f"run={fail_id}" in lines[0] and "checked=2/2" in lines[0]
    assert "diverged=writer:TokenMismatch " in lines[0] + " "  # which unit, not only that one did
    assert "PENDING" in lines[1] and f"run={pending_id}" in lines[1] and "no_truth=2xresponse_missing" in lines[1]
    assert f"disconnected from {first.grpc}" in err and "retrying in" in err


def test_watch_json_replays_recent_runs_then_follows(served):
    proc, _ = served
    recent = [r.run_id for r in FidelityServiceStub(grpc.insecure_channel(proc.grpc)).ListRuns(
        pb.ListRunsRequest(limit=2)).runs]
    watcher = subprocess.Popen([AGENTEVAL, "watch", "--endpoint", proc.grpc, "--json", "--replay", "2", "--count", "1"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        replayed = [json.loads(watcher.stdout.readline()) for _ in range(2)]
        spans, (trace_id,) = record([SCENARIOS["loop"][0]])  # then follows: --count counts this one only
        export_spans(proc, spans)
        out, err = watcher.communicate(timeout=30)
    finally:
        watcher.kill()
    assert watcher.returncode == 0, err
    docs = replayed + [json.loads(line) for line in out.splitlines()]
    assert [d["run_id"] for d in docs] == [*recent[::-1], run_id(trace_id)]
    assert all(d["executors"] and d["status"] in ("PASS", "WARN", "FAIL", "PENDING") for d in docs)


def test_watch_table_shows_status_score_checked_and_no_truth_reasons():
    board = Board(rows=3)
    docs = _example_docs()
    for doc in docs:
        board.add(doc)
    console = Console(record=True, width=180, color_system=None)
    console.print(board.render())
    text = console.export_text()
    for doc in docs[-3:]:
        assert doc["run_id"][:16] in text
    assert docs[0]["run_id"] not in text  # only the newest rows are kept
    assert "partial_response, response_missing" in text  # warn_partial_truth
    lines = [line for line in text.splitlines() if "warn_partial_tru" in line]
    assert lines and "WARN" in lines[0] and "2/4" in lines[0] and "1.000" in lines[0]


def test_watch_table_tells_two_runs_of_one_trace_apart_by_a_prefix_runs_show_takes():
    """Two workflow runs under one caller's span: their ids share the trace id, and both showed as
    its first 16 characters."""
    board = Board(rows=5)
    trace = "1517a06608924996" + "0" * 16
    docs = _example_docs()[:3]
    for doc, run in zip(docs, [f"{trace}-aa11bb22cc33dd44", f"{trace}-aa11ff22cc33dd44", "f" * 32], strict=True):
        doc["run_id"] = run
        board.add(doc)
    console = Console(record=True, width=260, color_system=None)
    console.print(board.render(260))
    text = console.export_text()
    assert f" {trace}-aa11b " in text and f" {trace}-aa11f " in text
    assert " " + "f" * 16 + " " in text  # no longer than it needs


def test_watch_rejects_an_unknown_status():
    res = subprocess.run([AGENTEVAL, "watch", "--status", "GREEN"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 1 and "--status" in res.stderr



def _watch_on_a_terminal(proc, scenario: str, columns: int = 160) -> tuple[str, str]:
    """`agenteval watch --count 1` under a pseudo-terminal, as a user runs it, while one run of
    ``scenario`` arrives: (its trace id, everything drawn on the terminal)."""
    import os
    import pty
    import select

    master, slave = pty.openpty()
    child = subprocess.Popen([AGENTEVAL, "watch", "--endpoint", proc.grpc, "--replay", "0", "--count", "1"],
                             stdin=slave, stdout=slave, stderr=slave,
                             env={**os.environ, "COLUMNS": str(columns), "TERM": "xterm"})
    os.close(slave)
    _wait_watchers(proc, 1)
    spans, (trace_id,) = record([SCENARIOS[scenario][0]])
    export_spans(proc, spans)
    screen = b""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not select.select([master], [], [], 0.5)[0]:
            continue
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        screen += chunk
    os.close(master)
    assert child.wait(10) == 0
    assert b"\x1b[" in screen  # drawn with terminal control sequences
    return trace_id, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.decode(errors="replace"))  # as seen: no escapes


def test_watch_on_a_terminal_draws_the_live_table(served):
    """Under a pseudo-terminal: the rich live table, not the piped lines."""
    proc, _ = served
    trace_id, text = _watch_on_a_terminal(proc, "path2_pending")
    assert trace_id[:16] in text
    assert "agenteval watch: run verdicts, newest first" in text and "NoTruth reasons" in text
    assert "connected to" in text


@pytest.mark.parametrize("columns", [160, 80])
def test_watch_on_a_terminal_names_the_unit_that_diverged(served, columns):
    """Piped, a FAIL line says `diverged=writer:TokenMismatch`; the live table said only FAIL."""
    proc, _ = served
    trace_id, text = _watch_on_a_terminal(proc, "fail_under_report", columns)
    if columns >= 100:
        row = next(line for line in text.splitlines() if trace_id[:16] in line)
        assert "FAIL" in row and "writer TokenMismatch" in row
    assert "writer" in text and "TokenMismatch" in text  # folded where it must be, never cut
    assert "researcher" not in text  # the unit that agreed is not listed
