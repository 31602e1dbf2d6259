"""Span facts (docs/design.md §3): what classification reads of a span, worked out once as it is
decoded, and the readings of names, counts and finish reasons that every decoder shares."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Final, cast

from collector.core.model import Announcement
from collector.core.profiles import (
    BRIDGE_EXECUTOR_ATTRIBUTE,
    INSTRUMENTATION_STATUS_ATTRIBUTE,
    INSTRUMENTATION_VERSION_ATTRIBUTE,
    LEDGER_SOURCE_ATTRIBUTE,
    LEDGER_SOURCE_BRIDGE,
    MAF_RELEASE_ATTRIBUTE,
    Matcher,
)

#: What classification reads of a span, worked out once as it is decoded (by the compiled decoder in
#: the same pass, else by :func:`span_facts` from its wanted attributes), so the classifier looks up
#: no attribute: its kind by name (:data:`RUN`, :data:`EXECUTOR`, :data:`AGENT` or :data:`OTHER`),
#: whether it is an AgentResponseEvent, whether it is a chat call, the agent, executor and bridge
#: executor names, whether its executor type hosts an agent, the subject, the error type, the input,
#: output and total tokens, the finish reason, the instrumentation's announcement (the MAF release,
#: its version and status), a chat call's model and provider, and the parts of its counts (cached
#: input read and written, reasoning output).
Facts = tuple[int, bool, bool, str | None, str | None, str | None, bool, str | None, str | None,
              int | None, int | None, int | None, str | None, str | None, str | None, str | None, str | None,
              str | None, int | None, int | None, int | None]
#: Positions in :data:`Facts` (the compiled decoder writes them in this order).
KIND: Final = 0
BRIDGE: Final = 1
CHAT: Final = 2
AGENT_ID: Final = 3
EXECUTOR_ID: Final = 4
BRIDGE_EXECUTOR: Final = 5
HOSTS_AGENT: Final = 6
SUBJECT: Final = 7
ERROR_TYPE: Final = 8
INPUT: Final = 9
OUTPUT: Final = 10
TOTAL: Final = 11
FINISH: Final = 12
MAF_RELEASE: Final = 13
INSTRUMENTATION_VERSION: Final = 14
INSTRUMENTATION_STATUS: Final = 15
MODEL: Final = 16
PROVIDER: Final = 17
CACHE_READ: Final = 18
CACHE_WRITE: Final = 19
REASONING: Final = 20
FACTS = 21  # values in Facts
#: How many facts journals of earlier versions wrote (replayed with the later facts unknown).
EARLIER_FACTS = (13, 16, 18)


@dataclass(slots=True)
class SpanRecord:
    """The part of a span that classification reads."""

    trace_id: bytes
    span_id: bytes
    parent_id: bytes
    name: str
    start_ns: int
    #: What classification reads of the span's attributes (:data:`Facts`).
    facts: Facts
    resource_subject: str | None = None
    #: The span's error status description ("" when it has none); None when the status is not ERROR.
    status_error: str | None = None
    #: The resource's ``telemetry.sdk.language`` (which runtime, hence which profile, wrote it).
    sdk_language: str | None = None
    #: The span's end (Unix ns); None when unknown (unset on the wire, or journaled by an earlier version).
    end_ns: int | None = None


#: MAF's id of an agent without a name (``str(uuid4())``, also as 32 hex digits): a per-process id
#: that never names a unit (docs/design.md §1).
_PER_PROCESS_ID = re.compile(r"[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}", re.IGNORECASE)


def is_per_process_id(name: str) -> bool:
    return len(name) in (32, 36) and _PER_PROCESS_ID.fullmatch(name) is not None


#: MAF .NET names an agent's host executor ``{Name}_{Id}`` (``GetDescriptiveId``), where the agent's
#: ``Id`` is a per-process uuid unless set: the executor is named by its agent's name (docs/maf.md).
_DOTNET_AGENT_EXECUTOR = re.compile(r"(.+?)_[0-9a-f]{32}", re.IGNORECASE)


#: MAF .NET's descriptive id of an agent (``AIAgentExtensions.GetDescriptiveId``, its executor's id):
#: every run of characters other than ASCII letters and digits turned into ``_``; on netstandard2.0
#: ``_`` itself is kept.
_NOT_IN_DESCRIPTIVE_IDS = (re.compile(r"[^0-9A-Za-z]+"), re.compile(r"[^0-9A-Za-z_]+"))


@lru_cache(maxsize=1024)
def descriptive_ids(name: str) -> frozenset[str]:
    """The executor ids (case-folded, without a per-process id) that MAF gives the agent ``name``:
    the name itself (MAF Python) and its descriptive id under either sanitizing rule (MAF .NET)."""
    # MAF sanitizes "{Name}_{Id}" as one string: a run of other characters ending the name joins the "_" before the id
    return frozenset([name.casefold(), *(p.sub("_", name + "_")[:-1].casefold() for p in _NOT_IN_DESCRIPTIVE_IDS)])


def announcement(s: SpanRecord) -> Announcement | None:
    """The instrumentation's announcement on a span, if it carries one."""
    if s.facts[INSTRUMENTATION_VERSION] or s.facts[MAF_RELEASE]:
        return Announcement(*s.facts[MAF_RELEASE:INSTRUMENTATION_STATUS + 1])
    return None


