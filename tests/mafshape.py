"""Spans shaped like MAF Python 1.23 and MAF .NET emit them, made with the real OpenTelemetry SDK.

A scenario is declarative: per executor, its invocations; per invocation, the chat calls that crossed
the boundary and what the framework reported. ``emit`` replays it through a real tracer:

- MAF Python: ``invoke_agent`` carries the usage it re-sums from its chat spans (never a ledger); the
  framework's report is an ``agent_response`` span under it, as our instrumentation writes it
  (``ledger="instrumentation"``), or absent (``ledger="invoke_agent"``: the unit is ledger_derived).
- MAF .NET: ``invoke_agent`` carries the AgentResponse's own usage (an independent ledger), and the
  resource says ``telemetry.sdk.language = dotnet``.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from google.protobuf import json_format
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode


@dataclass
class Call:
    """One chat call; all None is a bare request (the boundary saw no response)."""

    input: int | None = None
    output: int | None = None
    finish: str | None = None
    #: Set: the call raised (``error.type`` and an error status on its chat span).
    error: str | None = None
    provider: str | None = None


@dataclass
class Invocation:
    calls: list[Call]
    #: What the framework reports (input, output, finish); default: the honest sums.
    reported: tuple[int | None, int | None, str | None] | None = None

    def honest(self) -> tuple[int, int, str | None]:
        responses = [c for c in self.calls if c.input is not None]
        return (sum(c.input or 0 for c in responses), sum(c.output or 0 for c in responses),
                responses[-1].finish if responses else None)


@dataclass
class Scenario:
    executors: dict[str, list[Invocation]]
    name: str = "wf"
    chat_instrumented: set[str] | None = None  # None: all executors' chat clients are instrumented
    #: MAF Python's ledger: "instrumentation" (agent_response spans) or "invoke_agent" (derived only).
    ledger: str = "instrumentation"
    dotnet: bool = False
    sensitive: bool = True
    extra_root_attrs: dict = field(default_factory=dict)


def ok(i: int, o: int, finish: str = "stop") -> Call:
    return Call(i, o, finish)


def usage_attrs(i: int | None = None, o: int | None = None, finish: str | None = None, **more) -> dict:
    """A chat or agent span's usage and finish reason as MAF Python writes them, with ``more``."""
    attrs = dict(more)
    if i is not None:
        attrs["gen_ai.usage.input_tokens"] = i
    if o is not None:
        attrs["gen_ai.usage.output_tokens"] = o
    if finish is not None:
        attrs["gen_ai.response.finish_reasons"] = json.dumps([finish])  # MAF Python: a JSON string
    return attrs


def emit(tracer: trace.Tracer, sc: Scenario) -> str:
    """Emit one workflow run; returns the trace id (hex)."""
    root_name = "workflow_invoke" if sc.dotnet else "workflow.run"
    with tracer.start_as_current_span(root_name, attributes={"workflow.name": sc.name, "workflow.id": sc.name,
                                                             **sc.extra_root_attrs}) as root:
        for executor_id, invocations in sc.executors.items():
            for inv in invocations:
                with tracer.start_as_current_span(
                    f"executor.process {executor_id}",
                    attributes={"executor.id": executor_id, "executor.type": "AgentExecutor"},
                ):
                    reported = inv.reported or inv.honest()
                    agent_name = (f"invoke_agent {executor_id}({executor_id}-id)" if sc.dotnet
                                  else f"invoke_agent {executor_id}")
                    agent_attrs = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": executor_id,
                                   "gen_ai.agent.id": f"{executor_id}-id"}
                    # .NET: the AgentResponse's own usage; Python: re-summed from the chat spans.
                    agent_attrs.update(usage_attrs(*(reported if sc.dotnet else inv.honest())))
                    with tracer.start_as_current_span(agent_name, attributes=agent_attrs):
                        if sc.chat_instrumented is None or executor_id in sc.chat_instrumented:
                            for call in inv.calls:
                                attrs = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "fake-model",
                                         **usage_attrs(call.input, call.output, call.finish)}
                                if call.provider:
                                    attrs["gen_ai.provider.name"] = call.provider
                                if call.error:
                                    attrs["error.type"] = call.error
                                if sc.sensitive:
                                    attrs["gen_ai.input.messages"] = json.dumps(
                                        [{"role": "user", "parts": [{"content": "SECRET-PROMPT"}]}])
                                    if call.input is not None:
                                        attrs["gen_ai.output.messages"] = json.dumps(
                                            [{"role": "assistant", "parts": [{"content": "SECRET-ANSWER"}]}])
                                with tracer.start_as_current_span("chat fake-model", attributes=attrs) as chat:
                                    if call.error:
                                        chat.set_status(StatusCode.ERROR, "429 Too Many Requests")
                        if not sc.dotnet and sc.ledger == "instrumentation":
                            with tracer.start_as_current_span(
                                f"agent_response {executor_id}",
                                attributes={"fidelity.ledger.source": "AgentResponseEvent",
                                            "gen_ai.agent.name": executor_id, **usage_attrs(*reported)},
                            ):
                                pass
        trace_id = format(root.get_span_context().trace_id, "032x")
        RUN_IDS[trace_id] = f"{trace_id}-{root.get_span_context().span_id:016x}"
        return trace_id


