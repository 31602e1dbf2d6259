"""Real-world MAF Python shapes beyond the builder patterns of :mod:`maf_patterns`.

Each builder returns a fresh real agent-framework-core 1.23 / agent-framework-orchestrations 1.4
workflow (or agent) on the scripted clients of :mod:`collector.demo.maf_fakes`, or (MAF's own samples,
region 9) on MAF's real provider client talking to the tests' model server (:mod:`llm_server`); the
module-level constants give what the chat boundary and the caller will see, derived from the scripts.

What MAF 1.23 does here (measured, not assumed):

- ``AgentLoopMiddleware`` and ``ToolApprovalMiddleware`` sit in the agent middleware layer, which
  wraps MAF's agent telemetry: every ``call_next()`` is an ``invoke_agent`` span of its own, while
  the caller receives ONE ``AgentResponse`` (one ``agent_response`` ledger span, recorded under the
  first ``invoke_agent``). Inside a workflow all iterations share the workflow's trace; a direct
  ``agent.run`` (no parent span) starts a new trace for every iteration, plain and streamed.
- The loop's non-streaming response aggregates every iteration's usage unless
  ``return_final_only=True``; its streaming response (the stream's final response, which the
  ``AgentExecutor`` also uses) is always the LAST iteration's only (``return_final_only`` "has no
  effect on streaming runs").
- ``ToolApprovalMiddleware`` (auto-approval rule) re-runs the agent after approving: its streaming
  response is built from every update (both runs' usage); its non-streaming response is the re-run's
  own (the first run's usage is lost).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from dataclasses import dataclass
from random import randint
from typing import Annotated, Any

from agent_framework import (
    Agent,
    AgentContext,
    AgentExecutor,
    AgentExecutorResponse,
    AgentLoopMiddleware,
    AgentMiddleware,
    AgentResponse,
    AgentResponseUpdate,
    ChatContext,
    ChatResponse,
    ChatResponseUpdate,
    Content,
    Message,
    MiddlewareTermination,
    ResponseStream,
    ToolApprovalMiddleware,
    Workflow,
    WorkflowBuilder,
    add_usage_details,
    agent_middleware,
    tool,
)
from agent_framework_orchestrations import ConcurrentBuilder, SequentialBuilder
from pydantic import Field

from collector.demo.maf_fakes import Turn, lookup

from llm_server import Reply as ModelReply
from maf_patterns import Say, TextInstrumentedChatClient

TASK = "Write a short report."

# region a client whose responses may lack token counts


@dataclass(frozen=True)
class Reply(Say):
    """A :class:`Say` turn whose usage may be partial: ``counts`` is ``"both"`` (input, output and
    total), ``"output"`` (output tokens only, no input and no total: what some providers send) or
    ``"none"`` (a finish reason and no usage at all: a stream without usage in its last chunk)."""

    counts: str = "both"


class PartialUsageChatClient(TextInstrumentedChatClient):
    """:class:`TextInstrumentedChatClient` playing :class:`Reply` turns' partial usage."""

    @staticmethod
    def _usage(turn: Turn) -> dict[str, int] | None:
        counts = getattr(turn, "counts", "both")
        if counts == "none":
            return None
        if counts == "output":
            return {"output_token_count": turn.output_tokens}
        return {"input_token_count": turn.input_tokens, "output_token_count": turn.output_tokens,
                "total_token_count": turn.input_tokens + turn.output_tokens}


def real_agent(name: str | None, turns: Sequence[Turn], *, middleware: Sequence[Any] = (),
               tools: Sequence[Any] = (), **kwargs: Any) -> Agent:
    """An :class:`Agent` on a scripted, chat-instrumented client; ``name=None``: an unnamed agent."""
    return Agent(PartialUsageChatClient(turns=turns), name=name, instructions=f"You are {name or 'helpful'}.",
                 middleware=list(middleware) or None, tools=list(tools) or None, **kwargs)


def total(turns: Sequence[Turn]) -> int:
    return sum(t.input_tokens + t.output_tokens for t in turns)


# endregion

# region 1a: AgentLoopMiddleware


#: The drafter's answer is cut off twice (finish ``length``); the loop re-runs it until it stops.
LOOP_TURNS = [Turn(300, 400, "length"), Turn(350, 420, "length"), Turn(380, 150, "stop")]
LOOP_TOKENS = total(LOOP_TURNS)  # 2000: every iteration's chat call
LOOP_LAST_TOKENS = total(LOOP_TURNS[-1:])  # 530: the last iteration's only


