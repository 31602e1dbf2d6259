"""AgentEval's own WorkflowTrace files give AgentEval's verdicts and exit codes (docs/design.md §2 format 1).

The cases are AgentEval's workflow-trace-fidelity tests (its ``WorkflowTraceFidelityReconcilerTests``,
``WorkflowTraceFidelityAssertionTests`` and ``BenchWorkflowTraceFidelityCommandTests``), rebuilt as the
JSON its ``WorkflowTraceSerializer`` writes, with the verdict and exit code AgentEval asserts; then
the shapes its tests do not cover (request/response pairs, tool loops, error responses, enum
spellings, an untrusted ``totalTokens``, trace keys without a step).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from collector.config import CollectorConfig
from collector.loader import NoSteps, TraceFileError, iter_runs
from collector.reconcile import reconcile
from test_cli import AGENTEVAL, ROOT, bench

CAPTURED = "2026-11-30T10:00:00+00:00"


def step(executor_id: str, prompt: int | None, completion: int | None, finish: str | None, index: int = 0) -> dict:
    """A step as WorkflowTraceSerializer writes it: camelCase, nulls omitted, totalTokens computed."""
    out: dict[str, Any] = {"executorId": executor_id, "stepIndex": index, "output": executor_id,
                           "startOffsetMs": 0, "durationMs": 12}
    if prompt is not None:
        out["tokenUsage"] = {"promptTokens": prompt, "completionTokens": completion,
                             "totalTokens": prompt + completion}
    if finish is not None:
        out["finishReason"] = finish
    return out


def entry(kind: str = "Response", tokens: int | None = None, finish: str | None = None, scope: Any = "ChatTurn",
          **extra: Any) -> dict:
    """A TraceEntry as AgentEval's ForChatResponse / ForChatRequest write it (prompt = tokens)."""
    out: dict[str, Any] = {"type": kind, "index": 0, "timestamp": CAPTURED, **extra}
    if scope is not None:
        out["scope"] = scope
    if tokens is not None:
        out["tokenUsage"] = {"promptTokens": tokens, "completionTokens": 0, "totalTokens": tokens}
    if finish is not None:
        out["finishReason"] = finish
    return out


def chat(*entries: dict) -> dict:
    return {"version": "1.0", "traceName": "", "capturedAt": CAPTURED, "entries": list(entries)}


def workflow(steps: list[dict], traces: dict[str, dict] | None = None) -> dict:
    doc: dict[str, Any] = {"version": "1.0", "traceName": "wtf", "capturedAt": CAPTURED, "originalPrompt": "go",
                           "finalOutput": "done", "steps": steps,
                           "executorIds": list(dict.fromkeys(s["executorId"] for s in steps))}
    if traces is not None:
        doc["executorTraces"] = traces
    return doc


def reconciled(doc: dict, tmp_path: Path):
    path = tmp_path / "wf.trace.json"
    path.write_text(json.dumps(doc, indent=2))  # indented, as the serializer writes it
    cfg = CollectorConfig()
    [run] = list(iter_runs(path, cfg.matcher()))
    return reconcile(run, cfg.scoring.policy())


def units(verdict) -> dict[str, tuple[str, int | None, int | None]]:
    return {e.executor_id: (e.verdict.value, e.evidence.framework_tokens, e.evidence.truth_tokens)
            for e in verdict.executors}


# --- AgentEval's own cases -------------------------------------------------------------------------

def test_matching_tokens_agree(tmp_path):
    v = reconciled(workflow([step("a", 10, 5, "stop")], {"a": chat(entry(tokens=15, finish="stop"))}), tmp_path)
    assert units(v) == {"a": ("Agree", 15, 15)}
    assert (v.score, v.status.value, v.exit_code) == (1.0, "PASS", 0)


def test_token_divergence_is_token_mismatch_and_fails(tmp_path):
    v = reconciled(workflow([step("a", 10, 5, "stop")], {"a": chat(entry(tokens=99, finish="stop"))}), tmp_path)
    assert units(v) == {"a": ("TokenMismatch", 15, 99)}
    assert v.executors[0].evidence.delta == -84
    assert (v.score, v.exit_code) == (0.5, 9)


