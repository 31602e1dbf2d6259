"""The compiled decoder (native/, ``agenteval_native``) against the reference, protobuf + ``decode_request``
(:func:`decode_protobuf`).

For every payload, :func:`decode_bytes` must give exactly what the Python path gives (the same
:class:`Decoded`, or the same exception type), and the native decoder alone either the same result or
None (it then leaves the request to protobuf). Its journal line must replay as what
``collector.live.journal.encode`` of its spans replays as. CI sets AGENTEVAL_REQUIRE_NATIVE=1, so a
missing extension fails there instead of skipping.
"""

from __future__ import annotations

import base64
import json
import math
import os
import random
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    InstrumentationScope,
    KeyValue,
    KeyValueList,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from collector.config import CollectorConfig
from collector.core.facts import CACHE_READ, CHAT, FINISH, TOTAL, SpanRecord, finish_reason
from collector.core.profiles import LEDGER_SOURCE_BRIDGE
from collector.formats import decode
from collector.formats.decode import (
    MAX_ATTR_CHARS,
    MAX_VALUE_DEPTH,
    OWN_SCOPE,
    SDK_LANGUAGE,
    SERVICE_NAME,
    Decoded,
    count_spans,
    decode_bytes,
    decode_protobuf,
    parse_request,
    span_count,
)
from collector.live.journal import decode as journal_decode
from collector.live.journal import encode as journal_encode

from mafshape import SCENARIOS, export_request, record

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from workload import encode, trace_spans

MATCHER = CollectorConfig().matcher()
WANTED = MATCHER.wanted_keys
DOTNET = Path(__file__).parent / "fixtures" / "dotnet"
FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck),
                print_blob=False, max_examples=300)


@pytest.fixture(autouse=True)
def require_native() -> None:
    """These tests skip without the extension, unless CI requires it."""
    if not decode.NATIVE:
        message = "agenteval_native is not installed: `make install` builds it (needs Rust)"
        if os.environ.get("AGENTEVAL_REQUIRE_NATIVE") == "1":
            pytest.fail(message)
        pytest.skip(message)


# --- comparing results ----------------------------------------------------------------------------------

def plain(value: Any) -> Any:
    """``value`` with its types spelled out (True is not 1) and floats by their bits (NaN equals NaN)."""
    if isinstance(value, float):
        return "float", struct.pack("<d", value)
    if isinstance(value, dict):
        return "dict", [(k, plain(v)) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [plain(v) for v in value]
    return type(value).__name__, value


def result(decoded: Decoded) -> tuple:
    """Every field of every span record, the rejections and the own spans."""
    spans = [tuple(plain(getattr(span, name)) for name in SpanRecord.__slots__) for span in decoded.spans]
    return spans, decoded.rejected, decoded.own, decoded.reasons


def outcome(fn: Callable[[], Any]) -> tuple:
    """``fn()``, or the type of what it raised."""
    try:
        return "ok", fn()
    except Exception as exc:  # the type is the outcome
        return "raised", type(exc)


def records(spans: list[SpanRecord]) -> list[tuple]:
    return result(Decoded(spans))[0]


def assert_journal_line(payload: bytes, found: Decoded) -> None:
    """The native journal line replays as ``encode`` of the spans does, and as the spans themselves;
    it is missing only for a finish reason UTF-8 cannot hold (a lone surrogate from a JSON escape)."""
    if found.journal_line is None:
        assert any(s.facts[FINISH] and _lone_surrogate(s.facts[FINISH]) for s in found.spans)
        return
    replayed = records(journal_decode(found.journal_line, MATCHER))
    assert replayed == records(journal_decode(journal_encode(found.spans), MATCHER))
    assert replayed == records(found.spans)


def _lone_surrogate(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


def reference(payload: bytes) -> tuple:
    return outcome(lambda: result(decode_protobuf(payload, MATCHER)))


def received(payload: bytes) -> tuple:
    """What the receivers get: the request decoded; refusing it, its span count, which raises for
    exactly the payloads decoding raises for (a bad payload is INVALID_ARGUMENT, refused or not)."""
    decoded = outcome(lambda: result(decode_bytes(payload, MATCHER)))
    counted = outcome(lambda: count_spans(payload))
    assert counted[0] == decoded[0]
    if counted[0] == "ok":
        request, too_deep = parse_request(payload)
        assert counted[1] == span_count(request) + len(too_deep)
    return decoded


def assert_parity(payload: bytes, native_must_answer: bool = False) -> tuple:
    """The receivers' path and decode_bytes give what protobuf + decode_request give; the native
    decoder gives the same or None. Returns the reference outcome."""
    expected = reference(payload)
    assert outcome(lambda: result(decode_bytes(payload, MATCHER))) == expected
    assert received(payload) == expected
    found = decode._native_decode(payload, MATCHER)
    if expected[0] == "raised":
        assert found is None and decode._native.count_spans(payload) is None
    elif found is not None:
        assert ("ok", result(found)) == expected
        assert_journal_line(payload, found)
    else:
        assert not native_must_answer, "the native decoder left a canonical request to protobuf"
    return expected


# --- realistic payloads ---------------------------------------------------------------------------------

def dotnet_requests() -> list[bytes]:
    """The MAF .NET fixtures: the requests the OpenTelemetry .NET SDK sent (captured per release and
    scenario, and the captures of real apps), and the hand-built 1.17 traces (OTLP/JSON with hex ids)
    as protobuf."""
    bodies = [path.read_bytes() for path in sorted([*DOTNET.glob("1.*/*/*/*.pb"), *DOTNET.glob("captures/*/*.pb")])]
    for path in sorted(DOTNET.glob("source-1.17/*.jsonl")):
        for line in path.read_text().splitlines():
            doc = json.loads(line)
            for rs in doc.get("resourceSpans", []):
                for ss in rs.get("scopeSpans", []):
                    for span in ss.get("spans", []):
                        for obj in (span, *span.get("links", [])):
                            for key in ("traceId", "spanId", "parentSpanId"):
                                if obj.get(key):
                                    obj[key] = base64.b64encode(bytes.fromhex(obj[key])).decode()
            bodies.append(json_format.ParseDict(doc, ExportTraceServiceRequest()).SerializeToString())
    return bodies


def test_bench_workload_decodes_natively_and_identically() -> None:
    bodies = encode([trace_spans(random.Random(seed)) for seed in range(200)], spans_per_request=300)
    for body in bodies:
        assert assert_parity(body, native_must_answer=True)[0] == "ok"


def test_maf_shaped_sdk_requests_decode_natively_and_identically() -> None:
    """Every scenario through the real OpenTelemetry SDK and its OTLP encoder (resource, events, status)."""
    scenarios = [scenario for scenario, _, _ in SCENARIOS.values()]
    for dotnet in (False, True):
        spans, _ = record([replace(scenario, dotnet=dotnet) for scenario in scenarios])
        expected = assert_parity(export_request(spans).SerializeToString(), native_must_answer=True)
        assert expected[0] == "ok" and len(expected[1][0]) == len(spans)


def test_dotnet_fixture_requests_decode_natively_and_identically() -> None:
    bodies = dotnet_requests()
    assert len(bodies) >= 84
    for body in bodies:
        expected = assert_parity(body, native_must_answer=True)
        assert expected[0] == "ok" and expected[1][0]


def test_without_the_extension_protobuf_decodes_and_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    body = encode([trace_spans(random.Random(3))])[0]
    expected = reference(body)
    monkeypatch.setattr(decode, "_native", None)
    assert count_spans(body) == len(expected[1][0])
    assert ("ok", result(decode_bytes(body, MATCHER))) == expected
    assert received(b"\xff\xfe not protobuf") == reference(b"\xff\xfe not protobuf")


def test_native_schema_is_the_installed_protobufs() -> None:
    """The fields the native decoder knows (it checks them as protobuf would and skips the rest) are
    the installed opentelemetry-proto's, but for the ones it always leaves to protobuf ("Unsure")."""
    names = {"ExportTraceServiceRequest": "Request", "InstrumentationScope": "Scope"}
    kinds = {F.TYPE_STRING: "Str", F.TYPE_BYTES: "Bytes", F.TYPE_FIXED64: "I64", F.TYPE_DOUBLE: "I64",
             F.TYPE_FIXED32: "I32", **dict.fromkeys([F.TYPE_INT32, F.TYPE_INT64, F.TYPE_UINT32, F.TYPE_BOOL,
                                                     F.TYPE_ENUM], "Varint")}
    installed: dict[str, dict[int, str]] = {}

    def walk(descriptor: Any) -> None:
        name = names.get(descriptor.name, descriptor.name)
        if name in installed:
            return
        installed[name] = {}
        for f in descriptor.fields:
            if f.message_type is not None:
                walk(f.message_type)
                installed[name][f.number] = f"Message({names.get(f.message_type.name, f.message_type.name)})"
            else:
                installed[name][f.number] = kinds.get(f.type, f"type {f.type}")

    walk(ExportTraceServiceRequest.DESCRIPTOR)
    schema = {name: dict(fields) for name, fields in decode._native.schema()}
    assert schema.keys() == installed.keys()
    for name, fields in schema.items():
        unsure = {number for number, kind in fields.items() if kind == "Unsure"}
        assert {n: k for n, k in fields.items() if n not in unsure} == \
               {n: k for n, k in installed[name].items() if n not in unsure}, name


# --- generated requests ---------------------------------------------------------------------------------

LONG = ["é" * 1100, "𝟙" * 1030, "x" * 1025, "a" * 1000 + "字" * 30, "é" * 600, "ß" * 70, "x" * 1024]
texts = st.one_of(st.text(max_size=10), st.sampled_from(["", OWN_SCOPE, *LONG]))
keys = st.one_of(st.sampled_from(sorted(WANTED)), st.text(max_size=6))
leaf_values = st.one_of(
    texts.map(lambda s: AnyValue(string_value=s)),
    st.booleans().map(lambda b: AnyValue(bool_value=b)),
    st.integers(-(2**63), 2**63 - 1).map(lambda i: AnyValue(int_value=i)),
    st.floats().map(lambda d: AnyValue(double_value=d)),
    st.binary(max_size=6).map(lambda b: AnyValue(bytes_value=b)),
    st.just(AnyValue()),
)


def array(values: list[AnyValue]) -> AnyValue:
    return AnyValue(array_value=ArrayValue(values=values))


def kvlist(items: list[tuple[str, AnyValue]]) -> AnyValue:
    return AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key=k, value=v) for k, v in items]))


