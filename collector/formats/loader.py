"""Offline trace files (docs/design.md §2) -> reconciler input, detected by content, never by extension.

- AgentEval's own WorkflowTrace JSON (:mod:`collector.formats.agenteval_trace`, AgentEval's rules);
- ``workflow-trace/v1`` JSON (validated against the shipped JSON Schema);
- one OTLP/JSON ``ExportTraceServiceRequest``, or JSON Lines of them (the OpenTelemetry
  Collector's file exporter), classified exactly like live spans, one run per trace id;
- one serialized (protobuf) ``ExportTraceServiceRequest``, the body a collector receives over
  OTLP/gRPC or OTLP/HTTP: a capture replays as it was received, decoded as live requests are.

``-`` reads standard input.
"""

from __future__ import annotations

import codecs
import json
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO

import jsonschema
from google.protobuf.message import DecodeError as ProtoDecodeError
from jsonschema.exceptions import best_match

from collector.core.classify import TraceState
from collector.core.model import LEDGER_SOURCE_V1, ChatTurn, ExecutorRecord, LedgerEntry, RunInput, Usage
from collector.core.profiles import Matcher
from collector.formats import agenteval_trace
from collector.formats.decode import Decoded, DecodeError, count_spans, decode_bytes, decode_otlp_json

WORKFLOW_TRACE_SCHEMA = "workflow-trace/v1"


class TraceFileError(Exception):
    """An unreadable or invalid trace file; the message names the file, location and problem."""


class NoSteps(Exception):
    """A workflow trace with no step and no chat trace: nothing ran that could be checked (PENDING,
    as AgentEval reads it), and no run to store."""


#: The name ``-`` (standard input) is shown as.
STDIN = "<stdin>"


@cache
def workflow_trace_schema() -> dict[str, Any]:
    text = resources.files("collector.formats").joinpath("schemas/workflow-trace-v1.schema.json").read_text()
    return json.loads(text)


def _usage(obj: dict[str, Any]) -> Usage:
    return Usage(obj.get("input_tokens"), obj.get("output_tokens"), obj.get("total_tokens"))


def _invocation(obj: dict[str, Any]) -> str | None:
    value = obj.get("invocation")
    return None if value is None else str(value)


def _v1_turns(turns: list[dict[str, Any]]) -> tuple[ChatTurn, ...]:
    """A request followed by a response or failure (before the next request) is one answered call;
    only an unanswered request is a bare request."""
    out: list[ChatTurn] = []
    for i, t in enumerate(turns):
        kind = t["kind"]
        if kind == "request":
            answered = next((n["kind"] != "request" for n in turns[i + 1:]), False)
            if not answered:
                out.append(ChatTurn(Usage(), None, i, _invocation(t)))
        elif kind == "failed":
            out.append(ChatTurn(Usage(), None, i, _invocation(t), error=t.get("error") or "failed"))
        else:
            out.append(ChatTurn(_usage(t), t.get("finish_reason"), i, _invocation(t)))
    return tuple(out)


def workflow_trace_run(doc: dict[str, Any], where: str) -> RunInput:
    validator = jsonschema.Draft202012Validator(workflow_trace_schema())
    error = best_match(validator.iter_errors(doc))
    if error is not None:
        raise TraceFileError(f"{where}: {error.json_path}: {error.message}")
    if not doc["steps"] and not doc["executor_traces"]:
        raise NoSteps(f"{where}: no steps and no executor traces: nothing ran that could be checked")
    ledgers: dict[str, list[LedgerEntry]] = {}
    for i, step in enumerate(doc["steps"]):
        entry = LedgerEntry(_usage(step), step.get("finish_reason"), i, _invocation(step))
        ledgers.setdefault(step["executor_id"], []).append(entry)
    truth = {executor_id: _v1_turns(trace["turns"]) for executor_id, trace in doc["executor_traces"].items()}
    executors = tuple(
        ExecutorRecord(
            executor_id=eid,
            ledger=tuple(ledgers.get(eid, ())),
            turns=truth.get(eid, ()),
            ledger_source=LEDGER_SOURCE_V1 if eid in ledgers else "none",
        )
        for eid in dict.fromkeys([*ledgers, *truth])
    )
    return RunInput(executors=executors, trace_id=doc.get("trace_id"), subject=doc.get("subject"))


def agenteval_run(doc: dict[str, Any], where: str) -> RunInput:
    if (problem := agenteval_trace.schema_error(doc)) is not None:
        raise TraceFileError(f"{where}: AgentEval WorkflowTrace: {problem}")
    if not doc["steps"]:
        raise NoSteps(f"{where}: no steps: the workflow trace records no executor step, so nothing could be checked")
    return agenteval_trace.agenteval_run(doc)


def _single_document(doc: dict[str, Any], where: str) -> RunInput:
    """The run of a whole-file format (AgentEval WorkflowTrace or workflow-trace/v1)."""
    if "schema" in doc:
        if doc["schema"] != WORKFLOW_TRACE_SCHEMA:
            raise TraceFileError(
                f"{where}: $.schema: unknown schema {doc['schema']!r} (expected {WORKFLOW_TRACE_SCHEMA!r})"
            )
        return workflow_trace_run(doc, where)
    return agenteval_run(doc, where)


