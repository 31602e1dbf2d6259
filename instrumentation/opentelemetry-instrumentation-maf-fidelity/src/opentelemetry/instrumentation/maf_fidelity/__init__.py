"""Microsoft Agent Framework (Python) fidelity instrumentation.

Records the ``AgentResponse`` every agent invocation hands its caller (usage and finish reason, never
prompt or response text) as an ``agent_response {agent}`` span carrying
``fidelity.ledger.source = "AgentResponseEvent"``: the framework's own ledger, which a fidelity
collector reconciles against the chat spans of the same agent. MAF's own ``invoke_agent`` span
cannot serve: it re-sums its chat spans, and agent middleware may change the response after it.

Usage, with no call-site change::

    from opentelemetry.instrumentation.maf_fidelity import MafFidelityInstrumentor

    MafFidelityInstrumentor().instrument()                       # the global TracerProvider
    MafFidelityInstrumentor().instrument(tracer_provider=provider)

or ``opentelemetry-instrument python app.py`` (the ``opentelemetry_instrumentor`` entry point).

How: the public ``run`` of every agent class (``BaseAgent`` subclasses, including classes defined
later) is wrapped; only the outermost ``run`` of an instance's class records, so the framework's
layered ``super().run`` calls record once. The span is parented to that agent's own
``invoke_agent`` span when MAF's telemetry created one (so the collector attributes it
structurally, also for agents called as tools or nested in sub-workflows), else to the caller's
span. Plain runs record on return; streams when fully consumed, or, when the consumer stops early,
what it had received (``fidelity.stream.closed_early``). A run that raises records nothing.
``WorkflowAgent`` (``workflow.as_agent()``) is not recorded itself: its inner agents are.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Collection, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from opentelemetry.instrumentation.maf_fidelity.package import _instruments
from opentelemetry.instrumentation.maf_fidelity.version import __version__

LEDGER_SOURCE_ATTRIBUTE = "fidelity.ledger.source"
LEDGER_SOURCE = "AgentResponseEvent"
SPAN_PREFIX = "agent_response"
#: Agent classes that only wrap other agents (their inner agents are recorded instead).
COMPOSITE_AGENTS = frozenset({"WorkflowAgent"})

_USAGE_KEYS = (("input_token_count", "gen_ai.usage.input_tokens"),
               ("output_token_count", "gen_ai.usage.output_tokens"),
               ("total_token_count", "gen_ai.usage.total_tokens"))


@dataclass(slots=True)
class _Invocation:
    """One outermost agent run: where it was called from and, once MAF starts it, its agent span."""

    agent: Any
    parent: otel_context.Context
    start_ns: int = field(default_factory=time.time_ns)
    agent_span: trace.Span | None = None
    recorded: bool = False


_CURRENT: ContextVar[_Invocation | None] = ContextVar("maf_fidelity_invocation", default=None)


def response_attributes(response: Any) -> dict[str, Any]:
    """Usage and finish reason of an ``AgentResponse`` as GenAI span attributes."""
    attrs: dict[str, Any] = {}
    usage = getattr(response, "usage_details", None) or {}
    for key, attr in _USAGE_KEYS:
        value = usage.get(key) if isinstance(usage, dict) else getattr(usage, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            attrs[attr] = value
    finish = getattr(response, "finish_reason", None)
    if finish is not None:
        attrs["gen_ai.response.finish_reasons"] = [str(getattr(finish, "value", finish))]
    return attrs


def _agent_name(agent: Any) -> str:
    """The name MAF's own telemetry gives the agent (``gen_ai.agent.name``)."""
    return str(getattr(agent, "name", None) or getattr(agent, "id", None) or type(agent).__name__)


def _outermost_run_owner(cls: type) -> type | None:
    return next((klass for klass in cls.__mro__ if "run" in vars(klass)), None)


