"""Real MAF Python (agent-framework-core 1.23) workflows, the bridge, real OTLP exporters, and the
collector running as a subprocess."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest
from agent_framework import agent_middleware
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from collector.bridge import FidelityBridge
from collector.demo.maf_fakes import AgentSpec, Turn, chain, demo_workflows, under_report

from conftest import AGENTEVAL, CollectorProcess, export_spans, runs_of, verdicts

WORKFLOWS = {w.name: w for w in demo_workflows()}


@pytest.fixture(autouse=True)
def _telemetry(maf_spans):
    global MAF_SPANS
    MAF_SPANS = maf_spans


def run_workflow(workflow, stream: bool = False, bridge: FidelityBridge | None = None):
    bridge = bridge or FidelityBridge()
    MAF_SPANS.clear()

    async def go():
        if stream:
            return [event async for event in bridge.run(workflow, "Write a short report.", stream=True)]
        return await bridge.run(workflow, "Write a short report.")

    result = asyncio.run(go())
    return result, list(MAF_SPANS.get_finished_spans()), bridge.last_trace_id


@pytest.mark.parametrize("name", list(WORKFLOWS))
def test_real_maf_workflow_gets_the_expected_verdict(collector, capture, name):
    spec = WORKFLOWS[name]
    _, spans, trace_id = run_workflow(spec.build())
    export_spans(collector, spans, "http" if name == "agree" else "grpc")
    run = collector.run(trace_id)
    assert run["status"] == spec.status and verdicts(run) == spec.verdicts
    assert run["subject"] == name
    ledger_sources = {e["evidence"]["ledger_source"] for e in run["executors"]}
    assert ledger_sources == {"AgentResponseEvent"}
    (run_span,) = capture.wait_spans(trace_id, "fidelity.run", 1)
    status = next(kv.value.string_value for kv in run_span.attributes if kv.key == "fidelity.status")
    assert status == spec.status


def test_under_report_evidence_shows_both_numbers(collector):
    _, spans, trace_id = run_workflow(WORKFLOWS["under-report"].build())
    export_spans(collector, spans)
    writer = next(e for e in collector.run(trace_id)["executors"] if e["executor_id"] == "writer")
    ev = writer["evidence"]
    assert (ev["framework_tokens"], ev["truth_tokens"], ev["direction"]) == (600, 940, "under")
    assert ev["response_turns"] == 2 and len(ev["chat_span_ids"]) == 2


def test_path2_reasons_distinguish_missing_response_from_missing_chat(collector):
    _, spans, trace_id = run_workflow(WORKFLOWS["path2-pending"].build())
    export_spans(collector, spans)
    run = collector.run(trace_id)
    assert run["score"] is None
    assert {e["executor_id"]: e["no_truth_reason"] for e in run["executors"]} == {
        "researcher": "response_missing", "writer": "no_chat_trace"}


def test_streaming_run_gives_the_same_verdicts_as_the_plain_run(collector):
    spec = WORKFLOWS["agree"]
    _, plain_spans, plain_id = run_workflow(spec.build())
    _, stream_spans, stream_id = run_workflow(spec.build(), stream=True)
    export_spans(collector, plain_spans)
    export_spans(collector, stream_spans)
    plain, streamed = collector.run(plain_id), collector.run(stream_id)
    assert verdicts(streamed) == verdicts(plain) == spec.verdicts
    assert streamed["status"] == plain["status"] == "PASS"
    assert [e["evidence"]["framework_tokens"] for e in streamed["executors"]] == \
        [e["evidence"]["framework_tokens"] for e in plain["executors"]]


def test_streaming_loop_is_summed_per_invocation(collector):
    spec = WORKFLOWS["reviewer-loop"]
    _, spans, trace_id = run_workflow(spec.build(), stream=True)
    export_spans(collector, spans)
    run = collector.run(trace_id)
    (reviewer,) = run["executors"]
    assert reviewer["verdict"] == "Agree" and reviewer["evidence"]["ledger_entries"] == 3
    assert reviewer["evidence"]["aligned"] is True


def test_bridge_does_not_change_what_the_caller_receives():
    def shape(events):
        return [(e.type, e.executor_id, getattr(e.data, "text", None)) for e in events]

    async def bare(stream):
        wf = WORKFLOWS["agree"].build()
        if stream:
            return [e async for e in wf.run("Write a short report.", stream=True)]
        return await wf.run("Write a short report.")

    for stream in (False, True):
        plain = asyncio.run(bare(stream))
        bridged, _, _ = run_workflow(WORKFLOWS["agree"].build(), stream=stream)
        assert type(bridged) is type(plain)
        assert shape(bridged) == shape(plain)


def test_bridge_with_the_callers_own_tracer_provider(collector):
    # The parent span goes to the bridge's provider; ledger spans to the provider the (process-wide)
    # instrumentation was given; all share the run's trace.
    own = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(own))
    wf = chain("own-provider", [AgentSpec("solo", [Turn(50, 5)])])
    _, maf_spans, trace_id = run_workflow(wf, bridge=FidelityBridge(tracer_provider=provider))
    bridge_spans = list(own.get_finished_spans())
    assert "workflow.fidelity own-provider" in [s.name for s in bridge_spans]
    assert [s.name for s in maf_spans + bridge_spans].count("agent_response solo") == 1
    assert all(format(s.context.trace_id, "032x") == trace_id for s in maf_spans if s.name != "workflow.build")
    export_spans(collector, maf_spans + bridge_spans)
    assert verdicts(collector.run(trace_id)) == {"solo": "Agree"}


def test_mafs_separate_build_trace_is_counted_as_ignored_not_stored(tmp_path):
    """MAF exports ``workflow.build`` in a trace of its own, in which no agent runs: not a run, and
    counted in agenteval_traces_ignored_total (one per such trace), beside the run it built."""
    proc = CollectorProcess(tmp_path)
    try:
        MAF_SPANS.clear()
        workflow = chain("built", [AgentSpec("solo", [Turn(50, 5)])])
        built = list(MAF_SPANS.get_finished_spans())
        _, maf_spans, trace_id = run_workflow(workflow)
        build = {format(s.context.trace_id, "032x") for s in built if s.name == "workflow.build"}
        assert build and trace_id not in build
        export_spans(proc, built + maf_spans)
        assert verdicts(proc.run(trace_id)) == {"solo": "Agree"}
        deadline = time.monotonic() + 15
        while proc.metrics().get(("agenteval_traces_ignored_total", ()), 0) < len(build):
            assert time.monotonic() < deadline, "the build trace was not counted as ignored"
            time.sleep(0.1)
        time.sleep(1)  # nothing more is counted, and nothing of it is stored
        assert proc.metrics()[("agenteval_traces_ignored_total", ())] == len(build)
        assert [run["trace_id"] for run in proc.store().list_runs()] == [trace_id]
    finally:
        proc.stop()


def test_agenteval_demo_shows_every_status(collector):
    proc = subprocess.run([AGENTEVAL, "demo", "--endpoint", collector.grpc, "--timeout", "30"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for status in ("PASS", "FAIL", "WARN", "PENDING"):
        assert status in proc.stdout
    assert "response_missing" in proc.stdout and "no_chat_trace" in proc.stdout


def test_breaking_out_of_a_bridged_stream_early_ends_its_span_so_the_verdict_is_prompt(collector):
    bridge = FidelityBridge()
    MAF_SPANS.clear()

    async def go():
        stream = bridge.run(WORKFLOWS["agree"].build(), "Write a short report.", stream=True)
        async for event in stream:
            if getattr(event, "type", None) == "output":
                break  # the caller has what it wanted; it never closes the stream

    asyncio.run(go())
    import gc

    gc.collect()
    spans = list(MAF_SPANS.get_finished_spans())
    assert any(s.name == "workflow.fidelity agree" for s in spans)  # ended although never closed
    export_spans(collector, spans)
    run = collector.run(bridge.last_trace_id, timeout=10)  # collector max_trace_wait is 2 s: well before
    assert run["incomplete"] is False
    assert verdicts(run)["researcher"] == "Agree"


def test_bridge_runs_a_workflow_as_agent(collector):
    bridge = FidelityBridge()
    MAF_SPANS.clear()
    wf = chain("as-agent", [AgentSpec("drafter", [Turn(120, 30)]),
                            AgentSpec("editor", [Turn(200, 20)], middleware=[under_report(0.5)])])
    response = asyncio.run(bridge.run(wf.as_agent(name="pipeline"), "Write a short report."))
    assert response.messages  # what WorkflowAgent.run returns, untouched
    export_spans(collector, list(MAF_SPANS.get_finished_spans()))
    run = collector.run(bridge.last_trace_id)
    assert verdicts(run) == {"drafter": "Agree", "editor": "TokenMismatch"}  # inner agents; the wrapper is no unit
    editor = next(e for e in run["executors"] if e["executor_id"] == "editor")
    assert (editor["evidence"]["framework_tokens"], editor["evidence"]["truth_tokens"]) == (110, 220)


def _traced(work) -> tuple[list, str]:
    """Run ``work()`` (a coroutine function) under an application span, as an app's request handler
    does; return the spans and their trace id."""
    MAF_SPANS.clear()
    with trace.get_tracer("app").start_as_current_span("main") as main:
        asyncio.run(work())
    return list(MAF_SPANS.get_finished_spans()), format(main.get_span_context().trace_id, "032x")


def _only_call(n: int, middleware):
    """Agent middleware applying ``middleware`` to the agent's ``n``-th invocation only."""
    calls = {"n": 0}

    @agent_middleware
    async def nth(context, call_next) -> None:
        calls["n"] += 1
        await (middleware(context, call_next) if calls["n"] == n else call_next())

    return nth


