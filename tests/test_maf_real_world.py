"""Real-world MAF Python shapes (agent-framework-core 1.23, orchestrations 1.4) that the builder
patterns do not cover, exported over real OTLP to a running collector: what a user sees per unit
and per run (docs/design.md §1, §3)."""

from __future__ import annotations

import asyncio
import gc
import re
from typing import Any

import pytest
from opentelemetry import trace

from collector.demo.maf_fakes import under_report

import maf_real_world as rw
from conftest import export_spans, runs_of

STREAM = pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
UUID_LIKE = re.compile(r"[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}", re.IGNORECASE)


# --- driving and reading back -------------------------------------------------------------------

async def _run(target: Any, stream: bool, task: str = rw.TASK) -> Any:
    """``target.run(task)`` (a workflow or an agent) to completion, plain or streamed."""
    if stream:
        response_stream = target.run(task, stream=True)
        async for _ in response_stream:
            pass
        return await response_stream.get_final_response()
    return await target.run(task)


def drive(maf_spans, target: Any, stream: bool) -> list[Any]:
    """Run ``target`` on cleared MAF telemetry; the finished SDK spans."""
    maf_spans.clear()
    asyncio.run(_run(target, stream))
    return list(maf_spans.get_finished_spans())


def trace_ids(spans: list[Any], prefix: str = "invoke_agent") -> list[str]:
    return list(dict.fromkeys(format(s.context.trace_id, "032x") for s in spans if s.name.startswith(prefix)))


def one_run(maf_spans, collector, target: Any, stream: bool) -> dict:
    """Drive ``target``, export its spans over OTLP, and return THE run of its traces (exactly one)."""
    spans = drive(maf_spans, target, stream)
    export_spans(collector, spans)
    runs = runs_of(collector, trace_ids(spans))
    assert len(runs) == 1, [(r["run_id"], verdicts(r)) for r in runs]
    return runs[0]


def verdicts(run: dict) -> dict[str, str]:
    return {e["executor_id"]: e["verdict"] for e in run["executors"]}


def unit(run: dict, name: str) -> dict:
    return next(e for e in run["executors"] if e["executor_id"] == name)


def numbers(run: dict, name: str) -> tuple:
    ev = unit(run, name)["evidence"]
    return ev["framework_tokens"], ev["truth_tokens"]


# --- 1a. one AgentResponse, several invocations: AgentLoopMiddleware -----------------------------

@pytest.mark.parametrize("return_final_only", [False, True], ids=["aggregated", "final_only"])
@STREAM
def test_a_loop_middleware_that_keeps_only_the_last_usage_is_a_token_mismatch(
        maf_spans, collector, stream, return_final_only):
    # Three iterations (length, length, stop) inside ONE agent call: the ledger is the one response
    # the caller received, its truth every iteration's chat call. MAF returns the aggregated usage
    # only for a plain run without return_final_only; a streamed loop's final response is always the
    # last iteration's.
    run = one_run(maf_spans, collector, rw.loop_workflow(return_final_only=return_final_only), stream)
    aggregated = not stream and not return_final_only
    framework = rw.LOOP_TOKENS if aggregated else rw.LOOP_LAST_TOKENS  # 2000, or 530 of 2000
    drafter = unit(run, "drafter")
    ev = drafter["evidence"]
    assert (drafter["verdict"], ev["framework_tokens"], ev["truth_tokens"]) == (
        "Agree" if aggregated else "TokenMismatch", framework, rw.LOOP_TOKENS)
    assert (ev["ledger_entries"], ev["response_turns"]) == (1, 3)
    assert not drafter["finish_diverged"]  # never `stop` against iteration 1's `length`
    assert (ev["framework_finish"], ev["truth_finish"]) == ("stop", "stop")
    if aggregated:
        assert run["status"] == "PASS" and run["score"] == 1.0
    else:
        assert ev["direction"] == "under"
        assert run["status"] == "FAIL" and run["score"] == 0.5
    assert run["non_agent_executors"] == []


