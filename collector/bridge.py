"""``FidelityBridge``: the pre-instrumentation API, kept for existing users (docs/design.md §3b).

The framework's ledger is now recorded by the MAF instrumentation
(``opentelemetry-instrumentation-maf-fidelity``) wherever an agent runs, whatever the workflow's
output settings. The bridge switches that instrumentation on (once, with its tracer provider) and
wraps one run in a parent span, so the run's spans share a trace whose id it remembers:

    bridge = FidelityBridge()                      # or FidelityBridge(tracer_provider=my_provider)
    result = await bridge.run(workflow, "task")    # what workflow.run("task") returns
    async for event in bridge.run(workflow, "task", stream=True):   # the same stream
        ...
    await bridge.run(workflow.as_agent(), "task")  # anything with a MAF ``run`` method

The parent span ends when the run returns or raises, when a stream is fully consumed or closed, and
also when a stream the caller stopped reading early is dropped.
"""

from __future__ import annotations

import weakref
from typing import Any

from opentelemetry import trace
from opentelemetry.instrumentation.maf_fidelity import MafFidelityInstrumentor
from opentelemetry.trace import Span, TracerProvider

BRIDGE_SCOPE = "agenteval.bridge"


class FidelityBridge:
    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer(BRIDGE_SCOPE, tracer_provider=tracer_provider)
        instrumentor = MafFidelityInstrumentor()
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument(tracer_provider=tracer_provider)
        #: Hex trace id of the most recent run, to look its verdict up.
        self.last_trace_id: str | None = None

    def run(self, target: Any, message: Any = None, *, stream: bool = False, **kwargs: Any) -> Any:
        """``target.run(message, stream=..., **kwargs)`` inside a parent span; returns what it returns."""
        name = getattr(target, "name", None) or type(target).__name__
        span = self._tracer.start_span(f"workflow.fidelity {name}", attributes={"workflow.name": name})
        self.last_trace_id = format(span.get_span_context().trace_id, "032x")
        if not stream:
            return self._run(target, message, kwargs, span)
        with trace.use_span(span, end_on_exit=False):
            try:
                result_stream = target.run(message, stream=True, **kwargs)
            except BaseException:
                span.end()
                raise
        result_stream = (result_stream
                         .with_pull_context_manager(lambda: trace.use_span(span, end_on_exit=False))
                         .with_cleanup_hook(lambda: _end(span)))
        weakref.finalize(result_stream, _end, span)  # a consumer that breaks out and drops the stream
        return result_stream

    @staticmethod
    async def _run(target: Any, message: Any, kwargs: dict, span: Span) -> Any:
        with trace.use_span(span, end_on_exit=True, record_exception=True):
            return await target.run(message, **kwargs)


def _end(span: Span) -> None:
    if span.is_recording():
        span.end()
