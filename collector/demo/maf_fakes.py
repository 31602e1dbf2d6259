"""Real MAF Python workflows on a deterministic fake chat client (no network, no keys).

Used by ``agenteval demo`` and the tests: the workflows, agents, middleware and telemetry layers
are agent-framework-core's own; only the model behind the chat client is scripted.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from agent_framework import (
    Agent,
    AgentContext,
    AgentExecutorResponse,
    BaseChatClient,
    ChatMiddlewareLayer,
    ChatResponse,
    ChatResponseUpdate,
    Content,
    FinishReason,
    FunctionExecutor,
    FunctionInvocationLayer,
    Message,
    ResponseStream,
    UsageDetails,
    Workflow,
    WorkflowBuilder,
    WorkflowContext,
    agent_middleware,
    tool,
)
from agent_framework.exceptions import ChatClientException
from agent_framework.observability import ChatTelemetryLayer


@dataclass(frozen=True)
class Turn:
    """One scripted model call: its usage and finish reason, optionally a tool call."""

    input_tokens: int
    output_tokens: int
    finish_reason: str = "stop"
    tool_call: str | None = None
    #: False: the response carries no usage or finish reason (what the chat span then lacks).
    report: bool = True
    #: Set: the call raises this instead of answering (a provider error such as a 429).
    error: str | None = None


class ScriptedChatClient(BaseChatClient):
    """Plays back :class:`Turn`s in order (cycling), streaming or not."""

    OTEL_PROVIDER_NAME = "fake"

    def __init__(self, *, turns: Sequence[Turn], model: str = "fake-model", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.turns = list(turns)
        self.model = model
        self.calls = 0
        self.last_usage: UsageDetails | None = None

    def _next(self) -> Turn:
        turn = self.turns[self.calls % len(self.turns)]
        self.calls += 1
        return turn

    @staticmethod
    def _contents(turn: Turn) -> list[Content]:
        if turn.tool_call:
            return [Content.from_function_call(f"call-{turn.tool_call}", turn.tool_call, arguments={"query": "x"})]
        return [Content.from_text("ok")]

    @staticmethod
    def _usage(turn: Turn) -> UsageDetails:
        return UsageDetails(input_token_count=turn.input_tokens, output_token_count=turn.output_tokens,
                            total_token_count=turn.input_tokens + turn.output_tokens)

    def _inner_get_response(self, *, messages: Sequence[Message], stream: bool, options: Any, **kwargs: Any):
        turn = self._next()
        if turn.error:
            raise ChatClientException(turn.error)
        usage = self._usage(turn) if turn.report else None
        self.last_usage = usage
        finish = FinishReason(turn.finish_reason) if turn.report else None
        if stream:
            async def updates():
                yield ChatResponseUpdate(role="assistant", contents=self._contents(turn))
                tail = [Content.from_usage(usage)] if usage else []
                yield ChatResponseUpdate(role="assistant", contents=tail, finish_reason=finish)

            return ResponseStream(updates(), finalizer=ChatResponse.from_updates)

        async def respond() -> ChatResponse:
            return ChatResponse(messages=[Message(role="assistant", contents=self._contents(turn))],
                                finish_reason=finish, usage_details=usage)

        return respond()


class InstrumentedChatClient(FunctionInvocationLayer, ChatMiddlewareLayer, ChatTelemetryLayer, ScriptedChatClient):
    """The layer stack of MAF's provider clients (``FunctionInvocationLayer`` outermost, so function
    middleware and tool loops work), with ``ChatTelemetryLayer``: emits one chat span per model call."""


class UninstrumentedChatClient(FunctionInvocationLayer, ChatMiddlewareLayer, ScriptedChatClient):
    """No ``ChatTelemetryLayer``: no chat span at all (``no_chat_trace``)."""


@tool
def lookup(query: str) -> str:
    """Look something up (a deterministic stand-in tool)."""
    return f"facts about {query}"


def _rewrite_response(rewrite: Callable[[AgentContext, Any], None]) -> Callable[..., Awaitable[None]]:
    """Agent middleware applying ``rewrite(context, response)`` to the response the caller receives,
    plain or streamed (a stream's final response is rewritten by a result hook)."""

    @agent_middleware
    async def middleware(context: AgentContext, call_next: Callable[[], Awaitable[None]]) -> None:
        await call_next()
        if isinstance(context.result, ResponseStream):
            def hook(response: Any) -> Any:
                rewrite(context, response)
                return response

            context.result = context.result.with_result_hook(hook)
        else:
            rewrite(context, context.result)

    return middleware


def keep_last_call_usage() -> Callable[..., Awaitable[None]]:
    """Agent middleware reproducing the MAF .NET bug fixed in PR 7539: in a tool loop the agent's
    response keeps only the last chat call's usage instead of the sum."""

    def rewrite(context: AgentContext, response: Any) -> None:
        agent = context.agent
        assert isinstance(agent, Agent) and isinstance(agent.client, ScriptedChatClient)  # make_agent's
        response.usage_details = dict(agent.client.last_usage or {})

    return _rewrite_response(rewrite)


def report_usage(usage: dict[str, int], finish_reason: str | None) -> Callable[..., Awaitable[None]]:
    """Agent middleware standing in for the InProcessExecution path: the framework's response
    carries usage that never crossed the instrumented chat client."""

    def rewrite(context: AgentContext, response: Any) -> None:
        response.usage_details = dict(usage)
        response.finish_reason = finish_reason

    return _rewrite_response(rewrite)


def drop_finish_reason() -> Callable[..., Awaitable[None]]:
    """Agent middleware that suppresses the response's finish reason (reports none)."""

    def rewrite(context: AgentContext, response: Any) -> None:
        response.finish_reason = None

    return _rewrite_response(rewrite)


def under_report(fraction: float) -> Callable[..., Awaitable[None]]:
    """Agent middleware reporting only ``fraction`` of the agent's real usage (a generic under-report)."""

    def rewrite(context: AgentContext, response: Any) -> None:
        usage = dict(response.usage_details or {})
        response.usage_details = {k: int(v * fraction) for k, v in usage.items() if isinstance(v, int)}

    return _rewrite_response(rewrite)


@dataclass(frozen=True)
class AgentSpec:
    name: str
    turns: Sequence[Turn]
    instrumented: bool = True
    middleware: Sequence[Any] = ()
    tools: Sequence[Any] = ()
    #: What its chat spans name as the model and provider (a model genai-prices prices: the demo shows spend).
    model: str = "gpt-4o-mini"
    provider: str = "openai"


def make_agent(spec: AgentSpec) -> Agent:
    client = (InstrumentedChatClient(turns=spec.turns, model=spec.model, otel_provider_name=spec.provider)
              if spec.instrumented else UninstrumentedChatClient(turns=spec.turns, model=spec.model))
    return Agent(client, name=spec.name, instructions=f"You are {spec.name}.",
                 middleware=list(spec.middleware), tools=list(spec.tools) or None)


def chain(name: str, specs: Sequence[AgentSpec]) -> Workflow:
    """A sequential workflow: each agent's response goes to the next."""
    agents = [make_agent(s) for s in specs]
    builder = WorkflowBuilder(start_executor=agents[0], name=name)
    for a, b in pairwise(agents):
        builder.add_edge(a, b)
    return builder.build()


def review_loop(name: str, spec: AgentSpec, passes: int) -> Workflow:
    """One agent run ``passes`` times: a gate (a function executor, no agent) sends its response back
    to it until then. A cycle through the gate, not a self-loop edge, which MAF warns about."""
    agent = make_agent(spec)
    runs = {"n": 0}

    async def gate(response: AgentExecutorResponse, ctx: WorkflowContext[AgentExecutorResponse]) -> None:
        runs["n"] += 1
        if runs["n"] < passes:
            await ctx.send_message(response)

    gate_executor = FunctionExecutor(gate, id="gate")
    return (WorkflowBuilder(start_executor=agent, name=name)
            .add_edge(agent, gate_executor).add_edge(gate_executor, agent).build())


@dataclass(frozen=True)
class DemoWorkflow:
    """A named real workflow and the verdicts the collector should reach for it."""

    name: str
    build: Callable[[], Any]
    status: str
    verdicts: dict[str, str]
    about: str


def demo_workflows() -> list[DemoWorkflow]:
    tool_loop = [Turn(300, 40, "tool_calls", tool_call="lookup"), Turn(420, 180)]
    return [
        DemoWorkflow(
            "agree", lambda: chain("agree", [AgentSpec("researcher", [Turn(420, 180)]),
                                             AgentSpec("writer", tool_loop, tools=[lookup]),
                                             AgentSpec("reviewer", [Turn(700, 90)])]),
            "PASS", {"researcher": "Agree", "writer": "Agree", "reviewer": "Agree"},
            "three agents, framework and chat boundary agree"),
        DemoWorkflow(
            "under-report", lambda: chain("under-report", [
                AgentSpec("researcher", [Turn(420, 180)]),
                AgentSpec("writer", tool_loop, tools=[lookup], middleware=[keep_last_call_usage()])]),
            "FAIL", {"researcher": "Agree", "writer": "TokenMismatch"},
            "the writer's response keeps only the last chat call of its tool loop's usage"),
        DemoWorkflow(
            "suppressed-finish", lambda: chain("suppressed-finish", [
                AgentSpec("researcher", [Turn(420, 180)]), AgentSpec("writer", [Turn(610, 350)]),
                AgentSpec("reviewer", [Turn(700, 90, "content_filter")], middleware=[drop_finish_reason()])]),
            "WARN", {"researcher": "Agree", "writer": "Agree", "reviewer": "FinishMismatch"},
            "the chat call ended content_filter, the framework reports no finish reason"),
        DemoWorkflow(
            "reviewer-loop", lambda: review_loop("reviewer-loop", AgentSpec("reviewer", [Turn(400, 60), Turn(420, 55),
                                                                                        Turn(430, 20)]), 3),
            "PASS", {"reviewer": "Agree"},
            "an executor that runs three times; summed per executor it agrees"),
        DemoWorkflow(
            "path2-pending", lambda: chain("path2-pending", [
                AgentSpec("researcher", [Turn(420, 180, report=False)],
                          middleware=[report_usage({"input_token_count": 420, "output_token_count": 180}, "stop")]),
                AgentSpec("writer", [Turn(610, 350)], instrumented=False)]),
            "PENDING", {"researcher": "NoTruth", "writer": "NoTruth"},
            "chat spans without response data (Path-2) and a client without ChatTelemetryLayer"),
        DemoWorkflow(
            "path2-partial", lambda: chain("path2-partial", [
                AgentSpec("researcher", [Turn(420, 180)]), AgentSpec("writer", [Turn(610, 350)], instrumented=False)]),
            "WARN", {"researcher": "Agree", "writer": "NoTruth"},
            "one executor checked, one without chat telemetry: a pass that cannot be PASS"),
    ]
