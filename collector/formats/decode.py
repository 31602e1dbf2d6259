"""OTLP decoding: protobuf / OTLP-JSON requests -> compact :class:`SpanRecord` values.

Both wire formats go straight to span records, keeping only the attributes classification wants.
OTLP/JSON is not protobuf's canonical JSON mapping (ids are hex, enums may be integers, 64-bit
integers may be strings), and routing it through ``json_format`` into protobuf objects first cost
~10x the rest of the offline path, so :func:`decode_otlp_json` reads the documents directly.
"""

from __future__ import annotations

import binascii
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from google._upb._message import SetAllowOversizeProtos
from google.protobuf.message import DecodeError as ProtoDecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from collector.core.facts import MAX_TOKENS, SpanRecord, finish_reason, span_facts
from collector.core.profiles import (
    AGENT,
    ANNOUNCEMENT_ATTRIBUTES,
    BRIDGE_EXECUTOR_ATTRIBUTE,
    EXECUTOR,
    LEDGER_SOURCE_ATTRIBUTE,
    LEDGER_SOURCE_BRIDGE,
    OTHER,
    RUN,
    Matcher,
)

try:  # the compiled decoder (native/, built by `make install`); protobuf's stays the reference
    import agenteval_native as _native
except ImportError:
    _native = None

#: Instrumentation scope of the verdict spans we emit; spans from it are never re-ingested.
OWN_SCOPE = "agenteval.collector"
SERVICE_NAME = "service.name"
SDK_LANGUAGE = "telemetry.sdk.language"
#: Status.code of an error span (OTLP ``STATUS_CODE_ERROR``).
STATUS_ERROR = 2
#: Longest error description kept (a span's status message is free text).
MAX_ERROR_CHARS = 200
#: Longest string attribute value kept (values are ids and reasons; anything longer is hostile).
MAX_ATTR_CHARS = 1024
#: Longest ``telemetry.sdk.language`` kept.
MAX_LANGUAGE_CHARS = 64
_ZERO_TRACE = bytes(16)
_ZERO_SPAN = bytes(8)


class DecodeError(ValueError):
    """The request as a whole cannot be decoded; ``location`` says where (JSON path / line)."""

    def __init__(self, message: str, location: str | None = None) -> None:
        super().__init__(f"{location}: {message}" if location else message)
        self.location = location
        self.reason = message


@dataclass(slots=True)
class Decoded:
    spans: list[SpanRecord] = field(default_factory=list)
    rejected: int = 0
    own: int = 0
    reasons: list[str] = field(default_factory=list)
    #: ``spans`` as their crash-journal line, when the compiled decoder wrote it (else the journal encodes
    #: them); derived from ``spans``, so not part of equality.
    journal_line: bytes | None = field(default=None, compare=False, repr=False)

    def reject(self, reason: str) -> None:
        self.rejected += 1
        if len(self.reasons) < 5:
            self.reasons.append(reason)


#: Nesting kept in array / kvlist attribute values; deeper values are dropped (None).
MAX_VALUE_DEPTH = 8
#: Nesting taken in any attribute value (protobuf's usual message depth limit, counted in values): a
#: span holding a value nested deeper is rejected on its own (a resource or scope's: the request).
MAX_VALUE_NESTING = 100


def clean_text(text: str) -> str:
    """``text`` capped, with anything UTF-8 cannot hold (JSON's lone surrogates) replaced: every
    sink downstream (store, proto, OTLP export) must be able to encode it."""
    text = text[:MAX_ATTR_CHARS]
    return text if text.isascii() else text.encode("utf-8", "replace").decode("utf-8")


def any_value(value: AnyValue, depth: int = 0) -> Any:
    kind = value.WhichOneof("value")
    if kind is None or depth > MAX_VALUE_DEPTH:
        return None
    if kind == "array_value":
        return [any_value(v, depth + 1) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value, depth + 1) for kv in value.kvlist_value.values}
    if kind == "string_value":
        return value.string_value[:MAX_ATTR_CHARS]
    if kind == "bytes_value":
        return None  # nothing the classifier reads is bytes
    return getattr(value, kind)


