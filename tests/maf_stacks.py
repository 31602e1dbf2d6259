"""MAF's real provider clients under the instrumentation stacks users run (docs/instrumentation-stacks.md).

A *stack* is the set of OpenTelemetry instrumentations active beside MAF's own telemetry and the
fidelity instrumentation; a *client* is one of MAF's provider clients (agent-framework-openai's Chat
Completions and Responses clients, agent-framework-ollama, agent-framework-anthropic), talking to the
tests' own model server (:mod:`llm_server`). What each stack exports for each client, measured, is in
docs/instrumentation-stacks.md.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from agent_framework import Agent, ChatMiddlewareLayer, FunctionInvocationLayer, Workflow
from agent_framework_orchestrations import SequentialBuilder

from collector.demo.maf_fakes import drop_finish_reason, lookup, under_report

from llm_server import LLMServer, Reply, calls

TASK = "Write a short report."

#: Instrumentors by short name: (module, class).
INSTRUMENTORS: dict[str, tuple[str, str]] = {
    "openai-v2": ("opentelemetry.instrumentation.openai_v2", "OpenAIInstrumentor"),
    "openllmetry-openai": ("opentelemetry.instrumentation.openai", "OpenAIInstrumentor"),
    "openllmetry-anthropic": ("opentelemetry.instrumentation.anthropic", "AnthropicInstrumentor"),
    "httpx": ("opentelemetry.instrumentation.httpx", "HTTPXClientInstrumentor"),
    "httpx2": ("opentelemetry.instrumentation.httpx", "HTTPX2ClientInstrumentor"),  # openai 3, anthropic
}


CLIENTS = ("chat-completions", "responses", "ollama", "anthropic")


@dataclass(frozen=True)
class Stack:
    """Instrumentations on beside the fidelity instrumentation, in the order instrumented (the last
    wraps outermost). ``maf_chat``: MAF's chat telemetry layer on (its ``chat {model}`` spans).
    ``clients``: the clients tested with it, those whose calls it records (the others export what the
    fidelity instrumentation alone exports, docs/instrumentation-stacks.md)."""

    name: str
    instrumentors: tuple[str, ...] = ()
    maf_chat: bool = True
    clients: tuple[str, ...] = CLIENTS


STACKS = {s.name: s for s in (
    Stack("fidelity"),
    Stack("openai-v2", ("openai-v2",), clients=("chat-completions", "responses")),
    Stack("openllmetry", ("openllmetry-openai", "openllmetry-anthropic"),
          clients=("chat-completions", "responses", "anthropic")),
    Stack("httpx", ("httpx", "httpx2"), clients=("chat-completions", "ollama")),
    Stack("all", ("openai-v2", "openllmetry-openai", "openllmetry-anthropic", "httpx", "httpx2")),
    # MAF's chat telemetry off (its clients without ChatTelemetryLayer): truth only from provider spans
    # (agent-framework-ollama has no client without it, and nothing here records Ollama's API)
    Stack("provider-only-openai-v2", ("openai-v2",), maf_chat=False, clients=("chat-completions", "anthropic")),
    Stack("provider-only-openllmetry", ("openllmetry-openai", "openllmetry-anthropic"), maf_chat=False,
          clients=("chat-completions", "responses", "anthropic")),
)}


def instrumentor(short: str) -> Any:
    module, cls = INSTRUMENTORS[short]
    try:
        return getattr(importlib.import_module(module), cls)()
    except ImportError as exc:  # an old MAF release's environment may lack it: say which and why
        import pytest

        pytest.skip(f"{module} does not import here: {exc}")


#: The SDK modules whose classes instrumentations patch.
PATCHED_PACKAGES = ("openai.", "anthropic.", "ollama", "httpx")


def _class_attributes() -> dict[tuple[type, str], Any]:
    """Every attribute of every class of the loaded SDK modules (what instrumentors wrap)."""
    found: dict[tuple[type, str], Any] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(PATCHED_PACKAGES):
            continue
        for owner in list(vars(module).values()):
            if isinstance(owner, type) and owner.__module__ == name:
                found.update(((owner, attr), value) for attr, value in list(vars(owner).items()))
    return found


@contextmanager
def active(stack: Stack) -> Iterator[None]:
    """The stack's instrumentors on the global tracer provider, removed again afterwards: by their
    ``uninstrument()`` and, where that leaves a wrapper in place (OpenLLMetry's openai instrumentor on
    openai 3.x does), by restoring the SDK classes as they were (unwrapping those of SDK modules
    the instrumentors imported)."""
    for kind in ("chat-completions", "anthropic", "ollama"):  # the SDKs loaded before the snapshot
        _client_classes(kind, maf_chat=True)
    before = _class_attributes()
    done: list[Any] = []
    try:
        for short in stack.instrumentors:
            inst = instrumentor(short)
            inst.instrument()
            done.append(inst)
        yield
    finally:
        for inst in reversed(done):
            inst.uninstrument()
        for (owner, attr), value in _class_attributes().items():
            if (owner, attr) in before:
                if value is not before[owner, attr]:
                    setattr(owner, attr, before[owner, attr])
            elif type(value).__name__ == "FunctionWrapper":  # wrapt's, in a module imported since
                while type(value).__name__ == "FunctionWrapper":
                    value = value.__wrapped__
                setattr(owner, attr, value)


# region clients


def _client_classes(kind: str, maf_chat: bool) -> tuple[type, str]:
    """MAF's client class for ``kind`` (``maf_chat=False``: the same layers less ChatTelemetryLayer) and
    the keyword its SDK client is passed by."""
    if kind in ("chat-completions", "responses"):
        import agent_framework_openai as oa

        public, raw = ((oa.OpenAIChatCompletionClient, oa.RawOpenAIChatCompletionClient) if kind == "chat-completions"
                       else (oa.OpenAIChatClient, oa.RawOpenAIChatClient))
        keyword = "async_client"
    elif kind == "anthropic":
        import agent_framework_anthropic as an

        public, raw, keyword = an.AnthropicClient, an.RawAnthropicClient, "anthropic_client"
    else:
        from agent_framework_ollama import OllamaChatClient

        if not maf_chat:
            raise ValueError("agent-framework-ollama has no client without its telemetry layer")
        return OllamaChatClient, "client"
    if maf_chat:
        return public, keyword
    return type(f"Untraced{public.__name__}", (FunctionInvocationLayer, ChatMiddlewareLayer, raw), {}), keyword


class Clients:
    """MAF clients of one kind on the model server at ``base_url``, one per agent (its own model name, so the server
    plays each agent its own script), on one SDK client, closed by :meth:`aclose` on the event loop
    that used it."""

    def __init__(self, kind: str, base_url: str, maf_chat: bool = True) -> None:
        self.kind, self.base_url, self.maf_chat = kind, base_url, maf_chat
        self._sdk: Any = None

    def sdk(self) -> Any:
        """The SDK client all agents share (one connection pool, as an application has)."""
        if self._sdk is not None:
            return self._sdk
        if self.kind in ("chat-completions", "responses"):
            import openai

            self._sdk = openai.AsyncOpenAI(api_key="test-key", base_url=f"{self.base_url}/v1")
        elif self.kind == "anthropic":
            import anthropic

            self._sdk = anthropic.AsyncAnthropic(api_key="test-key", base_url=self.base_url)
        else:
            import ollama

            self._sdk = ollama.AsyncClient(host=self.base_url)
        return self._sdk

    def __call__(self, model: str) -> Any:
        cls, keyword = _client_classes(self.kind, self.maf_chat)
        return cls(model=model, **{keyword: self.sdk()})

    async def aclose(self) -> None:
        if self._sdk is not None:
            close = getattr(self._sdk, "close", None) or self._sdk._client.aclose  # ollama: its httpx client
            await close()
            self._sdk = None


# endregion

# region workflows and their scripts


def dropped_finish(kind: str) -> str:
    """The finish a dropped-finish scenario plays: ``content_filter`` where the API has one (Anthropic
    ``refusal``, the Responses API's incomplete ``content_filter``), else ``length`` (Ollama)."""
    return "length" if kind == "ollama" else "content_filter"


def research_script(kind: str) -> list[Reply]:
    """The researcher's tool loop: asks for ``lookup`` (120+40), then answers (150+30): 340 tokens.
    OpenAI's replies carry cached-input and reasoning parts (included in the counts)."""
    parts = {"cached": 64, "reasoning": 8} if kind in ("chat-completions", "responses") else {}
    return calls("lookup", Reply(120, 40, **parts), Reply(150, 30))


RESEARCHER_TOKENS, WRITER_TOKENS = 340, 170
CALLS = {"researcher": 2, "writer": 1, "assistant": 2}  # model calls per unit and run


def writer_script(finish: str = "stop") -> list[Reply]:
    return [Reply(130, 40, finish)]


def sequential(clients: Clients, *, researcher_mw: Sequence[Any] = (), writer_mw: Sequence[Any] = ()) -> Workflow:
    """researcher (a tool loop) -> writer, MAF's SequentialBuilder."""
    researcher = Agent(clients("researcher"), name="researcher", instructions="You research.",
                       tools=[lookup], middleware=list(researcher_mw) or None)
    writer = Agent(clients("writer"), name="writer", instructions="You write.", middleware=list(writer_mw) or None)
    return SequentialBuilder(name="research_report", participants=[researcher, writer]).build()


@dataclass(frozen=True)
class Scenario:
    """One run: what it builds, what the server plays per model, and what a user must see per unit:
    {unit: (verdict, framework tokens, truth tokens, framework finish, truth finish)}, the run status."""

    name: str
    expected: dict[str, tuple[str, int, int, str | None, str | None]]
    status: str


def scenarios(kind: str) -> list[Scenario]:
    dropped = dropped_finish(kind)
    return [
        Scenario("honest", {"researcher": ("Agree", RESEARCHER_TOKENS, RESEARCHER_TOKENS, "stop", "stop"),
                            "writer": ("Agree", WRITER_TOKENS, WRITER_TOKENS, "stop", "stop")}, "PASS"),
        # the researcher's middleware halves its reported usage; the writer's response loses its finish
        Scenario("injected", {
            "researcher": ("TokenMismatch", RESEARCHER_TOKENS // 2, RESEARCHER_TOKENS, "stop", "stop"),
            "writer": ("FinishMismatch", WRITER_TOKENS, WRITER_TOKENS, None, dropped)}, "FAIL"),
        Scenario("direct", {"assistant": ("Agree", RESEARCHER_TOKENS, RESEARCHER_TOKENS, "stop", "stop")}, "PASS"),
    ]


def script(server: LLMServer, scenario: str, kind: str) -> None:
    """Queue on the server the replies of one run of ``scenario`` on ``kind`` clients."""
    if scenario == "direct":
        server.script("assistant", research_script(kind))
        return
    server.script("researcher", research_script(kind))
    server.script("writer", writer_script("stop" if scenario == "honest" else dropped_finish(kind)))


def build(scenario: str, clients: Clients) -> Any:
    """The workflow or agent of ``scenario`` on ``clients`` (its replies scripted by :func:`script`)."""
    if scenario == "direct":
        return Agent(clients("assistant"), name="assistant", instructions="You help.", tools=[lookup])
    if scenario == "honest":
        return sequential(clients)
    return sequential(clients, researcher_mw=[under_report(0.5)], writer_mw=[drop_finish_reason()])


async def run(target: Any, stream: bool) -> None:
    """``target.run(TASK)`` to completion, plain or streamed."""
    if stream:
        response_stream = target.run(TASK, stream=True)
        async for _ in response_stream:
            pass
        await response_stream.get_final_response()
    else:
        await target.run(TASK)


# endregion
