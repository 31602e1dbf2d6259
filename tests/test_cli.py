"""The installed ``agenteval`` CLI, run as a subprocess the way users run it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from conftest import shown_seconds
from mafshape import SCENARIOS, Invocation, Scenario, export_request, ok, record, sent_times, to_otlp_json

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.json"))
EXPECTED_EXIT = {"pass": 0, "warn": 10, "fail": 9, "pending": 11}
AGENTEVAL = shutil.which("agenteval", path=str(Path(sys.executable).parent)) or "agenteval"


def run(*args: str, store: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "AGENTEVAL_STORE": str(store)}
    return subprocess.run([AGENTEVAL, *args], capture_output=True, text=True, env=env, timeout=60)


def bench(path: Path, store: Path, *extra: str) -> subprocess.CompletedProcess:
    return run("bench", "workflow-trace-fidelity", "--workflow-trace", str(path), "--subject", "ci", *extra,
               store=store)


def test_every_example_kind_is_shipped():
    kinds = {p.name.split("_")[0] for p in EXAMPLES}
    assert kinds == set(EXPECTED_EXIT) and len(EXAMPLES) >= 8


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_exits_with_the_code_its_name_promises(example, tmp_path):
    proc = bench(example, tmp_path / "runs.db")
    status = example.name.split("_")[0]
    assert proc.returncode == EXPECTED_EXIT[status], proc.stdout + proc.stderr
    assert status.upper() in proc.stdout


def test_table_shows_per_executor_verdicts(tmp_path):
    proc = bench(ROOT / "examples/fail_under_reported_tokens.json", tmp_path / "runs.db")
    lines = {line.split("│")[1].strip(): line for line in proc.stdout.splitlines() if line.count("│") > 3}
    assert "TokenMismatch" in lines["writer"] and "-420 under" in lines["writer"]
    assert "Agree" in lines["researcher"]
    assert "FAIL" in proc.stdout and "score 0.750" in proc.stdout


def test_a_maf_1_26_otlp_export_names_the_diverging_agents_and_its_release(tmp_path):
    # examples/fail_maf_1_26_*.json: a real agent-framework-core 1.26 run (invoke_workflow spans,
    # gen_ai.workflow.name) as the OpenTelemetry Collector's file exporter writes it
    (example,) = (ROOT / "examples").glob("fail_maf_1_26_*.json")
    proc = bench(example, tmp_path / "runs.db", "--json")
    assert proc.returncode == 9, proc.stderr
    (run,) = json.loads(proc.stdout)["runs"]
    units = {e["executor_id"]: e for e in run["executors"]}
    assert {name: e["verdict"] for name, e in units.items()} == {
        "researcher": "Agree", "writer": "TokenMismatch", "reviewer": "FinishMismatch"}
    writer, reviewer = units["writer"]["evidence"], units["reviewer"]["evidence"]
    assert (writer["framework_tokens"], writer["truth_tokens"], writer["response_turns"]) == (960, 1300, 2)
    assert (reviewer["framework_finish"], reviewer["truth_finish"]) == (None, "length")
    assert (run["status"], run["maf_release"], run["instrumentation_status"]) == ("FAIL", "1.26.0", "active")
    # what debugging the writer needs, per call: its tool loop's two calls against the one response
    calls = [(c["usage"]["input_tokens"], c["usage"]["output_tokens"], c["finish_reason"], c["model"], c["provider"])
             for c in writer["chat_calls"]]
    assert calls == [(300, 40, "tool_calls", "fake-model", "fake"), (610, 350, "stop", "fake-model", "fake")]
    assert [(e["usage"]["total_tokens"], e["finish_reason"]) for e in writer["ledger"]] == [(960, "stop")]
    assert (writer["framework_input_tokens"], writer["framework_output_tokens"],
            writer["truth_input_tokens"], writer["truth_output_tokens"]) == (610, 350, 910, 390)
    assert run["non_agent_executors"] == ["input-conversation"]


def test_pending_says_nothing_was_checked_and_why_never_a_score(tmp_path):
    proc = bench(ROOT / "examples/pending_path2_response_missing.json", tmp_path / "runs.db")
    assert proc.returncode == 11
    assert "nothing was checked" in proc.stdout
    assert "response_missing" in proc.stdout and "Path-2" in proc.stdout
    assert "score" not in proc.stdout.split("PENDING", 1)[1]
    assert "100%" not in proc.stdout and "1.000" not in proc.stdout


def test_json_output_carries_verdicts_and_evidence(tmp_path):
    proc = bench(ROOT / "examples/warn_suppressed_finish_reason.json", tmp_path / "runs.db", "--json",
                 "--preset", "audit-grade")
    doc = json.loads(proc.stdout)
    assert proc.returncode == doc["exit_code"] == 10
    (run_doc,) = doc["runs"]
    assert run_doc["preset"] == "audit-grade" and run_doc["cost_tier"] == "Free"
    reviewer = next(e for e in run_doc["executors"] if e["executor_id"] == "reviewer")
    assert reviewer["verdict"] == "FinishMismatch"
    assert reviewer["evidence"]["framework_finish"] is None
    assert reviewer["evidence"]["truth_finish"] == "content_filter"


def test_the_table_calls_a_suppressed_finish_reason_what_the_run_page_calls_it(tmp_path):
    proc = bench(ROOT / "examples/warn_suppressed_finish_reason.json", tmp_path / "runs.db")
    reviewer = next(line for line in proc.stdout.splitlines() if "reviewer" in line)
    assert "none (suppressed) / content_filter" in reviewer


def test_reading_a_failed_run_exits_0_and_its_own_code_is_in_the_json(tmp_path):
    """`bench` gates on the run; `runs list` / `runs show` only read it (docs/cli.md)."""
    store = tmp_path / "runs.db"
    assert bench(ROOT / "examples/fail_both.json", store).returncode == 9
    listed = run("runs", "list", "--json", store=store)
    assert listed.returncode == 0
    (doc,) = json.loads(listed.stdout)
    shown = run("runs", "show", doc["run_id"][:12], "--json", store=store)
    assert shown.returncode == 0 and json.loads(shown.stdout)["exit_code"] == doc["exit_code"] == 9
    assert run("runs", "show", doc["run_id"][:12], store=store).returncode == 0


def test_runs_show_says_when_a_run_started_and_how_long_it_took(tmp_path):
    """From an OTLP/JSON trace file's spans, as the run page says it (and its service); a file without span times
    (workflow-trace/v1) knows neither: null in the document, no line in `runs show`."""
    spans, (trace_id,) = record([SCENARIOS["fail_under_report"][0]])
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(to_otlp_json(export_request(spans))))
    assert bench(trace, tmp_path / "runs.db").returncode == 9
    (doc,) = json.loads(run("runs", "list", "--json", store=tmp_path / "runs.db").stdout)
    started, duration = sent_times(spans, trace_id)
    assert datetime.fromisoformat(doc["started_at"]) == started
    assert doc["duration_s"] == pytest.approx(duration, abs=1e-9)
    shown = run("runs", "show", doc["run_id"], store=tmp_path / "runs.db").stdout
    assert f"service.name {doc['service_name']}" in shown and doc["service_name"]
    head, took = next(line for line in shown.splitlines() if line.startswith("started ")).split(", duration ")
    assert head == f"started {started:%Y-%m-%d %H:%M:%S}.{started.microsecond // 1000:03d} UTC"
    assert shown_seconds(took) == pytest.approx(duration, rel=5e-3)  # three digits
    assert bench(ROOT / "examples/pass_all_agree.json", tmp_path / "v1.db").returncode == 0
    (doc,) = json.loads(run("runs", "list", "--json", store=tmp_path / "v1.db").stdout)
    assert (doc["started_at"], doc["duration_s"]) == (None, None)
    assert "started" not in run("runs", "show", doc["run_id"], store=tmp_path / "v1.db").stdout


def test_a_unit_without_a_ledger_shows_no_framework_tokens_not_zero(tmp_path):
    """MAF Python without the instrumentation: the only ledger re-sums the chat spans (ledger_derived).
    The framework reported nothing: "0" read as a framework that reported 0 tokens."""
    spans, _ = record([Scenario({"writer": [Invocation([ok(420, 180)])]}, name="derived", ledger="invoke_agent")])
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(to_otlp_json(export_request(spans))))
    proc = bench(trace, tmp_path / "runs.db")
    assert proc.returncode == 11
    writer = next(line for line in proc.stdout.splitlines() if "writer" in line)
    cells = [cell.strip() for cell in writer.split("│")[1:-1]]
    assert cells[1:5] == ["NoTruth", "-", "-", "600"], cells
    # no framework finish either: "none (suppressed)" blamed a ledger that is not there
    assert cells[6] == "- / stop", cells


def test_units_with_the_same_reason_are_explained_once(tmp_path):
    """Three agents without the instrumentation: one explanation and one fix naming the three, as
    the run page's card does, not the same two lines three times."""
    agents = ("researcher", "writer", "editor")
    spans, _ = record([Scenario({a: [Invocation([ok(420, 180)])] for a in agents}, name="derived",
                                ledger="invoke_agent")])
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(to_otlp_json(export_request(spans))))
    out = bench(trace, tmp_path / "runs.db").stdout
    assert out.count("fix:") == 1 and out.count("could never disagree") == 1, out
    assert "editor, researcher, writer: ledger_derived - the only framework ledger" in out, out


