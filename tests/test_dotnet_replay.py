"""Real MAF .NET traces on every machine, .NET SDK or not: each scenario's OTLP export requests as the
collector received them from the OpenTelemetry .NET SDK (tests/fixtures/dotnet/<release>/<scenario>/,
captured by capture.py on 1.28.0 and 1.20.0) replayed into a live collector over gRPC and HTTP in
their original batches, over gRPC one span per request in shuffled order, and through the offline CLI
as OTLP/JSON; every run must be what the scenario's construction said (expected.json). The run page,
`runs show`, `watch` and the metrics name the MAF .NET release."""

from __future__ import annotations

import json
import random
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from collector.core.model import STATUS_EXIT_CODES, Status

from conftest import AGENTEVAL, PROTOBUF, CollectorProcess, post, runs_of
from dotnet_scenarios import FIXTURES, RELEASES, assert_runs, requests_in
from mafshape import to_otlp_json

CAPTURED = sorted((release, path.name)
                  for release in RELEASES for path in (FIXTURES / release).iterdir() if path.is_dir())
SEVERITY = ("FAIL", "PENDING", "WARN", "PASS")
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def fixture(release: str, name: str) -> tuple[Path, dict]:
    folder = FIXTURES / release / name
    return folder, json.loads((folder / "expected.json").read_text())


def otlp_json_file(folder: Path, path: Path) -> Path:
    """The gRPC capture as the OpenTelemetry Collector's file exporter writes it (OTLP/JSON lines)."""
    path.write_text("".join(json.dumps(to_otlp_json(ExportTraceServiceRequest.FromString(body))) + "\n"
                            for body in requests_in(folder / "grpc")))
    return path


def one_span_each(requests: list[bytes]) -> list[bytes]:
    """Every span of the requests in a request of its own (its resource and scope kept)."""
    out = []
    for body in requests:
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    single = ExportTraceServiceRequest()
                    rs_copy = single.resource_spans.add(resource=rs.resource, schema_url=rs.schema_url)
                    rs_copy.scope_spans.add(scope=ss.scope, schema_url=ss.schema_url).spans.append(span)
                    out.append(single.SerializeToString())
    return out


def sender(proc: CollectorProcess, mode: str, channel: grpc.Channel):
    """Sends a fixture's captured requests to ``proc``: as captured over gRPC or HTTP, or over gRPC one
    span per request in shuffled order; returns its trace ids."""
    export = channel.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)

    def send(folder: Path, expected: dict) -> list[str]:
        transport = "http" if mode == "http" else "grpc"
        requests = requests_in(folder / transport)
        if mode == "shuffled":
            requests = one_span_each(requests)
            random.Random(folder.name).shuffle(requests)
        for body in requests:
            if transport == "http":
                status, answer, _ = post(proc.http, body, PROTOBUF)
                assert status == 200, answer
            else:
                export(body, timeout=15)
        return expected["trace_ids"][transport]

    return send


@pytest.fixture(scope="module", params=["grpc", "http", "shuffled"])
def replay(request, tmp_path_factory):
    """A collector of its own per way of sending (the same traces must not meet twice)."""
    proc = CollectorProcess(tmp_path_factory.mktemp(f"replay-{request.param}"))
    channel = grpc.insecure_channel(proc.grpc)
    yield proc, sender(proc, request.param, channel)
    channel.close()
    proc.stop()


