"""MAF .NET for real (docs/dotnet.md): real `Microsoft.Agents.AI.Workflows` workflows
(instrumentation/dotnet/samples/FidelityScenarios) on a scripted chat client, with MAF's telemetry
and the ledger package, exported by the OpenTelemetry .NET SDK over OTLP gRPC and HTTP/protobuf to a
running collector. Each scenario prints what the collector must say of it, worked out from how it
was built (what the script answered, what the middleware changed); the test compares that with the
stored runs. On each MAF .NET release tested: the newest and the oldest the NuGet copy restores.

Needs the .NET SDK: skipped without it, failed without it where AGENTEVAL_REQUIRE_DOTNET is set (CI
on a machine that has it). tests/test_dotnet_replay.py keeps .NET right where there is none."""

from __future__ import annotations

import fcntl
import json
import re
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import runs_of
from llm_server import LLMServer, Reply

ROOT = Path(__file__).resolve().parent.parent
DOTNET_DIR = ROOT / "instrumentation" / "dotnet"
SCENARIOS_PROJECT = DOTNET_DIR / "samples" / "FidelityScenarios"
#: Makefile MAF_DOTNET: the newest release served and the oldest that restores.
RELEASES = ("1.28.0", "1.20.0")


def _dotnet() -> str:
    dotnet = shutil.which("dotnet")
    if dotnet is None:
        if os.environ.get("AGENTEVAL_REQUIRE_DOTNET"):
            pytest.fail("no .NET SDK (dotnet), and AGENTEVAL_REQUIRE_DOTNET is set")
        pytest.skip("no .NET SDK (dotnet): the captured .NET traces still run (tests/test_dotnet_replay.py)")
    return dotnet


def scenario_program(release: str) -> Path:
    """The scenarios built against one MAF release (once; test workers wait for each other's build)."""
    dotnet = _dotnet()
    out = DOTNET_DIR / "bin" / release / "FidelityScenarios" / "Release" / "net10.0"
    with open(DOTNET_DIR / f".build-{release}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = subprocess.run([dotnet, "build", str(SCENARIOS_PROJECT), "-c", "Release", f"-p:MafVersion={release}",
                                "--nologo", "-v", "q"], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return out / "FidelityScenarios"


def run_scenario(program: Path, name: str, collector, transport: str, model_server: LLMServer) -> dict:
    """Runs a scenario; one whose agents call a model server gets the test's, scripted as the program says."""
    script = json.loads(subprocess.run([str(program), "script", name], capture_output=True, text=True, check=True,
                                       timeout=60).stdout)
    for model, replies in script.items():
        model_server.script(model, [Reply(r["input_tokens"], r["output_tokens"], r["finish"]) for r in replies])
    endpoint = f"http://{collector.grpc}" if transport == "grpc" else collector.http
    proc = subprocess.run([str(program), name, "--endpoint", endpoint, "--protocol", transport,
                           "--openai", model_server.base_url], capture_output=True, text=True, timeout=120)
    assert not model_server.unplayed(), model_server.unplayed()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def scenario_names() -> list[str]:
    """The scenarios of the sample's source (its `list` needs a build: parametrizing must not)."""
    text = (SCENARIOS_PROJECT / "Scenarios.cs").read_text()
    return re.findall(r'^\s*Named\("([^"]+)"', text, re.MULTILINE)


def units(run: dict) -> dict[str, dict]:
    return {e["executor_id"]: {
        "verdict": e["verdict"],
        "truth_tokens": e["evidence"]["truth_tokens"],
        "framework_tokens": e["evidence"]["framework_tokens"],
        "truth_finish": e["evidence"]["truth_finish"],
        "framework_finish": e["evidence"]["framework_finish"],
        "no_truth_reason": e.get("no_truth_reason"),
    } for e in run["executors"]}


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
def test_each_dotnet_scenario_gives_its_expected_verdicts_live(program, name, transport, collector, model_server):
    release, binary = program
    said = run_scenario(binary, name, collector, transport, model_server)
    assert said["maf_release"] == f"dotnet-{release}"
    stored = runs_of(collector, said["trace_ids"])
    # per trace, its workflow runs in the order they ran (a human-in-the-loop run's turns)
    expected = [run for trace in said["expected"] for run in trace]
    assert len(stored) == len(expected), [(r["run_id"], r["status"]) for r in stored]
    ordered = sorted(stored, key=lambda r: (said["trace_ids"].index(r["trace_id"]), r["started_at"]))
    for run, want in zip(ordered, expected):
        assert units(run) == want["units"], run["run_id"]
        assert run["status"] == want["status"]
        assert run["non_agent_executors"] == want["non_agent_executors"]
        assert run["maf_release"] == (f"dotnet-{release}" if want["ledger"] else None)
