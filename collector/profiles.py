"""Span-shape profiles (DESIGN §3): which span names and attribute keys mean what.

Profiles are data (the ``profiles`` section of the config); :class:`Matcher` compiles the union of
the enabled ones into the few lookups the classifier makes per span.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ProfileConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    executor_span_prefixes: list[str] = Field(default_factory=list)
    executor_id_attributes: list[str] = Field(default_factory=lambda: ["executor.id"])
    agent_span_prefixes: list[str] = Field(default_factory=lambda: ["invoke_agent"])
    agent_id_attributes: list[str] = Field(
        default_factory=lambda: ["gen_ai.agent.name", "gen_ai.agent.id"]
    )
    chat_operation_names: list[str] = Field(default_factory=lambda: ["chat"])
    chat_span_prefixes: list[str] = Field(default_factory=lambda: ["chat "])
    operation_attribute: str = "gen_ai.operation.name"
    input_tokens_attributes: list[str] = Field(
        default_factory=lambda: ["gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens"]
    )
    output_tokens_attributes: list[str] = Field(
        default_factory=lambda: ["gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens"]
    )
    total_tokens_attributes: list[str] = Field(default_factory=lambda: ["gen_ai.usage.total_tokens"])
    finish_reasons_attributes: list[str] = Field(
        default_factory=lambda: ["gen_ai.response.finish_reasons"]
    )
    subject_attributes: list[str] = Field(default_factory=lambda: ["workflow.name"])


def default_profiles() -> dict[str, ProfileConfig]:
    """MAF Python 1.23 (measured) and MAF .NET span shapes."""
    return {
        "maf-python": ProfileConfig(executor_span_prefixes=["executor.process"]),
        "maf-dotnet": ProfileConfig(executor_span_prefixes=["executor.process"]),
    }


#: Attributes the AgentResponseEvent bridge writes (DESIGN §3 "Bridge").
LEDGER_SOURCE_ATTRIBUTE = "fidelity.ledger.source"
LEDGER_SOURCE_BRIDGE = "AgentResponseEvent"
LEDGER_INVOCATION_ATTRIBUTE = "fidelity.invocation"
BRIDGE_EXECUTOR_ATTRIBUTE = "executor.id"


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
        self.operation_keys = tuple(dict.fromkeys(p.operation_attribute for p in profiles))
        self.input_keys = union("input_tokens_attributes")
        self.output_keys = union("output_tokens_attributes")
        self.total_keys = union("total_tokens_attributes")
        self.finish_keys = union("finish_reasons_attributes")
        self.subject_keys = union("subject_attributes")
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
            + (LEDGER_SOURCE_ATTRIBUTE, LEDGER_INVOCATION_ATTRIBUTE, BRIDGE_EXECUTOR_ATTRIBUTE)
        )

    def is_executor(self, name: str) -> bool:
        return name.startswith(self.executor_prefixes)

    def is_agent(self, name: str) -> bool:
        return name.startswith(self.agent_prefixes)

    def is_chat(self, name: str, attrs: dict) -> bool:
        for key in self.operation_keys:
            op = attrs.get(key)
            if op is not None:
                return op in self.chat_operations
        return name.startswith(self.chat_prefixes)

