"""Property-based fuzzing of *valid* OTLP requests (docs/design.md §3): any attribute value of any type on
every key the classifier reads, any id, any span name, any parent chain (cycles, self-parents, missing
parents, deep chains), any status, over OTLP/gRPC (protobuf) and OTLP/HTTP (JSON).

Per example, a well-formed MAF-shaped trace rides in the same request as the hostile spans and must be
stored exactly once with its expected status and per-unit verdicts; the request is answered per the
OTLP specification (never a server error) and the collector stays up. The same requests also go
through decode -> classify -> reconcile -> serialize in-process.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import sqlite3
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Status

from collector.config import CollectorConfig
from collector.core.classify import TraceState
from collector.core.facts import SpanRecord
from collector.core.model import RunVerdict
from collector.core.reconcile import reconcile
from collector.core.serialize import run_to_dict
from collector.formats.decode import OWN_SCOPE, SDK_LANGUAGE, SERVICE_NAME, Decoded, decode_otlp_json, decode_request
from collector.outputs.wire import run_message
from collector.store import unpack

from conftest import JSON, CollectorProcess, post
from mafshape import SCENARIOS, export_request, record, to_otlp_json
from test_reliability import grpc_raw

CONFIG = CollectorConfig()
MATCHER = CONFIG.matcher()
#: Every span attribute key the classifier reads (from the code, so a new key is fuzzed too).
WANTED = sorted(MATCHER.wanted_keys)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: The receivers' default size limits (the fixture keeps them): above them 413 / RESOURCE_EXHAUSTED is right.
MAX_BYTES = 4 * 1024 * 1024
GOOD = ("pass", "fail_under_report")
FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck),
                print_blob=False)
LIVE_EXAMPLES, INPROCESS_EXAMPLES = 70, 100

# --- the value model: ("s", str) ("i", int) ("iraw", JSON number token) ("d", float) ("b", bool)
# ("bytes", bytes) ("a", [values]) ("kv", [(key, value)]) ("none",) ------------------------------------

Value = tuple

STRINGS = [
    "", " ", "²", "١٢", "٣", "𝟙𝟚", "12", " 42 ", "-5", "+7", "0x1f", "1e3", "1_000", "9" * 40, str(2**63),
    str(2**64), "NaN", "inf", "[" * 1024, "]", '["stop"]', '[ "length" ]', "[]", "[null]", "[1, 2]",
    '[[["stop"]]]', '{"a": 1}', '"stop"', "stop\x00", "chat", "invoke_agent", "AgentResponseEvent",
    "AgentExecutor", "x.y.HandoffAgentExecutor", "researcher", "RESEARCHER", "writer", "\ud800", "\udfff\ud800x",
    "é" * 600, "x" * 5000, "\u202eevil", "\ufeff", "ǅ", "ß", "İ",
]
text = st.one_of(
    st.sampled_from(STRINGS),
    st.text(max_size=24),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF) | st.characters(), max_size=12),
)
int64 = st.one_of(st.sampled_from([0, 1, -1, INT64_MAX, INT64_MIN, 2**53 + 1, 10**12, 10**12 + 1, 420]),
                  st.integers(INT64_MIN, INT64_MAX))
#: intValue tokens valid JSON can carry but int64 cannot (JSON only; 400 is then an allowed answer).
RAW_INTS = ["1e400", "-1e400", "1e300", "1.5", "9223372036854775808", "-9223372036854775809",
            "18446744073709551616", "1E2", "-0.0"]
doubles = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -1e300, 0.0, -0.0, 5e-324, 420.0,
                                     9.223372036854776e18]), st.floats())
leaf = st.one_of(
    text.map(lambda s: ("s", s)),
    int64.map(lambda i: ("i", i)),
    st.sampled_from(RAW_INTS).map(lambda t: ("iraw", t)),
    doubles.map(lambda d: ("d", d)),
    st.booleans().map(lambda b: ("b", b)),
    st.binary(max_size=8).map(lambda b: ("bytes", b)),
    st.just(("none",)),
)
values = st.recursive(
    leaf,
    lambda kids: st.one_of(st.lists(kids, max_size=4).map(lambda vs: ("a", vs)),
                           st.lists(st.tuples(text, kids), max_size=4).map(lambda kvs: ("kv", kvs))),
    max_leaves=12,
)


@st.composite
def deep_values(draw) -> Value:
    """A value nested deeper than the decoder keeps (9 to 20 levels of arrays and kvlists; past 100, its
    span is rejected: tested in test_native_decode and test_receiver_hardening)."""
    value: Value = draw(leaf)
    for kind in draw(st.lists(st.sampled_from("ak"), min_size=9, max_size=20)):
        value = ("a", [value]) if kind == "a" else ("kv", [("k", value)])
    return value


any_value = st.one_of(values, values, values, deep_values())

# --- hostile spans ------------------------------------------------------------------------------------

NAME_PREFIXES = ["workflow.run", "workflow_invoke", "invoke_workflow", "workflow.session", "executor.process",
                 "invoke_agent", "chat", "agent_response", "execute_tool", "orchestrate_tools", "edge_group.process"]
names = st.one_of(
    st.sampled_from(NAME_PREFIXES),
    st.tuples(st.sampled_from(NAME_PREFIXES), text).map(" ".join),
    text,
    st.just("chat " + "m" * 3000),
)


@dataclass
class HSpan:
    trace_id: bytes
    span_id: bytes
    parent: bytes
    name: str
    attrs: list[tuple[str, Value]]
    status_code: int = 0
    status_message: str = ""
    kind: int = 1
    start: int = 0
    end: int = 0
    links: list[tuple[bytes, bytes]] = field(default_factory=list)

    def bad_ids(self) -> bool:
        """Ids the OTLP receiver must reject this span for (partial_success)."""
        return (len(self.trace_id) != 16 or not any(self.trace_id) or len(self.span_id) != 8
                or not any(self.span_id) or (len(self.parent) not in (0, 8)))


@dataclass
class HScope:
    name: str
    spans: list[HSpan]


@dataclass
class HResource:
    attrs: list[tuple[str, Value]]
    scopes: list[HScope]


@dataclass
class Case:
    """One hostile request, plus the good MAF-shaped trace that rides along."""

    resources: list[HResource]
    good: str
    good_at: int
    upper_hex: bool
    ints_as_numbers: bool

    def spans(self) -> list[HSpan]:
        return [s for r in self.resources for sc in r.scopes if sc.name != OWN_SCOPE for s in sc.spans]

    def json_lenient(self) -> bool:
        """Uses an intValue token that is valid JSON but no int64: a 400 is an allowed answer in JSON."""
        def raw(v: Value) -> bool:
            return v[0] == "iraw" or (v[0] == "a" and any(map(raw, v[1]))) or (
                v[0] == "kv" and any(raw(x) for _, x in v[1]))

        return any(raw(v) for r in self.resources for _, v in r.attrs) or any(
            raw(v) for r in self.resources for sc in r.scopes for s in sc.spans for _, v in s.attrs)


ids16 = st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=20), st.just(bytes(16)))
ids8 = st.one_of(st.binary(min_size=8, max_size=8), st.binary(max_size=12), st.just(bytes(8)))
u64 = st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1, 1_700_000_000_000_000_000]), st.integers(0, 2**64 - 1))


@st.composite
def attributes(draw) -> list[tuple[str, Value]]:
    keys = draw(st.lists(st.sampled_from(WANTED) | st.sampled_from(["other.key", ""]), max_size=len(WANTED)))
    return [(k, draw(any_value)) for k in keys]  # a key may repeat: valid protobuf, last one wins


@st.composite
def spans_of(draw) -> list[HSpan]:
    """Spans over a few traces, parents picked among each other (cycles, self-parents), missing, or junk."""
    traces = draw(st.lists(ids16, min_size=1, max_size=3))
    n = draw(st.integers(0, 10))
    sids = [draw(st.one_of(st.binary(min_size=8, max_size=8), ids8)) for _ in range(n)]
    out = []
    for i in range(n):
        how = draw(st.sampled_from(["none", "self", "other", "other", "missing", "junk", "zero"]))
        parent = {"none": b"", "self": sids[i], "zero": bytes(8),
                  "other": sids[draw(st.integers(0, n - 1))] if n else b"",
                  "missing": draw(st.binary(min_size=8, max_size=8)), "junk": draw(st.binary(max_size=12))}[how]
        status = draw(st.sampled_from([0, 1, 2, 2, 7]))
        message = draw(st.one_of(text, st.just("boom " * 4000))) if status else ""
        out.append(HSpan(draw(st.sampled_from(traces)), sids[i], parent, draw(names), draw(attributes()), status,
                         message, draw(st.sampled_from([0, 1, 2, 3, 4, 5, 42])), draw(u64), draw(u64),
                         draw(st.lists(st.tuples(ids16, ids8), max_size=1))))
    return out


@st.composite
def chain(draw) -> list[HSpan]:
    """A deep parent chain in one trace (each span the parent of the next), optionally closed into a cycle."""
    length = draw(st.sampled_from([0, 0, 0, 60, 800]))
    if not length:
        return []
    tid = draw(trace_ids)
    sids = [i.to_bytes(8, "big") for i in range(1, length + 1)]
    attrs = draw(attributes())
    closed = draw(st.booleans())
    return [HSpan(tid, sid, sids[i - 1] if i else (sids[-1] if closed else b""),
                  f"{NAME_PREFIXES[i % len(NAME_PREFIXES)]} {i}", attrs if i % 100 == 0 else [])
            for i, sid in enumerate(sids)]


trace_ids = st.binary(min_size=16, max_size=16).map(lambda b: b if any(b) else b"\x01" * 16)


@st.composite
def shaped_trace(draw) -> list[HSpan]:
    """A MAF-shaped run (workflow.run > executor.process > invoke_agent > chat + agent_response) whose
    every classifier-read value may be replaced by an arbitrary one, whose chat calls may fail, and whose
    parent links may be bent (self, cycle, missing): units get reconciled with hostile numbers."""
    def vary(sane: Value) -> Value:
        return draw(st.one_of(st.just(sane), st.just(sane), st.just(sane), st.just(sane), any_value))

    tid, count = draw(trace_ids), iter(range(1, 10**6))
    salt = draw(st.integers(0, 2**31 - 1))

    def sid() -> bytes:
        return (salt << 32 | next(count)).to_bytes(8, "big")

    root = HSpan(tid, sid(), b"", draw(st.sampled_from(["workflow.run", "workflow_invoke", "invoke_workflow"])),
                 [("workflow.name", vary(("s", "hostile")))])
    spans = [root]
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(["researcher", "writer", "RESEARCHER", "a/b", " "]))
        ex = HSpan(tid, sid(), root.span_id, f"executor.process {name}",
                   [("executor.id", vary(("s", name))), ("executor.type", vary(("s", "AgentExecutor")))])
        agent = HSpan(tid, sid(), ex.span_id, f"invoke_agent {name}",
                      [("gen_ai.operation.name", vary(("s", "invoke_agent"))),
                       ("gen_ai.agent.name", vary(("s", name)))])
        spans += [ex, agent]
        for _ in range(draw(st.integers(1, 3))):
            status = draw(st.sampled_from([0, 0, 0, 0, 2]))
            spans.append(HSpan(tid, sid(), agent.span_id, "chat m", [
                ("gen_ai.operation.name", vary(("s", "chat"))), ("gen_ai.usage.input_tokens", vary(("i", 420))),
                ("gen_ai.usage.output_tokens", vary(("i", 180))), ("gen_ai.usage.total_tokens", vary(("none",))),
                ("gen_ai.response.finish_reasons", vary(("s", '["stop"]'))), ("error.type", vary(("none",)))],
                status, "rate limited" if status else ""))
        if draw(st.sampled_from([True, True, True, False])):
            spans.append(HSpan(tid, sid(), agent.span_id, f"agent_response {name}", [
                ("fidelity.ledger.source", vary(("s", "AgentResponseEvent"))), ("gen_ai.agent.name", vary(("s", name))),
                ("gen_ai.usage.input_tokens", vary(("i", 420))), ("gen_ai.usage.output_tokens", vary(("i", 180))),
                ("gen_ai.response.finish_reasons", vary(("a", [("s", "stop")])))]))
    for span in spans:  # bend a few parent links
        how = draw(st.sampled_from(["keep"] * 30 + ["self", "other", "missing"]))
        if how == "self":
            span.parent = span.span_id
        elif how == "other":
            span.parent = draw(st.sampled_from(spans)).span_id
        elif how == "missing":
            span.parent = sid()
    return draw(st.permutations(spans))


#: Placeholder for the good trace's id (known only when the example runs): intruders carry it.
GOOD_TRACE = b"\xffGOOD-TRACE-ID!\xff"


@st.composite
def intruders(draw) -> list[HSpan]:
    """Spans in the good trace whose own ids are unusable: they must be rejected, never change its verdict."""
    out = []
    for _ in range(draw(st.integers(0, 3))):
        sid = draw(st.one_of(st.binary(max_size=7), st.binary(min_size=9, max_size=12), st.just(bytes(8))))
        parent = draw(st.one_of(st.just(b""), st.binary(min_size=8, max_size=8)))
        if draw(st.booleans()):  # or a good span id with a parent id of the wrong length
            sid, parent = draw(st.binary(min_size=8, max_size=8).filter(any)), draw(st.binary(min_size=1, max_size=7))
        out.append(HSpan(GOOD_TRACE, sid, parent, draw(names), draw(attributes()), draw(st.sampled_from([0, 2]))))
    return out


resource_attrs = st.lists(st.tuples(st.sampled_from([SERVICE_NAME, SDK_LANGUAGE]), any_value | st.sampled_from(
    [("s", "python"), ("s", "dotnet"), ("s", "DotNet"), ("s", "")])), max_size=3)
scope_names = st.sampled_from(["agent_framework", "", OWN_SCOPE, "Microsoft.Agents.AI", "é\ud800"])


@st.composite
def cases(draw) -> Case:
    resources = [HResource(draw(resource_attrs), [HScope(draw(scope_names), draw(spans_of()))
                                                   for _ in range(draw(st.integers(1, 2)))])
                 for _ in range(draw(st.integers(1, 3)))]
    for _ in range(draw(st.integers(0, 2))):
        resources.append(HResource(draw(resource_attrs), [HScope("agent_framework", draw(shaped_trace()))]))
    if bad := draw(intruders()):
        resources.append(HResource([], [HScope("agent_framework", bad)]))
    if deep := draw(chain()):
        resources.append(HResource([], [HScope("agent_framework", deep)]))
    return Case(resources, draw(st.sampled_from(GOOD)), draw(st.integers(0, len(resources))), draw(st.booleans()),
                draw(st.booleans()))


# --- rendering: protobuf and OTLP/JSON ---------------------------------------------------------------

def utf8(s: str) -> str:
    """Protobuf strings are UTF-8: lone surrogates can only travel in JSON."""
    return s.encode("utf-8", "replace").decode("utf-8")


def pb_value(v: Value) -> AnyValue:
    tag = v[0]
    if tag == "s":
        return AnyValue(string_value=utf8(v[1]))
    if tag == "i":
        return AnyValue(int_value=v[1])
    if tag == "iraw":
        return AnyValue(int_value=INT64_MIN if v[1].startswith("-") else INT64_MAX)
    if tag == "d":
        return AnyValue(double_value=v[1])
    if tag == "b":
        return AnyValue(bool_value=v[1])
    if tag == "bytes":
        return AnyValue(bytes_value=v[1])
    if tag == "a":
        return AnyValue(array_value=ArrayValue(values=[pb_value(x) for x in v[1]]))
    if tag == "kv":
        return AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key=utf8(k), value=pb_value(x)) for k, x in v[1]]))
    return AnyValue()


def pb_resource(r: HResource) -> ResourceSpans:
    out = ResourceSpans(resource=Resource(attributes=[KeyValue(key=k, value=pb_value(v)) for k, v in r.attrs]))
    for sc in r.scopes:
        ss: ScopeSpans = out.scope_spans.add()
        ss.scope.name = utf8(sc.name)
        for s in sc.spans:
            span = ss.spans.add(trace_id=s.trace_id, span_id=s.span_id, parent_span_id=s.parent, name=utf8(s.name),
                                kind=s.kind, start_time_unix_nano=s.start, end_time_unix_nano=s.end,
                                status=Status(code=s.status_code, message=utf8(s.status_message)))
            span.attributes.extend(KeyValue(key=k, value=pb_value(v)) for k, v in s.attrs)
            for tid, sid in s.links:
                span.links.add(trace_id=tid, span_id=sid)
    return out


def bind(case: Case, good: ExportTraceServiceRequest) -> list[HResource]:
    """The case's resources with the good trace's id in place of GOOD_TRACE."""
    tid = good.resource_spans[0].scope_spans[0].spans[0].trace_id
    return [HResource(r.attrs, [HScope(sc.name, [replace(sp, trace_id=tid) if sp.trace_id == GOOD_TRACE else sp
                                                 for sp in sc.spans]) for sc in r.scopes]) for r in case.resources]


def to_protobuf(case: Case, good: ExportTraceServiceRequest) -> ExportTraceServiceRequest:
    parts = [pb_resource(r) for r in bind(case, good)]
    parts[case.good_at:case.good_at] = list(good.resource_spans)
    return ExportTraceServiceRequest(resource_spans=parts)


_RAW = "\x00\x01RAW:"


def js_value(v: Value, case: Case) -> dict:
    tag = v[0]
    if tag == "s":
        return {"stringValue": v[1]}
    if tag == "i":
        return {"intValue": v[1] if case.ints_as_numbers else str(v[1])}
    if tag == "iraw":
        return {"intValue": _RAW + v[1]}  # becomes a bare number token after json.dumps
    if tag == "d":
        d = v[1]
        special = "NaN" if math.isnan(d) else "Infinity" if d > 0 else "-Infinity"
        return {"doubleValue": d if math.isfinite(d) else special}  # proto3 JSON spells them as strings
    if tag == "b":
        return {"boolValue": v[1]}
    if tag == "bytes":
        return {"bytesValue": base64.b64encode(v[1]).decode()}
    if tag == "a":
        return {"arrayValue": {"values": [js_value(x, case) for x in v[1]]}}
    if tag == "kv":
        return {"kvlistValue": {"values": [{"key": k, "value": js_value(x, case)} for k, x in v[1]]}}
    return {}


def js_resource(r: HResource, case: Case) -> dict:
    def hexid(b: bytes) -> str:
        return b.hex().upper() if case.upper_hex else b.hex()

    def u64(n: int) -> int | str:
        return n if case.ints_as_numbers else str(n)

    return {"resource": {"attributes": [{"key": k, "value": js_value(v, case)} for k, v in r.attrs]},
            "scopeSpans": [{"scope": {"name": sc.name}, "spans": [{
                "traceId": hexid(s.trace_id), "spanId": hexid(s.span_id), "parentSpanId": hexid(s.parent),
                "name": s.name, "kind": s.kind, "startTimeUnixNano": u64(s.start), "endTimeUnixNano": u64(s.end),
                "attributes": [{"key": k, "value": js_value(v, case)} for k, v in s.attrs],
                "status": {"code": s.status_code, "message": s.status_message} if s.status_code else {},
                "links": [{"traceId": hexid(t), "spanId": hexid(i)} for t, i in s.links],
            } for s in sc.spans]} for sc in r.scopes]}


def to_json(case: Case, good: ExportTraceServiceRequest) -> bytes:
    parts = [js_resource(r, case) for r in bind(case, good)]
    parts[case.good_at:case.good_at] = to_otlp_json(good)["resourceSpans"]
    text = json.dumps({"resourceSpans": parts})  # ASCII: lone surrogates travel as \ud800 escapes
    return re.sub(r'"\\u0000\\u0001RAW:([^"]*)"', r"\1", text).encode()


def good_trace(name: str) -> tuple[str, ExportTraceServiceRequest]:
    """A fresh MAF-shaped trace of scenario ``name`` (real SDK spans): its trace id and request.

    Hypothesis seeds ``random``, hence the SDK's id generator: the trace id is replaced by a unique one.
    """
    spans, _ = record([SCENARIOS[name][0]])
    request, trace_id = export_request(spans), os.urandom(16)
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                span.trace_id = trace_id
    return trace_id.hex(), request


def good_run_id(trace_id: str, request: ExportTraceServiceRequest) -> str:
    """The run id the collector gives the good trace's workflow run."""
    root = next(s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans
                if s.name == "workflow.run")
    return f"{trace_id}-{root.span_id.hex()}"


