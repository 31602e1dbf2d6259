"""One model call, one truth entry (docs/design.md §1): stacked chat instrumentations, finish-reason
and usage vocabularies, and runs whose chat calls no agent made.

Traces are made with the real OpenTelemetry SDK in MAF Python's shape (``workflow.run`` >
``executor.process`` > ``invoke_agent`` > ``chat {model}``, the fidelity instrumentation's
``agent_response`` ledger span), with provider instrumentations' chat spans stacked beneath MAF's as
users run them (openai-v2's ``chat {model}``, OpenLLMetry's ``openai.chat``, an httpx span between),
then decoded by both decoders, replayed from the journal, offered in every arrival order, and read
from an OTLP JSON file, each giving the same verdicts.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import urllib.request
from dataclasses import dataclass, field

import orjson
import pytest
from agent_framework import Message, WorkflowBuilder, WorkflowContext, executor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from collector.api.v1.fidelity_pb2 import RunVerdict
from collector.config import CollectorConfig
from collector.core.classify import TraceState
from collector.core.reconcile import reconcile
from collector.core.serialize import run_to_dict
from collector.demo.maf_fakes import InstrumentedChatClient, Turn
from collector.formats.decode import decode_bytes, decode_protobuf
from collector.formats.loader import iter_runs
from collector.live.journal import decode as journal_decode
from collector.live.journal import encode as journal_encode
from collector.outputs.wire import run_message, to_doc

from conftest import AGENTEVAL, export_spans, verdicts
from mafshape import export_request, to_otlp_json
from mafshape import usage_attrs as usage

CONFIG = CollectorConfig()
MATCHER = CONFIG.matcher()
POLICY = CONFIG.scoring.policy()


@dataclass
class Span:
    """One span of a chat call's record: a chat span of some instrumentation, or any span between."""

    name: str
    attrs: dict = field(default_factory=dict)
    error: str | None = None
    children: list[Span] = field(default_factory=list)
    #: Its children run side by side (each started before the previous one ends), as two
    #: instrumentations of one request do when neither is the other's parent.
    side_by_side: bool = False


def maf_chat(*children: Span, error: str | None = None, **response) -> Span:
    """MAF's chat layer (ChatTelemetryLayer): ``chat {model}``, gen_ai.operation.name = chat."""
    return Span("chat gpt-4o", {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
                                "gen_ai.request.model": "gpt-4o", **usage(**response)}, error, list(children))


def openai_v2(*children: Span, error: str | None = None, **response) -> Span:
    """opentelemetry-instrumentation-openai-v2's span: named like MAF's, the same attributes."""
    return Span("chat gpt-4o", {"gen_ai.operation.name": "chat", "gen_ai.system": "openai",
                                "gen_ai.request.model": "gpt-4o", **usage(**response)}, error, list(children))


def http(*children: Span) -> Span:
    """opentelemetry-instrumentation-httpx's client span between the layers."""
    return Span("POST", {"http.request.method": "POST"}, None, list(children))


@dataclass
class Agent:
    """One agent executor: its chat calls (each a tree of spans, outermost first) and what MAF's
    AgentResponse reported (input, output, finish)."""

    name: str
    calls: list[Span]
    reported: tuple[int | None, int | None, str | None]


