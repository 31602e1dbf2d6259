"""Domain model shared by every path: small values nothing mutates, no I/O, no transport types.

The reconciler takes a :class:`RunInput` and returns a :class:`RunVerdict`; adapters at the edges
(workflow-trace JSON, OTLP spans) build the former and sinks (store, spans, metrics, stream)
consume the latter.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from fractions import Fraction
from functools import lru_cache
from typing import Any, Literal


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
    USAGE_MISSING = "usage_missing"
    LEDGER_MISSING = "ledger_missing"
    LEDGER_DERIVED = "ledger_derived"
    LEDGER_UNJOINED = "ledger_unjoined"


#: Plain-words explanation of each NoTruth reason, for people debugging the upstream-hook gap.
NO_TRUTH_EXPLANATIONS: dict[NoTruthReason, str] = {
    NoTruthReason.NO_CHAT_TRACE: (
        "no chat-boundary span was attributed to this agent: its chat client is not "
        "instrumented (no ChatTelemetryLayer) or its spans never reached the collector"
    ),
    NoTruthReason.RESPONSE_MISSING: (
        "chat calls were seen but none carried a response (usage or finish reason) and none failed: the "
        "Path-2 gap (live InProcessExecution does not route executor responses back through the "
        "instrumented chat client, upstream request microsoft/agent-framework #6918), or a chat client "
        "that records no response (a streaming call without usage in its last chunk)"
    ),
    NoTruthReason.PARTIAL_RESPONSE: (
        "some chat calls carried a response and others were requests that never got one, or responses "
        "without a token count, so the token sum cannot be trusted"
    ),
    NoTruthReason.USAGE_MISSING: (
        "the chat calls answered (they carry finish reasons) but none reported a token count, so there is "
        "no token total to compare"
    ),
    NoTruthReason.LEDGER_MISSING: (
        "the chat boundary saw this agent's calls but the framework reported no response for it (the "
        "agent raised before answering, or its responses were not recorded): a visibility gap, not a "
        "divergence"
    ),
    NoTruthReason.LEDGER_DERIVED: (
        "the only framework ledger is the invoke_agent span, whose usage MAF Python re-sums from the same "
        "chat spans, so comparing the two could never disagree"
    ),
    NoTruthReason.LEDGER_UNJOINED: (
        "a ledger span recorded beside the workflow runs (by the caller, not in the run that produced it) "
        "names this agent's executor, but carries no identity of its run, and more than one run, or none, "
        "could own it: which run's response it is cannot be told, so nothing is compared (never a guess by time)"
    ),
}


#: How the .NET ledger package announces its MAF release (``dotnet-1.28.0``): the runtime, then
#: Microsoft.Agents.AI.Workflows' version; the Python instrumentation announces agent-framework-core's.
DOTNET_RELEASE_PREFIX = "dotnet-"

#: How an app outside this repository installs the ledger: from the release artifacts `make dist`
#: builds (docs/maf.md, docs/dotnet.md); neither is on a public package index.
PYTHON_INSTALL = ("pip install --find-links <agenteval>/dist opentelemetry-instrumentation-maf-fidelity, where "
                  "<agenteval> is the collector's repository after make dist")
DOTNET_INSTALL = ("dotnet add package AgentEval.Instrumentation.MafFidelity --source <agenteval>/dist, where "
                  "<agenteval> is the collector's repository after make dist")

#: The other way to ``no_chat_trace``: an answer no model call made that still reports tokens.
_NO_MODEL_CALL = ("If the agent answered without calling a model (a middleware or a cache that reports "
                  "usage of its own), no chat call can confirm those tokens: report none for such answers")

#: What would give each NoTruth unit its truth back (shown on the run page).
NO_TRUTH_FIXES: dict[NoTruthReason, str] = {
    NoTruthReason.NO_CHAT_TRACE: (
        "instrument this agent's chat client (MAF: enable_instrumentation(), clients with "
        "ChatTelemetryLayer) and export its spans to this collector, in the same trace as the workflow. "
        f"{_NO_MODEL_CALL}"
    ),
    NoTruthReason.RESPONSE_MISSING: (
        "an upstream hook in MAF's InProcessExecution that hands each executor's chat response back "
        "through the instrumented chat client, so the chat span records gen_ai.usage.* and "
        "gen_ai.response.finish_reasons; until it exists, reconcile direct-agent or pre-wired runs. "
        "If this agent's calls do not go through InProcessExecution, make its client report usage "
        "(streaming: ask the provider for usage in the last chunk)"
    ),
    NoTruthReason.PARTIAL_RESPONSE: (
        "find the chat spans without gen_ai.usage.* among the chat span ids below (typically streamed "
        "calls cut short, or a client layer that drops usage) and make them record the response"
    ),
    NoTruthReason.USAGE_MISSING: (
        "make the chat client report usage: a streamed call reports it only when asked for it in the "
        "last chunk (OpenAI-compatible clients: stream_options include_usage)"
    ),
    NoTruthReason.LEDGER_MISSING: (
        "if the agent failed, see the failed chat calls and the run's workflow errors; otherwise record "
        "its responses: call MafFidelityInstrumentor().instrument() or run under opentelemetry-instrument "
        f"(if it is not installed: {PYTHON_INSTALL})"
    ),
    NoTruthReason.LEDGER_DERIVED: (
        "record the AgentResponse the caller receives: call MafFidelityInstrumentor().instrument() or "
        f"run under opentelemetry-instrument (nothing announced it: {PYTHON_INSTALL}), no call-site change needed"
    ),
    NoTruthReason.LEDGER_UNJOINED: (
        "record each response where its agent ran: MafFidelityInstrumentor().instrument() parents every "
        "ledger span under its agent's span; a hand-built trace gives each ledger span its run's span as parent"
    ),
}

#: The same for runs of MAF .NET (docs/dotnet.md): the ledger package, its two ways in, MAF's switches.
DOTNET_FIXES: dict[NoTruthReason, str] = {
    **NO_TRUTH_FIXES,
    NoTruthReason.NO_CHAT_TRACE: (
        "instrument this agent's chat client (.AsBuilder().UseOpenTelemetry() on the IChatClient) and add "
        "the source Experimental.Microsoft.Extensions.AI to the tracer provider "
        "(AddMafFidelityInstrumentation() adds it), exporting to this collector in the same trace as the "
        f"workflow. {_NO_MODEL_CALL}"
    ),
    NoTruthReason.RESPONSE_MISSING: (
        "make this agent's chat client record each response: UseOpenTelemetry() on the IChatClient itself "
        "(not only on the agent), and for streamed calls a client that reports usage in the last update"
    ),
    NoTruthReason.USAGE_MISSING: (
        "make the chat client report usage: a streamed call reports it only when the provider sends it in "
        "the last update (OpenAI-compatible servers: stream_options include_usage)"
    ),
    NoTruthReason.LEDGER_MISSING: (
        "if the agent failed, see the failed chat calls and the run's workflow errors; otherwise record "
        f"its responses with the ledger package ({DOTNET_INSTALL}): bind the agent with "
        "AIAgentHostOptions { EmitAgentResponseEvents = true } and read the run's events through "
        "WithFidelityLedger(run), or add .UseFidelityLedger() first in the agent's builder; its spans need "
        "AddMafFidelityInstrumentation() on the tracer provider"
    ),
    NoTruthReason.LEDGER_DERIVED: (
        f"record the AgentResponse the caller receives with the ledger package ({DOTNET_INSTALL}): "
        "WithFidelityLedger(run) over the workflow's events, or .UseFidelityLedger() on the agent"
    ),
    NoTruthReason.LEDGER_UNJOINED: (
        "give the ledger its run: read the events through WithFidelityLedger(run) (run.WatchStreamAsync()"
        ".WithFidelityLedger(run), run.NewEvents.WithFidelityLedger(run)), which records each response under "
        f"the executor span that produced it (a release of the package that takes the run: {DOTNET_INSTALL}), "
        "with WithOpenTelemetry() on the "
        "workflow; WithFidelityLedger() without the run cannot tell runs under one caller span apart"
    ),
}


#: Ledger sources of hand-built trace files (workflow-trace/v1, AgentEval's WorkflowTrace): their
#: NoTruth units are fixed in the file, not by instrumenting anything.
LEDGER_SOURCE_V1 = "workflow-trace"
LEDGER_SOURCE_AGENTEVAL = "AgentEval WorkflowTrace"
FILE_FIXES: dict[NoTruthReason, str] = {
    NoTruthReason.NO_CHAT_TRACE: (
        "give this executor its chat-boundary turns in the file (workflow-trace/v1: executor_traces; "
        "AgentEval: executorTraces entries of scope ChatTurn and type Response)"
    ),
    NoTruthReason.RESPONSE_MISSING: (
        "record each chat call's response (usage and finish reason) where the trace was captured; the "
        "file has only requests for this executor"
    ),
    NoTruthReason.PARTIAL_RESPONSE: (
        "give every request of this executor its response turn (or a failed turn if the call raised)"
    ),
    NoTruthReason.USAGE_MISSING: "give this executor's response turns their token counts",
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


# The values below are built per chat span and per unit on the live path: plain dataclasses, not
# frozen ones (building a frozen ChatTurn with its Usage took 4x as long). Nothing mutates them. Those
# a run document holds (down to Usage) have no __slots__: orjson writes a dataclass from its __dict__,
# and one with slots field by field through ``__dataclass_fields__``, ~7x as long (the per-call
# evidence took the store writer's run_to_json from ~53 to ~130 µs a run, bench/RESULTS.md issue 39).
# The cost: ~80 bytes more a ledger entry held while its trace is assembled and in the late window.
@dataclass
class Usage:
    """Token counts. The parts (cached input read and written, reasoning output) are included in the
    input and output counts, as the GenAI conventions count them: shown, never added on top."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None
    reasoning_tokens: int | None = None

    @property
    def total(self) -> int | None:
        """input + output where either is known (the missing side counts 0: a model may report output
        tokens only), else the reported total; None where no count at all is known."""
        if self.input_tokens is None and self.output_tokens is None:
            return self.total_tokens
        return (self.input_tokens or 0) + (self.output_tokens or 0)


