"""OTLP decoding: protobuf / OTLP-JSON requests -> compact :class:`SpanRecord` values.

OTLP/JSON is not protobuf's canonical JSON mapping: trace and span ids are hex strings (json_format
alone would read them as base64). :func:`parse_otlp_json` rewrites the ids and hands the rest to
``google.protobuf.json_format``, which already accepts integer enums, 64-bit integers as strings and
(with ``ignore_unknown_fields``) unknown fields.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from collector.classify import SpanRecord

#: Instrumentation scope of the verdict spans we emit; spans from it are never re-ingested.
OWN_SCOPE = "agenteval.collector"
SERVICE_NAME = "service.name"
#: Longest string attribute value kept (values are ids and reasons; anything longer is hostile).
MAX_ATTR_CHARS = 1024
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

    def reject(self, reason: str) -> None:
        self.rejected += 1
        if len(self.reasons) < 5:
            self.reasons.append(reason)


def any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    if kind == "string_value":
        return value.string_value[:MAX_ATTR_CHARS]
    return getattr(value, kind)


def decode_request(request: ExportTraceServiceRequest, wanted: frozenset[str]) -> Decoded:
    """Extract span records, rejecting (and counting) spans whose ids are unusable."""
    out = Decoded()
    for rs in request.resource_spans:
        subject = None
        for kv in rs.resource.attributes:
            if kv.key == SERVICE_NAME:
                subject = kv.value.string_value or None
        for ss in rs.scope_spans:
            if ss.scope.name == OWN_SCOPE:
                out.own += len(ss.spans)
                continue
            for span in ss.spans:
                tid, sid, pid = span.trace_id, span.span_id, span.parent_span_id
                if len(tid) != 16 or tid == _ZERO_TRACE:
                    out.reject(f"span {span.name!r}: trace_id must be 16 non-zero bytes, got {len(tid)}")
                    continue
                if len(sid) != 8 or sid == _ZERO_SPAN:
                    out.reject(f"span {span.name!r}: span_id must be 8 non-zero bytes, got {len(sid)}")
                    continue
                if pid and len(pid) != 8:
                    out.reject(f"span {span.name!r}: parent_span_id must be empty or 8 bytes, got {len(pid)}")
                    continue
                attrs = {}
                for kv in span.attributes:  # the hot loop: one key read per attribute, values only if wanted
                    key = kv.key
                    if key in wanted:
                        attrs[key] = any_value(kv.value)
                out.spans.append(
                    SpanRecord(tid, sid, pid if pid != _ZERO_SPAN else b"", span.name,
                               span.start_time_unix_nano, attrs, subject)
                )
    return out


_ID_FIELDS = {"traceId": 16, "spanId": 8, "parentSpanId": 8}


def _fix_ids(obj: dict, path: str, errors: list[str]) -> bool:
    """Rewrite OTLP/JSON hex ids in place as base64 for json_format; False if any is invalid."""
    ok = True
    for key, size in _ID_FIELDS.items():
        value = obj.get(key)
        if value in (None, ""):
            continue
        if not isinstance(value, str):
            errors.append(f"{path}.{key}: expected a hex string, got {type(value).__name__}")
            ok = False
            continue
        try:
            raw = binascii.unhexlify(value)
        except (binascii.Error, ValueError):
            errors.append(f"{path}.{key}: {value!r} is not hex")
            ok = False
            continue
        if len(raw) != size:
            errors.append(f"{path}.{key}: expected {size * 2} hex digits, got {len(value)}")
            ok = False
            continue
        obj[key] = base64.b64encode(raw).decode()
    return ok


def _spans_of(doc: dict) -> Iterator[tuple[list, str]]:
    for i, rs in enumerate(_list(doc, "resourceSpans", "$")):
        base = f"$.resourceSpans[{i}]"
        for key in ("scopeSpans", "instrumentationLibrarySpans"):
            for j, ss in enumerate(_list(rs, key, base)):
                spans = _list(ss, "spans", f"{base}.{key}[{j}]")
                yield spans, f"{base}.{key}[{j}]"


def _list(obj: Any, key: str, path: str) -> list:
    if not isinstance(obj, dict):
        raise DecodeError("expected an object", path)
    value = obj.get(key, [])
    if value is None:
        return []
    if not isinstance(value, list):
        raise DecodeError(f"{key} must be an array", path)
    return value


def parse_otlp_json(doc: Any, location: str = "", strict: bool = True) -> tuple[ExportTraceServiceRequest, list[str]]:
    """Parse one OTLP/JSON ``ExportTraceServiceRequest`` (already ``json.loads``-ed).

    With ``strict`` any invalid id raises :class:`DecodeError`; otherwise the span is dropped and
    the reason returned, so a live receiver can report it in ``partial_success``.
    """
    where = f"{location} " if location else ""
    errors: list[str] = []
    for spans, path in _spans_of(doc):
        keep = []
        for k, span in enumerate(spans):
            span_path = f"{path}.spans[{k}]"
            if not isinstance(span, dict):
                raise DecodeError("span must be an object", f"{where}{span_path}")
            before = len(errors)
            good = _fix_ids(span, span_path, errors)
            for n, link in enumerate(span.get("links") or []):
                if isinstance(link, dict):
                    good = _fix_ids(link, f"{span_path}.links[{n}]", errors) and good
            if good:
                keep.append(span)
            elif strict:
                raise DecodeError(errors[before], location or None)
        spans[:] = keep
    try:
        request = json_format.ParseDict(doc, ExportTraceServiceRequest(), ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise DecodeError(str(exc), location or None) from exc
    return request, errors
