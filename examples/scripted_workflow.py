"""Your own MAF workflow, checked by the collector, on a scripted chat client: no model, no network,
no keys. Copy this file and replace the workflow with yours (docs/running.md "Your own workflow on a
scripted chat client").

Two agents in sequence; the writer's agent middleware reports half the usage its chat calls had, so
the collector finds the writer's under-report (TokenMismatch, FAIL) and the researcher agrees.

    agenteval collector serve &                      # or make run, in the agenteval source tree
    python examples/scripted_workflow.py             # OTEL_EXPORTER_OTLP_ENDPOINT: default 127.0.0.1:4317
    agenteval runs show <the trace id it prints>

What it needs in the app's environment: agent-framework-core, the MAF fidelity instrumentation, the
OpenTelemetry SDK and OTLP exporter, and collector/demo/maf_fakes.py (installed with the collector,
or copied: it imports nothing but agent_framework).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from agent_framework import Agent, WorkflowBuilder
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.maf_fidelity import MafFidelityInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from collector.demo.maf_fakes import InstrumentedChatClient, Turn, lookup, under_report


def scripted_agent(name: str, turns: Sequence[Turn], **options: Any) -> Agent:
    """An agent whose model is a script: each chat call answers the next Turn (tokens, finish reason,
    optionally a tool call). InstrumentedChatClient has the layers of MAF's provider clients; its
    ChatTelemetryLayer writes the chat spans, the collector's chat truth (without it: no_chat_trace).
    The model and provider named on the chat spans price the spend (gpt-4o-mini is in genai-prices)."""
    client = InstrumentedChatClient(turns=turns, model="gpt-4o-mini", otel_provider_name="openai")
    return Agent(client, name=name, instructions=f"You are the {name}.", **options)


async def main() -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": "my-app"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(insecure=True)))
    trace.set_tracer_provider(provider)  # MAF writes its workflow, agent and chat spans here
    MafFidelityInstrumentor().instrument()  # the framework's ledger: each AgentResponse, as a span

    researcher = scripted_agent("researcher", [Turn(420, 180)])
    writer = scripted_agent("writer", [Turn(300, 40, "tool_calls", tool_call="lookup"), Turn(420, 180)],
                            tools=[lookup], middleware=[under_report(0.5)])
    workflow = WorkflowBuilder(start_executor=researcher, name="my-workflow").add_edge(researcher, writer).build()

    with trace.get_tracer("my-app").start_as_current_span("my-app request") as span:
        await workflow.run("Write a short report.")
    provider.shutdown()  # sends what is left
    print(f"trace {trace.format_trace_id(span.get_span_context().trace_id)}")


if __name__ == "__main__":
    asyncio.run(main())