@dataclass
class LedgerEntry:
    """One response the framework reported for an executor (an AgentResponseEvent)."""

    usage: Usage
    finish_reason: str | None
    seq: int = 0
    invocation: str | None = None
    span_id: str | None = None


@dataclass
class ChatTurn:
    """One chat-boundary call: a response (usage and/or finish reason), a failed call (it raised:
    ``error`` set and no usage) or a bare request (the boundary saw no response)."""

    usage: Usage
    finish_reason: str | None
    seq: int = 0
    invocation: str | None = None
    span_id: str | None = None
    error: str | None = None
    model: str | None = None
    provider: str | None = None


@dataclass(frozen=True, slots=True)
class LayerDisagreement:
    """Two records of one chat call (stacked instrumentations) that report different token totals: the
    call's own span and total, and the other record's spans (beneath it, or beside it) and theirs
    (docs/design.md §1)."""

    span_id: str | None
    tokens: int
    inner_span_ids: tuple[str, ...]
    inner_tokens: int


@dataclass(slots=True)
class ExecutorRecord:
    """One agent unit (docs/design.md §1 Units): an executor's own agent, named by its agent's name (by the
    executor id where no span names the agent), or another agent that ran inside it, named
    ``executor/agent``. ``executor_id`` holds that unit name.

    ``ledger_derived``: the framework's only ledger for this unit re-sums the same chat spans (MAF
    Python's ``invoke_agent``), so it is withheld from ``ledger`` and the unit cannot be checked.
    """

    executor_id: str
    ledger: tuple[LedgerEntry, ...] = ()
    turns: tuple[ChatTurn, ...] = ()
    ledger_source: str = "none"
    span_ids: tuple[str, ...] = ()
    ledger_derived: bool = False
    #: Chat spans that recorded a call another chat span of the unit records (stacked
    #: instrumentations): folded into that call, never counted twice.
    stacked_chat_spans: int = 0
    chat_layers_disagree: tuple[LayerDisagreement, ...] = ()
    #: Ledger spans naming this unit's executor that no single run could own (no identity of their
    #: run, and several runs or none under their parent): the unit is NoTruth ``ledger_unjoined``.
    ledger_unjoined: int = 0
    #: Ledger spans of responses the unit's ledger holds already, recorded a second way (the agent
    #: decorator beside the workflow's events): counted once, the workflow's event kept.
    ledger_duplicates: int = 0