@STREAM
def test_a_direct_agent_loop_whose_iterations_start_new_traces_is_one_run(maf_spans, collector, stream):
    # agent.run with no span around it: MAF would start a new trace for each loop iteration (each
    # call_next() a root invoke_agent span); the caller still received ONE response, so the
    # instrumentation keeps the call's trace: the re-runs join its first invoke_agent span.
    spans = drive(maf_spans, rw.looping_drafter(), stream)
    traces = trace_ids(spans)
    assert len(traces) == 1
    assert [s.name for s in spans].count("invoke_agent drafter") == 3
    export_spans(collector, spans)
    runs = runs_of(collector, traces)
    assert [verdicts(r) for r in runs] == [{"drafter": "Agree" if not stream else "TokenMismatch"}]
    (run,) = runs
    ev = unit(run, "drafter")["evidence"]
    assert (ev["response_turns"], ev["truth_tokens"]) == (3, rw.LOOP_TOKENS)
    assert ev["framework_tokens"] == (rw.LOOP_LAST_TOKENS if stream else rw.LOOP_TOKENS)
    assert (ev["framework_finish"], ev["truth_finish"]) == ("stop", "stop")


# --- 1b. a tool approval that re-runs the agent inside one agent call --------------------------

APPROVERS = pytest.mark.parametrize("approver,stream", [
    (lambda: rw.ApproveAndRerun(), False),  # a custom agent middleware calling call_next() twice
    (rw.auto_approval, True),  # MAF's ToolApprovalMiddleware (its streamed response sums both runs)
], ids=["call_next_twice-plain", "ToolApprovalMiddleware-stream"])


@APPROVERS
def test_an_approval_rerun_is_checked_against_every_model_call_of_the_agent_call(
        maf_spans, collector, approver, stream):
    run = one_run(maf_spans, collector, rw.approval_workflow([approver()]), stream)
    mailer = unit(run, "mailer")
    ev = mailer["evidence"]
    assert mailer["verdict"] == "Agree", (mailer["verdict"], ev["finish_comparisons"])
    assert (ev["framework_tokens"], ev["truth_tokens"], ev["response_turns"]) == (1000, rw.APPROVAL_TOKENS, 2)
    assert (ev["framework_finish"], ev["truth_finish"]) == ("stop", "stop")  # not the first run's tool_calls
    assert run["status"] == "PASS"

    # The same agent call under-reporting 40%: caught on that unit.
    run = one_run(maf_spans, collector, rw.approval_workflow([under_report(0.6), approver()]), stream)
    mailer = unit(run, "mailer")
    assert mailer["verdict"] == "TokenMismatch"
    assert numbers(run, "mailer") == (600, 1000) and mailer["evidence"]["direction"] == "under"
    assert run["status"] == "FAIL" and run["score"] == 0.5


def test_tool_approval_middlewares_plain_response_losing_the_first_run_is_a_token_mismatch(maf_spans, collector):
    # MAF's ToolApprovalMiddleware, non-streaming: the caller's response is the re-run's own (660),
    # the first run's chat call (340) is in nobody's usage. A real under-report, and only that.
    run = one_run(maf_spans, collector, rw.approval_workflow([rw.auto_approval()]), False)
    mailer = unit(run, "mailer")
    assert mailer["verdict"] == "TokenMismatch" and not mailer["finish_diverged"]
    assert numbers(run, "mailer") == (rw.APPROVAL_RERUN_TOKENS, rw.APPROVAL_TOKENS)  # (660, 1000)
    assert (mailer["evidence"]["framework_finish"], mailer["evidence"]["truth_finish"]) == ("stop", "stop")


# --- 2. partial usage ----------------------------------------------------------------------------

@STREAM
def test_output_only_usage_is_summed_and_an_under_report_of_it_is_caught(maf_spans, collector, stream):
    run = one_run(maf_spans, collector, rw.output_only_workflow(), stream)
    assert verdicts(run) == {"researcher": "Agree", "writer": "Agree"}
    assert numbers(run, "researcher") == (rw.RESEARCHER_TOKENS, rw.RESEARCHER_TOKENS)  # 430: 340 + 90 output-only
    assert numbers(run, "writer") == (rw.WRITER_TOKENS, rw.WRITER_TOKENS)  # 250, input unknown counts 0
    assert run["status"] == "PASS" and run["score"] == 1.0

    run = one_run(maf_spans, collector, rw.output_only_workflow([under_report(0.6)]), stream)
    assert verdicts(run) == {"researcher": "Agree", "writer": "TokenMismatch"}
    assert numbers(run, "writer") == (150, 250)
    assert run["status"] == "FAIL" and run["score"] == 0.75  # never a PASS with the writer's truth unknown