def _open(path: Path) -> tuple[BinaryIO, str]:
    if str(path) == "-":
        return sys.stdin.buffer, STDIN
    if path.is_dir():
        raise TraceFileError(f"{path}: is a directory: pass one trace file (--workflow-trace FILE, or - for stdin)")
    try:
        return path.open("rb"), str(path)
    except FileNotFoundError:
        raise TraceFileError(f"{path}: no such file") from None
    except OSError as exc:
        raise TraceFileError(f"{path}: {exc.strerror or exc}") from None


def _documents(fh: BinaryIO, name: str, on_bytes: Callable[[int], None]) -> Iterator[tuple[Any, str]]:
    """Yield (document, location): one per line for JSON Lines, else the whole input once; input that
    is not JSON is a serialized request, yielded as its bytes."""
    skipped = b""
    first = fh.readline()
    while first and not first.strip():
        skipped += first
        first = fh.readline()
    if first and first.lstrip()[:1] not in (b"{", b"[") and not first.startswith(_BYTE_ORDER_MARKS):
        data = skipped + first + fh.read()
        on_bytes(len(data))
        yield data, name
        return
    try:
        doc = json.loads(first)
        whole = False
    except ValueError:
        whole = True
    if whole:
        data = first + fh.read()
        on_bytes(len(skipped) + len(data))
        if not data.strip():
            raise TraceFileError(f"{name}: empty: no trace to read")
        try:
            yield json.loads(data), name
        except ValueError as exc:
            # A request's first field is tagged 0x0A, a newline: one whose length byte is "{" or "[" reads
            # as the start of JSON
            if skipped[:1] == b"\n" and _request_spans(skipped + data):
                yield skipped + data, name
                return
            raise TraceFileError(_json_error(name, exc)) from exc
        return
    on_bytes(len(first))
    lineno = 1
    yield doc, f"{name}:{lineno}"
    for line in fh:
        lineno += 1
        on_bytes(len(line))
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError as exc:
            raise TraceFileError(f"{name}:{lineno}: invalid JSON: {exc}") from exc
        yield doc, f"{name}:{lineno}"


#: How JSON text in UTF-8 with a signature, UTF-16 or UTF-32 begins (Windows tools write them): JSON.
_BYTE_ORDER_MARKS = (codecs.BOM_UTF8, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)  # UTF-32's begin as UTF-16's


def _request_spans(data: bytes) -> bool:
    """``data`` is a serialized request holding spans."""
    try:
        return count_spans(data) > 0
    except ProtoDecodeError:
        return False


def _decode_request(data: bytes, matcher: Matcher, name: str) -> Decoded:
    """A serialized request decoded as the receivers decode one; a span they would reject is an error here."""
    try:
        decoded = decode_bytes(data, matcher)
    except ProtoDecodeError as exc:
        try:
            doc = json.loads(data)  # text that is no request: say what is wrong with it as JSON
        except ValueError as json_exc:
            if _is_text(data):
                raise TraceFileError(_json_error(name, json_exc)) from None
        else:
            raise TraceFileError(f"{name}: expected a JSON object, got {type(doc).__name__}") from None
        raise TraceFileError(
            f"{name}: neither JSON nor a serialized OTLP ExportTraceServiceRequest (protobuf: {exc})") from None
    if decoded.rejected:
        raise TraceFileError(f"{name}: {decoded.rejected} span(s) cannot be used: {'; '.join(decoded.reasons)}")
    return decoded


def _is_text(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _json_error(name: str, exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{name}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}"
    return f"{name}: invalid JSON: {exc}"


def _unknown(doc: dict[str, Any]) -> str:
    if "entries" in doc:
        return ("an AgentEval agent trace (one agent's entries), not a workflow trace: this command reads "
                "AgentEval WorkflowTrace files (steps, executorTraces), workflow-trace/v1 or OTLP JSON")
    keys = ", ".join(sorted(map(str, doc))[:5]) or "none"
    return ("not a trace this command reads (top-level keys: " + keys + "): expected AgentEval's WorkflowTrace "
            "(steps, executorTraces), workflow-trace/v1 (schema) or an OTLP ExportTraceServiceRequest (resourceSpans)")


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
    fh, name = _open(path)
    open_: OrderedDict[bytes, list] = OrderedDict()  # trace id -> [state, position of its last span]
    rootless: dict[bytes, TraceState] = {}
    closed: set[bytes] = set()
    yielded = seen_any = False
    position = 0  # spans read so far
    try:
        for doc, where in _documents(fh, name, on_bytes):
            if isinstance(doc, bytes):
                decoded = _decode_request(doc, matcher, where)
            elif not isinstance(doc, dict):
                raise TraceFileError(f"{where}: expected a JSON object, got {type(doc).__name__}")
            elif "resourceSpans" not in doc:
                if "schema" not in doc and not agenteval_trace.looks_like(doc):
                    raise TraceFileError(f"{where}: {_unknown(doc)}")
                if seen_any:
                    raise TraceFileError(f"{where}: a workflow trace document cannot follow OTLP requests")
                yield _single_document(doc, where)
                return
            else:
                decoded = decode_otlp_json(doc, matcher, where)
            seen_any = True
            for span in decoded.spans:
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
        raise TraceFileError(f"{name}: {exc.strerror or exc}") from exc
    finally:
        if fh is not sys.stdin.buffer:
            fh.close()
    for state in [*(s for s, _ in open_.values()), *rootless.values()]:
        for run, _ in state.run_inputs():
            yielded = True
            yield run
    if not yielded:
        what = "no spans" if not (seen_any and (open_ or rootless or closed)) else "no agent, ledger or chat span"
        raise TraceFileError(f"{name}: {what} found: nothing to reconcile")
