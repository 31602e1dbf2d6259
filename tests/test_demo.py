"""``agenteval demo`` as a user runs it: a subprocess against a real collector (its own ports and store),
the verdicts read back over the collector's gRPC API; and the ways it must fail fast and cleanly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collector.demo.maf_fakes import demo_workflows

from conftest import AGENTEVAL, CollectorProcess, free_port
from test_reliability import _certs

EXPECTED = {w.name: (w.status, w.verdicts) for w in demo_workflows()}
#: What must never reach the user's terminal.
NOISE = ("Traceback", "Self-loop", "Transient error", "Failed to export")


def demo(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``agenteval demo ARGS`` in a subprocess, as a user runs it."""
    return subprocess.run([AGENTEVAL, "demo", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def table(stdout: str) -> dict[str, tuple[str, dict[str, str]]]:
    """The demo table: workflow -> (status the collector reached, {unit: verdict}); wrapped cells joined."""
    rows: list[list[str]] = []
    for line in stdout.splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip("│").split("│")]
        if cells[0]:
            rows.append(cells)
        else:  # a wrapped row's continuation line
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells, strict=True)]
    out = {}
    for name, _expected, status, _score, executors, _about in rows:
        units = dict(item.split("=") for item in executors.split()) if executors != "-" else {}
        out[name] = (status, units)
    return out


