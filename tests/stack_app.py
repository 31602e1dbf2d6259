"""An agent application run by ``opentelemetry-instrument`` (tests/test_instrumentation_stacks.py):
configured by OTEL_* variables only, it runs every scenario of :mod:`maf_stacks` on one MAF client kind
against the model server at ``$AGENTEVAL_TEST_LLM_URL``, plain then streamed, each in a request span of
its own, and prints one JSON line: each run's trace id and which provider instrumentations are active."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from opentelemetry import trace

import maf_stacks as ms


def instrumented() -> dict[str, bool]:
    """Whether openai-v2 (what `opentelemetry-bootstrap` adds for openai) wrapped the Chat Completions API."""
    from openai.resources.chat.completions import AsyncCompletions

    return {"openai-v2": type(vars(AsyncCompletions)["create"]).__name__ == "FunctionWrapper"}  # wrapt's


async def main(kind: str) -> dict[str, str]:
    tracer = trace.get_tracer("stack-app")
    clients = ms.Clients(kind, os.environ["AGENTEVAL_TEST_LLM_URL"])
    traces: dict[str, str] = {}
    try:
        for stream in (False, True):
            for scenario in ms.scenarios(kind):
                with tracer.start_as_current_span("request") as span:
                    await ms.run(ms.build(scenario.name, clients), stream)
                traces[f"{scenario.name}-{'stream' if stream else 'plain'}"] = format(
                    span.get_span_context().trace_id, "032x")
    finally:
        await clients.aclose()
    return traces


if __name__ == "__main__":
    traces = asyncio.run(main(sys.argv[1]))
    print(json.dumps({"traces": traces, "instrumented": instrumented()}))