@dataclass(frozen=True)
class UnattributedChat:
    """Chat calls with no agent above them, by one executor (None: by none): a run note, never a unit."""

    executor: str | None
    calls: int
    tokens: int | None


@dataclass(frozen=True, slots=True)
class Announcement:
    """What the MAF instrumentation said of itself on the run's spans (docs/design.md §3b)."""

    maf_release: str | None
    version: str | None
    status: str | None

    @property
    def active(self) -> bool:
        return bool(self.status) and self.status.startswith("active")


@dataclass(slots=True)  # built once per run on the live path: not frozen, as above
class RunInput:
    executors: tuple[ExecutorRecord, ...]
    trace_id: str | None = None
    root_span_id: str | None = None
    subject: str | None = None
    incomplete: bool = False
    #: Spans of its trace are known never to have arrived (the root of a run without a
    #: workflow-run span, or the parent of a span), so units may be missing: it cannot pass. A run
    #: cut short otherwise (a collector stopping mid quiet period) is incomplete only.
    partial: bool = False
    #: Parts of its trace reached other replicas and could not be merged into it (docs/scale-out.md):
    #: partial too, so it never passes; its notes say which replica held which part.
    split: bool = False
    unattributed_chat: tuple[UnattributedChat, ...] = ()
    #: Executors in which no agent ran (function executors, dispatchers, idle participants...).
    non_agent_executors: tuple[str, ...] = ()
    #: Errors the workflow itself raised (error status on workflow or executor spans): shown, not scored.
    workflow_errors: tuple[str, ...] = ()
    #: The run's stable id (live: ``{trace id}-{workflow-run span id}``); None: the caller assigns one.
    run_id: str | None = None
    #: What the reader noticed and the user should know (e.g. a trace key with no step), shown on the run.
    notes: tuple[str, ...] = ()
    #: The MAF instrumentation's announcement on the run's spans (None: none carried one).
    announcement: Announcement | None = None
    #: The resource's ``service.name`` (live).
    service_name: str | None = None
    #: The MAF runtime its spans came from, by the SDK's ``telemetry.sdk.language`` (``dotnet``,
    #: ``python``; None: not said): what a NoTruth fix is written for.
    runtime: str | None = None
    #: When the run started (Unix ns): its workflow-run span's start, else its earliest span's; and
    #: the latest end of its spans. None: unknown (a file format without span times).
    start_ns: int | None = None
    end_ns: int | None = None

    @property
    def is_workflow(self) -> bool:
        """False when no agent ran and no chat call was made (e.g. MAF's separate ``workflow.build``
        trace): not a run. Chat calls no agent made are a run: spend nothing checks is shown."""
        return bool(self.executors or self.unattributed_chat)