@st.composite
def deep_values(draw: st.DrawFn) -> AnyValue:
    """Nested past MAX_VALUE_DEPTH (but within what the native decoder takes on itself)."""
    value = draw(leaf_values)
    for kind in draw(st.lists(st.sampled_from("ak"), min_size=MAX_VALUE_DEPTH - 1, max_size=20)):
        value = array([value]) if kind == "a" else kvlist([("k", value)])
    return value


any_values = st.one_of(
    st.recursive(leaf_values, lambda kids: st.one_of(st.lists(kids, max_size=3).map(array),
                                                     st.lists(st.tuples(keys, kids), max_size=3).map(kvlist)),
                 max_leaves=10),
    deep_values(),
)
attributes = st.lists(st.tuples(keys, st.none() | any_values).map(
    lambda kv: KeyValue(key=kv[0]) if kv[1] is None else KeyValue(key=kv[0], value=kv[1])), max_size=6)


def ids(size: int) -> st.SearchStrategy[bytes]:
    good = st.binary(min_size=size, max_size=size)
    return st.one_of(good, good, good, st.just(bytes(size)), st.binary(max_size=size + 2))


statuses = st.builds(Status, code=st.one_of(st.sampled_from([0, 1, 2]), st.integers(-3, 5)), message=texts)
spans = st.builds(
    Span, trace_id=ids(16), span_id=ids(8), parent_span_id=st.one_of(st.just(b""), st.just(bytes(8)), ids(8)),
    name=texts, start_time_unix_nano=st.integers(0, 2**64 - 1), end_time_unix_nano=st.integers(0, 2**64 - 1),
    kind=st.integers(0, 5), trace_state=texts, flags=st.integers(0, 2**32 - 1), attributes=attributes,
    status=st.none() | statuses,
    events=st.lists(st.builds(Span.Event, name=texts, attributes=attributes), max_size=2),
    links=st.lists(st.builds(Span.Link, trace_id=ids(16), trace_state=texts, attributes=attributes), max_size=2),
)
resource_attributes = st.lists(st.one_of(
    st.tuples(st.sampled_from([SERVICE_NAME, SDK_LANGUAGE]),
              texts.map(lambda s: AnyValue(string_value=s)) | any_values),
    st.tuples(keys, any_values),
).map(lambda kv: KeyValue(key=kv[0], value=kv[1])), max_size=4)
scopes = st.builds(InstrumentationScope, name=st.sampled_from([OWN_SCOPE, "agent_framework", ""]) | texts,
                   version=texts, attributes=attributes)