def trace_of(*agents: Agent, functions: dict[str, list[Span]] | None = None,
             name: str = "stacked") -> tuple[list, str]:
    """A MAF Python workflow run through a real SDK tracer: agents, and function executors calling a
    chat client themselves (``functions``). Returns the finished spans and the trace id."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "stacks", "telemetry.sdk.language": "python"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("agent_framework")

    def emit(span: Span) -> None:
        if not span.name:  # no span of its own: its children side by side where it stands
            opened = [tracer.start_span(child.name, attributes=child.attrs) for child in span.children]
            for child in reversed(opened):
                child.end()
            return
        with tracer.start_as_current_span(span.name, attributes=span.attrs) as s:
            if span.side_by_side:
                opened = [tracer.start_span(child.name, attributes=child.attrs) for child in span.children]
                for child in reversed(opened):
                    child.end()
            else:
                for child in span.children:
                    emit(child)
            if span.error:
                s.set_attribute("error.type", span.error)
                s.set_status(StatusCode.ERROR, span.error)

    with tracer.start_as_current_span("workflow.run", attributes={"workflow.name": name}) as root:
        for agent in agents:
            with tracer.start_as_current_span(f"executor.process {agent.name}",
                                              attributes={"executor.id": agent.name, "executor.type": "AgentExecutor"}):
                with tracer.start_as_current_span(f"invoke_agent {agent.name}",
                                                  attributes={"gen_ai.operation.name": "invoke_agent",
                                                              "gen_ai.agent.name": agent.name}):
                    for call in agent.calls:
                        emit(call)
                    with tracer.start_as_current_span(f"agent_response {agent.name}", attributes={
                            "fidelity.ledger.source": "AgentResponseEvent", "gen_ai.agent.name": agent.name,
                            **usage(*agent.reported)}):
                        pass
        for executor, calls in (functions or {}).items():
            with tracer.start_as_current_span(f"executor.process {executor}", attributes={
                    "executor.id": executor, "executor.type": "FunctionExecutor"}):
                for call in calls:
                    emit(call)
    provider.shutdown()
    return list(exporter.get_finished_spans()), format(root.get_span_context().trace_id, "032x")


def records(spans: list, native: bool = True) -> list:
    payload = export_request(spans).SerializeToString()
    decoded = decode_bytes(payload, MATCHER) if native else decode_protobuf(payload, MATCHER)
    assert not decoded.rejected
    return decoded.spans


def classify(recs: list) -> list[dict]:
    """Every run of the records' trace, reconciled, as the run document."""
    (trace_id,) = {r.trace_id for r in recs}
    state = TraceState(MATCHER, trace_id)
    for r in recs:
        state.add(r)
    return [run_to_dict(reconcile(run, POLICY)) for run, _ in state.run_inputs()]


def the_run(spans: list) -> dict:
    """The run of a trace, checked to be the same by both decoders, replayed from the journal, in
    reverse and shuffled arrival order (children before parents), and provisionally finalized
    before its parents arrived."""
    recs = records(spans)
    (run,) = classify(recs)
    assert classify(records(spans, native=False)) == [run]
    assert classify(journal_decode(journal_encode(recs), MATCHER)) == [run]
    assert classify(list(reversed(recs))) == [run]
    shuffled = list(recs)
    random.Random(38).shuffle(shuffled)
    assert classify(shuffled) == [run]
    # the children arrive, the trace is published provisionally (its parents missing), then the rest
    (trace_id,) = {r.trace_id for r in recs}
    state = TraceState(MATCHER, trace_id)
    leaves = [r for r in recs if r.parent_id and not any(o.parent_id == r.span_id for o in recs)]
    for r in leaves:
        state.add(r)
    state.run_inputs(everything=True, final=False)
    for r in recs:
        if r not in leaves:
            state.add(r)
    (revised, _), = state.run_inputs()
    assert run_to_dict(reconcile(revised, POLICY)) | {"revision": 1} == run | {"revision": 1}
    return run


def unit(run: dict, name: str) -> dict:
    return next(e for e in run["executors"] if e["executor_id"] == name)


SEQUENTIAL = (Agent("writer", [maf_chat(openai_v2(i=120, o=40, finish="stop"), i=120, o=40, finish="stop")],
                    (120, 40, "stop")),
              Agent("reviewer", [maf_chat(openai_v2(i=130, o=40, finish="stop"), i=130, o=40, finish="stop")],
                    (130, 40, "stop")))


def test_openai_v2_beneath_maf_records_each_call_once():
    """The issue's Sequential run: both agents reported exactly what the server sent; counted twice,
    truth was 320 against 160 and both honest agents FAILed with TokenMismatch."""
    run = the_run(trace_of(*SEQUENTIAL)[0])
    assert run["status"] == "PASS" and verdicts(run) == {"writer": "Agree", "reviewer": "Agree"}
    writer = unit(run, "writer")["evidence"]
    assert (writer["framework_tokens"], writer["truth_tokens"], writer["response_turns"]) == (160, 160, 1)
    assert writer["stacked_chat_spans"] == 1 and writer["chat_layers_disagree"] == []


def test_an_under_report_is_still_caught_beneath_stacked_layers():
    writer = Agent("writer", [maf_chat(http(openai_v2(i=120, o=40, finish="stop")), i=120, o=40, finish="stop")],
                   (60, 20, "stop"))
    run = the_run(trace_of(writer)[0])
    assert verdicts(run) == {"writer": "TokenMismatch"} and run["status"] == "FAIL"
    assert (unit(run, "writer")["evidence"]["truth_tokens"], unit(run, "writer")["evidence"]["delta"]) == (160, -80)