def first_watched(proc: CollectorProcess, *args: str) -> str:
    """The first line `agenteval watch` prints (piped: one line per run), the newest stored run replayed."""
    watcher = subprocess.Popen([AGENTEVAL, "watch", "--endpoint", proc.grpc, "--replay", "1", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        return watcher.stdout.readline()
    finally:
        watcher.kill()
        watcher.communicate()


@pytest.mark.parametrize("release", RELEASES)
def test_every_captured_dotnet_trace_gives_its_verdicts_live(release, replay):
    """All of a release's scenarios sent first, then read: the collector reconciles them side by side."""
    proc, send = replay
    names = [name for r, name in CAPTURED if r == release]
    sent = {name: send(*fixture(release, name)) for name in names}
    stored = runs_of(proc, [trace_id for trace_ids in sent.values() for trace_id in trace_ids], timeout=60)
    wrong = []
    for name, trace_ids in sent.items():
        try:
            assert_runs([r for r in stored if r["trace_id"] in trace_ids], trace_ids,
                        fixture(release, name)[1]["expected"], release)
        except AssertionError as exc:
            wrong.append(f"{name}: {exc}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("release", "name"), CAPTURED)
def test_each_captured_dotnet_trace_gives_its_verdicts_and_exit_code_offline(release, name, tmp_path):
    folder, expected = fixture(release, name)
    trace = otlp_json_file(folder, tmp_path / f"{name}.jsonl")
    proc = subprocess.run([AGENTEVAL, "bench", "workflow-trace-fidelity", "--workflow-trace", str(trace),
                           "--subject", name, "--json", "--store", str(tmp_path / "runs.db")],
                          capture_output=True, text=True, timeout=120)
    out = json.loads(proc.stdout)
    runs = out.get("runs", [out])
    worst = min((r["status"] for trace in expected["expected"] for r in trace), key=SEVERITY.index)
    assert (proc.returncode, out["status"]) == (STATUS_EXIT_CODES[Status(worst)], worst), proc.stderr
    assert_runs(runs, expected["trace_ids"]["grpc"], expected["expected"], release)


def test_a_dotnet_run_names_its_release_on_the_page_in_runs_show_watch_and_the_metrics(tmp_path):
    proc = CollectorProcess(tmp_path)  # of its own: the run `watch --replay 1` shows is this one
    channel = grpc.insecure_channel(proc.grpc)
    try:
        (trace_id,) = sender(proc, "grpc", channel)(*fixture("1.28.0", "graph-under-reported"))
        (run,) = runs_of(proc, [trace_id])
        names_its_release(proc, run)
    finally:
        channel.close()
        proc.stop()


def names_its_release(proc: CollectorProcess, run: dict) -> None:
    assert (run["maf_release"], run["status"]) == ("dotnet-1.28.0", "WARN")

    shown = subprocess.run([AGENTEVAL, "runs", "show", run["run_id"], "--store", str(proc.store_path)],
                           capture_output=True, text=True, timeout=60).stdout
    assert "Microsoft.Agents.AI.Workflows 1.28.0 (.NET), AgentEval.Instrumentation.MafFidelity 0.1.0 (active)" in shown
    page = urllib.request.urlopen(f"{proc.http}/runs/{run['run_id']}", timeout=10).read().decode()
    assert "Microsoft.Agents.AI.Workflows 1.28.0 (.NET)" in page
    assert "AgentEval.Instrumentation.MafFidelity 0.1.0" in page
    assert json.loads(first_watched(proc, "--json"))["maf_release"] == "dotnet-1.28.0"
    assert "maf=dotnet-1.28.0" in first_watched(proc)
    scrape = urllib.request.urlopen(proc.prometheus, timeout=10).read().decode()
    assert any('maf_release="dotnet-1.28.0"' in line and "WARN" in line for line in scrape.splitlines()), scrape[-2000:]


def test_a_dotnet_units_fix_speaks_dotnet_never_pip(replay):
    """failed-call: the writer's only call failed, no ledger: NoTruth ledger_missing, fixed the .NET way."""
    proc, send = replay
    folder, expected = fixture("1.20.0", "failed-call")
    (trace_id,) = send(folder, expected)
    (run,) = runs_of(proc, [trace_id])
    writer = next(e for e in run["executors"] if e["executor_id"] == "writer")
    assert writer["no_truth_reason"] == "ledger_missing"
    assert "AgentEval.Instrumentation.MafFidelity" in writer["no_truth_fix"] and "pip" not in writer["no_truth_fix"]
    assert "UseFidelityLedger" in writer["no_truth_fix"] or "WithFidelityLedger" in writer["no_truth_fix"]


def test_a_failed_dotnet_call_is_a_failed_turn_never_the_path2_gap(tmp_path):
    """The real failed-call trace, offline: the writer's call raised (HTTP 500 from its client)."""
    folder, _ = fixture("1.28.0", "failed-call")
    trace = otlp_json_file(folder, tmp_path / "failed.jsonl")
    proc = subprocess.run([AGENTEVAL, "bench", "workflow-trace-fidelity", "--workflow-trace", str(trace), "--subject",
                           "dotnet", "--json", "--store", str(tmp_path / "runs.db")], capture_output=True, text=True,
                          timeout=120)
    (run,) = json.loads(proc.stdout)["runs"]
    writer = next(e for e in run["executors"] if e["executor_id"] == "writer")
    assert writer["no_truth_reason"] == "ledger_missing" and writer["evidence"]["failed_turns"] == 1
    assert "Path-2" not in writer["no_truth_explanation"]
    # .NET records an agent failure as an event, never as span status: no workflow error to show.
    assert run["workflow_errors"] == []


def test_a_response_recorded_twice_is_counted_once_and_a_ledger_without_its_run_is_never_guessed(tmp_path):
    """Real MAF .NET traces, offline: agents recorded both ways count each response once and say so
    (runs show); one workflow run three times under one caller span, read without the run, compares
    nothing (ledger_unjoined, fixed by WithFidelityLedger(run)) where given the run it catches the middle
    run's lie."""
    shown = {}
    for name in ("recorded-twice-under-reported", "runs-one-after-another-without-the-run", "runs-one-after-another"):
        folder, _ = fixture("1.28.0", name)
        trace = otlp_json_file(folder, tmp_path / f"{name}.jsonl")
        store = tmp_path / f"{name}.db"
        proc = subprocess.run([AGENTEVAL, "bench", "workflow-trace-fidelity", "--workflow-trace", str(trace),
                               "--subject", name, "--json", "--store", str(store)],
                              capture_output=True, text=True, timeout=120)
        out = json.loads(proc.stdout)
        runs = sorted(out.get("runs", [out]), key=lambda r: r["started_at"])
        shown[name] = (runs, subprocess.run([AGENTEVAL, "runs", "show", runs[0]["run_id"], "--store", str(store)],
                                            capture_output=True, text=True, timeout=60).stdout)

    (twice,), text = shown["recorded-twice-under-reported"]
    writer = next(e for e in twice["executors"] if e["executor_id"] == "writer")
    assert (writer["verdict"], writer["evidence"]["ledger_entries"], writer["evidence"]["ledger_duplicates"]) == (
        "TokenMismatch", 1, 1)
    assert "each response counted once" in text

    blind, text = shown["runs-one-after-another-without-the-run"]
    assert [r["status"] for r in blind] == ["PENDING"] * 3
    writer = next(e for e in blind[1]["executors"] if e["executor_id"] == "writer")
    assert writer["no_truth_reason"] == "ledger_unjoined" and writer["evidence"]["ledger_unjoined"] == 3
    assert "WithFidelityLedger(run)" in writer["no_truth_fix"] and "pip" not in writer["no_truth_fix"]
    assert "no single run could own them" in text

    exact, _ = shown["runs-one-after-another"]
    assert [r["status"] for r in exact] == ["PASS", "FAIL", "PASS"]
