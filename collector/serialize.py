"""Run verdicts as plain JSON-able dicts: the one shape used by ``--json``, the store and logs."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable
from typing import Any

import orjson

from collector.model import (
    FILE_FIXES,
    LEDGER_SOURCE_AGENTEVAL,
    LEDGER_SOURCE_V1,
    NO_TRUTH_EXPLANATIONS,
    NO_TRUTH_FIXES,
    ExecutorVerdict,
    NoTruthReason,
    RunVerdict,
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
        return [v if type(v) in _EXACT_SCALARS else _plain(v) for v in value]
    names = _FIELDS.get(type(value))
    if names is None:
        names = _FIELDS[type(value)] = tuple(f.name for f in dataclasses.fields(value))
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
    if reason in (NoTruthReason.LEDGER_DERIVED, NoTruthReason.LEDGER_MISSING) and run.instrumentation_status:
        found = (f"opentelemetry-instrumentation-maf-fidelity {run.instrumentation_version} is installed "
                 f"(agent-framework-core {run.maf_release})")
        if not run.instrumentation_status.startswith("active"):
            return (f"{found} but records nothing: {run.instrumentation_status.removeprefix('inactive: ')}; "
                    "upgrade it to a release that supports this MAF, or run a MAF release it supports")
        recorded = (f"{found} and active, but no agent_response span of this agent reached the collector: "
                    "check that the agent runs through a MAF agent class's run() and that every span of the "
                    "process is exported to this collector")
        if reason is NoTruthReason.LEDGER_MISSING:
            return f"if the agent failed, see the failed chat calls and the run's workflow errors; otherwise {recorded}"
        return recorded
    return NO_TRUTH_FIXES[reason]


def _unit_extras(verdict: ExecutorVerdict, run: RunVerdict) -> dict[str, Any]:
    reason = verdict.no_truth_reason
    return {"checked": verdict.checked,
            "no_truth_explanation": NO_TRUTH_EXPLANATIONS[reason] if reason is not None else None,
            "no_truth_fix": no_truth_fix(verdict, run)}


_RUN_FIELDS = tuple(f.name for f in dataclasses.fields(RunVerdict) if f.name != "executors")


def _run_head(run: RunVerdict, executors: Any, plain: Callable[[Any], Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = {name: plain(getattr(run, name)) for name in _RUN_FIELDS}
    checked = run.checked
    out.update(checked=checked, unchecked=len(run.executors) - checked, exit_code=run.exit_code, executors=executors)
    out.update(extra)
    return out


def run_to_json(run: RunVerdict, **extra: Any) -> bytes:
    """The run document (the one shape of ``--json``, the store and the stream) as JSON.

    orjson writes the dataclasses itself, in their field order; walking them in Python instead
    (:func:`_plain`) cost ~18 µs a unit in the store writer, holding the GIL the receivers need.
    """
    try:
        units = b",".join(orjson.dumps(e)[:-1] + b"," + orjson.dumps(_unit_extras(e, run))[1:] for e in run.executors)
        return orjson.dumps(_run_head(run, orjson.Fragment(b"[" + units + b"]"), _same, extra))
    except TypeError:  # what orjson refuses (an integer beyond 64 bits, a lone surrogate): the slow way
        executors = [_plain(e) | _unit_extras(e, run) for e in run.executors]
        return to_json(_run_head(run, executors, _plain, extra))


def _same(value: Any) -> Any:
    return value


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

