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
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import AGENTEVAL, CollectorProcess, runs_of
from dotnet_scenarios import RELEASES, dotnet_sdk
from llm_server import LLMServer, Reply

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "dotnet.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", DOC, re.DOTALL)


def blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCKS if lang == language]


def test_the_page_shows_one_program_a_collector_config_and_four_command_blocks():
    assert len(blocks("csharp")) == 1
    dist, add, serve, run = blocks("sh")
    assert dist.strip() == "make dist"
    # a source that lasts: a nuget.config beside the app, keeping the machine's own sources
    assert "dotnet nuget add source /path/to/agenteval/dist --name agenteval --configfile nuget.config" in add
    assert "<clear" not in add
    # every package at the version tested
    for line in add.splitlines():
        if line.startswith("dotnet add package"):
            assert " --version " in line, line
    assert serve.strip() == ".venv/bin/agenteval collector serve --config collector.yaml"
    assert "export OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317" in run and run.strip().endswith("dotnet run")
    assert {"OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "OTEL_BSP_SCHEDULE_DELAY"} <= set(_bsp(run))


def _bsp(run: str) -> dict[str, str]:
    """The batch span processor's variables the page exports before `dotnet run`."""
    return dict(re.findall(r"^export (OTEL_BSP_\w+)=(\d+)", run, re.MULTILINE))


def test_the_pages_collector_config_is_valid_and_its_banner_is_what_serve_prints(tmp_path):
    """The YAML loads (`collector validate`), and `collector serve --config` with it (on ports of this
    test's choosing) prints the banner shown, line for line."""
    (yaml,) = blocks("yaml")
    (tmp_path / "collector.yaml").write_text(yaml)
    checked = subprocess.run([AGENTEVAL, "collector", "validate", "--config", "collector.yaml"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "valid" in checked.stdout
    banner = next(body for lang, body in BLOCKS if lang == "text" and "agenteval collector listening" in body)
    ports = {"4317": _free_port(), "4318": _free_port(), "9464": _free_port()}
    moved = yaml
    for port, free in ports.items():
        moved = moved.replace(f"127.0.0.1:{port}", f"127.0.0.1:{free}")
    (tmp_path / "moved.yaml").write_text(moved)
    proc = subprocess.Popen([AGENTEVAL, "collector", "serve", "--config", "moved.yaml"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []
        while not lines or lines[-1] != "Press Ctrl-C to stop.":
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line.rstrip("\n"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    expected = banner
    for port, free in ports.items():
        expected = expected.replace(f"127.0.0.1:{port}", f"127.0.0.1:{free}")
    assert expected.strip().splitlines() == lines


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sh(script: str, cwd: Path, env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"{script}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


#: (MAF release, the app's target framework): both releases on .NET 10, and a .NET 8 app on the newest,
#: with the Microsoft.Extensions.AI.OpenAI the page names for .NET 8 (this machine has only the .NET 10
#: runtime installed: the .NET 8 app runs self-contained, on the .NET 8 runtime pack NuGet serves).
APPS = [(release, "net10.0") for release in RELEASES] + [(RELEASES[0], "net8.0")]


@pytest.mark.parametrize(("release", "framework"), APPS)
def test_a_new_console_app_that_follows_the_page_gets_its_verdicts(release, framework, tmp_path):
    dotnet = dotnet_sdk()
    dist, add, _, run = blocks("sh")
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
        project = app / "app.csproj"
        project.write_text(re.sub(r"<TargetFramework>[^<]+<", f"<TargetFramework>{framework}<", project.read_text()))
        pinned = re.sub(r"^(dotnet add package Microsoft\.Agents\.AI(?:\.Workflows)?) --version 1\.28\.0$",
                        rf"\1 --version {release}", add.replace("/path/to/agenteval", str(ROOT)), flags=re.MULTILINE)
        assert pinned.count(f"--version {release}") >= 2
        if framework == "net8.0":  # the versions the page names for .NET 8
            for package in ("Microsoft.Extensions.AI.OpenAI", "OpenTelemetry.Exporter.OpenTelemetryProtocol"):
                pin = re.search(rf"`({re.escape(package)} --version [\d.]+)`", DOC)[1]
                pinned = re.sub(rf"^dotnet add package {re.escape(package)} .*$", f"dotnet add package {pin}", pinned,
                                flags=re.MULTILINE)
        _sh(pinned, app)
        # The nuget.config lasts: a second restore on an empty package cache still finds our package.
        sources = subprocess.run([dotnet, "nuget", "list", "source"], cwd=app, capture_output=True, text=True,
                                 timeout=120)
        assert "agenteval [Enabled]" in sources.stdout and str(ROOT / "dist") in sources.stdout, sources.stdout
        assert "nuget.org" in sources.stdout or "api.nuget.org" in sources.stdout, sources.stdout
        _sh(f"{dotnet} restore --force", app, env={"NUGET_PACKAGES": str(tmp_path / "fresh-cache")})
        assert (tmp_path / "fresh-cache" / "agenteval.instrumentation.maffidelity").is_dir()
    (app / "Program.cs").write_text(blocks("csharp")[0])
    _sh(f"{dotnet} build --nologo -v q", app)
    # the package's build for the app's framework (net8.0 has one of its own)
    assets = (app / "obj" / "project.assets.json").read_text()
    assert f"lib/{framework}/AgentEval.Instrumentation.MafFidelity.dll" in assets
    command = run.strip().splitlines()[-1] + " --no-build"
    if framework != "net10.0":
        _sh(f"{dotnet} publish -c Release -r linux-x64 --self-contained -o out --nologo -v q", app)
        command = "./out/app"

    server = LLMServer()
    collector = CollectorProcess(tmp_path / "collector")
    try:
        server.script("gpt-4o-mini", [Reply(120, 40), Reply(90, 30)])  # the researcher, then the assistant
        server.script("gpt-4o", [Reply(300, 200, "length")])  # the writer
        _sh(command, app, env={**_bsp(run),
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
        assert (f"Microsoft.Agents.AI.Workflows {release} (.NET), AgentEval.Instrumentation.MafFidelity 0.1.0 "
                "(active)") in shown
        scrape = urllib.request.urlopen(collector.prometheus, timeout=10).read().decode()
        assert f'maf_release="dotnet-{release}"' in scrape
    finally:
        collector.stop()
        server.close()