#: Finish reasons of providers and instrumentations -> the GenAI conventions' values (stop, length,
#: content_filter, tool_calls, error), compared after this mapping (keys lower case; a reason not
#: listed compares as itself). The default of ``scoring.finish_aliases``, documented key by key in
#: config/collector.yaml.
FINISH_REASON_MAP: dict[str, str] = {
    # OpenAI (Chat Completions: tool_calls; the legacy function_call) and OpenLLMetry (tool_call)
    "function_call": "tool_calls",
    "tool_call": "tool_calls",
    # Anthropic Messages, and Bedrock Converse (which uses the same words)
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
    "model_context_window_exceeded": "length",
    # Bedrock Converse
    "guardrail_intervened": "content_filter",
    "content_filtered": "content_filter",
    # Gemini (upper case on the wire, compared case-insensitively)
    "blocklist": "content_filter",
    "prohibited_content": "content_filter",
    "spii": "content_filter",
    "safety": "content_filter",
    "recitation": "content_filter",
    "image_safety": "content_filter",
    "language": "content_filter",
    "malformed_function_call": "error",
    "unexpected_tool_call": "error",
    # Ollama done_reason (stop and length are the conventions' own): a request that only loaded or
    # unloaded the model generated nothing and ended normally
    "load": "stop",
    "unload": "stop",
}


@dataclass(frozen=True, slots=True)
class Policy:
    """Scoring knobs. Presets are informational and deliberately absent here."""

    tolerance: float = 0.02
    flag_over_reporting: bool = False
    finish_aliases: tuple[tuple[str, str], ...] = tuple(sorted(FINISH_REASON_MAP.items()))


