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

A streamed chat call is sent when its stream is first read, but MAF's chat telemetry starts its
``chat {model}`` span when the stream is built. A chat middleware may replace that stream before
anyone reads it (MAF's ``override_result_with_middleware`` sample): no request is sent, and MAF ends
the span without a response when the stream is garbage collected. Such a span says so:
``fidelity.operation.name = "chat.unsent"`` (set when the stream is built, replaced by the span's own
operation when it is first read), so a collector never counts it as a model call.

One agent call may invoke the agent several times (a loop or approval middleware calling
``call_next()`` again): the one response covers them all. Where such a re-run starts with no span
current (a direct ``agent.run`` has none around it), MAF would start a new trace for it; it is
joined to the call's first ``invoke_agent`` span instead, so the collector sees the whole call.

Releases: the instrumentor checks for the MAF hooks it needs, not a version. Where one is missing it
records nothing and says which; on a release outside those tested it instruments and warns once.
It announces itself (``fidelity.instrumentation.version``, ``fidelity.maf.version``,
``fidelity.instrumentation.status``) on the spans it writes and on MAF's agent spans, so a collector
tells "not installed" from "installed, inactive on MAF X"; when inactive, on MAF's agent and workflow
spans through a span processor where the tracer provider takes one. A named agent says its name
(``fidelity.agent.name``); an agent without a name is known by MAF's per-process id, as MAF's own
agent span knows it (never by its class: two unnamed agents of one class would be one unit), and the
collector numbers such agents ``unnamed-agent-1``, ``-2``, ... in run order. The executor span of an
``AgentExecutor`` (or subclass) running its own agent says so (``fidelity.executor.type``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import weakref
from collections.abc import Callable, Collection, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.instrumentation.maf_fidelity.package import TESTED_NEWEST, TESTED_OLDEST, _instruments
from opentelemetry.instrumentation.maf_fidelity.version import __version__

LEDGER_SOURCE_ATTRIBUTE = "fidelity.ledger.source"
LEDGER_SOURCE = "AgentResponseEvent"
SPAN_PREFIX = "agent_response"
#: Agent classes that only wrap other agents (their inner agents are recorded instead).
COMPOSITE_AGENTS = frozenset({"WorkflowAgent"})
#: A named agent's name, on MAF's agent span and ours (absent for an agent without a name).
AGENT_NAME_ATTRIBUTE = "fidelity.agent.name"
#: On the executor span of an ``AgentExecutor`` (any subclass) whose own agent runs in it.
EXECUTOR_TYPE_ATTRIBUTE = "fidelity.executor.type"
AGENT_EXECUTOR = "AgentExecutor"
MAF_DISTRIBUTION = "agent-framework-core"
ANNOUNCEMENT_KEYS = ("fidelity.maf.version", "fidelity.instrumentation.version", "fidelity.instrumentation.status")
#: On MAF's chat span of a streamed call: what it turned out to record. ``chat.unsent`` from when its
#: stream is built until it is first read (then the span's own ``gen_ai.operation.name``): a stream
#: dropped unread sent no request, so its span is no model call.
OPERATION_ATTRIBUTE = "fidelity.operation.name"
UNSENT_CHAT = "chat.unsent"
#: MAF's module whose chat telemetry starts a streamed call's span (``_start_streaming_span``).
_OBSERVABILITY = "agent_framework.observability"
#: MAF spans stamped with the announcement while inactive (agent and workflow-run spans).
_ANNOUNCED_SPANS = ("invoke_agent", "workflow.run", "invoke_workflow")

_logger = logging.getLogger(__name__)

_USAGE_KEYS = (("input_token_count", "gen_ai.usage.input_tokens"),
               ("output_token_count", "gen_ai.usage.output_tokens"),
               ("total_token_count", "gen_ai.usage.total_tokens"))


@dataclass(slots=True)
class _Invocation:
    """One outermost agent run: where it was called from and, once MAF starts it, its agent span."""

    agent: Any
    parent: otel_context.Context
    #: What the agent is known by (:func:`agent_key`).
    name: str
    start_ns: int = field(default_factory=time.time_ns)
    agent_span: trace.Span | None = None
    recorded: bool = False


_CURRENT: ContextVar[_Invocation | None] = ContextVar("maf_fidelity_invocation", default=None)
#: While MAF's chat telemetry builds a stream: the chat span it starts, once started (with its operation).
_BUILDING: ContextVar[list[tuple[Any, Any]] | None] = ContextVar("maf_fidelity_chat_stream", default=None)


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


def stable_agent_name(agent: Any) -> str | None:
    """The agent's name (``fidelity.agent.name``), or None for an agent without one."""
    name = getattr(agent, "name", None)
    return str(name) if name else None


def agent_key(agent: Any) -> str:
    """What the agent is known by, as MAF's own telemetry knows it (``gen_ai.agent.name``): its name,
    else MAF's per-process id (so two unnamed agents, of one class or not, stay apart; the collector
    names them ``unnamed-agent-{n}``, never by the id), else its class."""
    return str(getattr(agent, "name", None) or getattr(agent, "id", None) or type(agent).__name__)


def _outermost_run_owner(cls: type) -> type | None:
    return next((klass for klass in cls.__mro__ if "run" in vars(klass)), None)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())


@dataclass(frozen=True, slots=True)
class Hooks:
    """What of MAF the instrumentation hooks, found in the installed release (None where missing)."""

    base_agent: type | None
    telemetry: type | None
    response_stream: type | None
    agent_response: type | None
    agent_executor: type | None
    #: MAF's chat telemetry layer and the function with which it starts a streamed call's span: where
    #: either is missing, an unread stream's span is not marked (the ledger does not need them).
    chat_telemetry: type | None = None
    start_streaming_span: Callable[..., Any] | None = None

    @classmethod
    def find(cls) -> Hooks:
        def get(module: str, name: str) -> Any:
            try:
                return getattr(__import__(module, fromlist=[name]), name, None)
            except ImportError:
                return None

        return cls(get("agent_framework", "BaseAgent"), get(_OBSERVABILITY, "AgentTelemetryLayer"),
                   get("agent_framework", "ResponseStream"), get("agent_framework", "AgentResponse"),
                   get("agent_framework", "AgentExecutor"), get(_OBSERVABILITY, "ChatTelemetryLayer"),
                   get(_OBSERVABILITY, "_start_streaming_span"))

    def missing(self) -> list[str]:
        """The hooks a ledger needs that this release lacks, by name."""
        wanted = [("BaseAgent", self.base_agent, ("__subclasses__",)),
                  ("AgentTelemetryLayer", self.telemetry, ("_trace_agent_invocation",)),
                  ("ResponseStream", self.response_stream,
                   ("with_pull_context_manager", "with_result_hook", "with_cleanup_hook", "updates")),
                  ("AgentResponse", self.agent_response, ("from_updates",))]
        out: list[str] = []
        for name, owner, attrs in wanted:
            if owner is None:
                out.append(name)
            else:
                out.extend(f"{name}.{attr}" for attr in attrs if not hasattr(owner, attr))
        return out


def maf_release() -> str | None:
    try:
        return metadata.version(MAF_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def status(release: str | None, missing: list[str]) -> str:
    """``active``, ``active, untested: ...`` or ``inactive: ...``: what the announcement says."""
    if release is None:
        return f"inactive: {MAF_DISTRIBUTION} is not installed"
    if missing:
        return f"inactive: {MAF_DISTRIBUTION} {release} lacks {', '.join(missing)}"
    if not _release(TESTED_OLDEST) <= _release(release) <= _release(TESTED_NEWEST):
        return (f"active, untested: {MAF_DISTRIBUTION} {release} is outside the tested {TESTED_OLDEST} to "
                f"{TESTED_NEWEST}")
    return "active"


class MafFidelityInstrumentor(BaseInstrumentor):
    """OpenTelemetry instrumentor recording MAF agent responses as AgentResponseEvent spans."""

    #: The announcement of the last ``instrument()`` (attributes), for the spans written and stamped.
    announcement: dict[str, str] = {}

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        hooks = Hooks.find()
        release = maf_release()
        missing = hooks.missing()
        said = status(release, missing)
        self.announcement = dict(zip(ANNOUNCEMENT_KEYS, (release or "none", __version__, said), strict=True))
        self._active = not missing and release is not None
        provider = kwargs.get("tracer_provider")
        if not self._active:
            _logger.warning("maf_fidelity %s: records nothing (%s)", __version__, said)
            self._announcer = _stamp_maf_spans(provider, self.announcement)
            return
        if said != "active":
            _logger.warning("maf_fidelity %s: %s", __version__, said)
        else:
            _logger.info("maf_fidelity %s: active on %s %s", __version__, MAF_DISTRIBUTION, release)
        self._tracer = trace.get_tracer(__name__, __version__, tracer_provider=provider,
                                        schema_url="https://opentelemetry.io/schemas/1.28.0")
        self._originals: dict[type, Callable[..., Any]] = {}
        self._hooks = hooks
        for cls in _subclasses(hooks.base_agent):
            self._wrap_class(cls)

        base = hooks.base_agent
        original_init_subclass = vars(base).get("__init_subclass__")
        instrumentor = self

        def __init_subclass__(cls: type, **kw: Any) -> None:
            if original_init_subclass is not None:
                original_init_subclass.__func__(cls, **kw)
            else:
                super(base, cls).__init_subclass__(**kw)
            instrumentor._wrap_class(cls)  # agent classes defined after instrument() are covered too

        self._original_init_subclass = original_init_subclass
        base.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]

        self._original_trace = hooks.telemetry._trace_agent_invocation
        hooks.telemetry._trace_agent_invocation = _capture_agent_span(self._original_trace, self.announcement)
        self._original_executor_init = None
        if hooks.agent_executor is not None:
            self._original_executor_init = hooks.agent_executor.__init__
            hooks.agent_executor.__init__ = _register_own_agent(self._original_executor_init)
        self._original_chat = None
        if (hooks.chat_telemetry is not None and hooks.start_streaming_span is not None
                and "get_response" in vars(hooks.chat_telemetry)):
            self._original_chat = hooks.chat_telemetry.get_response
            hooks.chat_telemetry.get_response = _mark_unsent_streams(self._original_chat, hooks.response_stream)
            __import__(_OBSERVABILITY, fromlist=["_"])._start_streaming_span = _capture_chat_span(
                hooks.start_streaming_span)

    def _uninstrument(self, **kwargs: Any) -> None:
        if not self._active:
            self._announcer.active = False
            return
        hooks = self._hooks
        for cls, original in self._originals.items():
            cls.run = original
        self._originals.clear()
        if self._original_init_subclass is None:
            del hooks.base_agent.__init_subclass__
        else:
            hooks.base_agent.__init_subclass__ = self._original_init_subclass
        hooks.telemetry._trace_agent_invocation = self._original_trace
        if self._original_executor_init is not None:
            hooks.agent_executor.__init__ = self._original_executor_init
        if self._original_chat is not None:
            hooks.chat_telemetry.get_response = self._original_chat
            __import__(_OBSERVABILITY, fromlist=["_"])._start_streaming_span = hooks.start_streaming_span

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
            _mark_agent_executor(agent)
            invocation = _Invocation(agent, otel_context.get_current(), agent_key(agent))
            token = _CURRENT.set(invocation)
            try:
                result = original(agent, *args, **kwargs)
            finally:
                _CURRENT.reset(token)
            return instrumentor._observe(invocation, result, bool(kwargs.get("stream")))

        return run

    def _observe(self, invocation: _Invocation, result: Any, stream: bool) -> Any:
        hooks = self._hooks
        if isinstance(result, hooks.response_stream):
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
                    self._record(invocation, hooks.agent_response.from_updates(list(result.updates)), stream=True,
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
        name = invocation.name
        attrs: dict[str, Any] = {
            LEDGER_SOURCE_ATTRIBUTE: LEDGER_SOURCE,
            "gen_ai.agent.name": name,
            "fidelity.stream": stream,
            **self.announcement,
            **response_attributes(response),
        }
        if (stable := stable_agent_name(agent)) is not None:
            attrs[AGENT_NAME_ATTRIBUTE] = stable
        if (agent_id := getattr(agent, "id", None)) is not None:
            attrs["gen_ai.agent.id"] = str(agent_id)
        if closed_early:
            attrs["fidelity.stream.closed_early"] = True
        parent = (trace.set_span_in_context(invocation.agent_span) if invocation.agent_span is not None
                  else invocation.parent)
        span = self._tracer.start_span(f"{SPAN_PREFIX} {name}", context=parent, attributes=attrs,
                                       start_time=invocation.start_ns)
        span.end()


def _capture_agent_span(original: Callable[..., Any], announcement: dict[str, str]) -> Callable[..., Any]:
    """Wrap MAF's agent telemetry so the invocation learns its ``invoke_agent`` span (MAF calls
    ``execute`` with that span current), says a named agent's name on that span and announces the
    instrumentation on it; and so a re-run of the agent inside one call that starts where no span is
    current joins the call's first ``invoke_agent`` span instead of starting a trace of its own."""

    @functools.wraps(original)
    def trace_agent_invocation(agent: Any, *args: Any, execute: Callable[[], Any], **kwargs: Any) -> Any:
        invocation = _CURRENT.get()
        ours = invocation is not None and invocation.agent is agent

        def execute_in_span() -> Any:
            span = trace.get_current_span()
            if ours and invocation.agent_span is None and span.get_span_context().is_valid:
                invocation.agent_span = span
            if span.is_recording():
                stable = stable_agent_name(agent)
                span.set_attributes({AGENT_NAME_ATTRIBUTE: stable, **announcement} if stable else announcement)
            return execute()

        rerun = ours and invocation.agent_span is not None and not trace.get_current_span().get_span_context().is_valid
        if not rerun:
            return original(agent, *args, execute=execute_in_span, **kwargs)
        joined = trace.set_span_in_context(invocation.agent_span)
        if kwargs.get("stream"):  # MAF starts a streamed invocation's span before returning the stream
            token = otel_context.attach(joined)
            try:
                return original(agent, *args, execute=execute_in_span, **kwargs)
            finally:
                otel_context.detach(token)
        pending = original(agent, *args, execute=execute_in_span, **kwargs)

        async def in_call() -> Any:  # a plain invocation starts its span when awaited
            token = otel_context.attach(joined)
            try:
                return await pending
            finally:
                otel_context.detach(token)

        return in_call()

    return trace_agent_invocation


def _capture_chat_span(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap MAF's ``_start_streaming_span`` so that, while its chat telemetry builds a stream, the chat
    span it starts is handed to :func:`_mark_unsent_streams` (with the span's operation)."""

    @functools.wraps(original)
    def start_streaming_span(attributes: Any, *args: Any, **kwargs: Any) -> Any:
        span = original(attributes, *args, **kwargs)
        building = _BUILDING.get()
        if building is not None and not building:
            operation = attributes.get("gen_ai.operation.name") if isinstance(attributes, dict) else None
            building.append((span, operation if isinstance(operation, str) else "chat"))
        return span

    return start_streaming_span


def _mark_unsent_streams(original: Callable[..., Any], response_stream: type) -> Callable[..., Any]:
    """Wrap MAF's chat telemetry so that the span of a streamed call says ``chat.unsent`` from when its
    stream is built until it is first read (its own operation then): a stream dropped unread (a chat
    middleware replaced it) sent no request. A build that raises marks nothing (its span records the
    error: a failed call).

    Read means: the stream was iterated, or resolving it ran code (an awaitable source, which may send
    the request), or either raised. Only resolving a lazy source (an async generator, as MAF's provider
    clients return) runs nothing: MAF's chat middleware resolves the stream it passes on, read or not.
    Where the stream does not show which it is (a MAF release that renamed its internals), any
    resolution counts as a read: the span stays a chat call, as without this mark."""

    @functools.wraps(original)
    def get_response(client: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("stream"):
            return original(client, *args, **kwargs)
        building: list[tuple[Any, Any]] = []
        token = _BUILDING.set(building)
        try:
            result = original(client, *args, **kwargs)
        finally:
            _BUILDING.reset(token)
        if not building or not isinstance(result, response_stream):
            return result
        span, operation = building[0]
        if not span.is_recording():
            return result
        span.set_attribute(OPERATION_ATTRIBUTE, UNSENT_CHAT)
        stream = weakref.ref(result)  # the stream holds this hook: no reference cycle through it
        sent = False

        @contextlib.contextmanager
        def read() -> Iterator[None]:
            nonlocal sent
            if sent:
                yield
                return
            lazy = hasattr(getattr(stream(), "_stream_source", None), "__aiter__")
            raised = True
            try:
                yield
                raised = False
            finally:
                if raised or not lazy or getattr(stream(), "_iterator", True) is not None:
                    sent = True
                    span.set_attribute(OPERATION_ATTRIBUTE, operation)

        return result.with_pull_context_manager(read)

    return get_response


#: Agents hosted by an ``AgentExecutor`` (any subclass), to the executor's id.
_OWN_AGENTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _register_own_agent(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(executor: Any, *args: Any, **kwargs: Any) -> None:
        original(executor, *args, **kwargs)
        agent = getattr(executor, "_agent", None) or getattr(executor, "agent", None)
        with contextlib.suppress(TypeError):  # an agent that cannot be weakly referenced keeps MAF's naming
            if agent is not None:
                _OWN_AGENTS[agent] = str(getattr(executor, "id", ""))

    return __init__


def _mark_agent_executor(agent: Any) -> None:
    """Say on the current executor span that it is an ``AgentExecutor`` running its own agent: MAF's
    ``executor.type`` is the class's short name, which a subclass changes."""
    try:
        executor_id = _OWN_AGENTS.get(agent)
    except TypeError:
        return
    span = trace.get_current_span()
    if executor_id and span.is_recording() and getattr(span, "name", None) == f"executor.process {executor_id}":
        span.set_attribute(EXECUTOR_TYPE_ATTRIBUTE, AGENT_EXECUTOR)


@dataclass(slots=True)
class _Announcer:
    """A span processor stamping MAF's agent and workflow spans with the announcement, so a collector
    sees an inactive instrumentation (duck-typed: the SDK is not a dependency of this package)."""

    announcement: dict[str, str]
    active: bool = True

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if self.active and span.name.startswith(_ANNOUNCED_SPANS):
            span.set_attributes(self.announcement)

    def _on_ending(self, span: Any) -> None:
        pass

    def on_end(self, span: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _stamp_maf_spans(provider: Any, announcement: dict[str, str]) -> _Announcer:
    announcer = _Announcer(announcement)
    provider = provider or trace.get_tracer_provider()
    add = getattr(provider, "add_span_processor", None)
    if add is not None:
        add(announcer)
    else:
        _logger.warning("maf_fidelity: the tracer provider takes no span processor; the collector will "
                        "not see that this instrumentation is inactive")
    return announcer


def _subclasses(cls: type) -> list[type]:
    out, stack = [], [cls]
    while stack:
        klass = stack.pop()
        out.append(klass)
        stack.extend(klass.__subclasses__())
    return out