# --- the live collector --------------------------------------------------------------------------------

FAST = {"assembly": {"quiet_period": 0.1, "sweep_interval": 0.02, "max_trace_wait": 2.0}}


class Live:
    """One collector for the module; if an example kills it, the crash is recorded and a fresh one
    started, so the next example (and shrinking) tests a live collector."""

    def __init__(self, tmp_factory: pytest.TempPathFactory) -> None:
        self.tmp_factory = tmp_factory
        self.crashes: list[str] = []
        self.logs: list[Path] = []
        #: (store path, trace id, run id, scenario) of every good trace sent
        self.sent: list[tuple[Path, str, str, str]] = []
        self._start()

    def _start(self) -> None:
        self.proc = CollectorProcess(self.tmp_factory.mktemp("fuzz"), overrides=FAST)
        self.logs.append(self.proc.stderr_path)

    def ensure_up(self) -> None:
        if self.proc.proc.poll() is not None:
            self.crashes.append(self.proc.stderr_path.read_text()[-2000:])
            self.proc.stop()
            self._start()

    def alive(self) -> None:
        """The example did not kill the collector."""
        if self.proc.proc.poll() is not None:
            tail = self.proc.stderr_path.read_text()[-1500:]
            pytest.fail(f"collector exited {self.proc.proc.returncode}; log tail:\n{tail}")