def _truncated(*, last_result: AgentResponse, **_: Any) -> bool:
    """Keep going while the answer was cut off (what a user writes for should_continue)."""
    reason = last_result.finish_reason
    return str(getattr(reason, "value", reason)) == "length"


def looping_drafter(*, return_final_only: bool = False, middleware: Sequence[Any] = ()) -> Agent:
    return real_agent("drafter", LOOP_TURNS, middleware=[
        *middleware, AgentLoopMiddleware(_truncated, return_final_only=return_final_only, max_iterations=5)])


def loop_workflow(*, return_final_only: bool = False) -> Workflow:
    return WorkflowBuilder(name="drafting_loop",
                           start_executor=looping_drafter(return_final_only=return_final_only)).build()


# endregion

# region 1b: a tool approval that re-runs the agent inside one agent call


@tool(approval_mode="always_require")
def send_email(query: str) -> str:
    """Send an email (needs approval)."""
    return f"sent: {query}"


#: The mailer asks to call send_email (needs approval: the run ends there), is approved, and is
#: re-run: the tool runs and the model answers.
APPROVAL_TURNS = [Turn(310, 30, "tool_calls", tool_call="send_email"), Turn(520, 140, "stop")]
APPROVAL_TOKENS = total(APPROVAL_TURNS)  # 1000
APPROVAL_RERUN_TOKENS = total(APPROVAL_TURNS[1:])  # 660


class ApproveAndRerun(AgentMiddleware):
    """Approves every tool-approval request and runs the agent again, returning ONE response with
    the re-run's messages and both runs' usage (the approval round-trip a caller would otherwise do
    itself, folded into one agent call). Non-streaming runs only."""

    async def process(self, context: Any, call_next: Callable[[], Awaitable[None]]) -> None:
        await call_next()
        first = context.result
        requests = [c for m in first.messages for c in m.contents if c.type == "function_approval_request"]
        if not requests:
            return
        context.messages = [*context.messages, *first.messages,
                            Message(role="user", contents=[r.to_function_approval_response(approved=True)
                                                           for r in requests])]
        await call_next()
        second = context.result
        context.result = AgentResponse(messages=list(second.messages), finish_reason=second.finish_reason,
                                       usage_details=add_usage_details(first.usage_details, second.usage_details))


def auto_approval() -> ToolApprovalMiddleware:
    """MAF's own tool-approval middleware with a standing rule approving send_email."""
    return ToolApprovalMiddleware(auto_approval_rules=[lambda call: call.name == "send_email"])


def approval_workflow(middleware: Sequence[Any]) -> Workflow:
    mailer = real_agent("mailer", APPROVAL_TURNS, middleware=middleware, tools=[send_email])
    return WorkflowBuilder(name="approved_mail", start_executor=mailer).build()


# endregion

# region 2: partial usage


#: researcher: a tool loop whose second call reports output tokens only; writer: output tokens only.
RESEARCHER_TURNS = [Reply(300, 40, "tool_calls", tool_call="lookup"), Reply(0, 90, counts="output")]
RESEARCHER_TOKENS = 300 + 40 + 90  # 430: the missing input side counts 0
WRITER_TURNS = [Reply(0, 250, counts="output")]
WRITER_TOKENS = 250


def output_only_workflow(writer_middleware: Sequence[Any] = ()) -> Workflow:
    return SequentialBuilder(name="output_only_usage", participants=[
        real_agent("researcher", RESEARCHER_TURNS, tools=[lookup]),
        real_agent("writer", WRITER_TURNS, middleware=writer_middleware)]).build()


#: planner: full usage; narrator: finish reasons, no token counts on any call (a tool loop);
#: fact_checker: a tool loop whose last call has a finish reason and no token counts.
PLANNER_TURNS = [Reply(400, 60)]
NARRATOR_TURNS = [Reply(0, 0, "tool_calls", tool_call="lookup", counts="none"), Reply(0, 0, counts="none")]
FACT_CHECKER_TURNS = [Reply(280, 35, "tool_calls", tool_call="lookup"), Reply(0, 0, counts="none")]


