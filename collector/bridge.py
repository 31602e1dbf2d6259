"""The AgentResponseEvent bridge for MAF Python users (DESIGN §3 "Bridge").

MAF's workflow events carry each executor's own accounting (the ``AgentResponse`` an executor
yields as output: usage and finish reason) but no trace context, and MAF Python's ``invoke_agent``
span re-sums its inner chat spans, so it is no independent ledger. The bridge wraps one workflow run
in a parent span (so MAF's spans and ours share a trace) and records every agent response as an
``agent_response {executor id}`` span carrying ``fidelity.ledger.source = "AgentResponseEvent"``.

    from collector.bridge import FidelityBridge

    bridge = FidelityBridge()                      # or FidelityBridge(tracer_provider=my_provider)
    result = await bridge.run(workflow, "task")    # same WorkflowRunResult as workflow.run("task")
    async for event in bridge.run(workflow, "task", stream=True):   # same events as stream=True
        ...

What the caller receives is exactly what ``workflow.run`` returns: the same result object, or the
same ``ResponseStream`` with an observing hook added (events pass through unchanged).
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, TracerProvider

from collector.profiles import (
    BRIDGE_EXECUTOR_ATTRIBUTE,
    LEDGER_INVOCATION_ATTRIBUTE,
    LEDGER_SOURCE_ATTRIBUTE,
    LEDGER_SOURCE_BRIDGE,
)

BRIDGE_SCOPE = "agenteval.bridge"
_OUTPUT_TYPES = ("output", "intermediate")


def _usage_attributes(response: Any) -> dict[str, Any]:
    usage = getattr(response, "usage_details", None) or {}
    attrs: dict[str, Any] = {}
    for key, attr in (("input_token_count", "gen_ai.usage.input_tokens"),
                      ("output_token_count", "gen_ai.usage.output_tokens"),
                      ("total_token_count", "gen_ai.usage.total_tokens")):
        if usage.get(key) is not None:
            attrs[attr] = int(usage[key])
    finish = getattr(response, "finish_reason", None)
    if finish is not None:
        attrs["gen_ai.response.finish_reasons"] = [str(getattr(finish, "value", finish))]
    return attrs


class _Recorder:
    """Turns one run's workflow events into AgentResponseEvent spans, in event order."""

    def __init__(self, tracer: trace.Tracer, parent: Span) -> None:
        self._tracer = tracer
        self._context = trace.set_span_in_context(parent)
        self._ordinals: dict[str, int] = {}
        self._updates: dict[str, list[Any]] = {}  # streaming: this invocation's updates so far

    def observe(self, event: Any) -> Any:
        """Record what an event tells about the ledger; return the event untouched."""
        from agent_framework import AgentResponse, AgentResponseUpdate

        executor_id = getattr(event, "executor_id", None)
        kind = getattr(event, "type", None)
        if executor_id is None:
            return event
        if kind in _OUTPUT_TYPES and isinstance(event.data, AgentResponse):
            self._emit(executor_id, event.data)
        elif kind in _OUTPUT_TYPES and isinstance(event.data, AgentResponseUpdate):
            self._updates.setdefault(executor_id, []).append(event.data)
        elif kind in ("executor_invoked", "executor_completed", "executor_failed"):
            self._flush(executor_id)  # an invocation boundary closes the streamed response
        return event

    def _flush(self, executor_id: str) -> None:
        from agent_framework import AgentResponse

        updates = self._updates.pop(executor_id, None)
        if updates:
            self._emit(executor_id, AgentResponse.from_updates(updates))

    def _emit(self, executor_id: str, response: Any) -> None:
        ordinal = self._ordinals.get(executor_id, 0)
        self._ordinals[executor_id] = ordinal + 1
        attrs = {
            LEDGER_SOURCE_ATTRIBUTE: LEDGER_SOURCE_BRIDGE,
            BRIDGE_EXECUTOR_ATTRIBUTE: executor_id,
            LEDGER_INVOCATION_ATTRIBUTE: ordinal,
            **_usage_attributes(response),
        }
        self._tracer.start_span(f"agent_response {executor_id}", context=self._context, attributes=attrs).end()

    def finish(self) -> None:
        for executor_id in list(self._updates):
            self._flush(executor_id)


class FidelityBridge:
    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer(BRIDGE_SCOPE, tracer_provider=tracer_provider)
        #: Hex trace id of the most recent run, to look its verdict up.
        self.last_trace_id: str | None = None

    def run(self, workflow: Any, message: Any = None, *, stream: bool = False, **kwargs: Any) -> Any:
        """``workflow.run(message, stream=..., **kwargs)``, recorded; returns what it returns."""
        name = getattr(workflow, "name", None) or "workflow"
        span = self._tracer.start_span(f"workflow.fidelity {name}", attributes={"workflow.name": name})
        self.last_trace_id = format(span.get_span_context().trace_id, "032x")
        recorder = _Recorder(self._tracer, span)
        if not stream:
            return self._run(workflow, message, kwargs, span, recorder)
        with trace.use_span(span, end_on_exit=False):
            result_stream = workflow.run(message, stream=True, **kwargs)

        def finish() -> None:
            recorder.finish()
            span.end()

        return (result_stream
                .with_pull_context_manager(lambda: trace.use_span(span, end_on_exit=False))
                .with_update_transform(recorder.observe)
                .with_cleanup_hook(finish))

    @staticmethod
    async def _run(workflow: Any, message: Any, kwargs: dict, span: Span, recorder: _Recorder) -> Any:
        with trace.use_span(span, end_on_exit=True, record_exception=True):
            result = await workflow.run(message, **kwargs)
            for event in result:
                recorder.observe(event)
            recorder.finish()
        return result