def span_count(request: ExportTraceServiceRequest) -> int:
    """Spans in a parsed request, without decoding them."""
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


#: Whether serialized requests are decoded by the compiled decoder (``agenteval_native``).
NATIVE: bool = _native is not None


def count_spans(payload: bytes) -> int:
    """The number of spans in a serialized request, for refusing it: raises protobuf's
    ``DecodeError`` when the payload is not a request; never builds span objects, so refusing a
    request under overload stays cheap."""
    if _native is not None and (count := _native.count_spans(payload)) is not None:
        return count
    request, too_deep = parse_request(payload)
    return span_count(request) + len(too_deep)


def decode_bytes(payload: bytes, matcher: Matcher) -> Decoded:
    """:func:`decode_request` of a serialized request. The compiled decoder answers whenever it is
    certain to give the same result; otherwise, or without it, :func:`decode_protobuf` does."""
    if (decoded := _native_decode(payload, matcher)) is not None:
        return decoded
    return decode_protobuf(payload, matcher)


def decode_protobuf(payload: bytes, matcher: Matcher) -> Decoded:
    """The reference decoder: protobuf parses the payload (raising its ``DecodeError``), spans
    holding values nested past :data:`MAX_VALUE_NESTING` are rejected."""
    request, too_deep = parse_request(payload)
    out = decode_request(request, matcher)
    for reason in too_deep:
        out.reject(reason)
    return out


def _native_decode(payload: bytes, matcher: Matcher) -> Decoded | None:
    """The compiled decoder's result, or None when it is not installed or leaves the payload to protobuf."""
    if _native is None or (found := _native_decoder(matcher).decode(payload)) is None:
        return None
    spans, rejected, own, line = found
    out = Decoded(spans, own=own, journal_line=line)
    for ids in rejected:  # (name, trace id, span id, parent id): the reason is worded here only
        _reject_ids(out, *ids)
    return out


@lru_cache(maxsize=8)
def _native_decoder(matcher: Matcher) -> Any:
    """The compiled decoder for one matcher, given this module's constants. ``keys``: each role's
    attribute keys, in the order :func:`span_facts` reads them and the decoder expects them."""
    assert _native is not None
    m = matcher
    keys = ((LEDGER_SOURCE_ATTRIBUTE,), m.operation_keys, m.agent_id_keys, m.executor_id_keys,
            (BRIDGE_EXECUTOR_ATTRIBUTE,), m.executor_type_keys, m.subject_keys, m.error_keys, m.input_keys,
            m.output_keys, m.total_keys, m.finish_keys, *((key,) for key in ANNOUNCEMENT_ATTRIBUTES), m.model_keys,
            m.provider_keys, m.cache_read_keys, m.cache_write_keys, m.reasoning_keys)
    return _native.Decoder(SpanRecord, keys=keys, run_names=sorted(m.run_names), executor_prefixes=m.executor_prefixes,
                           agent_prefixes=m.agent_prefixes, chat_prefixes=m.chat_prefixes,
                           chat_names=sorted(m.chat_names),
                           chat_operations=sorted(m.chat_operations), ledger_source=LEDGER_SOURCE_BRIDGE,
                           kinds=(RUN, EXECUTOR, AGENT, OTHER), finish_reason=finish_reason,
                           hosts_agent=m.is_agent_executor_type, max_tokens=MAX_TOKENS, own_scope=OWN_SCOPE,
                           service_name=SERVICE_NAME, sdk_language=SDK_LANGUAGE, max_chars=MAX_ATTR_CHARS,
                           max_language_chars=MAX_LANGUAGE_CHARS, max_error_chars=MAX_ERROR_CHARS,
                           max_value_depth=MAX_VALUE_DEPTH, status_error=STATUS_ERROR)