@pytest.mark.parametrize(("framework", "truth", "verdict"), [
    ((60, 40), 99, "Agree"),            # over-reporting is not a deception
    ((600, 400), 1005, "Agree"),        # 0.5% short: rounding
    ((520, 350), 1000, "TokenMismatch"),  # 13% hidden
    ((49, 49), 100, "Agree"),           # exactly 2% short: strict, still within tolerance
    ((48, 49), 100, "TokenMismatch"),   # 3% short
    ((147, 0), 150, "Agree"),           # exactly 2% again, on a total that is not a round number
    ((146, 0), 150, "TokenMismatch"),
])
def test_tolerance_edges_both_ways(framework, truth, verdict, tmp_path):
    v = reconciled(workflow([step("a", *framework, "stop")], {"a": chat(entry(tokens=truth, finish="stop"))}),
                   tmp_path)
    assert units(v)["a"] == (verdict, sum(framework), truth)


def test_under_reported_tokens_and_suppressed_finish_are_both(tmp_path):
    v = reconciled(workflow([step("a", 520, 350, None)], {"a": chat(entry(tokens=1000, finish="content_filter"))}),
                   tmp_path)
    [a] = v.executors
    assert (a.verdict.value, a.score, a.evidence.framework_finish, a.evidence.truth_finish) == (
        "Both", 0.0, None, "content_filter")
    assert (v.status.value, v.exit_code) == ("FAIL", 9)


def test_suppressed_finish_is_finish_mismatch(tmp_path):
    v = reconciled(workflow([step("a", 10, 5, None)], {"a": chat(entry(tokens=15, finish="content_filter"))}),
                   tmp_path)
    assert units(v) == {"a": ("FinishMismatch", 15, 15)}
    assert v.exit_code == 9


def test_a_suppressed_final_finish_is_not_masked_by_an_earlier_step(tmp_path):
    """AgentEval takes the framework reason of the executor's last step, null included."""
    doc = workflow([step("a", 10, 5, "stop"), step("a", 10, 5, None, index=1)],
                   {"a": chat(entry(tokens=15, finish="stop"), entry(tokens=15, finish="content_filter"))})
    [a] = reconciled(doc, tmp_path).executors
    assert (a.verdict.value, a.evidence.framework_finish, a.evidence.truth_finish) == (
        "FinishMismatch", None, "content_filter")


def test_no_truth_is_excluded_from_the_mean_so_a_deception_is_not_diluted(tmp_path):
    doc = workflow([step("a", 520, 350, None), step("b", 10, 5, "stop", 1), step("c", 10, 5, "stop", 2),
                    step("d", 10, 5, "stop", 3)], {"a": chat(entry(tokens=1000, finish="content_filter"))})
    v = reconciled(doc, tmp_path)
    assert (v.score, v.checked, v.unchecked, v.exit_code) == (0.0, 1, 3, 9)
    assert v.coverage_note == "3 of 4 executor(s) had no chat-boundary truth; the score covers the 1 verified"


def test_a_chat_trace_without_responses_is_no_truth_not_a_zero_total(tmp_path):
    v = reconciled(workflow([step("a", 10, 5, "stop")], {"a": chat()}), tmp_path)
    [a] = v.executors
    assert (a.verdict.value, a.no_truth_reason.value, v.status.value, v.exit_code) == (
        "NoTruth", "no_chat_trace", "PENDING", 11)
    assert v.score is None


def test_no_executor_traces_is_pending_never_a_pass(tmp_path):
    v = reconciled(workflow([step("a", 10, 5, "stop")]), tmp_path)
    assert (units(v), v.status.value, v.exit_code) == ({"a": ("NoTruth", 15, None)}, "PENDING", 11)


