"""CI reports (docs/outputs.md "CI reports"), as a CI job meets them: `agenteval bench ... --junit --markdown`
and `agenteval runs show --format junit|markdown`, the JUnit file checked against the JUnit schema CI
systems read (tests/fixtures/junit/junit.xsd) and read back by a JUnit parser library; exit codes unchanged."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import xmlschema
from junitparser import Failure, JUnitXml, Skipped

from conftest import AGENTEVAL

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = xmlschema.XMLSchema(ROOT / "tests/fixtures/junit/junit.xsd")
MAF_OTLP = next((ROOT / "examples").glob("fail_maf_1_26_*.json"))
#: Each example's exit code, as its name promises (tests/test_cli.py checks it without the reports).
EXIT_BY_NAME = {"pass": 0, "warn": 10, "fail": 9, "pending": 11}


def bench(path: Path, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([AGENTEVAL, "bench", "workflow-trace-fidelity", "--workflow-trace", str(path),
                           "--subject", "ci", "--store", str(tmp / "runs.db"), *extra],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})


def _reports(path: Path, tmp: Path, *extra: str) -> tuple[subprocess.CompletedProcess, JUnitXml, str]:
    proc = bench(path, tmp, "--junit", str(tmp / "report.xml"), "--markdown", str(tmp / "summary.md"), *extra)
    SCHEMA.validate(str(tmp / "report.xml"))  # raises with the offending element if not valid
    return proc, JUnitXml.fromfile(str(tmp / "report.xml")), (tmp / "summary.md").read_text()


def _cases(report: JUnitXml) -> dict[str, object]:
    (suite,) = list(report)
    return {case.name: case for case in suite}


def test_a_maf_run_with_a_diverging_agent_is_a_failed_test_case_with_its_evidence(tmp_path):
    plain = bench(MAF_OTLP, tmp_path, "--json")
    proc, report, summary = _reports(MAF_OTLP, tmp_path)
    assert proc.returncode == plain.returncode == 9, proc.stderr  # exit code unchanged by the reports
    (run,) = json.loads(plain.stdout)["runs"]
    (suite,) = list(report)
    assert run["run_id"] != "" and suite.name.startswith("ci run ")
    assert (suite.tests, suite.failures, suite.errors, suite.skipped) == (3, 2, 0, 0)
    cases = _cases(report)
    assert set(cases) == {"researcher", "writer", "reviewer"}
    assert cases["researcher"].is_passed
    (writer,) = cases["writer"].result
    assert isinstance(writer, Failure) and writer.type == "TokenMismatch"
    assert writer.message.startswith("the framework reported 960 tokens; the chat boundary summed 1,300 over 2 chat "
                                     "call(s): -340")
    evidence = run["executors"][[e["executor_id"] for e in run["executors"]].index("writer")]["evidence"]
    assert f"chat spans: {', '.join(evidence['chat_span_ids'])}" in writer.text  # from the message to the spans
    (reviewer,) = cases["reviewer"].result
    assert reviewer.type == "FinishMismatch"
    assert "none (suppressed)" in reviewer.message and "length" in reviewer.message
    properties = {p.name: p.value for p in suite.properties()}
    assert (properties["status"], properties["exit_code"], properties["trace_id"]) == ("FAIL", "9", run["trace_id"])
    # the job summary: status, score, a row per unit, what diverged
    assert "### ❌ FAIL: ci" in summary and "Score **0.667** over 3 of 3 agent unit(s), exit code 9" in summary
    rows = [line for line in summary.splitlines() if line.startswith("| `")]
    assert [row.split("|")[1].strip() for row in rows] == ["`researcher`", "`reviewer`", "`writer`"]
    assert "| `writer` | TokenMismatch | 0.500 | 960 | 1,300 | -340 under |" in summary
    assert "**Result: ❌ FAIL** (exit code 9)" in summary


def test_agentevals_own_trace_file_gets_the_same_reports_no_truth_skipped_with_its_reason_and_fix(tmp_path):
    example = ROOT / "examples/warn_agenteval_partial_truth.json"
    proc, report, summary = _reports(example, tmp_path)
    assert proc.returncode == 10, proc.stderr  # WARN, as without the reports
    (suite,) = list(report)
    skipped = {name: case for name, case in _cases(report).items() if case.is_skipped}
    assert suite.skipped == len(skipped) > 0
    for case in skipped.values():
        (result,) = case.result
        assert isinstance(result, Skipped) and result.message.startswith(f"NoTruth {result.type}: ")
        assert result.text.startswith("What would fix it: ")
    doc = json.loads(bench(example, tmp_path, "--json").stdout)["runs"][0]
    for unit in doc["executors"]:
        if unit["no_truth_reason"]:
            result = skipped[unit["executor_id"]].result[0]
            assert result.type == unit["no_truth_reason"]
            assert result.text == f"What would fix it: {unit['no_truth_fix']}"  # the file's fix, not instrumentation
            assert f"*Fix:* {unit['no_truth_fix']}." in summary
    assert "### ⚠️ WARN: ci" in summary


def test_a_pending_run_is_every_unit_skipped_and_exits_11(tmp_path):
    proc, report, summary = _reports(ROOT / "examples/pending_path2_response_missing.json", tmp_path)
    assert proc.returncode == 11
    cases = _cases(report)
    assert cases and all(case.is_skipped for case in cases.values())
    assert "### ⏳ PENDING" in summary and "`response_missing`" in summary


def test_every_example_writes_a_valid_report_and_keeps_its_exit_code(tmp_path):
    for example in sorted((ROOT / "examples").glob("*.json")):
        work = tmp_path / example.stem
        work.mkdir()
        proc, report, summary = _reports(example, work)
        assert proc.returncode == EXIT_BY_NAME[example.name.split("_")[0]], (example.name, proc.stderr)
        assert summary.rstrip().endswith(f"(exit code {proc.returncode}) over " + summary.rstrip().split(" over ")[-1])
        assert all(suite.tests == len(list(suite)) for suite in report)


def test_runs_show_writes_the_stored_run_as_junit_and_markdown(tmp_path):
    plain = bench(MAF_OTLP, tmp_path, "--json")
    run_id = json.loads(plain.stdout)["runs"][0]["run_id"]
    shown = {}
    for fmt in ("junit", "markdown"):
        proc = subprocess.run([AGENTEVAL, "runs", "show", run_id[:12], "--format", fmt, "--store",
                               str(tmp_path / "runs.db")], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        shown[fmt] = proc.stdout
    (tmp_path / "shown.xml").write_text(shown["junit"])
    SCHEMA.validate(str(tmp_path / "shown.xml"))
    (suite,) = list(JUnitXml.fromfile(str(tmp_path / "shown.xml")))
    assert suite.failures == 2 and {c.name for c in suite} == {"researcher", "writer", "reviewer"}
    assert shown["markdown"].startswith("### ❌ FAIL: ci") and "| `writer` | TokenMismatch |" in shown["markdown"]


def test_a_report_path_that_cannot_be_written_is_an_error_before_anything_runs(tmp_path):
    proc = bench(MAF_OTLP, tmp_path, "--junit", str(tmp_path / "missing-dir/report.xml"))
    assert proc.returncode == 1
    assert "--junit" in proc.stderr and "missing-dir/report.xml" in proc.stderr
    listed = subprocess.run([AGENTEVAL, "runs", "list", "--store", str(tmp_path / "runs.db")],
                            capture_output=True, text=True, timeout=60)
    assert "no runs stored" in listed.stdout


@pytest.mark.parametrize("bad", ["xml", "JUnit XML"])
def test_runs_show_rejects_an_unknown_format(tmp_path, bad):
    bench(MAF_OTLP, tmp_path)
    proc = subprocess.run([AGENTEVAL, "runs", "show", "x", "--format", bad, "--store", str(tmp_path / "runs.db")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "--format: expected table, json, junit or markdown" in proc.stderr


def test_an_unpriced_run_reports_its_spend_unknown_in_junit_as_in_markdown(tmp_path):
    """JUnit said `unreported_usd value="0.0"` where the Markdown said unknown (no model named)."""
    proc, report, summary = _reports(ROOT / "examples/fail_under_reported_tokens.json", tmp_path)
    assert proc.returncode == 9
    (suite,) = list(report)
    properties = {p.name: p.value for p in suite.properties()}
    assert properties["unreported_usd"] == "unknown" and properties["unreported_tokens"] == "420"
    assert "spend  unknown: no unit's model could be priced (2 unit(s); 420 tokens unreported)" \
        in (tmp_path / "report.xml").read_text()
    assert "unknown: no unit's model could be priced" in summary
    writer = next(line for line in summary.splitlines() if line.startswith("| `writer`"))
    assert writer.endswith("| unknown |")  # its 420 tokens have no price; the researcher's $0.00 reported them all
