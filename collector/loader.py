"""Offline trace files (DESIGN §2) -> reconciler input, detected by content, never by extension.

- ``workflow-trace/v1`` JSON (validated against the shipped JSON Schema);
- one OTLP/JSON ``ExportTraceServiceRequest``, or JSON Lines of them (the OpenTelemetry
  Collector's file exporter), classified exactly like live spans, one run per trace id.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Iterator
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from collector.classify import TraceState
from collector.decode import DecodeError, decode_otlp_json
from collector.model import ChatTurn, ExecutorRecord, LedgerEntry, RunInput, Usage
from collector.profiles import Matcher

WORKFLOW_TRACE_SCHEMA = "workflow-trace/v1"
LEDGER_SOURCE_FILE = "workflow-trace"


class TraceFileError(Exception):
    """An unreadable or invalid trace file; the message names the file, location and problem."""


@cache
def workflow_trace_schema() -> dict[str, Any]:
    text = resources.files("collector").joinpath("schemas/workflow-trace-v1.schema.json").read_text()
    return json.loads(text)


def _usage(obj: dict[str, Any]) -> Usage:
    return Usage(obj.get("input_tokens"), obj.get("output_tokens"), obj.get("total_tokens"))


def _invocation(obj: dict[str, Any]) -> str | None:
    value = obj.get("invocation")
    return None if value is None else str(value)


def workflow_trace_run(doc: dict[str, Any], where: str) -> RunInput:
    validator = jsonschema.Draft202012Validator(workflow_trace_schema())
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is not None:
        raise TraceFileError(f"{where}: {error.json_path}: {error.message}")
    ledgers: dict[str, list[LedgerEntry]] = {}
    for i, step in enumerate(doc["steps"]):
        entry = LedgerEntry(_usage(step), step.get("finish_reason"), i, _invocation(step))
        ledgers.setdefault(step["executor_id"], []).append(entry)
    truth = {
        executor_id: tuple(
            ChatTurn(
                _usage(t) if t["kind"] == "response" else Usage(),
                t.get("finish_reason") if t["kind"] == "response" else None,
                i,
                _invocation(t),
            )
            for i, t in enumerate(trace["turns"])
        )
        for executor_id, trace in doc["executor_traces"].items()
    }
    executors = tuple(
        ExecutorRecord(
            executor_id=eid,
            ledger=tuple(ledgers.get(eid, ())),
            turns=truth.get(eid, ()),
            ledger_source=LEDGER_SOURCE_FILE if eid in ledgers else "none",
        )
        for eid in dict.fromkeys([*ledgers, *truth])
    )
    return RunInput(executors=executors, trace_id=doc.get("trace_id"), subject=doc.get("subject"))


def _documents(path: Path, on_bytes: Callable[[int], None]) -> Iterator[tuple[Any, str]]:
    """Yield (document, location): one per line for JSON Lines, else the whole file once."""
    with path.open("rb") as fh:
        first = fh.readline()
        while first and not first.strip():
            first = fh.readline()
        try:
            doc = json.loads(first)
            whole = False
        except ValueError:
            whole = True
        if whole:
            fh.seek(0)
            data = fh.read()
            on_bytes(len(data))
            try:
                yield json.loads(data), str(path)
            except ValueError as exc:
                raise TraceFileError(_json_error(path, exc)) from exc
            return
        on_bytes(len(first))
        lineno = 1
        yield doc, f"{path}:{lineno}"
        for line in fh:
            lineno += 1
            on_bytes(len(line))
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except ValueError as exc:
                raise TraceFileError(f"{path}:{lineno}: invalid JSON: {exc}") from exc
            yield doc, f"{path}:{lineno}"


def _json_error(path: Path, exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}"
    return f"{path}: invalid JSON: {exc}"


#: Default of ``--trace-window``: spans read after a trace's last span before it is reconciled.
TRACE_WINDOW = 20_000


def iter_runs(path: Path, matcher: Matcher, on_bytes: Callable[[int], None] = lambda n: None,
              window: int = TRACE_WINDOW) -> Iterator[RunInput]:
    """Reconciler inputs, one per workflow run in a trace file, yielded as their traces complete.

    Streaming keeps memory flat in the file's size: in JSON Lines, a trace is complete once its root
    span has been read and ``window`` further spans passed without one of it (exporters write a root
    after its children, so stragglers are rare). A span arriving later than that is an error naming
    the trace, not a silently split run. Traces without a root wait for the end of the file.
    """
    if not path.is_file():
        raise TraceFileError(f"{path}: no such file")
    open_: OrderedDict[bytes, list] = OrderedDict()  # trace id -> [state, position of its last span]
    rootless: dict[bytes, TraceState] = {}
    closed: set[bytes] = set()
    yielded = seen_any = False
    position = 0  # spans read so far
    try:
        for doc, where in _documents(path, on_bytes):
            if not isinstance(doc, dict):
                raise TraceFileError(f"{where}: expected a JSON object, got {type(doc).__name__}")
            if "schema" in doc:
                if doc["schema"] != WORKFLOW_TRACE_SCHEMA:
                    raise TraceFileError(
                        f"{where}: $.schema: unknown schema {doc['schema']!r} (expected {WORKFLOW_TRACE_SCHEMA!r})"
                    )
                if seen_any:
                    raise TraceFileError(f"{where}: a workflow-trace document cannot follow OTLP requests")
                yield workflow_trace_run(doc, where)
                return
            if "resourceSpans" not in doc:
                raise TraceFileError(
                    f"{where}: neither a workflow-trace/v1 document (no 'schema') nor an OTLP "
                    "ExportTraceServiceRequest (no 'resourceSpans')"
                )
            seen_any = True
            for span in decode_otlp_json(doc, matcher.wanted_keys, where).spans:
                tid = span.trace_id
                if tid in closed:
                    raise TraceFileError(
                        f"{where}: trace {tid.hex()} has a span more than {window} spans after the rest of "
                        "it, after its run was reconciled; raise --trace-window")
                position += 1
                entry = open_.get(tid)
                if entry is None:
                    entry = open_[tid] = [rootless.pop(tid, None) or TraceState(matcher, tid), position]
                else:
                    entry[1] = position
                    open_.move_to_end(tid)
                entry[0].add(span)
            while open_:
                tid, (state, last) = next(iter(open_.items()))
                if last + window >= position:
                    break
                del open_[tid]
                if state.root_span_id is None and not state.run_spans_seen:
                    rootless[tid] = state
                    continue
                closed.add(tid)
                for run, _ in state.run_inputs():
                    yielded = True
                    yield run
    except DecodeError as exc:
        raise TraceFileError(str(exc)) from exc
    except OSError as exc:
        raise TraceFileError(f"{path}: {exc.strerror or exc}") from exc
    for state in [*(s for s, _ in open_.values()), *rootless.values()]:
        for run, _ in state.run_inputs():
            yielded = True
            yield run
    if not yielded:
        what = "no spans" if not (seen_any and (open_ or rootless or closed)) else "no agent, ledger or chat span"
        raise TraceFileError(f"{path}: {what} found: nothing to reconcile")
