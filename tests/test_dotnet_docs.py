"""docs/dotnet.md as a .NET user follows it: every command and the program it shows, run as written in
a new console app outside this repository (`make dist`, `dotnet add package` from dist/, its
Program.cs against MAF's OpenAI client on the tests' model server), on the newest and the oldest MAF
.NET release tested, exporting to a live collector; the runs, their units and numbers, and how
`runs show` and the metrics name the release are what the page says."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import AGENTEVAL, CollectorProcess, runs_of
from llm_server import LLMServer, Reply
from dotnet_scenarios import RELEASES, dotnet_sdk

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "dotnet.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", DOC, re.DOTALL)


def blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCKS if lang == language]


def test_the_page_shows_one_program_and_three_command_blocks():
    assert len(blocks("csharp")) == 1
    dist, add, run = blocks("sh")
    assert dist.strip() == "make dist"
    assert "--source /path/to/agenteval/dist" in add
    assert "export OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317" in run and run.strip().endswith("dotnet run")


def _sh(script: str, cwd: Path, env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"{script}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("release", RELEASES)
def test_a_new_console_app_that_follows_the_page_gets_its_verdicts(release, tmp_path):
    dotnet = dotnet_sdk()
    dist, add, run = blocks("sh")
    # One build of dist/ and of the NuGet cache's copy of our package at a time (test workers share both).
    with open(ROOT / "instrumentation" / "dotnet" / ".build-docs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _sh(dist, ROOT)
        # The package's version does not change with every build: drop the cached copy so that
        # `dotnet add package` takes the one just built.
        cache = Path(os.environ.get("NUGET_PACKAGES") or Path.home() / ".nuget" / "packages")
        shutil.rmtree(cache / "agenteval.instrumentation.maffidelity", ignore_errors=True)
        _sh(f"{dotnet} new console -o app", tmp_path)
        app = tmp_path / "app"
        pinned = re.sub(r"^(dotnet add package Microsoft\.Agents\.AI(?:\.Workflows)?)$", rf"\1 --version {release}",
                        add.replace("/path/to/agenteval", str(ROOT)), flags=re.MULTILINE)
        _sh(pinned, app)
    (app / "Program.cs").write_text(blocks("csharp")[0])
    _sh(f"{dotnet} build --nologo -v q", app)

    server = LLMServer()
    collector = CollectorProcess(tmp_path / "collector")
    try:
        server.script("gpt-4o-mini", [Reply(120, 40), Reply(90, 30)])  # the researcher, then the assistant
        server.script("gpt-4o", [Reply(300, 200, "length")])  # the writer
        _sh(run.strip().splitlines()[-1] + " --no-build", app, env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{collector.grpc}", "OPENAI_API_KEY": "test",
            "OPENAI_BASE_URL": f"{server.base_url}/v1"})
        assert not server.unplayed()
        deadline = time.monotonic() + 30
        while len(traces := {d["trace_id"] for d in collector.store().list_runs(limit=10)}) < 2:
            assert time.monotonic() < deadline, f"runs stored: {traces}"
            time.sleep(0.2)
        stored = runs_of(collector, sorted(traces))
        units = {r["run_id"]: {e["executor_id"]: (e["verdict"], e["evidence"]["framework_tokens"],
                                                   e["evidence"]["truth_tokens"], e["evidence"]["truth_finish"])
                               for e in r["executors"]} for r in stored}
        assert sorted(units.values(), key=len) == [
            {"assistant": ("Agree", 120, 120, "stop")},
            {"researcher": ("Agree", 160, 160, "stop"), "writer": ("Agree", 500, 500, "length")},
        ]
        assert {(r["subject"], r["status"], r["maf_release"], r["runtime"]) for r in stored} == {
            ("tides-app", "PASS", f"dotnet-{release}", "dotnet")}
        shown = subprocess.run([AGENTEVAL, "runs", "show", stored[0]["run_id"], "--store", str(collector.store_path)],
                               capture_output=True, text=True, timeout=60).stdout
        assert f"Microsoft.Agents.AI.Workflows {release} (.NET), AgentEval.Instrumentation.MafFidelity 0.1.0 (active)" in shown
        scrape = urllib.request.urlopen(collector.prometheus, timeout=10).read().decode()
        assert f'maf_release="dotnet-{release}"' in scrape
    finally:
        collector.stop()
        server.close()
