"""MAF .NET 1.17 traces hand-built from the .NET source (tests/fixtures/dotnet/source-1.17/README.md),
kept for what the real captured traces (tests/test_dotnet_replay.py) do not send, offline and live:
`workflow.session` > `workflow_invoke` > `executor.process` > `invoke_agent Name(Id)` (an independent
ledger) > `chat`; sessions never exported; orchestration builders without workflow spans."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from collector.core.model import STATUS_EXIT_CODES, Status

from conftest import AGENTEVAL, JSON, post

FIXTURES = Path(__file__).parent / "fixtures" / "dotnet" / "source-1.17"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
SEVERITY = ("FAIL", "PENDING", "WARN", "PASS")


def units(run: dict) -> dict[str, dict]:
    return {e["executor_id"]: {"verdict": e["verdict"], "framework_tokens": e["evidence"]["framework_tokens"],
                               "truth_tokens": e["evidence"]["truth_tokens"]} for e in run["executors"]}


def expected_units(run: dict) -> dict[str, dict]:
    return {name: {k: u[k] for k in ("verdict", "framework_tokens", "truth_tokens")}
            for name, u in run["units"].items()}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_offline_bench_gives_the_verdicts_and_exit_code_of_each_dotnet_trace(name, tmp_path):
    proc = subprocess.run([AGENTEVAL, "bench", "workflow-trace-fidelity", "--workflow-trace", str(FIXTURES / name),
                           "--subject", "dotnet", "--json", "--store", str(tmp_path / "runs.db")],
                          capture_output=True, text=True, timeout=120)
    out = json.loads(proc.stdout)
    want = EXPECTED[name]["runs"]
    worst = min((r["status"] for r in want), key=SEVERITY.index)
    assert proc.returncode == STATUS_EXIT_CODES[Status(worst)] and out["status"] == worst, proc.stderr
    got = sorted(((r["trace_id"], r["root_span_id"]), r) for r in out["runs"])
    assert len(got) == len(want)
    for (_, run), w in zip(got, sorted(want, key=lambda r: (r["trace_id"], r["root_span_id"])), strict=True):
        assert (run["status"], run["score"]) == (
            w["status"], pytest.approx(w["score"], abs=1e-4) if w["score"] is not None else None)
        assert units(run) == expected_units(w)
        assert run["non_agent_executors"] == w.get("non_agent_executors", [])


def test_live_collector_gives_every_dotnet_run_its_stable_id_and_verdict(collector):
    for name, fixture in EXPECTED.items():
        for line in (FIXTURES / name).read_text().splitlines():
            status, body, _ = post(collector.http, line.encode(), JSON)
            assert status == 200, body
        for w in fixture["runs"]:
            run = collector.run(w["live_run_id"])
            assert run["run_id"] == w["live_run_id"]
            assert run["status"] == w["status"] and units(run) == expected_units(w), name