def stored_runs(store: Path, trace_id: str) -> list[tuple[str, int, dict]]:
    con = sqlite3.connect(store, timeout=10)
    try:
        return [(rid, rev, json.loads(unpack(body))) for rid, rev, body in
                con.execute("SELECT run_id, revision, body FROM runs WHERE trace_id = ?", (trace_id,))]
    except sqlite3.OperationalError:  # the collector has not created the table yet
        return []
    finally:
        con.close()


def expect_stored_once(store: Path, trace_id: str, run: str, scenario: str, timeout: float = 15.0) -> None:
    """The good trace's run is stored exactly once, revision 1, with the scenario's status and verdicts."""
    deadline = time.monotonic() + timeout
    while not (rows := stored_runs(store, trace_id)):
        assert time.monotonic() < deadline, f"good trace {trace_id} ({scenario}) never stored"
        time.sleep(0.03)
    _, status, units = SCENARIOS[scenario]
    assert [(rid, rev) for rid, rev, _ in rows] == [(run, 1)], f"stored as {rows!r}"
    doc = rows[0][2]
    assert (doc["status"], {e["executor_id"]: e["verdict"] for e in doc["executors"]}) == (status, units)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    collector = Live(tmp_path_factory)
    yield collector
    collector.proc.stop()


def grpc_rejected(code: grpc.StatusCode, payload: Any, size: int) -> int:
    """The number of rejected spans in an OK answer; fails on anything else the request did not earn."""
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), f"server error {code}: {payload}"
    if size > MAX_BYTES and code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return -1
    assert code is grpc.StatusCode.OK, f"a valid request was refused: {code}: {str(payload)[:500]}"
    return payload.partial_success.rejected_spans