def test_preset_never_changes_scoring(tmp_path):
    scores = set()
    for preset in ("smoke", "standard", "audit-grade"):
        proc = bench(ROOT / "examples/warn_partial_truth.json", tmp_path / "runs.db", "--json", "--preset", preset)
        scores.add(json.loads(proc.stdout)["runs"][0]["score"])
    assert len(scores) == 1


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_otlp_jsonl_file_goes_through_span_classification(name, tmp_path):
    scenario, status, verdicts = SCENARIOS[name]
    spans, (trace_id,) = record([scenario])
    # Like the Collector's file exporter: several requests, one per line, children before parents.
    path = tmp_path / "trace.jsonl"
    with path.open("w") as fh:
        for i in range(0, len(spans), 3):
            fh.write(json.dumps(to_otlp_json(export_request(spans[i:i + 3]))) + "\n")
    proc = bench(path, tmp_path / "runs.db", "--json")
    doc = json.loads(proc.stdout)
    (run_doc,) = doc["runs"]
    assert run_doc["trace_id"] == trace_id and run_doc["status"] == status
    assert {e["executor_id"]: e["verdict"] for e in run_doc["executors"]} == verdicts
    assert proc.returncode == EXPECTED_EXIT[status.lower()]


def test_otlp_json_single_document_with_several_traces_gives_one_run_each(tmp_path):
    spans, ids = record([SCENARIOS["pass"][0], SCENARIOS["path2_pending"][0]])
    path = tmp_path / "two.json"
    path.write_text(json.dumps(to_otlp_json(export_request(spans)), indent=2))
    proc = bench(path, tmp_path / "runs.db", "--json")
    doc = json.loads(proc.stdout)
    assert {r["trace_id"]: r["status"] for r in doc["runs"]} == {ids[0]: "PASS", ids[1]: "PENDING"}
    assert proc.returncode == 11  # the most severe of the two