def missing_usage_workflow() -> Workflow:
    return SequentialBuilder(name="missing_usage", participants=[
        real_agent("planner", PLANNER_TURNS),
        real_agent("narrator", NARRATOR_TURNS, tools=[lookup]),
        real_agent("fact_checker", FACT_CHECKER_TURNS, tools=[lookup])]).build()


# endregion

# region 3: an executor calling a chat client itself


SUMMARY_TURNS = [Turn(900, 120)]
SUMMARY_TOKENS = total(SUMMARY_TURNS)  # 1020
ANALYST_TURNS, CRITIC_TURNS = [Turn(500, 100)], [Turn(510, 110)]


def summarizing_concurrent_workflow() -> Workflow:
    """ConcurrentBuilder with a custom aggregator that summarizes the agents' answers with a chat
    client of its own (MAF's ``concurrent_custom_aggregator`` sample): the aggregator executor
    ``summarize`` makes a chat call with no agent above it."""
    summarizer = TextInstrumentedChatClient(turns=SUMMARY_TURNS)

    async def summarize(results: list[AgentExecutorResponse]) -> str:
        answers = "\n".join(f"{r.executor_id}: {r.agent_response.text}" for r in results)
        response = await summarizer.get_response([Message(role="user", contents=[f"Summarize:\n{answers}"])])
        return response.text

    return (ConcurrentBuilder(name="concurrent_summary", participants=[
        real_agent("analyst", ANALYST_TURNS), real_agent("critic", CRITIC_TURNS)])
        .with_aggregator(summarize).build())


# endregion

# region 4: an agent that its middleware answers without a model call


GUARD_TURNS = [Turn(999, 99)]  # never played: the guard's middleware answers first
GUARDED_WRITER_TURNS = [Turn(610, 350)]
GUARD_REPORTED = {"input_token_count": 45, "output_token_count": 12, "total_token_count": 57}


def answering_middleware(*, terminate: bool, usage: dict[str, int] | None = None) -> Any:
    """Agent middleware that answers for the agent (a guardrail or cache hit) without calling it:
    sets ``context.result`` and returns, or (``terminate``) also raises MiddlewareTermination.
    ``usage``: the canned response claims token usage (it made no model call)."""

    @agent_middleware
    async def middleware(context: Any, call_next: Callable[[], Awaitable[None]]) -> None:
        contents = [Content.from_text("I can't help with that.")]
        if context.stream:
            async def updates():
                yield AgentResponseUpdate(role="assistant", contents=contents)
                if usage:
                    yield AgentResponseUpdate(role="assistant", contents=[Content.from_usage(dict(usage))])

            context.result = ResponseStream(updates(), finalizer=AgentResponse.from_updates)
        else:
            context.result = AgentResponse(messages=[Message(role="assistant", contents=contents)],
                                           usage_details=dict(usage) if usage else None)
        if terminate:
            raise MiddlewareTermination("blocked by guardrail")

    return middleware


def guarded_workflow(*, terminate: bool = False, usage: dict[str, int] | None = None) -> Workflow:
    return SequentialBuilder(name="guarded", participants=[
        real_agent("guard", GUARD_TURNS, middleware=[answering_middleware(terminate=terminate, usage=usage)]),
        real_agent("writer", GUARDED_WRITER_TURNS)]).build()


# endregion

# region 5, 6, 8: names and subjects


DRAFT_TURNS = [Turn(410, 90)]
ASSISTANT_TURNS = [Say(330, 60, "tool_calls", tool_call="calculator", arguments={"task": "2+2"}), Turn(480, 120)]
CALCULATOR_TURNS = [Turn(230, 45)]


def unnamed_agents_workflow() -> Workflow:
    """Agents created without a name (``Agent(client, instructions=...)``), as many samples do: two
    hosted by AgentExecutors with explicit ids, and one called as a tool by the second. The workflow
    has no name either."""
    draft = real_agent(None, DRAFT_TURNS)
    calculator = real_agent(None, CALCULATOR_TURNS)
    assistant = real_agent(None, ASSISTANT_TURNS, tools=[calculator.as_tool(name="calculator")])
    drafting, assisting = AgentExecutor(draft, id="draft"), AgentExecutor(assistant, id="assistant")
    return WorkflowBuilder(start_executor=drafting).add_edge(drafting, assisting).build()


WRITER_STEP_TURNS, REVIEWER_TURNS = [Turn(420, 180)], [Turn(700, 90)]