def test_loops_sum_the_framework_tokens_per_executor(tmp_path):
    doc = workflow([step("a", 10, 5, "stop"), step("b", 20, 8, "stop", 1), step("a", 1, 1, "stop", 2)],
                   {"a": chat(entry(tokens=17, finish="stop")), "b": chat(entry(tokens=28, finish="stop"))})
    v = reconciled(doc, tmp_path)
    assert units(v) == {"a": ("Agree", 17, 17), "b": ("Agree", 28, 28)}
    assert v.executors[0].evidence.ledger_entries == 2


def test_a_warn_score_exits_ten(tmp_path):
    ids = "abcdef"
    doc = workflow([step(i, 10, 5, "stop", n) for n, i in enumerate(ids)],
                   {i: chat(entry(tokens=99 if i == "f" else 15, finish="stop")) for i in ids})
    v = reconciled(doc, tmp_path)
    assert units(v)["f"] == ("TokenMismatch", 15, 99)
    assert (round(v.score, 3), v.status.value, v.exit_code, v.coverage_note) == (0.917, "WARN", 10, None)


def test_partial_truth_withholds_a_pass(tmp_path):
    v = reconciled(workflow([step("a", 10, 5, "stop"), step("router", 0, 0, None, 1)],
                            {"a": chat(entry(tokens=15, finish="stop"))}), tmp_path)
    assert (v.score, v.status.value, v.exit_code) == (1.0, "WARN", 10)
    assert v.coverage_note == "1 of 2 executor(s) had no chat-boundary truth; a pass on the 1 verified is withheld"


def test_a_partly_checked_fail_says_what_its_score_covers(tmp_path):
    v = reconciled(workflow([step("a", 10, 5, "stop"), step("b", 10, 5, "stop", 1)],
                            {"a": chat(entry(tokens=99, finish="stop"))}), tmp_path)
    assert v.status.value == "FAIL"
    assert "1 of 2 executor(s) had no chat-boundary truth" in v.coverage_note


def test_executor_ids_group_case_insensitively_and_match_trace_keys(tmp_path):
    doc = workflow([step("Writer", 10, 5, "stop"), step("writer", 1, 1, "stop", 1)],
                   {"WRITER": chat(entry(tokens=17, finish="stop"))})
    v = reconciled(doc, tmp_path)
    assert units(v) == {"Writer": ("Agree", 17, 17)}  # one unit, first spelling, not double-counted


def test_the_last_of_a_case_collision_between_trace_keys_wins(tmp_path):
    doc = workflow([step("a", 10, 5, "stop")],
                   {"A": chat(entry(tokens=99, finish="stop")), "a": chat(entry(tokens=15, finish="stop"))})
    assert units(reconciled(doc, tmp_path)) == {"a": ("Agree", 15, 15)}


# --- shapes AgentEval's tests do not cover ---------------------------------------------------------

def test_request_response_pairs_are_answered_calls(tmp_path):
    doc = workflow([step("a", 30, 10, "stop")], {"a": chat(
        entry("Request", scope="ChatTurn"), entry(tokens=20, finish="tool_calls"),
        entry("Request", scope="ChatTurn"), entry(tokens=20, finish="stop"))})
    v = reconciled(doc, tmp_path)
    assert units(v) == {"a": ("Agree", 40, 40)}
    assert (v.exit_code, v.executors[0].evidence.request_turns, v.executors[0].evidence.response_turns) == (0, 0, 2)


def test_a_tool_loop_that_keeps_only_the_last_calls_usage_is_caught(tmp_path):
    """The agent/tool entries of a tool loop are not truth; the two chat turns are, and they sum."""
    loop = chat(
        entry("Request", scope="AgentInvocation"),
        entry("Request", scope="ChatTurn"), entry(tokens=300, finish="tool_calls"),
        entry("ToolCall", scope="ToolExecution"), entry("ToolCall", scope="ToolExecution"),
        entry("Request", scope="ChatTurn"), entry(tokens=120, finish="stop"),
        entry("Response", tokens=120, finish="stop", scope="AgentInvocation"),
    )
    v = reconciled(workflow([step("assistant", 100, 20, "stop")], {"assistant": loop}), tmp_path)
    [a] = v.executors
    assert (a.verdict.value, a.evidence.framework_tokens, a.evidence.truth_tokens, a.evidence.truth_finish) == (
        "TokenMismatch", 120, 420, "stop")
    assert v.exit_code == 9