def span_error(s: SpanRecord) -> str | None:
    """The span's error (its ``error.type``, its status description, or "error"), or None."""
    kind = s.facts[ERROR_TYPE]
    if s.status_error is None:
        return kind
    detail = " ".join(p for p in (kind, s.status_error) if p)
    return detail or "error"


def stable_executor(name: str) -> str:
    """An executor id as a unit may carry it: never with a per-process id."""
    found = _DOTNET_AGENT_EXECUTOR.fullmatch(name)
    return found.group(1) if found else name


def workflow_name(name: str | None) -> str | None:
    """A subject, unless it holds a per-process id (MAF 1.23 names an unnamed workflow
    ``WorkflowBuilder-{uuid}``): the run is then named by what comes next (docs/design.md §1)."""
    return None if name is None or _PER_PROCESS_ID.search(name) else name


@lru_cache(maxsize=256)
def _finish_from_text(text: str) -> str | None:
    text = text.strip()
    if not text.startswith("["):
        return text or None
    try:
        return finish_reason(json.loads(text))
    except (ValueError, RecursionError):
        return text or None


def finish_reason(value: Any) -> str | None:
    """First finish reason from a string array or its JSON-encoded form (both MAF runtimes send the latter)."""
    if value is None:
        return None
    if isinstance(value, str):
        return _finish_from_text(value)  # a handful of distinct values: parse each once
    if isinstance(value, (list, tuple)):
        for item in cast("list[object] | tuple[object, ...]", value):
            if isinstance(item, str) and item.strip():
                return item.strip()
    return None


#: Largest token count kept for one span: more is absurd, and clamping keeps every sum far inside
#: int64 (the store, the proto and the metrics hold int64) while still showing an absurd value.
MAX_TOKENS = 10**12


def _int(value: Any) -> int | None:
    """A token count: a non-negative integer (or integral double, or ASCII digits), clamped."""
    if type(value) is int:  # the usual case (bool is a subclass, not this type)
        return None if value < 0 else value if value <= MAX_TOKENS else MAX_TOKENS
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float):
        value = int(value) if value.is_integer() else None  # nan and inf are not integers
    elif isinstance(value, str):
        text = value.strip()
        value = int(text) if text.isascii() and text.isdigit() and len(text) <= 32 else None
    if not isinstance(value, int) or value < 0:
        return None
    return min(value, MAX_TOKENS)


def _first(attrs: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        value = attrs.get(key)
        if value is not None:
            return value
    return None


def _text(value: Any) -> str | None:
    """An attribute used as a name: strings only (an array or kvlist is no name)."""
    if isinstance(value, str):
        value = value.strip()
        return value or None
    return None


def span_facts(m: Matcher, name: str, attrs: dict[str, Any]) -> Facts:
    """A span's :data:`Facts` from its wanted attributes (the reference the compiled decoder matches)."""
    return (
        m.kind(name),
        attrs.get(LEDGER_SOURCE_ATTRIBUTE) == LEDGER_SOURCE_BRIDGE,
        m.is_chat(name, attrs),
        _text(_first(attrs, m.agent_id_keys)),
        _text(_first(attrs, m.executor_id_keys)),
        _text(attrs.get(BRIDGE_EXECUTOR_ATTRIBUTE)),
        m.is_agent_executor_type(_first(attrs, m.executor_type_keys)),
        _text(_first(attrs, m.subject_keys)),
        _text(_first(attrs, m.error_keys)),
        _int(_first(attrs, m.input_keys)),
        _int(_first(attrs, m.output_keys)),
        _int(_first(attrs, m.total_keys)),
        finish_reason(_first(attrs, m.finish_keys)),
        _text(attrs.get(MAF_RELEASE_ATTRIBUTE)),
        _text(attrs.get(INSTRUMENTATION_VERSION_ATTRIBUTE)),
        _text(attrs.get(INSTRUMENTATION_STATUS_ATTRIBUTE)),
        _text(_first(attrs, m.model_keys)),
        _text(_first(attrs, m.provider_keys)),
        _int(_first(attrs, m.cache_read_keys)),
        _int(_first(attrs, m.cache_write_keys)),
        _int(_first(attrs, m.reasoning_keys)),
    )


def name_suffix(name: str, prefixes: tuple[str, ...]) -> str | None:
    """What follows the first of ``prefixes`` that ``name`` starts with (a span named ``invoke_agent
    writer``), or None."""
    for prefix in prefixes:
        if name.startswith(prefix):
            rest = name[len(prefix):].strip()
            return rest or None
    return None