@dataclass
class FinishComparison:
    invocation: str | None
    framework: str | None
    truth: str | None
    diverged: bool


@dataclass
class UnitCost:
    """What a unit's tokens cost in USD (docs/outputs.md "Spend"); a figure is None when its price
    is unknown (``unknown`` says why), never 0."""

    #: The model(s) its chat calls used, with their provider ("gpt-4o-mini (openai)").
    model: str | None
    framework_usd: float | None
    truth_usd: float | None
    #: truth - framework where the framework under-reported, 0 where it did not; None: not compared.
    unreported_usd: float | None
    unreported_tokens: int | None
    #: What priced the truth ("genai-prices 0.2.5: openai gpt-4o-mini", "pricing.models override").
    priced_by: str | None = None
    unknown: str | None = None


@dataclass
class RunSpend:
    """The run's spend: each figure summed over the units that have it; ``units_unknown`` units
    could not be priced and are in no sum."""

    framework_usd: float
    truth_usd: float
    unreported_usd: float
    unreported_tokens: int
    units_priced: int
    units_unknown: int


@dataclass
class Evidence:
    framework_tokens: int | None
    truth_tokens: int | None
    delta: int | None
    direction: str | None
    tolerance: float
    #: The unit's finish reasons: of the first invocation whose reasons differ, else the last.
    framework_finish: str | None
    truth_finish: str | None
    finish_comparisons: tuple[FinishComparison, ...]
    aligned: bool
    ledger_source: str
    ledger_missing: bool
    ledger_entries: int
    response_turns: int
    request_turns: int
    failed_turns: int
    ledger_span_ids: tuple[str, ...] = ()
    chat_span_ids: tuple[str, ...] = ()
    #: The unit's chat calls and ledger entries in order (``seq``: each one's start, Unix ns): the
    #: run page's per-call tables.
    chat_calls: tuple[ChatTurn, ...] = ()
    ledger: tuple[LedgerEntry, ...] = ()
    executor_span_ids: tuple[str, ...] = ()
    #: The token sums split into input and output (None: no entry reported that side).
    framework_input_tokens: int | None = None
    framework_output_tokens: int | None = None
    truth_input_tokens: int | None = None
    truth_output_tokens: int | None = None
    #: Parts of the truth's input and output (included in them, never added on top): cached input
    #: read and written, reasoning output (None: no call reported that part).
    truth_cache_read_tokens: int | None = None
    truth_cache_write_tokens: int | None = None
    truth_reasoning_tokens: int | None = None
    #: Chat spans folded into a call another chat span of the unit records (stacked instrumentations).
    stacked_chat_spans: int = 0
    #: Records of one call that report different token totals: a finding about the instrumentation.
    chat_layers_disagree: tuple[LayerDisagreement, ...] = ()
    #: Ledger spans naming this unit's executor that could not be joined to one run (ExecutorRecord).
    ledger_unjoined: int = 0
    #: Ledger spans not counted: the same response recorded a second way (ExecutorRecord).
    ledger_duplicates: int = 0
    #: What the unit's tokens cost (None: not priced, e.g. a run stored before pricing existed).
    cost: UnitCost | None = None


@dataclass
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


@dataclass(slots=True)  # built once per run on the live path: not frozen, as above
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
    #: See :attr:`RunInput.split`.
    split: bool = False
    #: Chat calls with no agent above them (the sum of ``unattributed_chat``'s calls).
    unattributed_chat_spans: int = 0
    unattributed_chat: tuple[UnattributedChat, ...] = ()
    revision: int = 1
    notes: tuple[str, ...] = field(default=())
    non_agent_executors: tuple[str, ...] = ()
    workflow_errors: tuple[str, ...] = ()
    #: AgentEval's coverage note when some units had no truth and others were checked, else None.
    coverage_note: str | None = None
    #: The MAF release and instrumentation its spans came from (the instrumentation's announcement).
    maf_release: str | None = None
    instrumentation_version: str | None = None
    instrumentation_status: str | None = None
    service_name: str | None = None
    #: See :attr:`RunInput.runtime`.
    runtime: str | None = None
    #: When the run started (ISO 8601, UTC) and how long it took (seconds, to the latest end of its
    #: spans); None: unknown (a file format without span times, spans without end times).
    started_at: str | None = None
    duration_s: float | None = None
    #: What the run's units cost (None: not priced).
    spend: RunSpend | None = None

    @property
    def checked(self) -> int:
        return [e.checked for e in self.executors].count(True)

    @property
    def unchecked(self) -> int:
        return len(self.executors) - self.checked

    @property
    def exit_code(self) -> int:
        return STATUS_EXIT_CODES[self.status]