def test_agents_named_with_a_space_a_hyphen_a_dot_or_an_underscore_are_units_by_those_names(collector):
    """The names .NET users give too (tests/test_dotnet_captures.py holds MAF .NET's own): on both
    runtimes a unit is named by its agent's name, and the lie is caught in the agent that told it."""
    names = ("Research Agent", "code-writer", "review.bot", "data_loader")
    specs = [AgentSpec(n, [Turn(100 * (i + 1), 20)], middleware=[under_report(0.5)] if n == "code-writer" else ())
             for i, n in enumerate(names)]
    workflow = chain("named-agents", specs)
    spans, trace_id = _traced(lambda: workflow.run("Write a short report."))
    export_spans(collector, spans)
    (run,) = runs_of(collector, [trace_id])
    assert verdicts(run) == {"Research Agent": "Agree", "code-writer": "TokenMismatch", "review.bot": "Agree",
                             "data_loader": "Agree"}
    writer = next(e for e in run["executors"] if e["executor_id"] == "code-writer")
    assert (writer["evidence"]["framework_tokens"], writer["evidence"]["truth_tokens"]) == (110, 220)
    assert (run["status"], run["score"], run["non_agent_executors"]) == ("WARN", 0.875, [])


@pytest.mark.parametrize("wrapped", [False, True], ids=["called-directly", "inside-its-own-agent-span"])
def test_a_workflow_agent_called_over_three_turns_is_judged_by_its_agents_in_one_run_a_turn(collector, wrapped):
    """workflow.as_agent() over three turns of one session, as MAF's WorkflowAsAnAgent sample runs it;
    wrapped: each turn inside an ``invoke_agent`` span of the workflow agent's own (what a host or
    .NET's OpenTelemetryAgent records; its usage would be the inner agents' sum). Either way: three
    runs judged by the workflow's agents, the lie of turn 2 caught there, and no run or unit for the
    workflow agent itself."""
    workflow = chain("wf-agent", [AgentSpec("French Agent", [Turn(150, 10)] * 3),
                                  AgentSpec("english.agent", [Turn(160, 20)] * 3,
                                            middleware=[_only_call(2, under_report(0.6))])])
    workflow_agent = workflow.as_agent(name="Workflow Agent")
    tracer = trace.get_tracer("app")

    async def turns() -> None:
        session = workflow_agent.create_session()
        for turn in range(3):
            if wrapped:
                with tracer.start_as_current_span("invoke_agent Workflow Agent", attributes={
                        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "Workflow Agent",
                        "gen_ai.usage.input_tokens": 310, "gen_ai.usage.output_tokens": 30}):
                    await workflow_agent.run(f"turn {turn}", session=session)
            else:
                await workflow_agent.run(f"turn {turn}", session=session)

    spans, trace_id = _traced(turns)
    export_spans(collector, spans)
    runs = sorted(runs_of(collector, [trace_id]), key=lambda r: r["started_at"])
    honest = {"French Agent": "Agree", "english.agent": "Agree"}
    assert [(r["status"], verdicts(r)) for r in runs] == [
        ("PASS", honest), ("FAIL", {"French Agent": "Agree", "english.agent": "TokenMismatch"}), ("PASS", honest)]
    english = next(e for e in runs[1]["executors"] if e["executor_id"] == "english.agent")
    assert (english["evidence"]["framework_tokens"], english["evidence"]["truth_tokens"]) == (108, 180)
    wrapper_notes = [any("ran inside the agent 'Workflow Agent'" in n for n in r["notes"]) for r in runs]
    assert wrapper_notes == [wrapped] * 3
