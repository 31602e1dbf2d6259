"""Every common MAF Python pattern (agent-framework-core 1.23, agent-framework-orchestrations 1.4) on
scripted clients stacked like provider clients, with the fidelity instrumentation and no call-site
change, exported over real OTLP to a running collector: per-unit verdicts and numbers, plain and
streaming, and real divergences caught with the right unit named."""

from __future__ import annotations

import asyncio

import pytest

from collector.demo.maf_fakes import drop_finish_reason, under_report

from conftest import export_spans
from maf_patterns import PATTERNS, Pattern, drive

#: What a user should see besides the agents: executors in which no agent ran, never reconciled.
NON_AGENT = {
    "sequential": ["input-conversation"],
    "sequential_all": ["input-conversation"],
    "concurrent": ["aggregator", "dispatcher"],
    "fan_in_graph": ["merge"],
    "handoff": ["refunds"],  # idle participant
    "group_chat_round_robin": ["group_chat_orchestrator"],
    "group_chat_manager": [],
    "magentic": [],
    "sub_workflow": ["drafting", "publish"],
    "agent_as_tool": [],
    "human_in_the_loop": None,  # checked in its own test
    "failing_call": ["input-conversation"],
    "as_agent": ["input-conversation"],
    "direct_agent": [],
}


def unit_name(agent: str, executor: str | None) -> str:
    if executor is None or executor.casefold() == agent.casefold():
        return executor or agent
    return f"{executor}/{agent}"


def run_pattern(maf_spans, collector, pattern: Pattern, stream: bool, overrides=None) -> list[dict]:
    """Drive the pattern, export its spans over OTLP, return the stored runs (one per trace with an agent)."""
    maf_spans.clear()
    turns = asyncio.run(drive(pattern, pattern.build(overrides), stream))
    assert pattern.fails_with or not any(t.error for t in turns), [t.error for t in turns]
    spans = list(maf_spans.get_finished_spans())
    export_spans(collector, spans)
    traces = list(dict.fromkeys(format(s.context.trace_id, "032x") for s in spans
                                if s.name.startswith("invoke_agent")))
    return [collector.run(trace_id) for trace_id in traces]


def unit(run: dict, name: str) -> dict:
    return next(e for e in run["executors"] if e["executor_id"] == name)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("name", [n for n in PATTERNS if n not in ("human_in_the_loop", "failing_call")])
def test_every_agent_is_its_own_unit_and_agreement_passes(maf_spans, collector, name, stream):
    pattern = PATTERNS[name]
    (run,) = run_pattern(maf_spans, collector, pattern, stream)
    expected = {unit_name(a, f.executor_id): f for a, f in pattern.agents.items() if f.run_turn}
    assert {e["executor_id"]: e["verdict"] for e in run["executors"]} == {u: "Agree" for u in expected}
    for name_, facts in expected.items():
        ev = unit(run, name_)["evidence"]
        tokens = facts.input_tokens + facts.output_tokens
        assert (ev["framework_tokens"], ev["truth_tokens"], ev["response_turns"]) == (tokens, tokens, facts.chat_calls)
        assert ev["ledger_source"] == "AgentResponseEvent" and ev["truth_finish"] == facts.finish_reason
    assert run["status"] == "PASS" and run["score"] == 1.0 and run["workflow_errors"] == []
    assert run["non_agent_executors"] == NON_AGENT[name]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_human_in_the_loop_turns_are_runs_of_their_own_and_a_turn_without_agents_is_none(maf_spans, collector, stream):
    pattern = PATTERNS["human_in_the_loop"]
    runs = run_pattern(maf_spans, collector, pattern, stream)
    assert [{e["executor_id"]: e["verdict"] for e in r["executors"]} for r in runs] == [
        {"writer": "Agree"}, {"editor": "Agree"}]  # turn 3 ran no agent: not a run, not PENDING
    assert [r["status"] for r in runs] == ["PASS", "PASS"]
    assert unit(runs[1], "editor")["evidence"]["truth_tokens"] == 760
    assert all(r["run_id"].startswith(r["trace_id"] + "-") for r in runs)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_failed_chat_call_is_a_failed_turn_and_a_workflow_error_never_path2(maf_spans, collector, stream):
    (run,) = run_pattern(maf_spans, collector, PATTERNS["failing_call"], stream)
    writer = unit(run, "writer")
    assert (writer["verdict"], writer["no_truth_reason"]) == ("NoTruth", "ledger_missing")
    assert writer["evidence"]["failed_turns"] == 1 and writer["evidence"]["request_turns"] == 0
    assert "Path-2" not in writer["no_truth_explanation"]
    assert unit(run, "researcher")["verdict"] == "Agree"
    assert run["status"] == "WARN"  # one unit checked and agreeing, one that could not be checked
    assert any("ChatClientException" in e for e in run["workflow_errors"])
    assert any(e.startswith("writer: ") for e in run["workflow_errors"])