def test_a_dropped_finish_reason_is_a_finish_mismatch_not_both():
    writer = Agent("writer", [maf_chat(openai_v2(i=100, o=30, finish="length"), i=100, o=30, finish="length")],
                   (100, 30, None))
    run = the_run(trace_of(writer)[0])
    assert verdicts(run) == {"writer": "FinishMismatch"} and run["score"] == 0.5


def test_an_inner_provider_span_supplies_the_response_the_framework_span_lacks():
    """MAF's streamed chat span without a response; OpenLLMetry's span beneath it has one."""
    inner = Span("openai.chat", {"gen_ai.system": "openai", "llm.request.type": "chat", **usage(200, 50, "tool_call")})
    writer = Agent("writer", [maf_chat(inner)], (200, 50, "tool_calls"))
    run = the_run(trace_of(writer)[0])
    assert verdicts(run) == {"writer": "Agree"}
    evidence = unit(run, "writer")["evidence"]
    assert (evidence["truth_tokens"], evidence["response_turns"], evidence["request_turns"]) == (250, 1, 0)
    assert evidence["truth_finish"] == "tool_call"  # raw values are kept; compared normalized


def test_an_inner_span_without_usage_beneath_an_outer_with_usage_is_no_partial_response():
    """All three active: OpenLLMetry's streamed span carried no usage; every unit became partial_response."""
    inner = Span("openai.chat", {"gen_ai.system": "openai", "llm.request.type": "chat"})
    writer = Agent("writer", [maf_chat(openai_v2(inner, i=90, o=10), i=90, o=10, finish="stop")], (90, 10, "stop"))
    run = the_run(trace_of(writer)[0])
    assert verdicts(run) == {"writer": "Agree"} and run["status"] == "PASS"
    assert unit(run, "writer")["evidence"]["stacked_chat_spans"] == 2


def test_a_retried_call_counts_each_attempt_once_and_a_failed_attempt_is_no_path2():
    """MAF's span has no response of its own; beneath it, a 429 attempt then a successful one."""
    call = maf_chat(openai_v2(error="RateLimitError"), http(openai_v2(i=300, o=60, finish="stop")))
    run = the_run(trace_of(Agent("writer", [call], (300, 60, "stop")))[0])
    assert verdicts(run) == {"writer": "Agree"}
    evidence = unit(run, "writer")["evidence"]
    assert (evidence["truth_tokens"], evidence["response_turns"], evidence["failed_turns"]) == (360, 1, 1)


def test_a_failed_call_recorded_by_two_layers_is_one_failed_call_never_path2():
    call = maf_chat(openai_v2(), error="APITimeoutError")  # the provider span never saw an answer
    run = the_run(trace_of(Agent("writer", [call, maf_chat(openai_v2(i=50, o=5, finish="stop"), i=50, o=5,
                                                          finish="stop")], (50, 5, "stop")))[0])
    evidence = unit(run, "writer")["evidence"]
    assert verdicts(run) == {"writer": "Agree"}
    assert (evidence["failed_turns"], evidence["request_turns"], evidence["response_turns"]) == (1, 0, 1)


def anthropic_records(i: int, o: int) -> list[Span]:
    """OpenLLMetry's anthropic.chat and the Anthropic SDK's own span: side by side beneath MAF's chat
    span, both counting cached input in."""
    attrs = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "anthropic", **usage(i, o),
             "gen_ai.usage.cache_read.input_tokens": 30}
    return [Span("anthropic.chat", {**attrs, "gen_ai.response.finish_reasons": json.dumps(["stop"])}),
            Span("anthropic.messages.create", dict(attrs))]


def test_two_records_of_one_attempt_side_by_side_count_once():
    """MAF's Anthropic chat span counts input without the cache reads (70 of 100); beneath it,
    OpenLLMetry's span and the SDK's own record the same request side by side."""
    outer = maf_chat(i=70, o=20, finish="stop")
    outer.children, outer.side_by_side = anthropic_records(100, 20), True
    bare = maf_chat()  # a framework span that saw no response: the records beneath supply it, once
    bare.children, bare.side_by_side = anthropic_records(130, 40), True
    spans, _ = trace_of(Agent("writer", [outer, bare], (240, 60, "stop")))
    run = the_run(spans)
    evidence = unit(run, "writer")["evidence"]
    assert verdicts(run) == {"writer": "Agree"}
    assert (evidence["truth_tokens"], evidence["response_turns"], evidence["stacked_chat_spans"]) == (260, 2, 4)
    (found,) = evidence["chat_layers_disagree"]
    assert (found["tokens"], found["inner_tokens"], len(found["inner_span_ids"])) == (90, 120, 1)
    # 30 a call: the first's own span reported none (taken from beneath, once), the second's from beneath
    assert evidence["truth_cache_read_tokens"] == 60