scope_spans = st.builds(ScopeSpans, scope=st.none() | scopes, spans=st.lists(spans, max_size=4), schema_url=texts)
requests = st.builds(ExportTraceServiceRequest, resource_spans=st.lists(st.builds(
    ResourceSpans, resource=st.none() | st.builds(Resource, attributes=resource_attributes),
    scope_spans=st.lists(scope_spans, max_size=3), schema_url=texts), max_size=3))


@FUZZ
@given(request=requests)
def test_generated_requests_decode_natively_and_identically(request: ExportTraceServiceRequest) -> None:
    assert_parity(request.SerializeToString(), native_must_answer=True)


@settings(FUZZ, max_examples=60)
@given(case=st.data())
def test_the_fuzz_suites_hostile_requests_decode_identically(case: st.DataObject) -> None:
    from test_fuzz import cases, good_trace, to_protobuf

    drawn = case.draw(cases())
    assert_parity(to_protobuf(drawn, good_trace(drawn.good)[1]).SerializeToString(), native_must_answer=True)


# --- hand-made and broken wire data ---------------------------------------------------------------------

def varint(n: int) -> bytes:
    n &= 2**64 - 1
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def tag(number: int, wire: int) -> bytes:
    return varint(number << 3 | wire)


def ld(number: int, data: bytes) -> bytes:
    return tag(number, 2) + varint(len(data)) + data


def request_of(span: bytes, scope: bytes = ld(1, b"agent_framework"), resource: bytes = b"",
               more: bytes = b"") -> bytes:
    """A request of one resource, one scope and one span, from their serialized fields (and ``more``
    fields of the resource spans)."""
    return ld(1, ld(1, resource) + ld(2, ld(1, scope) + ld(2, span)) + more)


#: A span without a status, and with an error status.
BARE = Span(trace_id=bytes(range(1, 17)), span_id=bytes(range(1, 9)), parent_span_id=bytes(range(9, 17)),
            name="chat gpt-4o", start_time_unix_nano=1_700_000_000_000_000_000,
            end_time_unix_nano=1_700_000_000_250_000_000,
            attributes=[KeyValue(key="gen_ai.operation.name", value=AnyValue(string_value="chat"))]).SerializeToString()
SPAN = BARE + ld(15, ld(2, b"boom") + tag(3, 0) + varint(Status.STATUS_CODE_ERROR))
RESOURCE = Resource(attributes=[KeyValue(key=SERVICE_NAME, value=AnyValue(string_value="svc"))]).SerializeToString()
WANTED_KEY = b"gen_ai.operation.name"


def attr(value: bytes, key: bytes = WANTED_KEY) -> bytes:
    """A span attribute field with a serialized AnyValue."""
    return ld(9, ld(1, key) + ld(2, value))


def nested(levels: int, value: bytes = tag(3, 0) + varint(1)) -> bytes:
    for _ in range(levels):
        value = ld(5, ld(1, value))
    return value


def kvlists(levels: int) -> bytes:
    value = tag(3, 0) + varint(1)
    for _ in range(levels):
        value = ld(6, ld(1, ld(1, b"k") + ld(2, value)))
    return value


