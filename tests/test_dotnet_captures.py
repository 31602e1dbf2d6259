"""Exports a collector received from real MAF .NET apps (tests/fixtures/dotnet/captures/<name>/001.pb: one
serialized ExportTraceServiceRequest each, MAF 1.28.0, the OpenTelemetry .NET SDK 1.21.0), read as they
came: by the offline CLI straight from the protobuf file, and by a live collector over gRPC and HTTP.
Each gives exactly the runs its expected.json lists, in start order, and no other: units named by the
agents' own names (a space, a hyphen, a dot), and a workflow used as an agent judged by its agents,
the wrapper agent no unit and no run of its own (docs/verdicts.md "How a unit is named")."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import grpc
import pytest

from collector.core.model import STATUS_EXIT_CODES, Status

from conftest import AGENTEVAL, PROTOBUF, CollectorProcess, post, runs_of

CAPTURES = Path(__file__).parent / "fixtures" / "dotnet" / "captures"
NAMES = sorted(p.name for p in CAPTURES.iterdir() if p.is_dir())
SEVERITY = ("FAIL", "PENDING", "WARN", "PASS")
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def expected(name: str) -> list[dict]:
    return json.loads((CAPTURES / name / "expected.json").read_text())["runs"]


def seen(runs: list[dict]) -> list[dict]:
    """What a user reads of each run, in the expectations' shape, in start order."""
    out = []
    for run in sorted(runs, key=lambda r: r["started_at"]):
        shown = {"status": run["status"], "score": None if run["score"] is None else round(run["score"], 3),
                 "units": {e["executor_id"]: [e["verdict"], e["evidence"]["framework_tokens"],
                                              e["evidence"]["truth_tokens"]] for e in run["executors"]},
                 "non_agent_executors": run["non_agent_executors"]}
        wrapped = [n for n in run["notes"] if "ran inside the agent" in n]
        if wrapped:
            shown["wrapper"] = wrapped[0].split("'")[1]
        out.append(shown)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_a_capture_read_by_the_offline_cli_as_the_collector_received_it(name, tmp_path):
    proc = subprocess.run([AGENTEVAL, "bench", "workflow-trace-fidelity", "--workflow-trace",
                           str(CAPTURES / name / "001.pb"), "--subject", name, "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout, proc.stderr
    out = json.loads(proc.stdout)
    runs = out.get("runs", [out])
    assert seen(runs) == expected(name)
    worst = min((r["status"] for r in expected(name)), key=SEVERITY.index)
    assert proc.returncode == STATUS_EXIT_CODES[Status(worst)], proc.stderr


@pytest.fixture(scope="module", params=["grpc", "http"])
def replay(request, tmp_path_factory):
    """A collector of its own per transport (the same traces must not meet twice)."""
    proc = CollectorProcess(tmp_path_factory.mktemp(f"captures-{request.param}"))
    yield proc, request.param
    proc.stop()


def trace_ids(body: bytes) -> list[str]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest.FromString(body)
    return sorted({s.trace_id.hex() for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans})


def test_the_captures_replayed_live_give_exactly_their_runs(replay):
    """Each capture sent as it came, over gRPC or OTLP/HTTP protobuf."""
    collector, transport = replay
    channel = grpc.insecure_channel(collector.grpc)
    export = channel.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)
    try:
        wrong = []
        for name in NAMES:
            body = (CAPTURES / name / "001.pb").read_bytes()
            if transport == "grpc":
                export(body, timeout=15)
            else:
                status, answer, _ = post(collector.http, body, PROTOBUF)
                assert status == 200, answer
            got = seen(runs_of(collector, trace_ids(body), timeout=60))
            if got != expected(name):
                wrong.append(f"{name}: {json.dumps(got, indent=1)}")
        assert not wrong, "\n".join(wrong)
    finally:
        channel.close()