class ReviewStep(AgentExecutor):
    """An AgentExecutor subclass hosting its own agent (what users write to add handlers)."""

    def __init__(self) -> None:
        super().__init__(real_agent("reviewer", REVIEWER_TURNS), id="step-2")


def review_step_workflow() -> Workflow:
    writer = real_agent("writer", WRITER_STEP_TURNS)
    review = ReviewStep()
    return WorkflowBuilder(name="review_steps", start_executor=writer).add_edge(writer, review).build()


def two_step_workflow(name: str | None) -> Workflow:
    """researcher -> writer, every agent's response a workflow output (for callers that record them)."""
    researcher = real_agent("researcher", [Turn(420, 180)])
    writer = real_agent("writer", [Turn(610, 350)])
    return (WorkflowBuilder(name=name, start_executor=researcher, output_from="all")
            .add_edge(researcher, writer).build())


TWO_STEP_TOKENS = {"researcher": 600, "writer": 960}

# endregion

# region 9: MAF's own sample override_result_with_middleware, on its real OpenAI client
#
# python/samples/02-agents/middleware/override_result_with_middleware.py, as published: the same tool,
# middleware and calls (a plain run for Seattle, then a streamed run for Portland), on
# agent_framework.openai's OpenAIChatClient pointed at the tests' model server instead of OpenAI.
#
# What MAF does with it (measured on 1.22 and 1.26): the chat middleware lets the call go on, then
# replaces its result. Plain, the model was called first (it asked for get_weather) and its
# response, usage and all, is replaced by a message without usage: the tool never runs and the
# caller's AgentResponse reports no tokens and no finish reason. Streamed, ``call_next()`` only
# builds the stream, and the middleware replaces it before anyone reads it: the model is never
# called. MAF's chat telemetry has started its ``chat {model}`` span all the same (when the stream
# is built), and ends it without a response when that stream is garbage collected.


# NOTE: approval_mode="never_require" is for sample brevity. Use "always_require" in production;
# see samples/02-agents/tools/function_tool_with_approval.py
# and samples/02-agents/tools/function_tool_with_approval_and_sessions.py.
@tool(approval_mode="never_require")
def get_weather(
    location: Annotated[str, Field(description="The location to get the weather for.")],
) -> str:
    """Get the weather for a given location."""
    conditions = ["sunny", "cloudy", "rainy", "stormy"]
    return f"The weather in {location} is {conditions[randint(0, 3)]} with a high of {randint(10, 30)}°C."


async def weather_override_middleware(context: ChatContext, call_next: Callable[[], Awaitable[None]]) -> None:
    """Chat middleware that overrides weather results for both streaming and non-streaming cases."""

    # Let the original agent execution complete first
    await call_next()

    # Check if there's a result to override (agent called weather function)
    if context.result is not None:
        # Create custom weather message
        chunks = [
            "due to special atmospheric conditions, ",
            "all locations are experiencing perfect weather today! ",
            "Temperature is a comfortable 22°C with gentle breezes. ",
            "Perfect day for outdoor activities!",
        ]

        if context.stream and isinstance(context.result, ResponseStream):

            async def _override_stream() -> AsyncIterable[ChatResponseUpdate]:
                for i, chunk_text in enumerate(chunks):
                    yield ChatResponseUpdate(
                        contents=[Content.from_text(text=f"Weather Advisory: [{i}] {chunk_text}")],
                        role="assistant",
                    )

            context.result = ResponseStream(_override_stream(), finalizer=ChatResponse.from_updates)
        else:
            # For non-streaming: just replace with a new message
            current_text = context.result.text if isinstance(context.result, ChatResponse) else ""
            custom_message = f"Weather Advisory: [0] {''.join(chunks)} Original message was: {current_text}"
            context.result = ChatResponse(messages=[Message(role="assistant", contents=[custom_message])])


async def validate_weather_middleware(context: ChatContext, call_next: Callable[[], Awaitable[None]]) -> None:
    """Chat middleware that simulates result validation for both streaming and non-streaming cases."""
    await call_next()

    validation_note = "Validation: weather data verified."

    if context.result is None:
        return

    if context.stream and isinstance(context.result, ResponseStream):
        result_stream = context.result

        async def _validated_stream() -> AsyncIterable[ChatResponseUpdate]:
            async for update in result_stream:
                yield update
            yield ChatResponseUpdate(
                contents=[Content.from_text(text=validation_note)],
                role="assistant",
            )

        context.result = ResponseStream(_validated_stream(), finalizer=ChatResponse.from_updates)
    elif isinstance(context.result, ChatResponse):
        context.result.messages.append(Message(role="assistant", contents=[validation_note]))