def parse_request(payload: bytes) -> tuple[ExportTraceServiceRequest, list[str]]:
    """The request, and why each span left out of it was: one holding a value nested past
    :data:`MAX_VALUE_NESTING`.

    protobuf refuses messages nested past 100 deep, which a legal value reaches at 32 kvlists (a
    kvlist level is 3 messages). Such a request is walked here first: its too-deep spans are cut out,
    its nesting is then bounded, and protobuf parses the rest with its limit lifted (unbounded, a
    ~250 KiB request nesting 65,000 messages crashes it)."""
    try:
        return ExportTraceServiceRequest.FromString(payload), []
    except ProtoDecodeError as error:
        too_deep: list[str] = []
        try:
            bounded = _cut_too_deep(payload, 0, len(payload), _REQUEST, too_deep)
        except (IndexError, ValueError):  # not protobuf's wire format, or a group: protobuf said why
            raise error from None
        SetAllowOversizeProtos(True)  # process-wide, for this parse only (decoding never awaits)
        try:
            return ExportTraceServiceRequest.FromString(bytes(bounded)), too_deep
        finally:
            SetAllowOversizeProtos(False)


# The messages of a request that hold other messages (a group of them can nest attribute values), and
# which field of each holds which: every field protobuf parses as a message, but leaves.
_REQUEST, _RESOURCE_SPANS, _RESOURCE, _SCOPE_SPANS, _SCOPE, _SPAN, _EVENT, _LINK, _KEY_VALUE, _ANY, _ARRAY, \
    _KVLIST = range(12)
_HOLDS: tuple[dict[int, int], ...] = (
    {1: _RESOURCE_SPANS}, {1: _RESOURCE, 2: _SCOPE_SPANS}, {1: _KEY_VALUE}, {1: _SCOPE, 2: _SPAN},
    {3: _KEY_VALUE}, {9: _KEY_VALUE, 11: _EVENT, 13: _LINK}, {3: _KEY_VALUE}, {4: _KEY_VALUE}, {2: _ANY},
    {5: _ARRAY, 6: _KVLIST}, {1: _ANY}, {1: _KEY_VALUE},
)


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it (IndexError past the end)."""
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint over 10 bytes")


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _fields(buf: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(number, wire type, field start, value start, field end) of each field of the message
    ``buf[start:end]``; a length-delimited value (wire type 2) is ``buf[value start:field end]``."""
    pos = start
    while pos < end:
        at = pos
        tag, pos = _varint(buf, pos)
        wire = tag & 7
        if wire == 2:
            length, pos = _varint(buf, pos)
            value = pos
            pos += length
        else:
            if wire == 0:
                pos = _varint(buf, pos)[1]
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:
                raise ValueError(f"wire type {wire}")
            value = pos
        if pos > end:
            raise ValueError("a field past the end of its message")
        yield tag >> 3, wire, at, value, pos


def _too_deep(buf: bytes, start: int, end: int, msg: int, enclosing: int = 0) -> bool:
    """Whether message ``msg`` at ``buf[start:end]``, inside ``enclosing`` attribute values, holds a
    value nested past :data:`MAX_VALUE_NESTING` (the walk stops there, so its recursion is bounded)."""
    holds = _HOLDS[msg]
    for number, wire, _, value, field_end in _fields(buf, start, end):
        inner = holds.get(number) if wire == 2 else None
        if inner is None:
            continue
        if inner == _ANY:
            if enclosing > MAX_VALUE_NESTING or _too_deep(buf, value, field_end, _ANY, enclosing + 1):
                return True
        elif _too_deep(buf, value, field_end, inner, enclosing):
            return True
    return False


def _cut_too_deep(buf: bytes, start: int, end: int, msg: int, reasons: list[str]) -> bytearray:
    """The request (or resource / scope spans) at ``buf[start:end]`` without its spans that hold a
    value nested too deep (why each was cut: appended to ``reasons``); raises protobuf's
    ``DecodeError`` for a resource or scope holding one."""
    out = bytearray()
    for number, wire, at, value, field_end in _fields(buf, start, end):
        inner = _HOLDS[msg].get(number) if wire == 2 else None
        if inner in (_RESOURCE_SPANS, _SCOPE_SPANS):
            body = _cut_too_deep(buf, value, field_end, inner, reasons)
            out += _varint_bytes(number << 3 | 2) + _varint_bytes(len(body)) + body
            continue
        if inner == _SPAN and _too_deep(buf, value, field_end, _SPAN):
            reasons.append(f"span {_span_name(buf, value, field_end)!r}: a value is nested more than "
                           f"{MAX_VALUE_NESTING} deep, past the limit")
            continue
        if inner is not None and inner != _SPAN and _too_deep(buf, value, field_end, inner):
            where = "resource" if inner == _RESOURCE else "scope"
            raise ProtoDecodeError(f"a {where} attribute value is nested more than {MAX_VALUE_NESTING} deep")
        out += buf[at:field_end]
    return out


