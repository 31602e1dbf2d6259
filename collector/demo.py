"""``agenteval demo``: real MAF workflows -> OTLP -> a running collector -> what it concluded."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from collector.emit_spans import otlp_span_exporter
from collector.store import RunStore


@dataclass
class DemoResult:
    name: str
    about: str
    trace_id: str
    expected: str
    run: dict | None

    @property
    def ok(self) -> bool:
        return self.run is not None and self.run["status"] == self.expected


def install_exporter(endpoint: str, protocol: str) -> TracerProvider:
    """A global TracerProvider exporting to the collector (MAF instruments the global provider)."""
    from agent_framework.observability import enable_instrumentation

    from opentelemetry.instrumentation.maf_fidelity import MafFidelityInstrumentor

    provider = TracerProvider(resource=Resource.create({"service.name": "agenteval-demo"}))
    provider.add_span_processor(BatchSpanProcessor(otlp_span_exporter(endpoint, protocol, insecure=True)))
    trace.set_tracer_provider(provider)
    enable_instrumentation(enable_sensitive_data=True)  # prompts go out; the collector must drop them
    MafFidelityInstrumentor().instrument()  # the framework's ledger: every agent response
    return provider


async def run_workflows() -> list[tuple[object, str]]:
    """Run every demo workflow through the bridge; returns (workflow spec, trace id) pairs."""
    from collector.bridge import FidelityBridge
    from collector.maf_fakes import demo_workflows

    bridge = FidelityBridge()
    out = []
    for spec in demo_workflows():
        await bridge.run(spec.build(), "Write a short report.")
        out.append((spec, bridge.last_trace_id))
    return out


def wait_for_runs(store: RunStore, trace_ids: list[str], timeout: float) -> dict[str, dict]:
    found: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while len(found) < len(trace_ids) and time.monotonic() < deadline:
        for tid in trace_ids:
            if tid not in found and (doc := store.get_run(tid)) is not None:
                found[tid] = doc
        time.sleep(0.2)
    return found


def demo(endpoint: str, protocol: str, store: RunStore, timeout: float) -> list[DemoResult]:
    provider = install_exporter(endpoint, protocol)
    ran = asyncio.run(run_workflows())
    provider.force_flush()
    runs = wait_for_runs(store, [tid for _, tid in ran], timeout)
    provider.shutdown()
    return [DemoResult(spec.name, spec.about, tid, spec.status, runs.get(tid)) for spec, tid in ran]