def side_by_side(*records: Span) -> Span:
    return Span("", children=list(records))


def test_a_provider_only_stack_of_two_records_side_by_side_counts_each_call_once():
    """MAF's chat telemetry off on Anthropic, OpenLLMetry on: its anthropic.chat and the SDK's own span
    are both directly under the agent span, side by side. Streamed, OpenLLMetry over-counts the
    output by one: the record with a count stands, the other total is shown."""
    first = anthropic_records(100, 20)
    second = anthropic_records(130, 41)[::-1]  # the SDK's span first this time: the one saying most stands
    second[0].attrs["gen_ai.usage.output_tokens"] = 40  # the SDK's own count
    writer = Agent("writer", [side_by_side(*first), side_by_side(*second)], (230, 60, "stop"))
    run = the_run(trace_of(writer)[0])
    evidence = unit(run, "writer")["evidence"]
    assert verdicts(run) == {"writer": "Agree"}
    assert (evidence["truth_tokens"], evidence["response_turns"], evidence["stacked_chat_spans"]) == (291, 2, 2)
    (found,) = evidence["chat_layers_disagree"]
    assert (found["tokens"], found["inner_tokens"]) == (171, 170)


def test_same_named_calls_side_by_side_stay_two_calls():
    """A client's concurrent calls each get their own span of the same name: never merged (that
    would under-count the truth and could hide an under-report)."""
    writer = Agent("writer",
                   [side_by_side(openai_v2(i=100, o=10, finish="stop"), openai_v2(i=100, o=10, finish="stop"))],
                   (100, 10, "stop"))
    run = the_run(trace_of(writer)[0])
    assert verdicts(run) == {"writer": "TokenMismatch"}
    assert unit(run, "writer")["evidence"]["truth_tokens"] == 220


def test_a_provider_only_stack_takes_its_truth_from_the_provider_spans():
    """MAF's chat telemetry off, openai-v2 on: the provider spans are the chat truth."""
    writer = Agent("writer", [openai_v2(i=80, o=20, finish="tool_calls"), openai_v2(i=120, o=30, finish="stop")],
                   (200, 50, "stop"))
    run = the_run(trace_of(writer)[0])
    assert verdicts(run) == {"writer": "Agree"}
    assert unit(run, "writer")["evidence"]["truth_tokens"] == 250


def test_layers_that_disagree_are_shown_with_both_figures():
    writer = Agent("writer", [maf_chat(openai_v2(i=120, o=40, finish="stop"), i=60, o=20, finish="stop")],
                   (60, 20, "stop"))
    spans, _ = trace_of(writer)
    run = the_run(spans)
    evidence = unit(run, "writer")["evidence"]
    assert verdicts(run) == {"writer": "Agree"}  # a finding about the instrumentation, not a verdict
    (found,) = evidence["chat_layers_disagree"]
    maf, v2 = (f"{s.context.span_id:016x}" for s in sorted((s for s in spans if s.name == "chat gpt-4o"),
                                                           key=lambda s: s.start_time))
    assert found == {"span_id": maf, "tokens": 80, "inner_span_ids": [v2], "inner_tokens": 160}


def test_an_agent_between_two_chat_spans_makes_them_two_calls():
    """A chat call under another agent's chat span is that agent's own (an agent called inside a call)."""
    inner_agent = Span("invoke_agent helper", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "helper"},
                       children=[maf_chat(i=10, o=5, finish="stop")])
    writer = Agent("writer", [maf_chat(inner_agent, i=100, o=20, finish="stop")], (100, 20, "stop"))
    run = the_run(trace_of(writer)[0])
    assert unit(run, "writer")["evidence"]["truth_tokens"] == 120
    assert unit(run, "writer/helper")["evidence"]["truth_tokens"] == 15