def assert_every_verdict(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert table(proc.stdout) == EXPECTED
    assert "path2-pending/researcher: response_missing" in proc.stdout
    assert "path2-partial/writer: no_chat_trace" in proc.stdout
    for name in EXPECTED:  # each `runs show` line names its workflow: bare ids could not be told apart
        assert re.search(rf"^  {re.escape(name)}: agenteval runs show [0-9a-f]{{12}}$", proc.stdout, re.M), name
    assert not re.search(r"^\s*agenteval runs show", proc.stdout, re.M)
    assert proc.stderr == ""
    assert not any(noise in proc.stdout for noise in NOISE)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_demo_shows_the_verdicts_the_collector_reached(collector, tmp_path, protocol):
    # The collector stores in its own temporary SQLite file; the demo's default store path stays unused.
    unused = tmp_path / "demo-default-store.db"
    if protocol == "grpc":
        proc = demo("--endpoint", collector.grpc, env={"AGENTEVAL_STORE": str(unused)})
    else:  # OTLP over HTTP; the verdicts still come back over the collector's gRPC port
        proc = demo("--protocol", "http/protobuf", "--endpoint", collector.http, "--api", collector.grpc,
                    env={"AGENTEVAL_STORE": str(unused)})
    assert_every_verdict(proc)
    assert "with the collector's --config, or --store" in proc.stdout  # its store is not the default one
    assert not unused.exists()
    stored = {r["subject"] for r in collector.store().list_runs((), None, 100, False)}
    assert set(EXPECTED) <= stored


def test_demo_with_tls_and_a_bearer_token(tmp_path):
    certs = _certs(tmp_path)
    token = "demo-s3cr3t"
    proc = CollectorProcess(tmp_path / "collector", overrides={"receivers": {
        "tls": {"cert_file": certs["server.crt"], "key_file": certs["server.key"]},
        "auth": {"bearer_token_env": "AGENTEVAL_TOKEN"}}}, env={"AGENTEVAL_TOKEN": token})
    try:
        tls = ("--endpoint", proc.grpc, "--ca-file", certs["ca.crt"])
        assert_every_verdict(demo(*tls, "--token-env", "DEMO_TOKEN", env={"DEMO_TOKEN": token}))
        # Without the token: refused at the first check, before any workflow runs.
        env = {k: v for k, v in os.environ.items() if k != "AGENTEVAL_TOKEN"}
        started = time.monotonic()
        refused = subprocess.run([AGENTEVAL, "demo", *tls], capture_output=True, text=True, timeout=60, env=env)
        assert refused.returncode == 1 and time.monotonic() - started < 15
        assert f"{proc.grpc}: UNAUTHENTICATED" in refused.stderr and "$AGENTEVAL_TOKEN" in refused.stderr
        assert refused.stdout == "" and "Traceback" not in refused.stderr
    finally:
        proc.stop()
    assert token not in proc.stderr_path.read_text()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_no_collector_fails_at_once_naming_the_endpoint(protocol):
    port = free_port()  # nothing listens there
    endpoint = f"127.0.0.1:{port}" if protocol == "grpc" else f"http://127.0.0.1:{port}"
    started = time.monotonic()
    proc = demo("--protocol", protocol, "--endpoint", endpoint, timeout=60)
    elapsed = time.monotonic() - started
    assert proc.returncode == 1
    assert elapsed < 10, elapsed  # the probe takes at most 2 s; before it, ~37 s of exporter retries
    assert f"no collector at {endpoint} ({protocol})" in proc.stderr
    assert "agenteval collector serve" in proc.stderr
    assert proc.stdout == ""
    assert not any(noise in proc.stderr for noise in NOISE)


def test_an_otlp_port_without_the_fidelity_api_is_named(capture):
    # An OpenTelemetry Collector in front (docker compose): OTLP is accepted, GetRun is not served.
    proc = demo("--endpoint", f"127.0.0.1:{capture.port}", timeout=60)
    assert proc.returncode == 1
    assert f"127.0.0.1:{capture.port}: UNIMPLEMENTED" in proc.stderr and "pass --api" in proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr


def test_spans_sent_elsewhere_say_which_collector_was_asked(collector, capture):
    # Spans go to a receiver that is not the collector asked for the verdicts.
    proc = demo("--endpoint", f"127.0.0.1:{capture.port}", "--api", collector.grpc, "--timeout", "2")
    assert proc.returncode == 1
    assert all(status == "no verdict" for status, _ in table(proc.stdout).values())
    assert f"no verdict from {collector.grpc} within 2s for agree, under-report" in proc.stderr
    assert "pass --api" in proc.stderr and "Traceback" not in proc.stderr


#: Runs the CLI with ``sys.argv[1:]`` in a process where the module ``BLOCKED`` is not installed.
WITHOUT = """
import sys
from importlib.abc import MetaPathFinder

BLOCKED = {blocked!r}


class NotInstalled(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == BLOCKED or name.startswith(BLOCKED + "."):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
sys.argv[0] = "agenteval"
from collector.ui.cli import main

main()
"""


@pytest.mark.parametrize(("blocked", "fix"), [
    ("agent_framework", "pip install 'agenteval-collector[maf]'"),
    ("opentelemetry.instrumentation.maf_fidelity",
     "pip install ./instrumentation/opentelemetry-instrumentation-maf-fidelity"),
])
def test_without_the_maf_extra_one_line_names_the_fix(blocked, fix):
    proc = subprocess.run([sys.executable, "-c", WITHOUT.format(blocked=blocked), "demo",
                           "--endpoint", f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert fix in proc.stderr and f"No module named '{blocked}'" in proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1
    assert proc.stdout == ""


def test_demo_help_names_the_maf_extra():
    proc = demo("--help", timeout=60)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "[maf] extra" in text
    assert "pip install '.[maf]' \\ ./instrumentation/opentelemetry-instrumentation-maf-fidelity" in text
    assert "--store" not in proc.stdout and "--api" in proc.stdout


def test_demo_workflows_build_without_self_loops():
    for spec in demo_workflows():
        workflow = spec.build()
        edges = [e for group in workflow.edge_groups for e in group.edges]
        assert all(e.source_id != e.target_id for e in edges), spec.name


def test_your_own_workflow_on_the_scripted_client_as_docs_show_it(collector):
    """examples/scripted_workflow.py, run as docs/running.md says: a two-agent workflow of one's own
    whose writer's middleware halves its usage is caught (TokenMismatch), the researcher agrees."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "examples/scripted_workflow.py")], capture_output=True,
                          text=True, timeout=120, cwd=root,
                          env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{collector.grpc}"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    trace_id = proc.stdout.split()[-1]
    run = collector.run(trace_id)
    assert (run["subject"], run["status"]) == ("my-workflow", "FAIL")
    assert {e["executor_id"]: e["verdict"] for e in run["executors"]} == {"researcher": "Agree",
                                                                          "writer": "TokenMismatch"}
    shown = subprocess.run([AGENTEVAL, "runs", "show", trace_id, "--store", collector.store_url],
                           capture_output=True, text=True, timeout=60)
    assert "writer" in shown.stdout and "TokenMismatch" in shown.stdout and "FAIL" in shown.stdout
    running = (root / "docs/running.md").read_text()
    assert "python examples/scripted_workflow.py" in running and "ChatTelemetryLayer" in running