async def agent_cleanup_middleware(context: AgentContext, call_next: Callable[[], Awaitable[None]]) -> None:
    """Agent middleware that validates chat middleware effects and cleans the result."""
    await call_next()

    if context.result is None:
        return

    validation_note = "Validation: weather data verified."

    state = {"found_prefix": False, "found_validation": False}

    def _sanitize(response: AgentResponse) -> AgentResponse:
        found_prefix = state["found_prefix"]
        found_validation = state["found_validation"]
        cleaned_messages: list[Message] = []

        for message in response.messages:
            text = message.text
            if text is None:
                cleaned_messages.append(message)
                continue

            if validation_note in text:
                found_validation = True
                text = text.replace(validation_note, "").strip()
                if not text:
                    continue

            if "Weather Advisory:" in text:
                found_prefix = True
                text = text.replace("Weather Advisory:", "")

            text = re.sub(r"\[\d+\]\s*", "", text).strip()
            if not text:
                continue

            cleaned_messages.append(
                Message(
                    role=message.role,
                    contents=[text],
                    author_name=message.author_name,
                    message_id=message.message_id,
                    additional_properties=message.additional_properties,
                    raw_representation=message.raw_representation,
                )
            )

        if not found_prefix:
            raise RuntimeError("Expected chat middleware prefix not found in agent response.")
        if not found_validation:
            raise RuntimeError("Expected validation note not found in agent response.")

        cleaned_messages.append(Message(role="assistant", contents=[" Agent: OK"]))
        response.messages = cleaned_messages
        return response

    if context.stream and isinstance(context.result, ResponseStream):

        def _clean_update(update: AgentResponseUpdate) -> AgentResponseUpdate:
            cleaned_contents: list[Content] = []

            for content in update.contents or []:
                if not content.text:
                    cleaned_contents.append(content)
                    continue
                text = content.text
                if "Weather Advisory:" in text:
                    state["found_prefix"] = True
                    text = text.replace("Weather Advisory:", "")
                if validation_note in text:
                    state["found_validation"] = True
                    text = text.replace(validation_note, "").strip()
                    if not text:
                        continue
                text = re.sub(r"\[\d+\]\s*", "", text)
                content.text = text
                cleaned_contents.append(content)

            update.contents = cleaned_contents
            return update

        context.result.with_transform_hook(_clean_update)
        context.result.with_result_hook(_sanitize)
    elif isinstance(context.result, AgentResponse):
        context.result = _sanitize(context.result)


#: The model server's one reply: asked about Seattle, the model calls get_weather. The streamed
#: Portland call never reaches the model (nothing is scripted for it: a request would fail).
WEATHER_MODEL = "weather-model"
WEATHER_TURNS = [ModelReply(96, 18, "tool_calls", tool_call="get_weather", arguments={"location": "Seattle"})]
WEATHER_TOKENS = sum(t.total for t in WEATHER_TURNS)  # 114: the plain run's one model call


async def override_result_sample(base_url: str) -> tuple[AgentResponse, AgentResponse]:
    """The sample's ``main()``: the agent as the sample builds it (its OpenAIChatClient on the model
    server at ``base_url``), run plain, then streamed; the two final responses its caller prints."""
    import openai
    from agent_framework.openai import OpenAIChatClient

    sdk = openai.AsyncOpenAI(api_key="test-key", base_url=f"{base_url}/v1")
    try:
        agent = Agent(
            client=OpenAIChatClient(
                model=WEATHER_MODEL,
                async_client=sdk,
                middleware=[validate_weather_middleware, weather_override_middleware],
            ),
            name="WeatherAgent",
            instructions="You are a helpful weather assistant. Use the weather tool to get current conditions.",
            tools=get_weather,
            middleware=[agent_cleanup_middleware],
        )
        # Non-streaming example
        result = await agent.run("What's the weather like in Seattle?")
        # Streaming example
        response = agent.run("What's the weather like in Portland?", stream=True)
        async for _ in response:
            pass
        return result, await response.get_final_response()
    finally:
        await sdk.close()


# endregion
