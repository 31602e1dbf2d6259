"""Run verdicts as plain JSON-able dicts: the one shape used by ``--json``, the store and logs.

A document is bounded whatever the run's size: each list that grows with its spans (a unit's span
ids and finish comparisons, the run's workflow errors) keeps its first ``max_items`` entries and
says how many it left out (``<list>_more``); the unit's counts and totals are always whole.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable
from typing import Any, cast

import orjson

from collector.core.model import (
    DOTNET_FIXES,
    FILE_FIXES,
    LEDGER_SOURCE_AGENTEVAL,
    LEDGER_SOURCE_V1,
    NO_TRUTH_EXPLANATIONS,
    NO_TRUTH_FIXES,
    ExecutorVerdict,
    NoTruthReason,
    RunVerdict,
    fmt_maf_release,
    ledger_package,
)

_SCALARS = (str, int, float, bool, type(None))
#: Exactly these types (not subclasses: our enums subclass str) need no conversion.
_EXACT_SCALARS = frozenset(_SCALARS)
#: A hand-built file's units are fixed in the file; the live fixes name instrumentation.
_FILE_SOURCES = (LEDGER_SOURCE_V1, LEDGER_SOURCE_AGENTEVAL)
_FILE_FIXES = {**NO_TRUTH_FIXES, **FILE_FIXES}
_FIELDS: dict[type, tuple[str, ...]] = {}


def _plain(value: Any) -> Any:
    if isinstance(value, _SCALARS):  # before Enum: our enums are str subclasses
        return value.value if isinstance(value, enum.Enum) else value
    if isinstance(value, tuple):
        return [v if type(v) in _EXACT_SCALARS else _plain(v) for v in cast("tuple[Any, ...]", value)]
    cls: type[Any] = value.__class__
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(value))
    # Most fields are plain scalars: kept without a call (a document has ~25 fields per unit).
    return {name: v if type(v) in _EXACT_SCALARS else _plain(v)
            for name in names for v in (getattr(value, name),)}


def no_truth_fix(verdict: ExecutorVerdict, run: RunVerdict) -> str | None:
    """What would give the unit its truth back, true of this run: where the MAF instrumentation
    announced itself on the run's spans, a missing ledger is not fixed by installing it."""
    reason = verdict.no_truth_reason
    if reason is None:
        return None
    if verdict.evidence.ledger_source in _FILE_SOURCES:
        return _FILE_FIXES[reason]
    dotnet = run.runtime == "dotnet"
    if reason in (NoTruthReason.LEDGER_DERIVED, NoTruthReason.LEDGER_MISSING) and run.instrumentation_status:
        found = (f"{ledger_package(dotnet)} {run.instrumentation_version} is installed "
                 f"({fmt_maf_release(run.maf_release)})")
        if not run.instrumentation_status.startswith("active"):
            return (f"{found} but records nothing: {run.instrumentation_status.removeprefix('inactive: ')}; "
                    "upgrade it to a release that supports this MAF, or run a MAF release it supports")
        runs_through = ("the agent's AgentResponseEvents are read through WithFidelityLedger(run) or the agent "
                        "has .UseFidelityLedger()" if dotnet else "the agent runs through a MAF agent class's run()")
        recorded = (f"{found} and active, but no agent_response span of this agent reached the collector: "
                    f"check that {runs_through} and that every span of the process is exported to this collector")
        if reason is NoTruthReason.LEDGER_MISSING:
            return f"if the agent failed, see the failed chat calls and the run's workflow errors; otherwise {recorded}"
        return recorded
    return (DOTNET_FIXES if dotnet else NO_TRUTH_FIXES)[reason]


def _unit_extras(verdict: ExecutorVerdict, run: RunVerdict) -> dict[str, Any]:
    reason = verdict.no_truth_reason
    return {"checked": verdict.checked,
            "no_truth_explanation": NO_TRUTH_EXPLANATIONS[reason] if reason is not None else None,
            "no_truth_fix": no_truth_fix(verdict, run)}


#: Entries each bounded list of a document keeps by default (``store.max_span_ids_per_unit``).
MAX_ITEMS = 100
#: A unit's evidence lists that grow with its spans, each followed in the document by ``<name>_more``.
BOUNDED_EVIDENCE = ("finish_comparisons", "ledger_span_ids", "chat_span_ids", "executor_span_ids", "chat_calls",
                    "ledger")