#: (payload, what answers): "native" (the native decoder itself), "protobuf" (native leaves it to
#: protobuf, which decodes it) or "error" (protobuf refuses it, and so does decode_bytes).
CASES: dict[str, tuple[bytes, str]] = {
    "canonical": (request_of(SPAN, resource=RESOURCE), "native"),
    "empty request": (b"", "native"),
    "fields in reverse order": (ld(1, ld(2, ld(2, attr(ld(1, b"v")) + ld(5, b"n") + ld(2, b"\x01" * 8)
                                                + ld(1, b"\x02" * 16)) + ld(1, ld(1, b"scope")))
                                       + ld(1, RESOURCE)), "native"),
    "own scope after its spans": (ld(1, ld(2, ld(2, SPAN) + ld(2, SPAN) + ld(1, ld(1, OWN_SCOPE.encode())))), "native"),
    "key after value": (request_of(SPAN + ld(9, ld(2, ld(1, b"v")) + ld(1, WANTED_KEY))), "native"),
    "unknown fields of every wire type": (request_of(
        SPAN + tag(200, 0) + varint(7) + tag(201, 1) + bytes(8) + ld(202, b"\xff\xfe") + tag(203, 5) + bytes(4)),
        "native"),
    "capped non-ASCII text": (request_of(
        BARE + ld(5, "é".encode() * 1030) + attr(ld(1, "字".encode() * 1025)) + ld(15, ld(2, "ß".encode() * 201)
                                                                                  + tag(3, 0) + varint(2)),
        resource=ld(1, ld(1, SERVICE_NAME.encode()) + ld(2, ld(1, "𝟙".encode() * 1025)))
        + ld(1, ld(1, SDK_LANGUAGE.encode()) + ld(2, ld(1, "é".encode() * 65)))), "native"),
    "all-zero parent": (request_of(BARE + ld(4, bytes(8))), "native"),
    **{f"rejected: {what}": (request_of(BARE + fields), "native") for what, fields in {
        "short trace id": ld(1, bytes(15)), "zero trace id": ld(1, bytes(16)), "long span id": ld(2, bytes(9)),
        "zero span id": ld(2, bytes(8)), "7-byte parent": ld(4, b"\x01" * 7), "no ids": ld(1, b"") + ld(2, b""),
        "long name": ld(5, "é".encode() * 2000) + ld(1, b"\x01")}.items()},
    "attribute without a value": (request_of(SPAN + ld(9, ld(1, WANTED_KEY))), "native"),
    "status code past int32": (request_of(BARE + ld(15, ld(2, b"m") + tag(3, 0) + varint(2 + 2**32))), "native"),
    "negative status code": (request_of(BARE + ld(15, tag(3, 0) + varint(-1))), "native"),
    "empty status": (request_of(BARE + ld(15, b"")), "native"),
    "bool of 2": (request_of(SPAN + attr(tag(2, 0) + varint(2))), "native"),
    "overlong varint value": (request_of(SPAN + attr(tag(3, 0) + b"\x81\x80\x00")), "native"),
    "10-byte varint overflowing 64 bits": (request_of(SPAN + attr(tag(3, 0) + b"\xff" * 9 + b"\x7f")), "protobuf"),
    "duplicated status": (request_of(SPAN + ld(15, ld(2, b"second"))), "protobuf"),
    "duplicated resource": (request_of(SPAN, resource=RESOURCE, more=ld(1, b"")), "protobuf"),
    "duplicated scope": (ld(1, ld(2, ld(1, ld(1, OWN_SCOPE.encode())) + ld(1, ld(2, b"1.0")) + ld(2, SPAN))),
                         "protobuf"),
    "duplicated attribute value": (request_of(SPAN + ld(9, ld(1, WANTED_KEY) + ld(2, ld(5, ld(1, ld(1, b"a"))))
                                                        + ld(2, ld(5, ld(1, ld(1, b"b")))))), "protobuf"),
    "two AnyValue members": (request_of(SPAN + attr(ld(1, b"text") + tag(3, 0) + varint(5))), "protobuf"),
    "string_value_strindex": (request_of(SPAN + attr(tag(8, 0) + varint(3))), "protobuf"),
    "key_strindex": (request_of(SPAN + ld(9, ld(1, WANTED_KEY) + tag(3, 0) + varint(3))), "native"),
    "field 1000 (instrumentation_library_spans)": (ld(1, ld(1000, ld(2, SPAN))), "protobuf"),
    "name as a varint": (request_of(SPAN + tag(5, 0) + varint(1)), "protobuf"),
    "start time as a varint": (request_of(SPAN + tag(7, 0) + varint(5)), "protobuf"),
    "end time as a varint": (request_of(SPAN + tag(8, 0) + varint(5)), "protobuf"),
    "end time twice (the last counts)": (request_of(SPAN + tag(8, 1) + struct.pack("<Q", 2**64 - 1)), "native"),
    "end time zero (unset)": (request_of(SPAN + tag(8, 1) + bytes(8)), "native"),
    "status as a varint": (request_of(SPAN + tag(15, 0) + varint(5)), "protobuf"),
    "unknown group": (request_of(SPAN + tag(99, 3) + tag(1, 0) + varint(1) + tag(99, 4)), "protobuf"),
    "nested 31 deep": (request_of(SPAN + attr(nested(31), b"other")), "native"),
    "nested 31 deep, wanted": (request_of(SPAN + attr(nested(31))), "native"),
    "nested 60 deep": (request_of(SPAN + attr(nested(60))), "native"),
    "nested 100 deep": (request_of(SPAN + attr(nested(100), b"other")), "native"),
    "kvlists 40 deep": (request_of(SPAN + attr(kvlists(40))), "native"),
    "kvlists 100 deep": (request_of(SPAN + attr(kvlists(100), b"other")), "protobuf"),
    **{f"rejected: nested {levels} deep{where}": (request_of(SPAN + fields), "protobuf") for levels in (101, 5000)
       for where, fields in {"": attr(nested(levels), b"other"), ", kvlists": attr(kvlists(levels)),
                             " in an event": ld(11, ld(3, ld(1, b"k") + ld(2, nested(levels)))),
                             " in a link": ld(13, ld(4, ld(1, b"k") + ld(2, nested(levels)))),
                             ", invalid UTF-8 past the limit": attr(nested(levels, ld(1, b"\xff")))}.items()},
    "a resource value nested 101 deep": (request_of(SPAN, resource=ld(1, ld(1, b"k") + ld(2, nested(101)))),
                                         "error"),
    "a scope value nested 101 deep": (request_of(SPAN, scope=ld(3, ld(1, b"k") + ld(2, nested(101)))), "error"),
    "nested 101 deep, malformed elsewhere": (request_of(SPAN + attr(nested(101), b"other") + ld(5, b"\xff")),
                                             "protobuf"),
    "field number 0": (b"\x00\x01", "error"),
    "wire type 6": (tag(1, 6), "error"),
    "wire type 7 in a span": (request_of(SPAN + tag(20, 7)), "error"),
    "6-byte tag": (request_of(SPAN + b"\xa0\x86\x80\x80\x80\x00" + varint(1)), "error"),  # field 100
    "length past the end": (ld(1, b"")[:-1] + b"\x05", "error"),
    "11-byte varint": (request_of(SPAN + attr(tag(3, 0) + b"\xff" * 10 + b"\x01")), "error"),
    "end group without a start": (request_of(SPAN + tag(99, 4)), "error"),
    **{f"invalid UTF-8 in {where}": (payload, "error") for where, payload in {
        "a span name": request_of(SPAN + ld(5, b"chat \xff")),
        "a surrogate span name": request_of(SPAN + ld(5, b"\xed\xa0\x80")),
        "an overlong span name": request_of(SPAN + ld(5, b"\xc0\x80")),
        "a span name past U+10FFFF": request_of(SPAN + ld(5, b"\xf4\x90\x80\x80")),
        "trace_state": request_of(SPAN + ld(3, b"\xff")),
        "an event name": request_of(SPAN + ld(11, ld(2, b"\xc3"))),
        "a link's trace_state": request_of(SPAN + ld(13, ld(3, b"\xff"))),
        "a link attribute": request_of(SPAN + ld(13, ld(4, ld(1, b"\xff")))),
        "an unwanted attribute key": request_of(SPAN + ld(9, ld(1, b"k\xff"))),
        "an unwanted attribute value": request_of(SPAN + attr(ld(1, b"\xff"), b"other")),
        "a nested kvlist key": request_of(SPAN + attr(ld(6, ld(1, ld(1, b"\xff"))))),
        "a value nested past MAX_VALUE_DEPTH": request_of(SPAN + attr(ld(5, ld(1, nested(12)[:-2] + ld(1, b"\xff"))))),
        "a wanted attribute value": request_of(SPAN + attr(ld(1, b"\xff"))),
        "a status message": request_of(BARE + ld(15, ld(2, b"\xff"))),
        "the scope name": request_of(SPAN, scope=ld(1, b"\xff")),
        "the scope version": request_of(SPAN, scope=ld(2, b"\xff")),
        "a scope attribute": request_of(SPAN, scope=ld(3, ld(1, b"k") + ld(2, ld(1, b"\xff")))),
        "an own scope's span": request_of(SPAN + ld(5, b"\xff"), scope=ld(1, OWN_SCOPE.encode())),
        "service.name": request_of(SPAN, resource=ld(1, ld(1, SERVICE_NAME.encode()) + ld(2, ld(1, b"\xff")))),
        "a resource entity ref": request_of(SPAN, resource=ld(3, ld(2, b"\xff"))),
        "a scope's schema_url": ld(1, ld(2, ld(3, b"\xff") + ld(2, SPAN))),
        "a resource's schema_url": ld(1, ld(3, b"\xff")),
    }.items()},
}