@STREAM
def test_responses_without_token_counts_are_usage_missing_or_partial_never_agree(maf_spans, collector, stream):
    run = one_run(maf_spans, collector, rw.missing_usage_workflow(), stream)
    assert verdicts(run) == {"planner": "Agree", "narrator": "NoTruth", "fact_checker": "NoTruth"}
    assert unit(run, "narrator")["no_truth_reason"] == "usage_missing"  # no call of it counted tokens
    assert unit(run, "fact_checker")["no_truth_reason"] == "partial_response"  # one of its two did
    assert unit(run, "narrator")["evidence"]["truth_finish"] == "stop"
    assert run["status"] == "WARN" and run["score"] == 1.0


# --- 3. an executor that calls a chat client itself ----------------------------------------------

@STREAM
def test_an_aggregator_calling_a_chat_client_itself_is_noted_and_not_a_unit(maf_spans, collector, stream):
    run = one_run(maf_spans, collector, rw.summarizing_concurrent_workflow(), stream)
    assert verdicts(run) == {"analyst": "Agree", "critic": "Agree"}
    assert run["unattributed_chat"] == [{"executor": "summarize", "calls": 1, "tokens": rw.SUMMARY_TOKENS}]
    assert run["status"] == "PASS" and run["score"] == 1.0
    assert run["non_agent_executors"] == ["dispatcher", "summarize"]


# --- 4. an agent its middleware answered without a model call ------------------------------------

@pytest.mark.parametrize("terminate", [False, True], ids=["answers", "answers_and_terminates"])
@STREAM
def test_an_agent_its_middleware_answered_is_not_scored_and_listed_with_idle_participants(
        maf_spans, collector, stream, terminate):
    run = one_run(maf_spans, collector, rw.guarded_workflow(terminate=terminate), stream)
    assert verdicts(run) == {"writer": "Agree"}
    assert run["non_agent_executors"] == ["guard", "input-conversation"]
    assert run["status"] == "PASS" and run["score"] == 1.0

    # The same canned answer claiming tokens no model call produced: a unit without chat truth.
    run = one_run(maf_spans, collector, rw.guarded_workflow(terminate=terminate, usage=rw.GUARD_REPORTED), stream)
    assert verdicts(run) == {"guard": "NoTruth", "writer": "Agree"}
    assert unit(run, "guard")["no_truth_reason"] == "no_chat_trace"
    assert unit(run, "guard")["evidence"]["framework_tokens"] == 57
    assert run["non_agent_executors"] == ["input-conversation"] and run["status"] == "WARN"


# --- 5, 6. unit names ----------------------------------------------------------------------------

@STREAM
def test_unnamed_agents_are_named_by_their_executor_and_the_same_in_every_run(maf_spans, collector, stream):
    seen = []
    for _ in range(2):  # fresh workflow, agents and clients each time: new MAF agent ids
        run = one_run(maf_spans, collector, rw.unnamed_agents_workflow(), stream)
        names = sorted(verdicts(run))
        assert not [n for n in names if UUID_LIKE.search(n)], names
        assert run["subject"] and not UUID_LIKE.search(run["subject"]), run["subject"]
        assert set(verdicts(run).values()) == {"Agree"} and run["status"] == "PASS"
        seen.append(names)
    # the tool agent is known by its MAF id, not its class (issue 58): numbered with the two unnamed
    # agents that ran before it (shown by their executors' ids), never the uuid
    assert seen[0] == seen[1] == ["assistant", "assistant/unnamed-agent-1", "draft"]


def test_an_agent_executor_subclass_hosting_its_agent_is_named_by_its_executor_id(maf_spans, collector):
    run = one_run(maf_spans, collector, rw.review_step_workflow(), False)
    assert verdicts(run) == {"writer": "Agree", "step-2": "Agree"}
    assert numbers(run, "step-2") == (790, 790)
    assert run["status"] == "PASS"