def _span_name(buf: bytes, start: int, end: int) -> str:
    """A span's name (as far as it is text), for a reason: never whole."""
    name = ""
    for number, wire, _, value, field_end in _fields(buf, start, end):
        if number == 5 and wire == 2:
            name = buf[value:min(field_end, value + 256)].decode("utf-8", "replace")
    return name[:64] + "…" if len(name) > 64 else name


def decode_request(request: ExportTraceServiceRequest, matcher: Matcher) -> Decoded:
    """Extract span records, rejecting (and counting) spans whose ids are unusable."""
    out = Decoded()
    wanted = matcher.wanted_keys
    for rs in request.resource_spans:
        subject = language = None
        for kv in rs.resource.attributes:
            if kv.key == SERVICE_NAME:
                subject = kv.value.string_value[:MAX_ATTR_CHARS] or None
            elif kv.key == SDK_LANGUAGE:
                language = kv.value.string_value[:MAX_LANGUAGE_CHARS] or None
        for ss in rs.scope_spans:
            if ss.scope.name == OWN_SCOPE:
                out.own += len(ss.spans)
                continue
            for span in ss.spans:
                tid, sid, pid = span.trace_id, span.span_id, span.parent_span_id
                name = span.name
                if len(name) > MAX_ATTR_CHARS:
                    name = name[:MAX_ATTR_CHARS]
                if not (len(tid) == 16 and len(sid) == 8 and (not pid or len(pid) == 8)
                        and tid != _ZERO_TRACE and sid != _ZERO_SPAN):  # the usual case in one test
                    _reject_ids(out, name, tid, sid, pid)
                    continue
                attrs = {}
                for kv in span.attributes:  # the hot loop: one key read per attribute, values only if wanted
                    key = kv.key
                    if key in wanted:
                        value = kv.value
                        if value.WhichOneof("value") == "string_value":  # most wanted values: inline
                            text = value.string_value
                            attrs[key] = text if len(text) <= MAX_ATTR_CHARS else text[:MAX_ATTR_CHARS]
                        else:
                            attrs[key] = any_value(value)
                error = None
                if span.HasField("status") and span.status.code == STATUS_ERROR:
                    error = span.status.message[:MAX_ERROR_CHARS]
                out.spans.append(
                    SpanRecord(tid, sid, pid if pid != _ZERO_SPAN else b"", name, span.start_time_unix_nano,
                               span_facts(matcher, name, attrs), subject, error, language,
                               span.end_time_unix_nano or None)
                )
    return out


def _reject_ids(out: Decoded, name: str, tid: bytes, sid: bytes, pid: bytes) -> None:
    out.reject(_id_problem(name, tid, sid, pid) or "unusable ids")


def _id_problem(name: str, tid: bytes, sid: bytes, pid: bytes) -> str | None:
    """Why a span's ids are unusable (it is then rejected in partial_success), or None."""
    if len(name) > 64:
        name = name[:64] + "…"  # echoed to the client and the log: never whole
    if len(tid) != 16 or tid == _ZERO_TRACE:
        return f"span {name!r}: trace_id must be 16 non-zero bytes, got {len(tid)}"
    if len(sid) != 8 or sid == _ZERO_SPAN:
        return f"span {name!r}: span_id must be 8 non-zero bytes, got {len(sid)}"
    if pid and len(pid) != 8:
        return f"span {name!r}: parent_span_id must be empty or 8 bytes, got {len(pid)}"
    return None


_ID_FIELDS = (("traceId", 16), ("spanId", 8), ("parentSpanId", 8))


class _BadSpan(ValueError):
    """A span to reject (or, decoding a file, to fail on)."""