@settings(FUZZ, max_examples=LIVE_EXAMPLES)
@given(case=cases())
def test_grpc_protobuf_hostile_values_never_cost_the_good_trace(live: Live, case: Case) -> None:
    live.ensure_up()
    trace_id, good = good_trace(case.good)
    run = good_run_id(trace_id, good)
    body = to_protobuf(case, good).SerializeToString()
    code, payload, _ = grpc_raw(live.proc.grpc, body)
    live.alive()
    rejected = grpc_rejected(code, payload, len(body))
    event(f"grpc {code.name}, rejected spans: {'some' if rejected > 0 else rejected}")
    if rejected < 0:  # over the size limit: the good trace goes on its own, as an exporter would split it
        assert grpc_raw(live.proc.grpc, good.SerializeToString())[0] is grpc.StatusCode.OK
    else:
        spans = case.spans()
        assert sum(s.bad_ids() for s in spans) <= rejected <= len(spans), payload.partial_success
    expect_stored_once(live.proc.store_path, trace_id, run, case.good)
    live.sent.append((live.proc.store_path, trace_id, run, case.good))


@settings(FUZZ, max_examples=LIVE_EXAMPLES)
@given(case=cases())
def test_http_json_hostile_values_never_cost_the_good_trace(live: Live, case: Case) -> None:
    live.ensure_up()
    trace_id, good = good_trace(case.good)
    run = good_run_id(trace_id, good)
    body = to_json(case, good)
    status, payload, _ = post(live.proc.http, body, JSON)
    live.alive()
    assert status < 500, f"server error {status}: {payload[:500]!r}"
    event(f"http {status}")
    allowed = {200} | ({400} if case.json_lenient() else set()) | ({413} if len(body) > MAX_BYTES else set())
    assert status in allowed, f"a valid OTLP/JSON request got {status}: {payload[:500]!r}"
    if status == 200:
        response = json_format.Parse(payload, ExportTraceServiceResponse())
        spans = case.spans()
        rejected = response.partial_success.rejected_spans
        assert sum(s.bad_ids() for s in spans) <= rejected <= len(spans), response.partial_success
    else:  # refused as a whole (with a message): the good trace sent right alongside still gets through
        assert json.loads(payload)["message"]
        assert post(live.proc.http, json.dumps(to_otlp_json(good)).encode(), JSON)[0] == 200
    expect_stored_once(live.proc.store_path, trace_id, run, case.good)
    live.sent.append((live.proc.store_path, trace_id, run, case.good))