# --- 7. caller-side ledger spans (the seed's shape) ----------------------------------------------

async def _run_with_caller_ledger(workflow: Any, tracer: Any, under: dict[str, float]) -> None:
    """A caller that records each AgentResponse the workflow yields under its own span (the seed's
    shape): ``agent_response {executor}`` spans naming ``executor.id``, no ``gen_ai.agent.name``."""
    from agent_framework import AgentResponse

    with tracer.start_as_current_span("handle_request"):
        result = await workflow.run(rw.TASK)
        for event in result:
            if getattr(event, "type", None) != "output" or not isinstance(event.data, AgentResponse):
                continue
            usage = event.data.usage_details or {}
            fraction = under.get(event.executor_id, 1.0)
            attrs = {"fidelity.ledger.source": "AgentResponseEvent", "executor.id": event.executor_id,
                     "gen_ai.usage.input_tokens": int(usage["input_token_count"] * fraction),
                     "gen_ai.usage.output_tokens": int(usage["output_token_count"] * fraction)}
            if event.data.finish_reason is not None:
                attrs["gen_ai.response.finish_reasons"] = [str(getattr(event.data.finish_reason, "value",
                                                                       event.data.finish_reason))]
            tracer.start_span(f"agent_response {event.executor_id}", attributes=attrs).end()


@pytest.mark.parametrize("under", [{}, {"writer": 0.5}], ids=["agreeing", "writer_under_reports"])
def test_caller_side_ledger_spans_beside_the_workflow_join_its_one_run(maf_spans, collector, under):
    from opentelemetry.instrumentation.maf_fidelity import MafFidelityInstrumentor

    instrumentor = MafFidelityInstrumentor()
    instrumentor.uninstrument()  # the caller's spans are the only ledger
    try:
        maf_spans.clear()
        asyncio.run(_run_with_caller_ledger(rw.two_step_workflow("caller_ledger"), trace.get_tracer("caller"), under))
    finally:
        instrumentor.instrument()
    spans = list(maf_spans.get_finished_spans())
    ledgers = [s for s in spans if s.name.startswith("agent_response")]
    (caller,) = [s for s in spans if s.name == "handle_request"]
    # MAF up to 1.23: workflow.run; from 1.26: invoke_workflow {name}
    (workflow_run,) = [s for s in spans if s.name.partition(" ")[0] in ("workflow.run", "invoke_workflow")]
    assert len(ledgers) == 2 and all(s.parent.span_id == caller.context.span_id for s in ledgers)
    assert workflow_run.parent.span_id == caller.context.span_id  # siblings, not under the workflow
    export_spans(collector, spans)
    runs = runs_of(collector, trace_ids(spans))
    assert len(runs) == 1, [(r["run_id"], verdicts(r)) for r in runs]
    (run,) = runs
    assert run["run_id"].endswith(format(workflow_run.context.span_id, "016x"))
    assert all(e["evidence"]["ledger_source"] == "AgentResponseEvent" for e in run["executors"])
    assert numbers(run, "researcher") == (600, 600)
    if under:
        assert verdicts(run) == {"researcher": "Agree", "writer": "TokenMismatch"}
        assert numbers(run, "writer") == (480, 960)
        assert run["status"] == "FAIL" and run["score"] == 0.75
    else:
        assert verdicts(run) == {"researcher": "Agree", "writer": "Agree"}
        assert numbers(run, "writer") == (960, 960)
        assert run["status"] == "PASS" and run["score"] == 1.0


# --- 8. subjects ---------------------------------------------------------------------------------

def test_the_run_subject_is_the_workflow_name_else_the_service_name(maf_spans, collector):
    named = one_run(maf_spans, collector, rw.two_step_workflow("report_pipeline"), False)
    assert named["subject"] == "report_pipeline"
    spans = drive(maf_spans, rw.two_step_workflow(None), False)
    service_name = spans[0].resource.attributes["service.name"]
    export_spans(collector, spans)
    (unnamed,) = runs_of(collector, trace_ids(spans))
    assert unnamed["subject"] == service_name, (unnamed["subject"], service_name)
    assert not UUID_LIKE.search(unnamed["subject"])
    assert verdicts(unnamed) == {"researcher": "Agree", "writer": "Agree"}