@pytest.mark.parametrize("name", CASES)
def test_hand_made_requests_decode_identically(name: str) -> None:
    payload, answers = CASES[name]
    expected = assert_parity(payload)
    assert expected[0] == ("raised" if answers == "error" else "ok"), expected
    assert (decode._native_decode(payload, MATCHER) is not None) == (answers == "native")
    if name.startswith("rejected: nested"):
        assert expected[1][1:] == (1, 0, ["span 'chat gpt-4o': a value is nested more than 100 deep, past the limit"])


def test_every_truncation_of_a_request_decodes_identically() -> None:
    body = encode([trace_spans(random.Random(1))], spans_per_request=100)[0]
    for end in range(len(body)):
        assert_parity(body[:end])


@FUZZ
@given(body=st.binary(max_size=300))
def test_random_bytes_decode_identically(body: bytes) -> None:
    assert_parity(body)


MUTATED = [request_of(SPAN, resource=RESOURCE), *dotnet_requests()[:2],
           encode([trace_spans(random.Random(2), executors=2, chats=1)])[0]]


@FUZZ
@given(base=st.sampled_from(MUTATED), edits=st.lists(st.tuples(st.sampled_from("xid"), st.floats(0, 1),
                                                                 st.integers(0, 255)), min_size=1, max_size=4))
def test_mutated_requests_decode_identically(base: bytes, edits: list[tuple[str, float, int]]) -> None:
    """Bytes changed, inserted or deleted anywhere in real requests."""
    body = bytearray(base)
    for op, where, byte in edits:
        at = min(int(where * len(body)), len(body) - 1)
        if op == "x":
            body[at] = byte
        elif op == "i":
            body.insert(at, byte)
        else:
            del body[at]
    assert_parity(bytes(body))


# --- the journal line -------------------------------------------------------------------------------

KEYS = sorted(WANTED)
FLOATS = [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, 2.2250738585072014e-308, 1e-7, 2.5e-7,
          1e-6, 1e-5, 1.2345e-5, 0.1, 1.0, 100.0, 123.456, 9007199254740993.0, 9999999999999998.0, 1e16,
          1.2345e16, -1.5e20, 1e22, 1.7976931348623157e308]
TEXTS = ["", "plain", 'a "quoted" \\ back\\slash', "".join(map(chr, range(32))) + "\x7f", "é字 ß", "😀🧪",
         "\u2028\u2029\ufeff", "\\u0000 not an escape", "é" * (MAX_ATTR_CHARS + 10), "😀" * (MAX_ATTR_CHARS + 1)]


def deep_around(value: AnyValue, levels: int, kinds: str = "ak") -> AnyValue:
    """``value`` nested ``levels`` arrays / kvlists deep (taking turns as ``kinds`` says)."""
    for level in range(levels):
        value = array([value]) if kinds[level % len(kinds)] == "a" else kvlist([("k", value)])
    return value


def deep(levels: int, kinds: str = "ak") -> AnyValue:
    return deep_around(AnyValue(int_value=7), levels, kinds)


def request(*spans: Span, resource: Resource | None = None, scope: str = "agent_framework") -> bytes:
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=resource, scope_spans=[ScopeSpans(scope=InstrumentationScope(name=scope), spans=list(spans))])],
    ).SerializeToString()


def span(*values: AnyValue, n: int = 1, **fields: Any) -> Span:
    """A span with ``values`` as its wanted attributes (a key each), ids from ``n`` and other ``fields``."""
    attributes = [KeyValue(key=KEYS[i % len(KEYS)], value=v) for i, v in enumerate(values)]
    return Span(**{"trace_id": bytes([n]) * 16, "span_id": bytes([n + 1]) * 8, "parent_span_id": bytes([n + 2]) * 8,
                   "name": "chat", "start_time_unix_nano": 1_700_000_000_000_000_000,
                   "end_time_unix_nano": 1_700_000_001_500_000_000, "attributes": attributes,
                   **fields})


def resource(**attributes: str) -> Resource:
    return Resource(attributes=[KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in attributes.items()])


SERVICE = {SERVICE_NAME: "svc \"quoted\" é", SDK_LANGUAGE: "dotnet"}
JOURNAL_CASES: dict[str, bytes] = {
    "no spans": b"",
    "floats": request(span(*(AnyValue(double_value=f) for f in FLOATS[:len(KEYS)])),
                      span(*(AnyValue(double_value=f) for f in FLOATS[len(KEYS):]), n=9)),
    "floats in an array": request(span(array([AnyValue(double_value=f) for f in FLOATS]))),
    "ints": request(span(*(AnyValue(int_value=i) for i in (0, -1, 1, -(2**63), 2**63 - 1, 2**53 + 1, -(2**31))))),
    "bools": request(span(AnyValue(bool_value=True), AnyValue(bool_value=False), array([AnyValue(bool_value=True)]))),
    "texts": request(span(*(AnyValue(string_value=t) for t in TEXTS))),
    "texts as kvlist keys": request(span(kvlist([(t, AnyValue(string_value=t)) for t in TEXTS]))),
    "bytes and empty values": request(span(AnyValue(bytes_value=b"\x00\xff"), AnyValue(), array([AnyValue()]))),
    "attribute without a value": request(span(AnyValue(int_value=1)), span(n=5, attributes=[KeyValue(key=KEYS[0])])),
    "empty array and kvlist": request(span(array([]), kvlist([]), kvlist([("", array([]))]))),
    **{f"nested {levels} deep": request(span(deep(levels), deep(levels, "a"), deep(levels, "k")))
       for levels in (MAX_VALUE_DEPTH, MAX_VALUE_DEPTH + 1, MAX_VALUE_DEPTH + 3)},
    "no attributes": request(span()),
    "unwanted attributes only": request(span(attributes=[KeyValue(key="x", value=AnyValue(string_value="y"))])),
    "names": request(*(span(n=n, name=t) for n, t in enumerate(TEXTS, 1))),
    "start times": request(span(start_time_unix_nano=0), span(n=3, start_time_unix_nano=2**64 - 1)),
    "end times: unset, least, greatest, before the start": request(
        span(end_time_unix_nano=0), span(n=3, end_time_unix_nano=1), span(n=5, end_time_unix_nano=2**64 - 1),
        span(n=7, start_time_unix_nano=2**62, end_time_unix_nano=2**61)),
    "parents: none, zero, self": request(span(parent_span_id=b""), span(n=3, parent_span_id=bytes(8)),
                                         span(n=5, parent_span_id=b"\x06" * 8)),
    "status errors": request(*(span(n=n, status=Status(code=code, message=message)) for n, (code, message) in
                               enumerate([(2, "boom"), (2, ""), (2, 'x"\n' * 100), (1, "ok"), (0, "")], 1))),
    "resource subject and language": request(span(), resource=resource(**SERVICE)),
    "empty resource subject": request(span(), resource=resource(**{SERVICE_NAME: "", SDK_LANGUAGE: "python"})),
    "long resource subject": request(span(), resource=resource(**{SERVICE_NAME: "é" * 2000, SDK_LANGUAGE: "l" * 99})),
    "rejected and own spans around kept ones": request(span(), span(n=3, span_id=b""), span(n=5))
    + request(span(n=7), scope=OWN_SCOPE),
    "a wanted attribute twice": request(span(n=3), span(attributes=[
        KeyValue(key=KEYS[0], value=AnyValue(int_value=1)), KeyValue(key=KEYS[0], value=AnyValue(int_value=2))])),
    "a kvlist key twice": request(span(kvlist([("a", AnyValue(int_value=1)), ("b", AnyValue()),
                                               ("a", AnyValue(int_value=2))]))),
    "a kvlist key twice past the depth limit": request(span(deep_around(
        kvlist([("a", AnyValue()), ("a", AnyValue())]), MAX_VALUE_DEPTH + 1))),
    "a kvlist key twice in a rejected span": request(span(n=3), span(kvlist([("a", AnyValue()), ("a", AnyValue())]),
                                                                     trace_id=bytes(16))),
    "a finish reason with a lone surrogate": request(span(attributes=[KeyValue(
        key="gen_ai.response.finish_reasons", value=AnyValue(string_value='["\\ud800 "]'))])),
}
#: The cases whose line the native decoder leaves to ``_encode``.
NO_LINE = {"a finish reason with a lone surrogate"}