def test_collector_survived_the_fuzzing(live: Live) -> None:
    """After every example: no crash, no traceback in the log, /metrics answers, and no good trace got a
    second run or revision later on."""
    live.ensure_up()
    trace_id, good = good_trace("pass")
    assert grpc_raw(live.proc.grpc, good.SerializeToString())[0] is grpc.StatusCode.OK
    expect_stored_once(live.proc.store_path, trace_id, good_run_id(trace_id, good), "pass")
    assert not live.crashes, "the collector died during fuzzing:\n" + "\n---\n".join(live.crashes)
    with urllib.request.urlopen(live.proc.prometheus, timeout=10) as resp:
        assert resp.status == 200 and b"agenteval_spans_received" in resp.read()
    time.sleep(0.5)  # anything that would revise a good run has arrived by now
    for store, tid, run, scenario in live.sent:
        expect_stored_once(store, tid, run, scenario, timeout=1.0)
    failed = sum(v for (name, _), v in live.proc.metrics().items() if name == "agenteval_pipeline_failures_total")
    for log in live.logs:
        text = log.read_text()
        assert "Traceback" not in text, text[text.index("Traceback") - 300:][:3000]
        # docs/design.md §5: a value the store cannot hold is clamped or rejected at ingest, never left to break
        # a write: no hostile run may fail a stage (it would be missing from the store and the stream).
        runs_failed = [e for e in map(_event, text.splitlines()) if e.get("event") == "run_failed"]
        assert not runs_failed, f"{len(runs_failed)} run(s) failed a stage, e.g. {runs_failed[:3]}"
    assert failed == 0


