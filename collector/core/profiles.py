"""Span-shape profiles (docs/design.md §3): which span names and attribute keys mean what.

Profiles are data (the ``profiles`` section of the config); :class:`Matcher` compiles the union of
the enabled ones into the few lookups the classifier makes per span.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: OpenLLMetry's model-call spans (opentelemetry-instrumentation-openai / -anthropic).
OPENLLMETRY_CHAT_SPANS = ("openai.chat", "openai.response", "anthropic.chat")


class ProfileConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Resource ``telemetry.sdk.language`` values whose spans this profile describes.
    sdk_languages: list[str] = Field(default_factory=list)
    #: Whether this runtime's agent span carries the framework's own AgentResponse usage
    #: ("independent", a ledger) or re-sums its chat spans ("derived", never a ledger).
    agent_span_ledger: Literal["independent", "derived"] = "derived"
    #: Spans that start a workflow run (exact name, or the name followed by a space and more).
    workflow_run_span_names: list[str] = Field(
        default_factory=lambda: ["workflow.run", "workflow_invoke", "invoke_workflow"])
    #: Executor types (``executor.type``, last dotted part) that host one agent of their own: that
    #: agent's unit is the executor's (named by the agent's name); any other agent in one is ``executor/agent``.
    agent_executor_types: list[str] = Field(default_factory=list)
    #: Executor-type attribute.
    #: Executor-type attributes, first present wins: the MAF instrumentation's ``fidelity.executor.type``
    #: says ``AgentExecutor`` for any subclass running its own agent (MAF's ``executor.type`` is the
    #: subclass's short name).
    executor_type_attributes: list[str] = Field(default_factory=lambda: ["fidelity.executor.type", "executor.type"])
    executor_span_prefixes: list[str] = Field(default_factory=list)
    executor_id_attributes: list[str] = Field(default_factory=lambda: ["executor.id"])
    agent_span_prefixes: list[str] = Field(default_factory=lambda: ["invoke_agent"])
    #: The agent's name, first present wins: the MAF instrumentation's ``fidelity.agent.name`` (a named
    #: agent's name), then GenAI's; an agent without a name is known by MAF's per-process id, which keeps
    #: it apart within its run and never names a unit (it is shown as ``unnamed-agent-{n}``).
    agent_id_attributes: list[str] = Field(
        default_factory=lambda: ["fidelity.agent.name", "gen_ai.agent.name", "gen_ai.agent.id"]
    )
    #: Chat truth: a span whose operation is one of these, or whose name is one of ``chat_span_names``,
    #: or (without an operation) whose name starts with one of ``chat_span_prefixes``.
    chat_operation_names: list[str] = Field(default_factory=lambda: ["chat", "generate_content", "text_completion"])
    chat_span_prefixes: list[str] = Field(default_factory=lambda: ["chat "])
    #: Provider instrumentations that name a model call by its API (OpenLLMetry's), whatever operation
    #: attribute they carry.
    chat_span_names: list[str] = Field(default_factory=lambda: list(OPENLLMETRY_CHAT_SPANS))
    operation_attribute: str = "gen_ai.operation.name"
    input_tokens_attributes: list[str] = Field(
        default_factory=lambda: ["gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens"]
    )
    output_tokens_attributes: list[str] = Field(
        default_factory=lambda: ["gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens"]
    )
    total_tokens_attributes: list[str] = Field(default_factory=lambda: ["gen_ai.usage.total_tokens",
                                                                        "llm.usage.total_tokens"])
    #: Parts of the input and output counts (the GenAI conventions: input includes cached input,
    #: output includes reasoning), first present wins: shown in the evidence, never added on top.
    cache_read_tokens_attributes: list[str] = Field(
        default_factory=lambda: ["gen_ai.usage.cache_read.input_tokens", "gen_ai.usage.cache_read_input_tokens"])
    cache_write_tokens_attributes: list[str] = Field(
        default_factory=lambda: ["gen_ai.usage.cache_write.input_tokens", "gen_ai.usage.cache_creation.input_tokens",
                                 "gen_ai.usage.cache_creation_input_tokens"])
    reasoning_tokens_attributes: list[str] = Field(
        default_factory=lambda: ["gen_ai.usage.reasoning.output_tokens", "gen_ai.usage.reasoning_tokens",
                                 "llm.usage.reasoning_tokens"])
    finish_reasons_attributes: list[str] = Field(
        default_factory=lambda: ["gen_ai.response.finish_reasons"]
    )
    #: A chat call's model and provider, first present wins (shown per call on the run page).
    model_attributes: list[str] = Field(default_factory=lambda: ["gen_ai.response.model", "gen_ai.request.model"])
    provider_attributes: list[str] = Field(default_factory=lambda: ["gen_ai.provider.name", "gen_ai.system"])
    #: The workflow's name (else the resource's ``service.name``); never a per-process id such as
    #: MAF Python's ``workflow.id`` (a uuid).
    subject_attributes: list[str] = Field(default_factory=lambda: ["gen_ai.workflow.name", "workflow.name"])
    #: Names a builder gives every workflow it builds unnamed: such a run is named
    #: ``{service.name}/{name}``, so two services' unnamed workflows stay apart.
    default_workflow_names: list[str] = Field(default_factory=list)
    #: Error attribute of a span (besides an error status).
    error_attributes: list[str] = Field(default_factory=lambda: ["error.type"])


PYTHON_AGENT_EXECUTORS = ["AgentExecutor", "HandoffAgentExecutor"]
#: agent-framework-orchestrations' builders name an unnamed workflow after themselves.
PYTHON_DEFAULT_WORKFLOW_NAMES = ["Sequential", "Concurrent", "GroupChat", "Handoff", "Magentic"]
DOTNET_AGENT_EXECUTORS = ["AIAgentHostExecutor", "HandoffAgentExecutor"]


def default_profiles() -> dict[str, ProfileConfig]:
    """MAF Python 1.23 (measured) and MAF .NET 1.17 (source-verified) span shapes."""
    return {
        "maf-python": ProfileConfig(sdk_languages=["python"], agent_span_ledger="derived",
                                    executor_span_prefixes=["executor.process"],
                                    agent_executor_types=PYTHON_AGENT_EXECUTORS,
                                    default_workflow_names=PYTHON_DEFAULT_WORKFLOW_NAMES),
        "maf-dotnet": ProfileConfig(sdk_languages=["dotnet"], agent_span_ledger="independent",
                                    executor_span_prefixes=["executor.process"],
                                    agent_executor_types=DOTNET_AGENT_EXECUTORS),
    }


#: Attributes the MAF instrumentation's AgentResponseEvent spans carry (docs/design.md §3b). The agent is
#: named by the profile's agent id attributes; ``executor.id`` names the executor of spans written
#: by the pre-instrumentation bridge, whose spans sat outside the executor.
LEDGER_SOURCE_ATTRIBUTE = "fidelity.ledger.source"
LEDGER_SOURCE_BRIDGE = "AgentResponseEvent"
BRIDGE_EXECUTOR_ATTRIBUTE = "executor.id"
#: The instrumentation's announcement (docs/design.md §3b), on the spans it writes and the MAF spans it
#: stamps: the MAF release it found, its own version, and whether it records ("active...") or not
#: ("inactive: why").
MAF_RELEASE_ATTRIBUTE = "fidelity.maf.version"
INSTRUMENTATION_VERSION_ATTRIBUTE = "fidelity.instrumentation.version"
INSTRUMENTATION_STATUS_ATTRIBUTE = "fidelity.instrumentation.status"
ANNOUNCEMENT_ATTRIBUTES = (MAF_RELEASE_ATTRIBUTE, INSTRUMENTATION_VERSION_ATTRIBUTE, INSTRUMENTATION_STATUS_ATTRIBUTE)
#: The MAF instrumentation's word on what a chat span recorded (docs/design.md §3b), read before the
#: span's own operation: ``chat.unsent`` on MAF's span of a streamed call whose stream was dropped
#: unread (a chat middleware replaced it before any model call), so no request was sent and the span
#: is no model call; the span's own operation once the stream was read.
FIDELITY_OPERATION_ATTRIBUTE = "fidelity.operation.name"


#: Span kinds by name (:meth:`Matcher.kind`).
RUN, EXECUTOR, AGENT, OTHER = range(4)


class Matcher:
    """The union of the enabled profiles, flattened for per-span lookups."""

    def __init__(self, profiles: list[ProfileConfig]) -> None:
        def union(attr: str) -> tuple[str, ...]:
            return tuple(dict.fromkeys(v for p in profiles for v in getattr(p, attr)))

        self.executor_prefixes = union("executor_span_prefixes")
        self.executor_id_keys = union("executor_id_attributes")
        self.agent_prefixes = union("agent_span_prefixes")
        self.agent_id_keys = union("agent_id_attributes")
        self.chat_operations = frozenset(union("chat_operation_names"))
        self.chat_prefixes = union("chat_span_prefixes")
        self.chat_names = frozenset(union("chat_span_names"))
        self.operation_keys = tuple(dict.fromkeys([FIDELITY_OPERATION_ATTRIBUTE,
                                                   *(p.operation_attribute for p in profiles)]))
        self.input_keys = union("input_tokens_attributes")
        self.output_keys = union("output_tokens_attributes")
        self.total_keys = union("total_tokens_attributes")
        self.cache_read_keys = union("cache_read_tokens_attributes")
        self.cache_write_keys = union("cache_write_tokens_attributes")
        self.reasoning_keys = union("reasoning_tokens_attributes")
        self.finish_keys = union("finish_reasons_attributes")
        self.model_keys = union("model_attributes")
        self.provider_keys = union("provider_attributes")
        self.subject_keys = union("subject_attributes")
        self.default_workflow_names = frozenset(union("default_workflow_names"))
        self.error_keys = union("error_attributes")
        self.executor_type_keys = union("executor_type_attributes")
        self.run_names = frozenset(union("workflow_run_span_names"))
        self._kinds: dict[str, int] = {}
        self.agent_executor_types = frozenset(t.casefold() for t in union("agent_executor_types"))
        #: telemetry.sdk.language -> the agent span is an independent ledger (unknown: it is not).
        self.independent_agent_span = {
            lang.casefold(): p.agent_span_ledger == "independent" for p in profiles for lang in p.sdk_languages
        }
        #: Every attribute key the classifier reads; decoding keeps only these.
        self.wanted_keys = frozenset(
            self.executor_id_keys
            + self.agent_id_keys
            + self.operation_keys
            + self.input_keys
            + self.output_keys
            + self.total_keys
            + self.finish_keys
            + self.subject_keys
            + self.error_keys
            + self.executor_type_keys
            + (LEDGER_SOURCE_ATTRIBUTE, BRIDGE_EXECUTOR_ATTRIBUTE)
            + ANNOUNCEMENT_ATTRIBUTES
            + self.model_keys
            + self.provider_keys
            + self.cache_read_keys
            + self.cache_write_keys
            + self.reasoning_keys
        )

    def kind(self, name: str) -> int:
        """What a span of this name is, by name alone: RUN, EXECUTOR, AGENT or OTHER (chat spans are
        told by their attributes). Names repeat, so this is cached (bounded: hostile name variety
        cannot grow memory)."""
        known = self._kinds.get(name)
        if known is None:
            if len(self._kinds) >= 4096:
                self._kinds.clear()
            if name in self.run_names or name.partition(" ")[0] in self.run_names:
                known = RUN
            elif name.startswith(self.executor_prefixes):
                known = EXECUTOR
            elif name.startswith(self.agent_prefixes):
                known = AGENT
            else:
                known = OTHER
            self._kinds[name] = known
        return known

    def is_agent_executor_type(self, executor_type: object) -> bool:
        return (isinstance(executor_type, str)
                and executor_type.rpartition(".")[2].casefold() in self.agent_executor_types)

    def agent_span_is_ledger(self, sdk_language: str | None) -> bool:
        return bool(sdk_language) and self.independent_agent_span.get(sdk_language.casefold(), False)

    def is_chat(self, name: str, attrs: Mapping[str, object]) -> bool:
        if name in self.chat_names:
            return True
        for key in self.operation_keys:
            op = attrs.get(key)
            if isinstance(op, str):  # an operation that is no string is no operation
                return op in self.chat_operations
        return name.startswith(self.chat_prefixes)