@pytest.mark.parametrize("name", JOURNAL_CASES)
def test_hand_made_requests_journal_lines_replay_as_their_spans(name: str) -> None:
    payload = JOURNAL_CASES[name]
    assert assert_parity(payload, native_must_answer=True)[0] == "ok"  # checks the line, too
    found = decode._native_decode(payload, MATCHER)
    assert (found.journal_line is None) == (name in NO_LINE)


def test_span_end_times_are_compared_and_journaled() -> None:
    """Each span's end time (None where unset) is a field of the records compared above, and of the
    journal line: both decoders read it from the wire, not only agree on leaving it out."""
    assert "end_ns" in SpanRecord.__slots__
    payload = JOURNAL_CASES["end times: unset, least, greatest, before the start"]
    found = decode._native_decode(payload, MATCHER)
    assert [s.end_ns for s in found.spans] == [s.end_ns for s in decode_protobuf(payload, MATCHER).spans] \
        == [None, 1, 2**64 - 1, 2**61]
    assert [s.end_ns for s in journal_decode(found.journal_line, MATCHER)] == [None, 1, 2**64 - 1, 2**61]


def test_journal_lines_are_orjsons_bytes() -> None:
    """Not the contract (that is what the line replays as), but the native writer follows orjson's
    format (integers, escapes), so the journal reads the same whichever wrote it."""
    bodies = [*JOURNAL_CASES.values(), *encode([trace_spans(random.Random(seed)) for seed in range(20)])]
    found = [decode._native_decode(body, MATCHER) for body in bodies]
    lines = [(f.journal_line, journal_encode(f.spans)) for f in found if f.journal_line is not None]
    assert len(lines) == len(bodies) - len(NO_LINE)
    for line, encoded in lines:
        assert line == encoded


TOKEN_KEYS = [*MATCHER.input_keys, *MATCHER.output_keys, *MATCHER.total_keys, *MATCHER.cache_read_keys,
              *MATCHER.cache_write_keys, *MATCHER.reasoning_keys]


@FUZZ
@given(values=st.lists(st.floats() | st.integers(-(2**63), 2**63 - 1) | st.integers(0, 10**13), min_size=1,
                       max_size=10))
def test_token_counts_are_read_and_journaled_as_python_and_orjson_do(values: list[float | int]) -> None:
    """Numbers under the token keys (each key in turn, so a count also lands behind another of its role)."""
    attributes = [KeyValue(key=TOKEN_KEYS[i % len(TOKEN_KEYS)],
                           value=AnyValue(double_value=v) if isinstance(v, float) else AnyValue(int_value=v))
                  for i, v in enumerate(values)]
    payload = request(span(attributes=attributes), span(attributes=attributes[::-1], n=3))
    assert assert_parity(payload, native_must_answer=True)[0] == "ok"
    found = decode._native_decode(payload, MATCHER)
    assert found.journal_line == journal_encode(found.spans)


wanted_attributes = st.lists(st.tuples(st.sampled_from(KEYS), any_values).map(
    lambda kv: KeyValue(key=kv[0], value=kv[1])), max_size=8)


@FUZZ
@given(attributes=st.lists(wanted_attributes, min_size=1, max_size=4), names=st.lists(texts, min_size=4),
       service=st.none() | st.builds(resource, **{SERVICE_NAME: texts, SDK_LANGUAGE: texts}),
       status=st.none() | statuses)
def test_generated_wanted_attributes_are_journaled_exactly(attributes: list[list[KeyValue]], names: list[str],
                                                          service: Resource | None, status: Status | None) -> None:
    """Every kind of value under wanted keys (the generated requests above rarely keep a span)."""
    kept = [span(n=2 * i + 1, name=name, attributes=attrs, status=status)
            for i, (attrs, name) in enumerate(zip(attributes, names, strict=False))]
    assert assert_parity(request(*kept, resource=service), native_must_answer=True)[0] == "ok"


# --- generated profile-shaped requests -----------------------------------------------------------------

# Span names and role values the classifier reads, and values nested up to 110 deep (past MAX_VALUE_NESTING,
# where protobuf alone says what happens), encoded by hand (protobuf will not serialize a message nested
# past 100).
PREFIXES = sorted({*MATCHER.run_names, *MATCHER.executor_prefixes, *MATCHER.agent_prefixes, *MATCHER.chat_prefixes,
                   *MATCHER.chat_names})
VOCABULARY = sorted({*MATCHER.chat_operations, *MATCHER.agent_executor_types, *PREFIXES, LEDGER_SOURCE_BRIDGE,
                     "AgentExecutor", "x.HandoffAgentExecutor", "stop", "length", " "})