def test_only_requests_is_the_path2_gap_not_a_pass(tmp_path):
    doc = workflow([step("a", 10, 5, "stop")], {"a": chat(entry("Request"), entry("Request"))})
    v = reconciled(doc, tmp_path)
    assert (v.executors[0].no_truth_reason.value, v.exit_code) == ("response_missing", 11)


def test_agent_scoped_or_unscoped_responses_are_not_truth(tmp_path):
    doc = workflow([step("a", 10, 5, "stop"), step("b", 10, 5, "stop", 1)], {
        "a": chat(entry(tokens=99, finish="stop", scope="AgentInvocation")),
        "b": chat(entry(tokens=99, finish="stop", scope=None)),
    })
    v = reconciled(doc, tmp_path)
    assert {e.executor_id: e.verdict.value for e in v.executors} == {"a": "NoTruth", "b": "NoTruth"}
    assert v.exit_code == 11


def test_error_responses_are_failed_turns_that_add_nothing(tmp_path):
    doc = workflow([step("a", 10, 5, "stop"), step("b", 10, 5, None, 1)], {
        "a": chat(entry(error={"type": "HttpRequestException", "message": "429"}),
                  entry(tokens=15, finish="stop")),
        "b": chat(entry(error={"type": "TimeoutException"})),
    })
    v = reconciled(doc, tmp_path)
    a, b = v.executors
    assert (a.verdict.value, a.evidence.truth_tokens, a.evidence.failed_turns) == ("Agree", 15, 1)
    # every call failed: checked against 0 tokens (AgentEval counts the response), never explained as Path-2
    assert (b.verdict.value, b.evidence.truth_tokens, b.evidence.failed_turns, b.no_truth_reason) == (
        "Agree", 0, 1, None)
    assert v.exit_code == 0


def test_an_error_response_with_usage_counts_its_tokens_as_agenteval_does(tmp_path):
    doc = workflow([step("a", 10, 5, "stop")], {"a": chat(entry(tokens=60, finish="length", error={"type": "X"}))})
    assert units(reconciled(doc, tmp_path)) == {"a": ("Both", 15, 60)}


@pytest.mark.parametrize(("kind", "scope"), [("Response", "ChatTurn"), ("response", "chatturn"),
                                             ("RESPONSE", "CHATTURN"), ("rEsPoNsE", "chatTurn"), (1, 1)])
def test_enum_names_are_read_in_any_case_or_by_number(kind, scope, tmp_path):
    doc = workflow([step("a", 10, 5, "stop")], {"a": chat(entry(kind, tokens=99, finish="stop", scope=scope))})
    assert units(reconciled(doc, tmp_path)) == {"a": ("TokenMismatch", 15, 99)}


def test_total_tokens_is_not_trusted_on_either_side(tmp_path):
    s = step("a", 10, 5, "stop")
    s["tokenUsage"]["totalTokens"] = 5000
    e = entry(tokens=15, finish="stop")
    e["tokenUsage"]["totalTokens"] = 1
    assert units(reconciled(workflow([s], {"a": chat(e)}), tmp_path)) == {"a": ("Agree", 15, 15)}


def test_a_trace_key_without_a_step_is_ignored_and_said(tmp_path):
    doc = workflow([step("a", 10, 5, "stop")], {"a": chat(entry(tokens=15, finish="stop")),
                                                  "ghost": chat(entry(tokens=900, finish="length"))})
    v = reconciled(doc, tmp_path)
    assert (units(v), v.exit_code) == ({"a": ("Agree", 15, 15)}, 0)
    assert v.notes == ("executorTraces['ghost'] has no step: ignored, not reconciled "
                       "(AgentEval reconciles the executors of steps only)",)