def test_path2_reason_distinguishes_missing_response_from_missing_chat(tmp_path):
    spans, _ = record([SCENARIOS["partial_warn"][0]])
    path = tmp_path / "t.json"
    path.write_text(json.dumps(to_otlp_json(export_request(spans))))
    doc = json.loads(bench(path, tmp_path / "runs.db", "--json").stdout)
    writer = next(e for e in doc["runs"][0]["executors"] if e["executor_id"] == "writer")
    assert writer["no_truth_reason"] == "no_chat_trace"


INVALID = {
    "bad_json": ('{"schema": "workflow-trace/v1",\n  "steps": [,]}', "invalid JSON", ":2:"),
    "schema_violation": (json.dumps({"schema": "workflow-trace/v1", "steps": [{"executor_id": "a", "input_tokens": -3}],
                                     "executor_traces": {}}), "$.steps[0].input_tokens", "minimum"),
    "unknown_schema": (json.dumps({"schema": "workflow-trace/v9", "steps": []}), "unknown schema", "workflow-trace/v9"),
    "not_a_trace": (json.dumps({"hello": 1}), "not a trace this command reads (top-level keys: hello)",
                    "resourceSpans"),
    "non_hex_trace_id": (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [
        {"traceId": "not-hex-at-all-0123456789abcdef", "spanId": "0011223344556677", "name": "x"}]}]}]}),
        "$.resourceSpans[0].scopeSpans[0].spans[0].traceId", "not hex"),
    "bad_jsonl_line": ('{"resourceSpans": []}\n{"resourceSpans": [\n', ":2:", "invalid JSON"),
}


@pytest.mark.parametrize("case", INVALID)
def test_invalid_file_exits_1_naming_file_location_and_problem(case, tmp_path):
    text, location, problem = INVALID[case]
    path = tmp_path / f"{case}.json"
    path.write_text(text)
    proc = bench(path, tmp_path / "runs.db")
    assert proc.returncode == 1
    assert str(path) in proc.stderr and location in proc.stderr and problem in proc.stderr


def _agent_request(name: str, trace_id: bytes = b"\x01" * 16) -> ExportTraceServiceRequest:
    """One direct agent call that reported 12 tokens, as a serialized-request test needs it."""
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add(
        trace_id=trace_id, span_id=b"\x02" * 8, name=name, start_time_unix_nano=1, end_time_unix_nano=2)
    span.attributes.add(key="gen_ai.usage.input_tokens", value=AnyValue(int_value=12))
    return request


