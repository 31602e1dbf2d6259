"""Domain model shared by every path: small frozen values, no I/O, no transport types.

The reconciler takes a :class:`RunInput` and returns a :class:`RunVerdict`; adapters at the edges
(workflow-trace JSON, OTLP spans) build the former and sinks (store, spans, metrics, stream)
consume the latter.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal


class Verdict(str, enum.Enum):
    AGREE = "Agree"
    TOKEN_MISMATCH = "TokenMismatch"
    FINISH_MISMATCH = "FinishMismatch"
    BOTH = "Both"
    NO_TRUTH = "NoTruth"


#: The single definition of what each verdict is worth (NoTruth is skipped, so it has none).
VERDICT_SCORES: dict[Verdict, float] = {
    Verdict.AGREE: 1.0,
    Verdict.TOKEN_MISMATCH: 0.5,
    Verdict.FINISH_MISMATCH: 0.5,
    Verdict.BOTH: 0.0,
}


class NoTruthReason(str, enum.Enum):
    NO_CHAT_TRACE = "no_chat_trace"
    RESPONSE_MISSING = "response_missing"
    PARTIAL_RESPONSE = "partial_response"


#: Plain-words explanation of each NoTruth reason, for people debugging the upstream-hook gap.
NO_TRUTH_EXPLANATIONS: dict[NoTruthReason, str] = {
    NoTruthReason.NO_CHAT_TRACE: (
        "no chat-boundary span was attributed to this executor: its chat client is not "
        "instrumented (no ChatTelemetryLayer) or its spans never reached the collector"
    ),
    NoTruthReason.RESPONSE_MISSING: (
        "chat calls were seen but none carried response usage or finish reason: the Path-2 gap "
        "(live InProcessExecution does not route executor responses back through the "
        "instrumented chat client); an upstream hook that records the response on the chat span "
        "would close it"
    ),
    NoTruthReason.PARTIAL_RESPONSE: (
        "some chat calls carried a response and others did not, so the token sum cannot be trusted"
    ),
}


#: What would give each NoTruth executor its truth back (shown on the run page).
NO_TRUTH_FIXES: dict[NoTruthReason, str] = {
    NoTruthReason.NO_CHAT_TRACE: (
        "instrument this executor's chat client (MAF: wrap it with ChatTelemetryLayer / enable "
        "instrumentation) and export its spans to this collector, in the same trace as the workflow"
    ),
    NoTruthReason.RESPONSE_MISSING: (
        "an upstream hook in MAF's InProcessExecution that hands each executor's chat response back "
        "through the instrumented chat client, so the chat span records gen_ai.usage.* and "
        "gen_ai.response.finish_reasons; until it exists, reconcile direct-agent or pre-wired runs"
    ),
    NoTruthReason.PARTIAL_RESPONSE: (
        "find the chat spans without gen_ai.usage.* among the chat span ids below (typically streamed "
        "calls cut short, or a client layer that drops usage) and make them record the response"
    ),
}


class Status(str, enum.Enum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    PENDING = "PENDING"


#: Process exit code per run status (setup / IO errors exit 1, see ``cli``).
STATUS_EXIT_CODES: dict[Status, int] = {
    Status.PASS: 0,
    Status.WARN: 10,
    Status.FAIL: 9,
    Status.PENDING: 11,
}
EXIT_ERROR = 1

PASS_THRESHOLD = 0.99
WARN_THRESHOLD = 0.80

Preset = Literal["smoke", "standard", "audit-grade"]
COST_TIER = "Free"


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None

    @property
    def known(self) -> bool:
        return self.total is not None

    @property
    def total(self) -> int | None:
        """input + output where both are known, else the reported total."""
        if self.input_tokens is not None and self.output_tokens is not None:
            return self.input_tokens + self.output_tokens
        return self.total_tokens


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One response the framework reported for an executor (an AgentResponseEvent)."""

    usage: Usage
    finish_reason: str | None
    seq: int = 0
    invocation: str | None = None
    span_id: str | None = None


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One chat-boundary call: a response (usage and/or finish reason) or a bare request."""

    usage: Usage
    finish_reason: str | None
    seq: int = 0
    invocation: str | None = None
    span_id: str | None = None

    @property
    def is_response(self) -> bool:
        return self.usage.known or self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class ExecutorRecord:
    executor_id: str
    ledger: tuple[LedgerEntry, ...] = ()
    turns: tuple[ChatTurn, ...] = ()
    ledger_source: str = "none"
    span_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RunInput:
    executors: tuple[ExecutorRecord, ...]
    trace_id: str | None = None
    root_span_id: str | None = None
    subject: str | None = None
    incomplete: bool = False
    unattributed_chat_spans: int = 0


    @property
    def is_workflow(self) -> bool:
        """False for traces with nothing to reconcile (e.g. MAF's separate ``workflow.build`` trace)."""
        return bool(self.executors) or self.unattributed_chat_spans > 0


@dataclass(frozen=True, slots=True)
class Policy:
    """Scoring knobs. Presets are informational and deliberately absent here."""

    tolerance: float = 0.02
    flag_over_reporting: bool = False
    finish_aliases: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class FinishComparison:
    invocation: str | None
    framework: str | None
    truth: str | None
    diverged: bool


@dataclass(frozen=True, slots=True)
class Evidence:
    framework_tokens: int | None
    truth_tokens: int | None
    delta: int | None
    direction: str | None
    tolerance: float
    framework_finish: str | None
    truth_finish: str | None
    finish_comparisons: tuple[FinishComparison, ...]
    aligned: bool
    ledger_source: str
    ledger_missing: bool
    ledger_entries: int
    response_turns: int
    request_turns: int
    ledger_span_ids: tuple[str, ...] = ()
    chat_span_ids: tuple[str, ...] = ()
    executor_span_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ExecutorVerdict:
    executor_id: str
    verdict: Verdict
    score: float | None
    token_diverged: bool
    finish_diverged: bool
    no_truth_reason: NoTruthReason | None
    evidence: Evidence

    @property
    def checked(self) -> bool:
        return self.verdict is not Verdict.NO_TRUTH


@dataclass(frozen=True, slots=True)
class RunVerdict:
    status: Status
    score: float | None
    executors: tuple[ExecutorVerdict, ...]
    trace_id: str | None = None
    root_span_id: str | None = None
    subject: str | None = None
    preset: str = "standard"
    cost_tier: str = COST_TIER
    incomplete: bool = False
    unattributed_chat_spans: int = 0
    revision: int = 1
    notes: tuple[str, ...] = field(default=())

    @property
    def checked(self) -> int:
        return sum(1 for e in self.executors if e.checked)

    @property
    def unchecked(self) -> int:
        return len(self.executors) - self.checked

    @property
    def exit_code(self) -> int:
        return STATUS_EXIT_CODES[self.status]