# --- real divergences: caught, with the unit named ------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_under_reporting_hidden_participants_fail_the_run(maf_spans, collector, stream):
    # Default outputs: only the last participant's response is a workflow output; the others are hidden.
    pattern = PATTERNS["sequential"]
    (run,) = run_pattern(maf_spans, collector, pattern, stream, {
        "researcher": {"middleware": [under_report(0.5)]}, "writer": {"middleware": [under_report(0.5)]}})
    assert {e["executor_id"]: e["verdict"] for e in run["executors"]} == {
        "researcher": "TokenMismatch", "writer": "TokenMismatch", "reviewer": "Agree"}
    researcher = unit(run, "researcher")["evidence"]
    assert (researcher["framework_tokens"], researcher["truth_tokens"], researcher["direction"]) == (300, 600, "under")
    writer = unit(run, "writer")["evidence"]
    assert (writer["framework_tokens"], writer["truth_tokens"]) == (650, 1300)
    assert run["status"] == "FAIL" and run["score"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_an_under_reporting_manager_agent_is_caught_on_its_own_unit(maf_spans, collector, stream):
    (run,) = run_pattern(maf_spans, collector, PATTERNS["group_chat_manager"], stream,
                         {"moderator": {"middleware": [under_report(0.5), drop_finish_reason()]}})
    moderator = unit(run, "moderator")
    assert moderator["verdict"] == "Both"
    assert (moderator["evidence"]["framework_tokens"], moderator["evidence"]["truth_tokens"]) == (528, 1056)
    assert moderator["evidence"]["ledger_entries"] == 3  # one per manager call, summed
    assert {unit(run, e)["verdict"] for e in ("expert_a", "expert_b")} == {"Agree"}
    assert run["status"] == "FAIL"
    # Magentic: the manager runs inside the orchestrator executor, so it is `executor/agent`.
    (magentic,) = run_pattern(maf_spans, collector, PATTERNS["magentic"], stream,
                              {"manager": {"middleware": [under_report(0.5)]}})
    manager = unit(magentic, "magentic_orchestrator/manager")
    assert manager["verdict"] == "TokenMismatch" and manager["evidence"]["truth_tokens"] == 5646
    assert manager["evidence"]["framework_tokens"] < manager["evidence"]["truth_tokens"] * 0.6
    assert magentic["status"] == "WARN" and magentic["score"] == pytest.approx(5 / 6)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_an_under_reporting_agent_used_as_a_tool_is_caught_and_its_caller_is_not_blamed(maf_spans, collector, stream):
    (run,) = run_pattern(maf_spans, collector, PATTERNS["agent_as_tool"], stream,
                         {"calculator": {"middleware": [under_report(0.5)]}})
    calculator = unit(run, "assistant/calculator")
    assert calculator["verdict"] == "TokenMismatch"
    assert (calculator["evidence"]["framework_tokens"], calculator["evidence"]["truth_tokens"]) == (137, 275)
    assistant = unit(run, "assistant")  # the nested call is not in the caller's truth
    assert assistant["verdict"] == "Agree" and assistant["evidence"]["truth_tokens"] == 990
    assert run["status"] == "FAIL" and run["score"] == 0.75


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_suppressed_finish_inside_a_sub_workflow_names_the_inner_units(maf_spans, collector, stream):
    (run,) = run_pattern(maf_spans, collector, PATTERNS["sub_workflow"], stream,
                         {"drafter": {"middleware": [drop_finish_reason()]},
                          "editor": {"middleware": [drop_finish_reason()]}})
    assert {e["executor_id"]: e["verdict"] for e in run["executors"]} == {
        "scout": "Agree", "drafter": "FinishMismatch", "editor": "FinishMismatch"}
    editor = unit(run, "editor")["evidence"]
    assert (editor["framework_finish"], editor["truth_finish"]) == (None, "stop")
    assert run["status"] == "FAIL" and run["non_agent_executors"] == ["drafting", "publish"]


def test_without_the_instrumentation_a_real_under_report_is_never_a_pass(maf_spans, collector):
    # MAF Python's invoke_agent re-sums its chat spans: on that ledger alone this run would PASS.
    from opentelemetry.instrumentation.maf_fidelity import MafFidelityInstrumentor

    instrumentor = MafFidelityInstrumentor()
    instrumentor.uninstrument()
    try:
        (run,) = run_pattern(maf_spans, collector, PATTERNS["sequential"], False,
                             {"writer": {"middleware": [under_report(0.5)]}})
    finally:
        instrumentor.instrument()
    assert run["status"] == "PENDING" and run["score"] is None
    assert {e["executor_id"]: e["no_truth_reason"] for e in run["executors"]} == {
        "researcher": "ledger_derived", "writer": "ledger_derived", "reviewer": "ledger_derived"}
    assert "MafFidelityInstrumentor" in unit(run, "writer")["no_truth_fix"]


def test_run_page_and_runs_show_explain_units_non_agent_executors_and_workflow_errors(maf_spans, collector):
    import subprocess
    import urllib.request

    from conftest import AGENTEVAL

    (run,) = run_pattern(maf_spans, collector, PATTERNS["failing_call"], False)
    page = urllib.request.urlopen(f"{collector.http}/runs/{run['run_id']}", timeout=10).read().decode()
    assert "Agent units" in page and "executor/agent" in page
    assert 'id="non-agent">input-conversation' in page and "no agent ran" in page
    assert "The workflow itself raised errors" in page and "ChatClientException" in page
    assert "ledger_missing" in page and "1 of its chat call(s) failed" in page
    shown = subprocess.run([AGENTEVAL, "runs", "show", run["run_id"], "--store", str(collector.store_path)],
                           capture_output=True, text=True, timeout=60)
    assert "not reconciled (no agent ran): input-conversation" in shown.stdout
    assert "workflow error (not scored): writer: ChatClientException" in shown.stdout
    assert "(1 chat call(s) failed)" in shown.stdout and "checked 1/2 agent units" in shown.stdout
    (tool,) = run_pattern(maf_spans, collector, PATTERNS["agent_as_tool"], False)
    page = urllib.request.urlopen(f"{collector.http}/runs/{tool['run_id']}", timeout=10).read().decode()
    assert 'data-executor="assistant/calculator"' in page