@pytest.mark.parametrize(("raw", "framework"), [
    ("end_turn", "stop"), ("max_tokens", "length"), ("tool_use", "tool_calls"), ("stop_sequence", "stop"),
    ("refusal", "content_filter"), ("STOP", "stop"), ("MAX_TOKENS", "length"), ("SAFETY", "content_filter"),
    ("PROHIBITED_CONTENT", "content_filter"), ("guardrail_intervened", "content_filter"),
    ("content_filtered", "content_filter"), ("tool_call", "tool_calls"), ("function_call", "tool_calls"),
    ("load", "stop"),
])
def test_finish_reasons_of_every_vendor_compare_by_the_conventions_values(raw, framework):
    writer = Agent("writer", [maf_chat(i=10, o=5, finish=raw)], (10, 5, framework))
    run = the_run(trace_of(writer)[0])
    assert verdicts(run) == {"writer": "Agree"}
    assert unit(run, "writer")["evidence"]["truth_finish"] == raw


def test_a_vendor_reason_that_means_something_else_still_diverges():
    writer = Agent("writer", [maf_chat(i=10, o=5, finish="max_tokens")], (10, 5, "stop"))
    assert verdicts(the_run(trace_of(writer)[0])) == {"writer": "FinishMismatch"}


def test_cache_and_reasoning_parts_are_shown_never_added_on_top():
    parts = {"gen_ai.usage.cache_read.input_tokens": "70", "gen_ai.usage.cache_write.input_tokens": 20,
             "gen_ai.usage.reasoning.output_tokens": "30"}  # numbers sent as strings are numbers
    older = {"gen_ai.usage.cache_creation.input_tokens": 5}
    writer = Agent("writer", [maf_chat(i="100", o=40, finish="stop", **parts),
                              maf_chat(openai_v2(i=10, o=4, finish="stop", **older), i=10, o=4, finish="stop")],
                   (110, 44, "stop"))
    run = the_run(trace_of(writer)[0])
    evidence = unit(run, "writer")["evidence"]
    assert verdicts(run) == {"writer": "Agree"} and evidence["truth_tokens"] == 154
    assert (evidence["truth_cache_read_tokens"], evidence["truth_cache_write_tokens"],
            evidence["truth_reasoning_tokens"]) == (70, 25, 30)
    first, second = evidence["chat_calls"]
    assert (first["usage"]["cache_read_tokens"], first["usage"]["reasoning_tokens"]) == (70, 30)
    assert second["usage"]["cache_write_tokens"] == 5  # from the layer beneath, which alone reported it


def test_a_run_whose_chat_calls_no_agent_made_is_pending_with_its_spend():
    """MAF's reflection sample: function executors calling a chat client directly."""
    spans, _ = trace_of(functions={"reflect": [maf_chat(openai_v2(i=100, o=50, finish="stop"), i=100, o=50,
                                                        finish="stop")],
                                   "critic": [maf_chat(i=30, o=10, finish="stop")]})
    run = the_run(spans)
    assert run["status"] == "PENDING" and run["score"] is None and run["executors"] == []
    assert sorted((u["executor"], u["calls"], u["tokens"]) for u in run["unattributed_chat"]) == [
        ("critic", 1, 40), ("reflect", 1, 150)]
    (note,) = run["notes"]
    assert note.startswith("No agent ran in this run: its 2 chat call(s), 190 tokens were made by critic, reflect")