#: The run's lists that grow with its spans (one workflow error per failed executor span).
BOUNDED_RUN = ("workflow_errors",)

_RUN_FIELDS = tuple(f.name for f in dataclasses.fields(RunVerdict) if f.name != "executors")
_UNIT_FIELDS = tuple(f.name for f in dataclasses.fields(ExecutorVerdict) if f.name != "evidence")


def _bounded(value: Any, names: tuple[str, ...], limit: int) -> tuple[Any, dict[str, int]]:
    """``value`` with each of its ``names`` lists cut to ``limit`` entries, and how many each lost."""
    more = {name + "_more": max(len(getattr(value, name)) - limit, 0) for name in names}
    if any(more.values()):
        value = dataclasses.replace(value, **{name: getattr(value, name)[:limit] for name in names})
    return value, more


def _run_head(run: RunVerdict, executors: Any, plain: Callable[[Any], Any] | None, extra: dict[str, Any],
              limit: int) -> dict[str, Any]:
    bounded, more = _bounded(run, BOUNDED_RUN, limit)
    if plain is None:  # orjson writes the values as they are
        out = {name: getattr(bounded, name) for name in _RUN_FIELDS}
    else:
        out = {name: plain(getattr(bounded, name)) for name in _RUN_FIELDS}
    checked = run.checked
    out.update(more)
    out.update(checked=checked, unchecked=len(run.executors) - checked, exit_code=run.exit_code, executors=executors)
    out.update(extra)
    return out


#: ``<list>_more`` of a unit none of whose evidence lists was cut (the usual case).
_NOTHING_MORE = {f"{name}_more": 0 for name in BOUNDED_EVIDENCE}


def _unit(e: ExecutorVerdict, run: RunVerdict, limit: int) -> dict[str, Any]:
    """A unit for orjson: the dataclass's fields as orjson writes them (its ``__dict__``), its
    evidence's ``_more`` counts and the extras appended; a unit with a list over ``limit`` is cut
    first. (One orjson call per run: a call and its bytes spliced per unit took twice as long.)"""
    ev = e.evidence
    if (len(ev.chat_calls) > limit or len(ev.finish_comparisons) > limit or len(ev.ledger) > limit
            or len(ev.executor_span_ids) > limit):  # (spelled out: this runs per unit of every run)
        ev, more = _bounded(ev, BOUNDED_EVIDENCE, limit)
    else:
        more = _NOTHING_MORE
    unit = e.__dict__ | {"evidence": ev.__dict__ | more}
    unit.update(_unit_extras(e, run))
    return unit


def _plain_unit(e: ExecutorVerdict, run: RunVerdict, limit: int) -> dict[str, Any]:
    evidence, more = _bounded(e.evidence, BOUNDED_EVIDENCE, limit)
    unit = {name: _plain(getattr(e, name)) for name in _UNIT_FIELDS}
    unit["evidence"] = _plain(evidence) | more
    return unit | _unit_extras(e, run)


def run_to_json(run: RunVerdict, max_items: int = MAX_ITEMS, **extra: Any) -> bytes:
    """The run document (the one shape of ``--json``, the store and the stream) as JSON, each list
    that grows with the run's spans cut to ``max_items`` entries (see the module docstring).

    orjson writes the dataclasses itself, in their field order; walking them in Python instead
    (:func:`_plain`) cost ~18 µs a unit in the store writer, holding the GIL the receivers need.
    """
    try:
        return orjson.dumps(_run_head(run, [_unit(e, run, max_items) for e in run.executors], None, extra,
                                      max_items))
    except TypeError:  # what orjson refuses (an integer beyond 64 bits, a lone surrogate): the slow way
        executors = [_plain_unit(e, run, max_items) for e in run.executors]
        return to_json(_run_head(run, executors, _plain, extra, max_items))


def run_to_dict(run: RunVerdict, **extra: Any) -> dict[str, Any]:
    return from_json(run_to_json(run, **extra))


def to_json(value: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """Compact JSON, by orjson (several times faster than ``json`` on the per-run and per-request
    paths); values orjson refuses (an integer beyond 64 bits, a lone surrogate) fall back to ``json``."""
    try:
        return orjson.dumps(value, default=default)
    except TypeError:
        return json.dumps(value, separators=(",", ":"), default=default).encode()


def from_json(data: str | bytes) -> Any:
    """The inverse of :func:`to_json`: orjson, or ``json`` for what only ``json`` wrote (a lone
    surrogate escape)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)