profile_names = st.tuples(st.sampled_from(PREFIXES), st.sampled_from(["", " ", "  ", "x", ".x"]), texts).map("".join)
names = st.one_of(profile_names, profile_names, texts)
token_values = st.one_of(
    st.integers(-(2**63), 2**63 - 1).map(lambda i: AnyValue(int_value=i)),
    st.sampled_from([0, 1, -1, 10**12, 10**12 + 1, 2**63 - 1, -(2**63)]).map(lambda i: AnyValue(int_value=i)),
    st.floats().map(lambda d: AnyValue(double_value=d)),
    st.sampled_from([0.0, -0.0, 3.0, 3.5, -2.0, 1e12, 1e12 + 1, 1e300]).map(lambda d: AnyValue(double_value=d)),
    st.one_of(st.integers(-(10**40), 10**40).map(str), st.sampled_from(["1" * 32, "1" * 33, "+5", "٤٢", "4 2", ""]),
              st.text("0123456789 +-\u3000\t.", max_size=36))
    .map(lambda t: AnyValue(string_value=t)),
)
finish_values = st.one_of(
    st.lists(st.none() | st.integers(-3, 3) | st.sampled_from(VOCABULARY) | texts, max_size=4)
    .map(lambda items: AnyValue(string_value=json.dumps(items))),
    st.lists(st.sampled_from(VOCABULARY) | texts, max_size=3).map(lambda items: AnyValue(string_value=" ".join(items))),
    st.lists(st.one_of(st.sampled_from(VOCABULARY).map(lambda t: AnyValue(string_value=f" {t} ")), leaf_values),
             max_size=4).map(array),
)
role_values = st.one_of(any_values, token_values, finish_values,
                        st.sampled_from(VOCABULARY).map(lambda t: AnyValue(string_value=t)))
#: Attributes: values of every kind under wanted keys, token values under token keys, finish values
#: under finish keys, anything under other keys.
profile_attributes = st.lists(st.one_of(
    st.builds(KeyValue, key=st.sampled_from(TOKEN_KEYS), value=token_values),
    st.builds(KeyValue, key=st.sampled_from(MATCHER.finish_keys), value=finish_values),
    st.builds(KeyValue, key=st.sampled_from(KEYS), value=role_values),
    st.builds(KeyValue, key=keys, value=any_values),
), max_size=8)


@st.composite
def nested_bytes(draw: st.DrawFn, most: int) -> tuple[bytes, int]:
    """A serialized AnyValue nested up to ``most`` arrays / kvlists deep (by hand), and how deep."""
    deep = [levels for levels in (MAX_VALUE_DEPTH, 60, 99, 100, 101, 110) if levels <= most]
    levels = draw(st.integers(0, most) | st.sampled_from(deep))
    value = draw(role_values).SerializeToString()
    for kind in draw(st.lists(st.sampled_from("ak"), min_size=levels, max_size=levels)):
        value = ld(5, ld(1, value)) if kind == "a" else ld(6, ld(1, ld(1, b"k") + ld(2, value)))
    return value, levels


@st.composite
def profile_spans(draw: st.DrawFn, most: int) -> tuple[bytes, int]:
    """A serialized span (usable ids four times in five, else random ones; a profile's name, role
    values, values nested up to ``most`` deep in its attributes or an event's) and the deepest nesting in it."""
    if draw(st.integers(0, 4)):
        good = [draw(st.binary(min_size=size, max_size=size).filter(any)) for size in (16, 8, 8)]
        trace_id, span_id, parent_span_id = good[0], good[1], draw(st.sampled_from([b"", bytes(8), good[2]]))
    else:
        trace_id, span_id = draw(ids(16)), draw(ids(8))
        parent_span_id = draw(st.one_of(st.just(b""), st.just(bytes(8)), ids(8)))
    span = draw(st.builds(Span, trace_id=st.just(trace_id), span_id=st.just(span_id),
                          parent_span_id=st.just(parent_span_id), name=names,
                          start_time_unix_nano=st.integers(0, 2**64 - 1),
                          end_time_unix_nano=st.integers(0, 2**64 - 1) | st.just(0), status=st.none() | statuses,
                          attributes=profile_attributes))
    body, deepest = span.SerializeToString(), 0
    for in_event, key, (value, levels) in draw(st.lists(st.tuples(st.booleans(), st.sampled_from(KEYS) | keys,
                                                                  nested_bytes(most)), max_size=2)):
        pair = ld(1, key.encode()) + ld(2, value)
        body += ld(11, ld(3, pair)) if in_event else ld(9, pair)
        deepest = max(deepest, levels)
    return body, deepest


@st.composite
def profile_requests(draw: st.DrawFn) -> tuple[bytes, int]:
    """A serialized request of profile-shaped spans (in one request of three, values nested up to 110
    deep), and the deepest nesting in it."""
    most = draw(st.sampled_from([MAX_VALUE_DEPTH + 2, MAX_VALUE_DEPTH + 2, 110]))
    payload, deepest = b"", 0
    for _ in range(draw(st.integers(1, 2))):
        resource = draw(st.none() | st.builds(Resource, attributes=resource_attributes))
        body = b"" if resource is None else ld(1, resource.SerializeToString())
        for _ in range(draw(st.integers(1, 2))):
            scope = draw(st.none() | scopes)
            spans = draw(st.lists(profile_spans(most), min_size=1, max_size=4))
            deepest = max([deepest, *(levels for _, levels in spans)])
            body += ld(2, (b"" if scope is None else ld(1, scope.SerializeToString()))
                       + b"".join(ld(2, span) for span, _ in spans))
        payload += ld(1, body)
    return payload, deepest


@settings(FUZZ, max_examples=200)
@given(case=profile_requests())
def test_generated_profile_shaped_requests_decode_identically(case: tuple[bytes, int]) -> None:
    """Span records (facts included), rejected ids and own spans as the reference decodes them, and
    the journal line as ``_encode`` writes them; the native decoder answers unless a value nests near
    or past MAX_VALUE_NESTING (it then leaves the request to protobuf, which rejects a span nested past it)."""
    payload, deepest = case
    expected = assert_parity(payload, native_must_answer=deepest <= 60)
    assert expected[0] == "ok"
    found = decode._native_decode(payload, MATCHER)
    if found is not None and found.journal_line is not None:
        assert found.journal_line == journal_encode(found.spans)


# --- span facts -------------------------------------------------------------------------------------------

def test_strip_is_pythons_for_every_code_point() -> None:
    """The compiled decoder strips names and token strings as ``str.strip`` does."""
    points = [chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c <= 0xDFFF]
    assert [decode._native.py_strip(f"{c}a{c}") for c in points] == [f"{c}a{c}".strip() for c in points]