def test_an_unnamed_orchestration_is_named_by_its_service_and_builder(maf_spans, collector):
    # agent-framework-orchestrations names every unnamed Sequential workflow "Sequential": two
    # services' unnamed pipelines would share one subject (and one metric label)
    from agent_framework_orchestrations import SequentialBuilder

    workflow = SequentialBuilder(participants=[rw.real_agent("researcher", [rw.Turn(420, 180)])]).build()
    spans = drive(maf_spans, workflow, False)
    export_spans(collector, spans)
    (run,) = runs_of(collector, trace_ids(spans))
    assert run["subject"] == f"{spans[0].resource.attributes['service.name']}/Sequential"
    assert verdicts(run) == {"researcher": "Agree"}


# --- 9. MAF's own samples on its real provider client --------------------------------------------

@pytest.fixture(scope="module")
def model_server():
    from llm_server import LLMServer

    server = LLMServer()
    yield server
    server.close()


def test_mafs_override_result_sample_stores_its_plain_call_only_not_the_stream_its_middleware_replaced(
        maf_spans, collector, model_server):
    # MAF's override_result_with_middleware sample, as published, on its OpenAI client. Plain: the
    # model asks for get_weather (114 tokens, tool_calls) and the chat middleware replaces that
    # response with one carrying no usage: the caller's AgentResponse reports nothing, an under-report
    # of 114 tokens and a finish it dropped. Streamed: the middleware replaces the stream before
    # anyone reads it, so no model call is made; MAF's chat span for it says so
    # (fidelity.operation.name = chat.unsent). An idle agent call in a run of nothing else: no run.
    model_server.reset()
    model_server.script(rw.WEATHER_MODEL, rw.WEATHER_TURNS)
    maf_spans.clear()
    plain, streamed = asyncio.run(rw.override_result_sample(model_server.base_url))
    gc.collect()  # MAF ends the unread stream's chat span when that stream is collected
    spans = list(maf_spans.get_finished_spans())
    assert "perfect weather" in plain.text and streamed.text.endswith("Agent: OK")  # the sample ran as published
    assert len(model_server.requests) == 1 and model_server.unplayed() == {}  # the stream reached no model
    plain_trace, streamed_trace = trace_ids(spans)

    ignored_before = collector.metrics().get(("agenteval_traces_ignored_total", ()), 0)
    export_spans(collector, spans)
    runs = runs_of(collector, [plain_trace, streamed_trace])
    assert [r["trace_id"] for r in runs] == [plain_trace], [(r["status"], verdicts(r)) for r in runs]
    (run,) = runs
    weather = unit(run, "WeatherAgent")
    ev = weather["evidence"]
    assert verdicts(run) == {"WeatherAgent": "Both"}
    assert (ev["framework_tokens"], ev["truth_tokens"], ev["direction"]) == (0, rw.WEATHER_TOKENS, "under")
    assert (ev["framework_finish"], ev["truth_finish"]) == (None, "tool_calls")
    assert (ev["ledger_entries"], ev["response_turns"], ev["request_turns"]) == (1, 1, 0)
    assert weather["no_truth_reason"] is None and weather["no_truth_fix"] is None
    assert (run["status"], run["score"], run["non_agent_executors"], run["unattributed_chat"]) == (
        "FAIL", 0.0, [], [])
    assert collector.metrics().get(("agenteval_traces_ignored_total", ()), 0) == ignored_before + 1

    # MAF's span of the unread stream is exported as it was, with the instrumentation's word on it
    (unsent,) = [s for s in spans if s.name.startswith("chat ")
                 and format(s.context.trace_id, "032x") == streamed_trace]
    assert unsent.attributes["gen_ai.operation.name"] == "chat"
    assert unsent.attributes["fidelity.operation.name"] == "chat.unsent"
    assert not any(k.startswith("gen_ai.usage") or k == "gen_ai.response.finish_reasons" for k in unsent.attributes)
