"""MAF .NET for real (docs/dotnet.md): real `Microsoft.Agents.AI.Workflows` workflows
(instrumentation/dotnet/samples/FidelityScenarios) on a scripted chat client or MAF's OpenAI client,
with MAF's telemetry and the ledger package, exported by the OpenTelemetry .NET SDK over OTLP gRPC and
HTTP/protobuf to a running collector. Each scenario prints what the collector must say of it, worked
out from how it was built (what the script answered, what the middleware changed); the test compares
that with the stored runs. On each MAF .NET release tested: the newest and the oldest the NuGet copy
restores. And each captured fixture (tests/test_dotnet_replay.py replays them everywhere) must still
agree with its scenario.

Needs the .NET SDK: skipped without it, failed without it where AGENTEVAL_REQUIRE_DOTNET is set (CI
on a machine that has it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import runs_of
from dotnet_scenarios import (
    FIXTURES,
    RELEASES,
    Capture,
    assert_runs,
    capture,
    requests_in,
    scenario_names,
    scenario_program,
    shape,
)
from llm_server import LLMServer


@pytest.fixture(scope="module")
def model_server():
    server = LLMServer()
    yield server
    server.close()


@pytest.fixture(scope="module", params=RELEASES)
def program(request) -> tuple[str, Path]:
    return request.param, scenario_program(request.param)


@pytest.mark.parametrize("transport", ["grpc", "http"])
@pytest.mark.parametrize("name", scenario_names())
def test_each_dotnet_scenario_gives_its_expected_verdicts_live_and_agrees_with_its_fixture(
        program, name, transport, collector, model_server):
    """Live: the scenario's export requests reach the collector through a capture that passes each on
    as it came; the runs are what the scenario said. The captured fixture of this release, scenario
    and transport (tests/fixtures/dotnet/, replayed everywhere by tests/test_dotnet_replay.py) must
    still agree with it: the same expectations, spans of the same shape (names, scopes, kinds,
    attribute keys)."""
    release, binary = program
    receiver = Capture(forward=collector)
    try:
        said, requests = capture(binary, name, transport, receiver, model_server)
    finally:
        receiver.close()
    assert said["maf_release"] == f"dotnet-{release}"
    assert_runs(runs_of(collector, said["trace_ids"]), said["trace_ids"], said["expected"], release)

    fixture = FIXTURES / release / name
    recapture = f"recapture: .venv/bin/python tests/fixtures/dotnet/capture.py --release {release} --scenario {name}"
    assert fixture.is_dir(), f"no fixture {fixture}: {recapture}"
    kept = json.loads((fixture / "expected.json").read_text())
    assert (said["maf_release"], said["expected"]) == (kept["maf_release"], kept["expected"]), recapture
    assert shape(requests) == shape(requests_in(fixture / transport)), f"the scenario's spans changed: {recapture}"