def test_a_serialized_otlp_request_is_read_as_a_collector_receives_it(tmp_path):
    """Detected by content: also a request whose first length byte is "{" (it begins with a newline
    and a brace, as JSON may)."""
    padding = next(n for n in range(200) if len(_agent_request("invoke_agent solo" + " " * n).resource_spans[0]
                                                  .SerializeToString()) == ord("{"))
    body = _agent_request("invoke_agent solo" + " " * padding).SerializeToString()
    assert body[:2] == b"\n{"
    path = tmp_path / "capture.bin"
    path.write_bytes(body)
    proc = bench(path, tmp_path / "runs.db", "--json")
    (run,) = json.loads(proc.stdout)["runs"]
    assert (proc.returncode, run["status"]) == (11, "PENDING"), proc.stderr
    assert [(e["executor_id"], e["no_truth_reason"]) for e in run["executors"]] == [("solo", "no_chat_trace")]


@pytest.mark.parametrize(("body", "problem"), [
    (b"\x00\x01\xffnot a request", "neither JSON nor a serialized OTLP ExportTraceServiceRequest"),
    (_agent_request("invoke_agent x", trace_id=b"\x01" * 3).SerializeToString(), "1 span(s) cannot be used"),
], ids=["not-protobuf", "bad-span"])
def test_a_file_neither_json_nor_a_usable_request_exits_1_saying_why(body, problem, tmp_path):
    path = tmp_path / "capture.bin"
    path.write_bytes(body)
    proc = bench(path, tmp_path / "runs.db")
    assert proc.returncode == 1 and str(path) in proc.stderr and problem in proc.stderr, proc.stderr


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16"])
def test_json_written_with_a_byte_order_mark_reads_as_json(encoding, tmp_path):
    """Windows tools (PowerShell's Out-File) write JSON with a byte order mark: still JSON, never protobuf."""
    example = next(p for p in EXAMPLES if p.name.startswith("fail_"))
    path = tmp_path / f"{encoding}.json"
    path.write_text(example.read_text(), encoding=encoding)
    assert bench(path, tmp_path / "runs.db").returncode == EXPECTED_EXIT["fail"]


@pytest.mark.parametrize(("text", "problem"), [("<html>not a trace</html>", "invalid JSON"),
                                               ('"a string"', "expected a JSON object, got str")])
def test_text_that_is_not_json_is_told_so_as_json(text, problem, tmp_path):
    path = tmp_path / "trace.txt"
    path.write_text(text)
    proc = bench(path, tmp_path / "runs.db")
    assert proc.returncode == 1 and problem in proc.stderr and "protobuf" not in proc.stderr, proc.stderr


def test_missing_file_exits_1(tmp_path):
    proc = bench(tmp_path / "nope.json", tmp_path / "runs.db")
    assert proc.returncode == 1 and "no such file" in proc.stderr


def test_bad_arguments_exit_1(tmp_path):
    proc = run("bench", "workflow-trace-fidelity", "--subject", "x", store=tmp_path / "r.db")
    assert proc.returncode == 1 and "--workflow-trace" in proc.stderr
    proc = bench(ROOT / "examples/pass_all_agree.json", tmp_path / "r.db", "--preset", "bogus")
    assert proc.returncode == 1