FINISH_KEY = "gen_ai.response.finish_reasons"
#: Values read as names, token counts and finish reasons, where Python's reading has corners.
FACT_VALUES = [
    *(AnyValue(string_value=t) for t in (
        "42", " 42 ", "\u300042\u2029", "\x1c7\x1f", "٤٢", "+5", "-5", "4 2", "1" * 32, "1" * 33, "0" * 40,
        "9" * 32, "", " ", "\xa0", "x", " agent one ", "stop", '["stop"]', ' ["", " length "] ', "[1, \"x\"]",
        "[", "[]", '["a" "b"]', '["stop"] x', '["\\u0041"]', '[null, "n"]', '["\\t"]', "[\"\t\"]",
        "workflow.run", "AgentExecutor", "x.HandoffAgentExecutor", "agentexecutor", "AGENTEXECUTOR", "ß",
        "AgentResponseEvent", "agentresponseevent", "chat", "Chat", "invoke_agent")),
    *(AnyValue(int_value=i) for i in (0, 1, -1, 10**12, 10**12 + 1, 2**63 - 1, -(2**63))),
    *(AnyValue(double_value=f) for f in (0.0, -0.0, 3.0, 3.5, -2.0, 1e12, 1e12 + 1, 1e300, math.nan, math.inf)),
    AnyValue(bool_value=True), AnyValue(), AnyValue(bytes_value=b"7"),
    array([AnyValue(string_value=" "), AnyValue(int_value=1), AnyValue(string_value=" stop ")]), array([]),
    array([AnyValue(), AnyValue(string_value="length")]), kvlist([("stop", AnyValue(string_value="x"))]),
]
NAMES = ["chat gpt", "chat", "workflow.run", "workflow.run x", "workflow.runner", "executor.process e",
         "invoke_agent a", "invoke_agent", "other", "openai.chat", "openai.chat x", "anthropic.chat", "POST"]


#: Each role's keys (those of a role are read in this order, the first one present counting).
ROLES = [MATCHER.agent_id_keys, MATCHER.executor_id_keys, MATCHER.executor_type_keys, MATCHER.subject_keys,
         MATCHER.error_keys, MATCHER.input_keys, MATCHER.output_keys, MATCHER.total_keys, MATCHER.finish_keys,
         MATCHER.operation_keys, MATCHER.cache_read_keys, MATCHER.cache_write_keys, MATCHER.reasoning_keys]


@pytest.mark.parametrize("key", sorted(WANTED))
def test_every_wanted_key_reads_as_python_reads_it(key: str) -> None:
    """Each corner value under each wanted key, alone, then given twice (the last one counts), then
    beside the other keys of its role in either order, in spans of each kind of name: the same facts
    either way."""
    others = [k for role in ROLES if key in role for k in role if k != key]
    for variant in range(4):
        spans = []
        for n, value in enumerate(FACT_VALUES):
            attributes = [KeyValue(key=key, value=value)]
            if variant == 1:
                attributes.append(KeyValue(key=key, value=FACT_VALUES[n - 1]))
            elif variant >= 2:
                beside = [KeyValue(key=k, value=FACT_VALUES[n - 2]) for k in others]
                attributes = attributes + beside if variant == 2 else beside + attributes
            spans.append(span(n=2 * n + 1, name=NAMES[(n + variant) % len(NAMES)], attributes=attributes))
        assert assert_parity(request(*spans), native_must_answer=True)[0] == "ok"


def finish_request(reasons: list[str]) -> bytes:
    return request(*(span(n=2 * i + 1, attributes=[KeyValue(key=FINISH_KEY, value=AnyValue(string_value=r))])
                     for i, r in enumerate(reasons)))


def test_a_finish_reason_string_is_decoded_by_python_once_per_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def counted(value: Any) -> Any:
        calls.append(value)
        return finish_reason(value)

    monkeypatch.setattr(decode, "finish_reason", counted)
    decoder = decode._native_decoder.__wrapped__(MATCHER)  # a fresh one, calling `counted`
    spans, *_ = decoder.decode(finish_request([f'["r{i % 3}"]' for i in range(30)]))
    assert [s.facts[FINISH] for s in spans] == [f"r{i % 3}" for i in range(30)]
    assert sorted(calls) == ['["r0"]', '["r1"]', '["r2"]']


THREADS = """
import sys, threading
from test_native_decode import MATCHER, decode, finish_request
sys.setswitchinterval(1e-6)

def work(k):
    for j in range(60):
        decode._native_decode(finish_request([f'["t{k}-{j}-{i}"]' for i in range(100)]), MATCHER)

threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


def test_threads_sharing_a_decoder_never_wait_for_each_other_forever() -> None:
    """Decoding a finish reason calls into Python, which may switch threads mid-call: the decoder's
    memory of them is not locked across that call (two threads deadlocked when it was, holding the
    GIL, hence a process of its own)."""
    done = subprocess.run([sys.executable, "-c", THREADS], cwd=Path(__file__).parent, timeout=60,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_stacked_instrumentations_spans_read_alike() -> None:
    """Provider instrumentations' chat spans (OpenLLMetry names them by API, with or without an
    operation attribute; an HTTP span between is none) and the count parts, as strings and numbers."""
    def value(v: Any) -> AnyValue:
        return AnyValue(string_value=v) if isinstance(v, str) else AnyValue(int_value=v)

    shapes = [("openai.chat", {"gen_ai.operation.name": "chat", "gen_ai.usage.reasoning_tokens": 5}),
              ("openai.response", {"gen_ai.operation.name": "response", "gen_ai.usage.cache_read_input_tokens": "30"}),
              ("anthropic.chat", {"gen_ai.usage.cache_creation.input_tokens": 0,
                                  "gen_ai.usage.cache_write.input_tokens": "7"}),
              ("POST", {"http.request.method": "POST"}),
              ("chat m", {"gen_ai.usage.cache_read.input_tokens": " 12 ", "gen_ai.usage.reasoning.output_tokens": 3,
                          "llm.usage.total_tokens": "99"}),
              ("generate_content m", {"gen_ai.operation.name": "generate_content"})]
    spans = [span(n=n + 1, name=name, attributes=[KeyValue(key=k, value=value(v)) for k, v in attrs.items()])
             for n, (name, attrs) in enumerate(shapes)]
    decoded = decode_bytes(request(*spans), MATCHER)
    assert assert_parity(request(*spans), native_must_answer=True)[0] == "ok"
    facts = [s.facts for s in decoded.spans]
    assert [f[CHAT] for f in facts] == [True, True, True, False, True, True]
    assert [f[CACHE_READ:] for f in facts] == [(None, None, 5), (30, None, None), (None, 7, None),
                                               (None, None, None), (12, None, 3), (None, None, None)]
    assert facts[4][TOTAL] == 99