def test_a_step_without_token_usage_reports_zero(tmp_path):
    v = reconciled(workflow([step("a", None, None, "stop")], {"a": chat(entry(tokens=40, finish="stop"))}), tmp_path)
    assert units(v) == {"a": ("TokenMismatch", 0, 40)}


def test_unknown_keys_are_ignored(tmp_path):
    doc = workflow([{**step("a", 10, 5, "stop"), "parallelBranchId": "x", "future": [1]}],
                   {"a": {**chat(entry(tokens=15, finish="stop", providerMetadata={"k": 1})), "agentName": "w"}})
    doc["graph"] = {"nodes": ["a"], "edges": []}
    assert units(reconciled(doc, tmp_path)) == {"a": ("Agree", 15, 15)}


@pytest.mark.parametrize(("doc", "message"), [
    (workflow([step("a", 10, 5, "stop")], {"a": chat({"type": "Reply", "scope": "ChatTurn"})}),
     "$.executorTraces.a.entries[0].type: 'Reply' is not a TraceEntryType"),
    (workflow([step("a", 10, 5, "stop")], {"a": chat(entry(scope="Turn"))}),
     "$.executorTraces.a.entries[0].scope: 'Turn' is not a TraceEntryScope"),
    ({"steps": [{"executorId": "a", "tokenUsage": {"promptTokens": "ten"}}]},
     "$.steps[0].tokenUsage.promptTokens: 'ten' is not of type 'integer'"),
    ({"steps": [{"stepIndex": 0}]}, "$.steps[0]: 'executorId' is a required property"),
    ({"steps": {"a": 1}}, "$.steps: {'a': 1} is not of type 'array'"),
])
def test_invalid_files_name_the_json_path(doc, message, tmp_path):
    with pytest.raises(TraceFileError) as caught:
        reconciled(doc, tmp_path)
    assert message in str(caught.value) and "wf.trace.json" in str(caught.value)


def test_a_file_with_no_steps_says_so(tmp_path):
    with pytest.raises(NoSteps, match="no steps"):
        reconciled(workflow([], {}), tmp_path)


# --- the CLI, as AgentEval users run it ------------------------------------------------------------

def test_cli_token_mismatch_exits_nine_with_the_coverage_note(tmp_path):
    path = tmp_path / "t.trace.json"
    path.write_text(json.dumps(workflow([step("a", 10, 5, "stop"), step("b", 10, 5, "stop", 1)],
                                        {"a": chat(entry(tokens=99, finish="stop"))}), indent=2))
    proc = bench(path, tmp_path / "r.db")
    assert proc.returncode == 9, proc.stderr
    assert "1 of 2 executor(s) had no chat-boundary truth; the score covers the 1 verified" in proc.stdout
    as_json = bench(path, tmp_path / "r.db", "--json")
    [run] = json.loads(as_json.stdout)["runs"]
    assert run["coverage_note"].startswith("1 of 2 executor(s)")
    shown = subprocess.run([AGENTEVAL, "runs", "show", run["run_id"], "--store", str(tmp_path / "r.db")],
                           capture_output=True, text=True, timeout=60)
    assert "the score covers the 1 verified" in shown.stdout
    shown_json = subprocess.run([AGENTEVAL, "runs", "show", run["run_id"], "--json", "--store", str(tmp_path / "r.db")],
                                capture_output=True, text=True, timeout=60)
    assert json.loads(shown_json.stdout)["coverage_note"] == run["coverage_note"]


def test_cli_fixes_for_a_file_say_what_to_put_in_the_file(tmp_path):
    path = tmp_path / "t.trace.json"
    path.write_text(json.dumps(workflow([step("a", 10, 5, "stop"), step("router", 0, 0, None, 1)],
                                        {"a": chat(entry(tokens=15, finish="stop"))})))
    [run] = json.loads(bench(path, tmp_path / "r.db", "--json").stdout)["runs"]
    router = next(e for e in run["executors"] if e["executor_id"] == "router")
    assert router["no_truth_reason"] == "no_chat_trace"
    assert "executorTraces entries of scope ChatTurn and type Response" in router["no_truth_fix"]
    assert "instrument" not in router["no_truth_fix"]