def _hex_ids(obj: dict, path: str) -> list[bytes]:
    """An OTLP/JSON object's trace / span / parent ids as bytes (b"" when absent)."""
    out = []
    for key, size in _ID_FIELDS:
        value = obj.get(key)
        if value in (None, ""):
            out.append(b"")
            continue
        if not isinstance(value, str):
            raise _BadSpan(f"{path}.{key}: expected a hex string, got {type(value).__name__}")
        try:
            raw = binascii.unhexlify(value)
        except (binascii.Error, ValueError):
            raise _BadSpan(f"{path}.{key}: {value[:64]!r} is not hex") from None
        if len(raw) != size:
            raise _BadSpan(f"{path}.{key}: expected {size * 2} hex digits, got {len(value)}")
        out.append(raw)
    return out


def json_any_value(value: Any, depth: int = 0) -> Any:
    """An OTLP/JSON ``AnyValue`` object as a plain value (strings cleaned and capped like protobuf
    ones). A value of the wrong type or an unknown kind is dropped (None): one bad value never
    fails its span, let alone the request."""
    if not isinstance(value, dict) or not value or depth > MAX_VALUE_DEPTH:
        return None
    kind, inner = next(iter(value.items()))
    if kind == "stringValue":
        return clean_text(inner) if isinstance(inner, str) else None
    if kind == "intValue":
        return _json_int(inner)
    if kind == "boolValue":
        return inner if isinstance(inner, bool) else None
    if kind == "doubleValue":
        return float(inner) if isinstance(inner, (int, float)) and not isinstance(inner, bool) else None
    if kind in ("arrayValue", "kvlistValue"):
        items = inner.get("values") if isinstance(inner, dict) else None
        if not isinstance(items, list):
            return None
        if kind == "arrayValue":
            return [json_any_value(v, depth + 1) for v in items]
        return {kv["key"]: json_any_value(kv.get("value"), depth + 1) for kv in items
                if isinstance(kv, dict) and isinstance(kv.get("key"), str)}
    return None  # bytesValue (nothing the classifier reads) or a kind this version does not know


def _json_span_too_deep(span: dict) -> bool:
    """Whether an OTLP/JSON span's attributes, or its events' or links', hold a value nested past
    :data:`MAX_VALUE_NESTING` (as protobuf reads them: the first member of a value is its kind)."""
    if _json_attributes_too_deep(span.get("attributes")):
        return True
    for key in ("events", "links"):
        items = span.get(key)
        if isinstance(items, list) and any(isinstance(item, dict) and _json_attributes_too_deep(item.get("attributes"))
                                           for item in items):
            return True
    return False


def _json_attributes_too_deep(attributes: Any) -> bool:
    return isinstance(attributes, list) and any(
        isinstance(kv, dict) and _json_value_too_deep(kv.get("value"), 0) for kv in attributes)


def _json_value_too_deep(value: Any, enclosing: int) -> bool:
    if not isinstance(value, dict):
        return False
    if enclosing > MAX_VALUE_NESTING:
        return True
    if not value:
        return False
    kind, inner = next(iter(value.items()))
    items = inner.get("values") if kind in ("arrayValue", "kvlistValue") and isinstance(inner, dict) else None
    if not isinstance(items, list):
        return False
    if kind == "arrayValue":
        return any(_json_value_too_deep(item, enclosing + 1) for item in items)
    return any(isinstance(kv, dict) and _json_value_too_deep(kv.get("value"), enclosing + 1) for kv in items)