def test_chat_calls_outside_any_workflow_and_agent_are_no_run():
    """An application's own chat call (no workflow, no agent, no executor) is nothing to reconcile."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("openai_v2").start_as_current_span("chat gpt-4o", attributes={
            "gen_ai.operation.name": "chat", **usage(10, 5, "stop")}):
        pass
    assert classify(records(list(exporter.get_finished_spans()))) == []


def test_offline_otlp_json_files_give_the_same_verdicts(tmp_path):
    spans, _ = trace_of(*SEQUENTIAL)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(to_otlp_json(export_request(spans))))
    (run,) = list(iter_runs(path, MATCHER))
    assert verdicts(run_to_dict(reconcile(run, POLICY))) == {"writer": "Agree", "reviewer": "Agree"}


def test_the_live_collector_stores_one_truth_per_call(collector):
    spans, trace_id = trace_of(*SEQUENTIAL)
    export_spans(collector, spans)
    run = collector.run(trace_id)
    assert run["status"] == "PASS" and verdicts(run) == {"writer": "Agree", "reviewer": "Agree"}
    assert unit(run, "reviewer")["evidence"]["truth_tokens"] == 170


def test_the_run_page_and_runs_show_show_stacked_layers_parts_and_disagreement(collector):
    parts = {"gen_ai.usage.cache_read.input_tokens": 30, "gen_ai.usage.reasoning.output_tokens": 5}
    writer = Agent("writer", [maf_chat(openai_v2(i=120, o=40, finish="stop"), i=60, o=20, finish="stop", **parts)],
                   (60, 20, "stop"))
    spans, trace_id = trace_of(writer, name="layers-shown")
    export_spans(collector, spans)
    run = collector.run(trace_id)
    evidence = unit(run, "writer")["evidence"]
    assert evidence["stacked_chat_spans"] == 1 and evidence["truth_cache_read_tokens"] == 30
    (found,) = evidence["chat_layers_disagree"]
    assert (found["tokens"], found["inner_tokens"]) == (80, 160)
    with urllib.request.urlopen(f"{collector.http}/runs/{run['run_id']}", timeout=10) as page:
        html = page.read().decode()
    assert "Chat layers disagree" in html and found["span_id"] in html and found["inner_span_ids"][0] in html
    assert "of which cache read 30" in html and "of which reasoning 5" in html
    shown = subprocess.run([AGENTEVAL, "runs", "show", run["run_id"], "--store", collector.store_url],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    assert "chat layers disagree (not a verdict)" in text and "reports 80 tokens" in text and "160" in text
    assert "1 chat span(s) recorded calls another chat span already records" in text
    assert "cache read 30, reasoning 5" in text
    # the gRPC API carries the same evidence
    message = RunVerdict.FromString(run_message(run).SerializeToString())
    wire = to_doc(message)["executors"][0]["evidence"]
    assert wire["chat_layers_disagree"] == [found] and wire["truth_cache_read_tokens"] == 30


def test_a_real_maf_workflow_whose_executors_call_a_chat_client_directly_is_stored_pending(maf_spans, collector):
    """MAF's reflection sample's shape: function executors call an instrumented chat client directly;
    no agent runs. The run is stored PENDING with its unattributed chat and why."""
    client = InstrumentedChatClient(turns=[Turn(400, 120), Turn(90, 30, "length")])

    @executor(id="draft")
    async def draft(task: str, ctx: WorkflowContext[str]) -> None:
        response = await client.get_response([Message("user", [task])])
        await ctx.send_message(response.text or "draft")

    @executor(id="reflect")
    async def reflect(text: str, ctx: WorkflowContext[None, str]) -> None:
        response = await client.get_response([Message("user", [f"Critique: {text}"])])
        await ctx.yield_output(response.text or "done")

    workflow = WorkflowBuilder(name="reflection", start_executor=draft).add_edge(draft, reflect).build()
    maf_spans.clear()
    asyncio.run(workflow.run("Write a haiku."))
    spans = list(maf_spans.get_finished_spans())
    assert not any(s.name.startswith("invoke_agent") for s in spans)
    export_spans(collector, spans)
    (trace_id,) = {format(s.context.trace_id, "032x") for s in spans if s.name.startswith("chat")}
    run = collector.run(trace_id)
    assert run["status"] == "PENDING" and run["score"] is None and run["executors"] == []
    assert run["subject"] == "reflection"
    assert sorted((u["executor"], u["calls"], u["tokens"]) for u in run["unattributed_chat"]) == [
        ("draft", 1, 520), ("reflect", 1, 120)]
    (note,) = run["notes"]
    assert "No agent ran in this run: its 2 chat call(s), 640 tokens were made by draft, reflect" in note
    assert "through a MAF agent" in note


def test_a_journal_of_the_previous_version_replays_with_the_count_parts_unknown():
    """Rows journaled before the count parts (18 facts) replay whole: the parts unknown, the calls the same."""
    recs = records(trace_of(*SEQUENTIAL)[0])
    line = orjson.dumps([[s.trace_id.hex(), s.span_id.hex(), s.parent_id.hex(), s.name, s.start_ns, s.facts[:18],
                          s.resource_subject, s.status_error, s.sdk_language, s.end_ns] for s in recs]) + b"\n"
    replayed = journal_decode(line, MATCHER)
    assert [r.facts for r in replayed] == [r.facts[:18] + (None, None, None) for r in recs]
    assert classify(replayed) == classify(recs)