#: trace id -> the run id the collector gives that trace's workflow run.
RUN_IDS: dict[str, str] = {}


def run_id(trace_id: str) -> str:
    return RUN_IDS[trace_id]


def record(scenarios: list[Scenario], service: str = "maf-app") -> tuple[list, list[str]]:
    """Run scenarios through a real SDK tracer; returns finished ReadableSpans and trace ids."""
    exporter = InMemorySpanExporter()
    resource = {"service.name": service}
    if any(sc.dotnet for sc in scenarios):
        resource["telemetry.sdk.language"] = "dotnet"
    provider = TracerProvider(resource=Resource.create(resource))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("agent_framework")
    ids = [emit(tracer, sc) for sc in scenarios]
    provider.shutdown()
    return list(exporter.get_finished_spans()), ids


def sent_times(spans: list, trace_id: str) -> tuple[datetime, float]:
    """When the trace's workflow run started (its workflow-run span's start, to the microsecond) and
    how long it took (to its spans' latest end, in seconds), worked out from the spans sent."""
    mine = [s for s in spans if format(s.context.trace_id, "032x") == trace_id]
    (root,) = [s for s in mine if s.parent is None]
    started = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=root.start_time // 1000)
    return started, (max(s.end_time for s in mine) - root.start_time) / 1e9


def export_request(spans) -> ExportTraceServiceRequest:
    return encode_spans(spans)


def to_otlp_json(request: ExportTraceServiceRequest) -> dict:
    """OTLP/JSON as the OpenTelemetry Collector writes it: hex ids, integer enums."""
    doc = json_format.MessageToDict(request, use_integers_for_enums=True)
    for rs in doc.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
                for link in span.get("links", []):
                    for key in ("traceId", "spanId"):
                        if key in link:
                            link[key] = base64.b64decode(link[key]).hex()
    return doc


#: Shared scenarios: (scenario, expected run status, expected verdict per executor).
SCENARIOS: dict[str, tuple[Scenario, str, dict[str, str]]] = {
    "pass": (
        Scenario({"researcher": [Invocation([ok(420, 180)])],
                  "writer": [Invocation([ok(300, 120, "tool_calls"), ok(310, 230)])]}, name="pass"),
        "PASS", {"researcher": "Agree", "writer": "Agree"},
    ),
    "fail_under_report": (
        Scenario({"researcher": [Invocation([ok(420, 180)])],
                  "writer": [Invocation([ok(300, 120, "tool_calls"), ok(310, 230)], reported=(310, 230, "stop"))]},
                 name="fail-under-report"),
        "FAIL", {"researcher": "Agree", "writer": "TokenMismatch"},
    ),
    "finish_mismatch": (
        Scenario({"researcher": [Invocation([ok(420, 180)])], "writer": [Invocation([ok(610, 350)])],
                  "reviewer": [Invocation([ok(700, 90, "content_filter")], reported=(700, 90, None))]},
                 name="finish-mismatch"),
        "WARN", {"researcher": "Agree", "writer": "Agree", "reviewer": "FinishMismatch"},
    ),
    "loop": (
        Scenario({"writer": [Invocation([ok(500, 300)]), Invocation([ok(560, 280)])],
                  "reviewer": [Invocation([ok(400, 60)]), Invocation([ok(420, 55)]), Invocation([ok(430, 20)])]},
                 name="loop"),
        "PASS", {"writer": "Agree", "reviewer": "Agree"},
    ),
    "path2_pending": (
        Scenario({"researcher": [Invocation([Call()], reported=(420, 180, "stop"))],
                  "writer": [Invocation([Call(), Call()], reported=(610, 350, "stop"))]}, name="path2"),
        "PENDING", {"researcher": "NoTruth", "writer": "NoTruth"},
    ),
    "partial_warn": (
        Scenario({"researcher": [Invocation([ok(420, 180)])], "writer": [Invocation([ok(610, 350)])]},
                 name="partial", chat_instrumented={"researcher"}),
        "WARN", {"researcher": "Agree", "writer": "NoTruth"},
    ),
}