def test_cli_reads_standard_input(tmp_path):
    doc = workflow([step("a", 10, 5, "stop")], {"a": chat(entry(tokens=15, finish="stop"))})
    proc = subprocess.run([AGENTEVAL, "bench", "workflow-trace-fidelity", "--workflow-trace", "-", "--subject", "ci",
                           "--store", str(tmp_path / "r.db"), "--json"],
                          input=json.dumps(doc), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["status"], out["runs"][0]["source"], out["runs"][0]["executors"][0]["verdict"]) == (
        "PASS", "stdin", "Agree")


def test_cli_says_a_directory_is_a_directory(tmp_path):
    proc = bench(tmp_path, tmp_path / "r.db")
    assert proc.returncode == 1
    assert f"{tmp_path}: is a directory" in proc.stderr and "no such file" not in proc.stderr


def test_cli_no_steps_is_pending_and_says_so(tmp_path):
    path = tmp_path / "empty.trace.json"
    path.write_text(json.dumps(workflow([])))
    proc = bench(path, tmp_path / "r.db")
    assert proc.returncode == 11
    assert "no steps" in proc.stderr and "span" not in proc.stderr + proc.stdout
    proc = bench(path, tmp_path / "r.db", "--json")
    assert (json.loads(proc.stdout)["runs"], proc.returncode) == ([], 11)


def test_cli_an_agent_trace_is_named_for_what_it_is(tmp_path):
    path = tmp_path / "agent.trace.json"
    path.write_text(json.dumps(chat(entry(tokens=15, finish="stop"))))
    proc = bench(path, tmp_path / "r.db")
    assert proc.returncode == 1
    assert "an AgentEval agent trace" in proc.stderr


def test_the_shipped_schema_accepts_every_agenteval_example():
    import jsonschema
    schema = json.loads((ROOT / "collector/schemas/agenteval-workflow-trace.schema.json").read_text())
    examples = [p for p in (ROOT / "examples").glob("*agenteval*.json")]
    assert len(examples) >= 4
    for p in examples:
        jsonschema.Draft202012Validator(schema).validate(json.loads(p.read_text()))


# --- workflow-trace/v1 requests (docs/design.md §2): the same call counted once, in our own format ----------

def v1(turns: list[dict]) -> dict:
    return {"schema": "workflow-trace/v1", "steps": [{"executor_id": "a", "input_tokens": 30, "output_tokens": 10,
                                                      "finish_reason": "stop"}],
            "executor_traces": {"a": {"turns": turns}}}


def resp(tokens: int, finish: str) -> dict:
    return {"kind": "response", "input_tokens": tokens, "output_tokens": 0, "finish_reason": finish}


def test_v1_request_response_pairs_are_answered_calls(tmp_path):
    v = reconciled(v1([{"kind": "request"}, resp(20, "tool_calls"), {"kind": "request"}, resp(20, "stop")]), tmp_path)
    assert (units(v), v.exit_code) == ({"a": ("Agree", 40, 40)}, 0)


def test_v1_an_unanswered_request_is_still_bare(tmp_path):
    v = reconciled(v1([{"kind": "request"}, resp(20, "tool_calls"), {"kind": "request"}]), tmp_path)
    [a] = v.executors
    assert (a.no_truth_reason.value, a.evidence.request_turns, v.exit_code) == ("partial_response", 1, 11)


def test_v1_a_request_answered_by_a_failure_is_a_failed_turn_not_path2(tmp_path):
    v = reconciled(v1([{"kind": "request"}, {"kind": "failed", "error": "429"}, {"kind": "request"},
                       resp(40, "stop")]), tmp_path)
    [a] = v.executors
    assert (a.verdict.value, a.evidence.failed_turns, a.evidence.request_turns) == ("Agree", 1, 0)
