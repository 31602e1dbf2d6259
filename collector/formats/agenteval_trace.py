"""AgentEval's own WorkflowTrace JSON (docs/design.md §2 format 1) -> reconciler input, with AgentEval's rules.

The file is what AgentEval's ``WorkflowTraceSerializer`` writes: ``steps`` (the framework ledger, one
per AgentResponseEvent) and ``executorTraces`` (per executor, the chat-boundary entries). Parity
with ``agenteval bench workflow-trace-fidelity``:

- units come from ``steps`` only; a trace key without a step is reported in the run's notes, not
  reconciled; trace keys match step ids case-insensitively, the last of a case collision wins;
- truth is the entries of scope ``ChatTurn`` and type ``Response``; an absent scope means
  ``AgentInvocation`` (not truth); requests, tool calls and stream chunks are not counted (chat-turn
  requests without any response still make the unit's NoTruth reason ``response_missing``);
- tokens are prompt + completion (``totalTokens`` is not trusted), absent counts are 0;
- a ``Response`` carrying ``error`` and neither usage nor finish reason is a failed turn (0 tokens).
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

from collector.core.model import LEDGER_SOURCE_AGENTEVAL, ChatTurn, ExecutorRecord, LedgerEntry, RunInput, Usage

_TYPES = ("request", "response", "toolcall", "streamchunk")
_SCOPES = ("agentinvocation", "chatturn", "toolexecution")
#: An entry key holding an enum -> what its error message says is expected.
_ENUM_NAMES = {
    "type": "TraceEntryType: expected Request, Response, ToolCall or StreamChunk (any case) or 0-3",
    "scope": "TraceEntryScope: expected AgentInvocation, ChatTurn or ToolExecution (any case) or 0-2",
}


@cache
def _validator() -> jsonschema.Draft202012Validator:
    text = resources.files("collector.formats").joinpath("schemas/agenteval-workflow-trace.schema.json").read_text()
    return jsonschema.Draft202012Validator(json.loads(text))


def looks_like(doc: dict[str, Any]) -> bool:
    """AgentEval's WorkflowTrace, by content: it has ``steps`` or ``executorTraces`` (camelCase)."""
    return "steps" in doc or "executorTraces" in doc


def schema_error(doc: dict[str, Any]) -> str | None:
    """``"$.path: problem"`` for the first thing AgentEval's deserializer would reject, else None."""
    error = best_match(_validator().iter_errors(doc))
    if error is None:
        return None
    where = error.absolute_path
    enum = _ENUM_NAMES.get(str(where[-1])) if len(where) > 3 and where[0] == "executorTraces" else None
    if enum is not None:
        return f"{error.json_path}: {error.instance!r} is not a {enum}"
    return f"{error.json_path}: {error.message}"


def _enum(value: str | int | None, names: tuple[str, ...]) -> str:
    """An enum read the way System.Text.Json's string-enum converter reads it: any case, or its number."""
    if value is None:
        return names[0]
    return names[value] if isinstance(value, int) else value.lower()


def _usage(obj: dict[str, Any] | None) -> Usage:
    obj = obj or {}
    return Usage(obj.get("promptTokens") or 0, obj.get("completionTokens") or 0)


def _chat_turn_type(entry: dict[str, Any]) -> str | None:
    """The entry's type if it is scoped to a chat turn, else None."""
    return _enum(entry.get("type"), _TYPES) if _enum(entry.get("scope"), _SCOPES) == "chatturn" else None


def _turn(entry: dict[str, Any], seq: int) -> ChatTurn | None:
    """A truth turn, or None for an entry AgentEval does not count."""
    if _chat_turn_type(entry) != "response":
        return None
    error, finish, usage = entry.get("error"), entry.get("finishReason"), entry.get("tokenUsage")
    if error is not None and usage is None and finish is None:
        return ChatTurn(Usage(), None, seq, error=error.get("type") or error.get("message") or "error")
    text = None if error is None else error.get("type") or error.get("message") or "error"
    return ChatTurn(_usage(usage), finish, seq, error=text)


def agenteval_run(doc: dict[str, Any]) -> RunInput:
    """The run of a validated WorkflowTrace document (see :func:`schema_error`)."""
    ledgers: dict[str, tuple[str, list[LedgerEntry]]] = {}
    for i, step in enumerate(doc["steps"]):
        eid = step["executorId"]
        ledgers.setdefault(eid.casefold(), (eid, []))[1].append(
            LedgerEntry(_usage(step.get("tokenUsage")), step.get("finishReason"), i)
        )
    traces: dict[str, tuple[str, list[Any]]] = {}
    for key, trace in (doc.get("executorTraces") or {}).items():
        traces[key.casefold()] = (key, (trace or {}).get("entries") or [])  # last of a case collision wins
    executors = []
    for folded, (eid, ledger) in ledgers.items():
        entries = traces.get(folded, ("", []))[1]
        turns = tuple(t for i, e in enumerate(entries) if (t := _turn(e, i)) is not None)
        if not turns:  # requests never answered: not counted, but they name the Path-2 gap
            turns = tuple(ChatTurn(Usage(), None, i) for i, e in enumerate(entries) if _chat_turn_type(e) == "request")
        executors.append(ExecutorRecord(eid, tuple(ledger), turns, LEDGER_SOURCE_AGENTEVAL))
    ignored = [key for folded, (key, _) in traces.items() if folded not in ledgers]
    notes = tuple(
        f"executorTraces[{key!r}] has no step: ignored, not reconciled (AgentEval reconciles the executors "
        "of steps only)" for key in ignored
    )
    return RunInput(executors=tuple(executors), notes=notes)