class MafFidelityInstrumentor(BaseInstrumentor):
    """OpenTelemetry instrumentor recording MAF agent responses as AgentResponseEvent spans."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        from agent_framework import BaseAgent
        from agent_framework.observability import AgentTelemetryLayer

        self._tracer = trace.get_tracer(__name__, __version__, tracer_provider=kwargs.get("tracer_provider"),
                                        schema_url="https://opentelemetry.io/schemas/1.28.0")
        self._originals: dict[type, Callable[..., Any]] = {}
        self._base = BaseAgent
        for cls in _subclasses(BaseAgent):
            self._wrap_class(cls)

        original_init_subclass = vars(BaseAgent).get("__init_subclass__")
        instrumentor = self

        def __init_subclass__(cls: type, **kw: Any) -> None:  # noqa: N807 (the hook's own name)
            if original_init_subclass is not None:
                original_init_subclass.__func__(cls, **kw)
            else:
                super(BaseAgent, cls).__init_subclass__(**kw)
            instrumentor._wrap_class(cls)  # agent classes defined after instrument() are covered too

        self._original_init_subclass = original_init_subclass
        BaseAgent.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]

        self._telemetry = AgentTelemetryLayer
        self._original_trace = AgentTelemetryLayer._trace_agent_invocation
        AgentTelemetryLayer._trace_agent_invocation = _capture_agent_span(self._original_trace)

    def _uninstrument(self, **kwargs: Any) -> None:
        for cls, original in self._originals.items():
            cls.run = original
        self._originals.clear()
        if self._original_init_subclass is None:
            del self._base.__init_subclass__
        else:
            self._base.__init_subclass__ = self._original_init_subclass
        self._telemetry._trace_agent_invocation = self._original_trace

    def _wrap_class(self, cls: type) -> None:
        original = vars(cls).get("run")
        if original is None or cls in self._originals or cls.__name__ in COMPOSITE_AGENTS:
            return
        self._originals[cls] = original
        cls.run = self._wrap_run(cls, original)

    def _wrap_run(self, owner: type, original: Callable[..., Any]) -> Callable[..., Any]:
        instrumentor = self

        @functools.wraps(original)
        def run(agent: Any, *args: Any, **kwargs: Any) -> Any:
            if _outermost_run_owner(type(agent)) is not owner or type(agent).__name__ in COMPOSITE_AGENTS:
                return original(agent, *args, **kwargs)  # a layer's super().run: the outer call records
            invocation = _Invocation(agent, otel_context.get_current())
            token = _CURRENT.set(invocation)
            try:
                result = original(agent, *args, **kwargs)
            finally:
                _CURRENT.reset(token)
            return instrumentor._observe(invocation, result, bool(kwargs.get("stream")))

        return run

    def _observe(self, invocation: _Invocation, result: Any, stream: bool) -> Any:
        from agent_framework import AgentResponse, ResponseStream

        if isinstance(result, ResponseStream):
            exhausted = failed = False

            @contextlib.contextmanager
            def pull() -> Iterator[None]:
                nonlocal exhausted, failed
                token = _CURRENT.set(invocation)
                try:
                    yield
                except StopAsyncIteration:
                    exhausted = True
                    raise
                except BaseException:
                    failed = True  # the run raised: its caller received no response
                    raise
                finally:
                    _CURRENT.reset(token)

            def on_result(response: Any) -> None:
                # MAF's own telemetry finalizes a stream the consumer closed early, so the final
                # response may be built from the updates received so far.
                if not failed:
                    self._record(invocation, response, stream=True, closed_early=not exhausted)

            def on_cleanup() -> None:
                if not exhausted and not failed and not invocation.recorded:  # the consumer stopped early
                    self._record(invocation, AgentResponse.from_updates(list(result.updates)), stream=True,
                                 closed_early=True)

            return result.with_pull_context_manager(pull).with_result_hook(on_result).with_cleanup_hook(on_cleanup)

        async def awaited() -> Any:
            token = _CURRENT.set(invocation)
            try:
                response = await result
            finally:
                _CURRENT.reset(token)
            self._record(invocation, response, stream=stream)
            return response

        return awaited()

    def _record(self, invocation: _Invocation, response: Any, stream: bool, closed_early: bool = False) -> None:
        if invocation.recorded:
            return
        invocation.recorded = True
        agent = invocation.agent
        attrs: dict[str, Any] = {
            LEDGER_SOURCE_ATTRIBUTE: LEDGER_SOURCE,
            "gen_ai.agent.name": _agent_name(agent),
            "fidelity.stream": stream,
            **response_attributes(response),
        }
        if (agent_id := getattr(agent, "id", None)) is not None:
            attrs["gen_ai.agent.id"] = str(agent_id)
        if closed_early:
            attrs["fidelity.stream.closed_early"] = True
        parent = (trace.set_span_in_context(invocation.agent_span) if invocation.agent_span is not None
                  else invocation.parent)
        span = self._tracer.start_span(f"{SPAN_PREFIX} {attrs['gen_ai.agent.name']}", context=parent,
                                       attributes=attrs, start_time=invocation.start_ns)
        span.end()


def _capture_agent_span(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap MAF's agent telemetry so the invocation learns its ``invoke_agent`` span: MAF calls
    ``execute`` with that span current."""

    @functools.wraps(original)
    def trace_agent_invocation(agent: Any, *args: Any, execute: Callable[[], Any], **kwargs: Any) -> Any:
        def execute_in_span() -> Any:
            invocation = _CURRENT.get()
            if invocation is not None and invocation.agent is agent and invocation.agent_span is None:
                span = trace.get_current_span()
                if span.get_span_context().is_valid:
                    invocation.agent_span = span
            return execute()

        return original(agent, *args, execute=execute_in_span, **kwargs)

    return trace_agent_invocation


def _subclasses(cls: type) -> list[type]:
    out, stack = [], [cls]
    while stack:
        klass = stack.pop()
        out.append(klass)
        stack.extend(klass.__subclasses__())
    return out