def test_unwritable_store_exits_1(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = bench(ROOT / "examples/pass_all_agree.json", blocker / "runs.db")
    assert proc.returncode == 1 and "error:" in proc.stderr and "Traceback" not in proc.stderr


def _interleaved_jsonl(path, gap: int) -> list[str]:
    """Three traces, one span per line; trace 0's last chat span comes ``gap`` lines after its root."""
    spans, ids = record([SCENARIOS["pass"][0], SCENARIOS["loop"][0], SCENARIOS["path2_pending"][0]])
    first = [s for s in spans if format(s.context.trace_id, "032x") == ids[0]]
    late = next(s for s in first if s.name.startswith("chat"))
    lines = [s for s in first if s is not late]
    others = [s for s in spans if format(s.context.trace_id, "032x") != ids[0]]
    lines += others[:gap] + [late] + others[gap:]
    path.write_text("".join(json.dumps(to_otlp_json(export_request([s]))) + "\n" for s in lines))
    return ids


def test_jsonl_streams_runs_out_as_traces_complete(tmp_path):
    path = tmp_path / "three.jsonl"
    ids = _interleaved_jsonl(path, gap=5)
    proc = bench(path, tmp_path / "runs.db", "--json", "--trace-window", "10")
    doc = json.loads(proc.stdout)
    assert {r["trace_id"]: r["status"] for r in doc["runs"]} == {ids[0]: "PASS", ids[1]: "PASS", ids[2]: "PENDING"}
    assert doc["status"] == "PENDING" and proc.returncode == 11
    assert len(proc.stdout.splitlines()) == len(doc["runs"]) + 2  # one run per line, between header and status


def test_a_span_beyond_the_trace_window_is_an_error_not_a_split_run(tmp_path):
    path = tmp_path / "late.jsonl"
    ids = _interleaved_jsonl(path, gap=30)
    proc = bench(path, tmp_path / "runs.db", "--json", "--trace-window", "3")
    assert proc.returncode == 1
    assert ids[0] in proc.stderr and "--trace-window" in proc.stderr and f"{path}:" in proc.stderr
    doc = json.loads(proc.stdout)  # the JSON on stdout is still well formed, and says what happened
    assert doc["exit_code"] == 1 and ids[0] in doc["error"]
    assert ids[0] not in {r["trace_id"] for r in doc["runs"]}
    ok = bench(path, tmp_path / "runs2.db", "--json", "--trace-window", "40")
    assert ok.returncode == 11 and ids[0] in {r["trace_id"] for r in json.loads(ok.stdout)["runs"]}


def test_offline_bench_keeps_nothing_unless_a_store_is_named(tmp_path):
    """The README's offline check stored its run "demo" in the live collector's default store, where
    it showed up as a FAIL among production runs. Now only --store, a --config store.url or
    $AGENTEVAL_STORE keep runs; the table, --json and the reports are the same either way."""
    data = tmp_path / "data"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "AGENTEVAL_STORE"} | {
        "XDG_DATA_HOME": str(data), "HOME": str(tmp_path), "TMPDIR": str(scratch)}
    example = str(ROOT / "examples/fail_under_reported_tokens.json")
    args = [AGENTEVAL, "bench", "workflow-trace-fidelity", "--workflow-trace", example, "--subject", "demo"]
    proc = subprocess.run([*args, "--junit", str(tmp_path / "j.xml")], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 9 and "TokenMismatch" in proc.stdout
    assert "not stored: 1 run(s) checked" in proc.stderr and "--store" in proc.stderr
    assert 'name="status" value="FAIL"' in (tmp_path / "j.xml").read_text()
    as_json = subprocess.run([*args, "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert as_json.returncode == 9 and json.loads(as_json.stdout)["runs"][0]["status"] == "FAIL"
    assert not data.exists(), sorted(data.rglob("*"))  # the default store was never opened
    listed = subprocess.run([AGENTEVAL, "runs", "list"], capture_output=True, text=True, env=env, timeout=60)
    assert listed.stdout.strip() == "no runs stored"
    kept = subprocess.run([*args, "--store", str(tmp_path / "mine.db")], capture_output=True, text=True, env=env,
                          timeout=60)
    assert kept.returncode == 9 and f"stored 1 run(s) in {tmp_path / 'mine.db'}" in " ".join(kept.stderr.split())
    assert not list(scratch.iterdir())  # the runs' scratch store is gone too


def test_an_over_report_is_agree_and_runs_show_says_it_over_reported(tmp_path):
    """MAF .NET's captured over-report (a middleware doubling the writer's usage: 1,000 reported for
    500): Agree by the verdict table, the run a PASS, and `runs show` names the over-report in the
    writer's verdict cell and in a line under the table; the honest units say nothing of the kind."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_dotnet_replay import otlp_json_file

    trace = otlp_json_file(ROOT / "tests/fixtures/dotnet/1.28.0/over-reported", tmp_path / "over.jsonl")
    assert bench(trace, tmp_path / "runs.db").returncode == 0
    (doc,) = json.loads(run("runs", "list", "--json", store=tmp_path / "runs.db").stdout)
    shown = subprocess.run([AGENTEVAL, "runs", "show", doc["run_id"]], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "AGENTEVAL_STORE": str(tmp_path / "runs.db"), "COLUMNS": "200"}).stdout
    cells = {c[0]: c for c in ([cell.strip() for cell in line.split("│")[1:-1]] for line in shown.splitlines()
                               if line.startswith("│"))}
    assert cells["writer"][1:6] == ["Agree (over-reported +100%)", "1.000", "1000", "500", "+500 over"], cells
    assert cells["researcher"][1] == "Agree" and cells["reviewer"][1] == "Agree"
    assert ("writer: over-reported +100%: the framework reported 1,000 tokens, 500 more than the chat boundary's "
            "500 (an over-report is Agree unless scoring.flag_over_reporting)") in " ".join(shown.split())
    assert "PASS  score 1.000" in shown