@dataclass(frozen=True, slots=True)
class Failure:
    """A trace or run that could not be finalized or stored: counted, logged, shown on the run page."""

    id: str
    stage: str
    error: str


def fmt_score(score: float | None) -> str:
    """A score as people read it (terminal tables, watch lines, a failed run's span status)."""
    return "-" if score is None else f"{score:.3f}"


def fmt_usd(usd: float | None) -> str:
    """A dollar figure as people read it: to the cent, or where under a cent to two significant
    digits (a unit's spend is often a fraction of a cent); ``unknown`` for None, never $0."""
    if usd is None:
        return "unknown"
    if usd == 0 or abs(usd) >= 0.01:
        return f"${usd:,.2f}"
    decimals = 1 - math.floor(math.log10(abs(usd)))  # two significant digits, never in e-notation
    return f"${usd:.{decimals}f}"


@lru_cache(maxsize=16)
def _exact(tolerance: float) -> tuple[int, int]:
    """The tolerance as written (0.02 is exactly 2/100) as numerator and denominator, so the 2%
    boundary is exact and compared in integers."""
    return Fraction(str(tolerance)).as_integer_ratio()


def beyond_tolerance(delta: int, truth_tokens: int, tolerance: float) -> bool:
    """Whether the framework's total is off the truth's by more than the tolerance (strict: exactly
    the tolerance off is within it): the one boundary the verdict and every display use."""
    numerator, denominator = _exact(tolerance)
    return abs(delta) * denominator > truth_tokens * numerator


def over_reported(delta: int | None, direction: str | None, tolerance: float, truth_tokens: int | None) -> bool:
    """Whether a checked unit's ledger is above its truth beyond the tolerance: an over-report, Agree
    unless ``scoring.flag_over_reporting`` (docs/verdicts.md), and shown as one either way."""
    return direction == "over" and delta is not None and truth_tokens is not None and beyond_tolerance(
        delta, truth_tokens, tolerance)


def fmt_over_report(evidence: Mapping[str, Any]) -> str | None:
    """A unit's over-report in a few words (``over-reported +33%``; ``+40 tokens`` over a truth of 0),
    or None where the ledger is not above the truth beyond the tolerance."""
    delta: int | None = evidence.get("delta")
    truth: int | None = evidence.get("truth_tokens")
    if delta is None or not over_reported(delta, evidence.get("direction"), evidence["tolerance"], truth):
        return None
    return f"over-reported +{round(100 * delta / truth)}%" if truth else f"over-reported +{delta:,} tokens"


def fmt_maf_release(release: str | None) -> str:
    """A run's MAF release as people read it: the .NET ledger announces ``dotnet-{version}``."""
    if release is not None and release.startswith(DOTNET_RELEASE_PREFIX):
        return f"Microsoft.Agents.AI.Workflows {release.removeprefix(DOTNET_RELEASE_PREFIX)} (.NET)"
    return f"agent-framework-core {release or '-'}"


def ledger_package(dotnet: bool) -> str:
    """The ledger's package for a runtime (docs/maf.md, docs/dotnet.md)."""
    return "AgentEval.Instrumentation.MafFidelity" if dotnet else "opentelemetry-instrumentation-maf-fidelity"


def fmt_started(started_at: str) -> str:
    """A run's ``started_at`` (ISO 8601) as people read it: UTC, to the millisecond, said so."""
    when = datetime.fromisoformat(started_at).astimezone(UTC)
    return when.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def fmt_duration(seconds: float) -> str:
    """A run's ``duration_s`` as people read it: three significant digits in µs, ms or s, then
    minutes and hours."""
    if seconds < 0.9995e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 0.9995:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 99.95:
        return f"{seconds:.3g} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min {secs:02d} s" if hours else f"{minutes} min {secs:02d} s"