def _event(line: str) -> dict:
    try:
        event = json.loads(line)
    except ValueError:
        return {}
    return event if isinstance(event, dict) else {}


# --- in-process: decode -> classify -> reconcile -> serialize -------------------------------------------

def _int64_everywhere(value: Any, path: str = "$") -> None:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        assert INT64_MIN <= value <= INT64_MAX, f"{path} = {value} does not fit int64"
    elif isinstance(value, dict):
        for k, v in value.items():
            _int64_everywhere(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _int64_everywhere(v, f"{path}[{i}]")


def classify_and_reconcile(decoded: Decoded) -> list[RunVerdict]:
    """What the live pipeline does with a request: per trace, classify in two batches (finalizing what is
    ready after the first, like a sweep before the trace is quiet), then everything; reconcile each run."""
    by_trace: dict[bytes, list[SpanRecord]] = defaultdict(list)
    for span in decoded.spans:
        by_trace[span.trace_id].append(span)
    verdicts = []
    for tid, spans in by_trace.items():
        state = TraceState(MATCHER, tid)
        half = len(spans) // 2
        inputs = []
        for batch, everything in ((spans[:half], False), (spans[half:], True)):
            for span in batch:
                state.add(span)
            inputs += state.run_inputs(everything=everything)
        verdicts += [reconcile(run, CONFIG.scoring.policy(), CONFIG.scoring.preset) for run, _ in inputs]
    return verdicts


@settings(FUZZ, max_examples=INPROCESS_EXAMPLES)
@given(case=cases())
def test_decode_classify_reconcile_in_process_never_raises(case: Case) -> None:
    trace_id, good = good_trace(case.good)
    _, status, units = SCENARIOS[case.good]
    for decoded in (decode_request(to_protobuf(case, good), MATCHER),
                    decode_otlp_json(json.loads(to_json(case, good)), MATCHER, strict=False)):
        verdicts = classify_and_reconcile(decoded)
        for verdict in verdicts:
            doc = run_to_dict(verdict, run_id=verdict.trace_id, source="live")
            _int64_everywhere(doc)
            text = json.dumps(doc, ensure_ascii=False, allow_nan=False)
            text.encode("utf-8")  # every sink (SQLite, proto, OTLP export, logs) must be able to encode it
            run_message(doc).SerializeToString()
        mine = [v for v in verdicts if v.trace_id == trace_id]
        others = [v for v in verdicts if v.trace_id != trace_id]
        event(f"hostile runs reconciled: {min(len(others), 3)}{'+' if len(others) > 3 else ''}")
        event(f"hostile statuses: {sorted({v.status.value for v in others})}")
        assert len(mine) == 1 and mine[0].status.value == status
        assert {e.executor_id: e.verdict.value for e in mine[0].executors} == units
