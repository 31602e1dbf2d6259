"""What a trace's runs hold while the trace is assembled (docs/design.md §3): per run, its executors
and its agent units, each unit's ledger and chat calls, in the compact forms the late window keeps."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from collector.core.chat_calls import Turn
from collector.core.model import Announcement, LedgerEntry

#: :attr:`Unit.direct_name` once its direct chat spans have several names.
SEVERAL_NAMES = "\x00several"

#: Past every span start (a fixed64): a run's earliest start while none is known.
NO_START = 2**64


@dataclass(slots=True)
class Unit:
    """One agent unit of a run: (executor, agent), compared case-insensitively."""

    ledger: list[LedgerEntry] = field(default_factory=list[LedgerEntry])
    #: Its agent's first invocation's start (Unix ns): unnamed agents are numbered in this order.
    started: int = NO_START
    #: Agent spans of a runtime whose agent span is an independent ledger (.NET).
    agent_spans: list[LedgerEntry] = field(default_factory=list[LedgerEntry])
    #: Agent spans that only re-sum the chat spans (MAF Python): never a ledger, only counted.
    derived_agent_spans: int = 0
    #: One of them carried usage or a finish reason (with no chat span below it, MAF puts the
    #: AgentResponse's own there): the agent answered something, so it is no idle call.
    derived_reported: bool = False
    #: Chat calls as plain tuples (:data:`Turn`); they become ChatTurns when the run is built.
    turns: list[Turn] = field(default_factory=list[Turn])
    #: The agent ran directly in its executor (no other agent between): a candidate for "own agent".
    top_level: bool = False
    #: A chat span of the unit lies beneath another (stacked instrumentations): see
    #: :func:`~collector.core.chat_calls.calls`.
    stacked: bool = False
    #: The name of the chat spans directly under the unit's agent span (:data:`SEVERAL_NAMES`: several,
    #: which may be two records of one call side by side, as :func:`~collector.core.chat_calls.calls`
    #: reads; the usual case, one name, is built without looking).
    direct_name: str | None = None
    #: A workflow run lies beneath its agent span (a workflow used as an agent): no unit, that
    #: workflow's agents are.
    wraps: bool = False
    #: The executor instances (MAF .NET ids with the agent's per-process id, case-folded) it ran
    #: directly under: which of two agents sharing an executor name a workflow event is of.
    instances: set[str] | None = None


@dataclass(slots=True)
class Executor:
    """One executor of a run, over all its invocations."""

    spans: list[tuple[int, str]] = field(default_factory=list[tuple[int, str]])  # (start, span id) per invocation
    hosts_agent: bool = False  # its type hosts one agent of its own (AgentExecutor)
    #: A workflow ran inside it (a workflow used as its agent): judged by that workflow's agents.
    composite: bool = False
    #: Its ids that carried a per-process id (MAF .NET's ``{Name}_{Id}``), case-folded: the agent
    #: instance's identity, which a caller's ledger span naming the same id joins by.
    instances: set[str] | None = None


@dataclass(slots=True)
class Run:
    """One workflow run (a workflow-run span and its subtree), or the trace's direct-agent run."""

    span_id: str | None
    subject: str | None = None
    seen: bool = False  # its workflow-run span has arrived (ended)
    executors: dict[str, Executor] = field(default_factory=lambda: defaultdict(Executor))
    units: dict[tuple[str | None, str | None], Unit] = field(default_factory=lambda: defaultdict(Unit))
    errors: list[str] = field(default_factory=list[str])
    #: The instrumentation's announcement, from the first span of the run that carries one.
    announcement: Announcement | None = None
    #: The parent of its workflow-run span (callers' ledger spans join the run under the same parent).
    parent_id: bytes = b""
    #: Its workflow-run span's start (Unix ns; None: none arrived, or it had none).
    start_ns: int | None = None
    #: The agent (key) whose span the run ran beneath, outside every other run: a workflow used as an
    #: agent and called directly.
    wrapper: str | None = None
    dirty: bool = False
    revision: int = 0