def _json_int(value: Any) -> int | None:
    """OTLP/JSON int64: a number or a decimal string; anything else (1e400, "abc") is no value."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None  # inf and nan are not integers
    if isinstance(value, str) and len(value) <= 32:
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _json_time(value: Any) -> int | None:
    """An OTLP/JSON span time (Unix ns, a fixed64): None when unset (0) or not one (as protobuf's
    decoder reads it, a time outside the fixed64 range is no time)."""
    nanos = _json_int(value)
    return nanos if nanos is not None and 0 < nanos < 2**64 else None


def _scopes(doc: Any) -> Iterator[tuple[dict, dict, str]]:
    """(resource span, scope span, path) for every scope in a request document."""
    for i, rs in enumerate(_list(doc, "resourceSpans", "$")):
        base = f"$.resourceSpans[{i}]"
        for key in ("scopeSpans", "instrumentationLibrarySpans"):
            for j, ss in enumerate(_list(rs, key, base)):
                yield rs, ss, f"{base}.{key}[{j}]"


def _list(obj: Any, key: str, path: str) -> list:
    if not isinstance(obj, dict):
        raise DecodeError("expected an object", path)
    value = obj.get(key, [])
    if value is None:
        return []
    if not isinstance(value, list):
        raise DecodeError(f"{key} must be an array", path)
    return value


def decode_otlp_json(doc: Any, matcher: Matcher, location: str = "", strict: bool = True) -> Decoded:
    """Decode one OTLP/JSON ``ExportTraceServiceRequest`` (already ``json.loads``-ed).

    A malformed document raises :class:`DecodeError`. A span with unusable ids raises it too with
    ``strict`` (files); otherwise it is rejected and counted, so a live receiver can report it in
    ``partial_success``.
    """
    out = Decoded()
    wanted = matcher.wanted_keys
    where = f"{location} " if location else ""
    resources: dict[int, tuple[str | None, str | None]] = {}
    for rs, ss, path in _scopes(doc):
        if id(rs) not in resources:
            found: dict[str, str | None] = {SERVICE_NAME: None, SDK_LANGUAGE: None}
            for kv in _list(rs.get("resource") or {}, "attributes", path):
                key = kv.get("key") if isinstance(kv, dict) else None
                value = kv.get("value") if key in found else None
                if isinstance(key, str) and isinstance(value, dict) and isinstance(value.get("stringValue"), str):
                    found[key] = clean_text(value["stringValue"]) or None
            resources[id(rs)] = (found[SERVICE_NAME], found[SDK_LANGUAGE])
        subject, language = resources[id(rs)]
        spans = _list(ss, "spans", path)
        scope = ss.get("scope") or ss.get("instrumentationLibrary") or {}
        if isinstance(scope, dict) and scope.get("name") == OWN_SCOPE:
            out.own += len(spans)
            continue
        for k, span in enumerate(spans):
            span_path = f"{path}.spans[{k}]"
            if not isinstance(span, dict):
                raise DecodeError("span must be an object", f"{where}{span_path}")
            try:
                tid, sid, pid = _hex_ids(span, span_path)
                for n, link in enumerate(span.get("links") or ()):
                    _hex_ids(link if isinstance(link, dict) else {}, f"{span_path}.links[{n}]")
                name = span.get("name") or ""
                if not isinstance(name, str):
                    raise TypeError(f"name must be a string, got {type(name).__name__}")
                name = clean_text(name)
                if problem := _id_problem(name, tid, sid, pid):
                    raise _BadSpan(f"{span_path}: {problem}")
                if _json_span_too_deep(span):
                    raise _BadSpan(f"{span_path}: span {name[:64]!r}: a value is nested more than {MAX_VALUE_NESTING} "
                                 "deep, past the limit")
                attrs = {}
                for kv in span.get("attributes") or ():
                    key = kv.get("key") if isinstance(kv, dict) else None
                    if key in wanted:
                        attrs[key] = json_any_value(kv.get("value"))
                start = _json_int(span.get("startTimeUnixNano") or 0) or 0
                end = _json_time(span.get("endTimeUnixNano"))
                error = _json_status_error(span.get("status"))
            except _BadSpan as exc:
                if strict:
                    raise DecodeError(str(exc), location or None) from None
                out.reject(str(exc))
                continue
            except (AttributeError, TypeError, ValueError, binascii.Error) as exc:
                raise DecodeError(f"malformed span: {exc}", f"{where}{span_path}") from exc
            out.spans.append(SpanRecord(tid, sid, pid if pid != _ZERO_SPAN else b"", name, start,
                                        span_facts(matcher, name, attrs), subject, error, language, end))
    return out


def _json_status_error(status: Any) -> str | None:
    """An OTLP/JSON span status's error description (the code may be an integer or the enum name)."""
    if not isinstance(status, dict) or status.get("code") not in (STATUS_ERROR, "STATUS_CODE_ERROR", "2"):
        return None
    message = status.get("message")
    return clean_text(message)[:MAX_ERROR_CHARS] if isinstance(message, str) else ""
