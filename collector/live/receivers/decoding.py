"""Decoding a request, the same for every transport, and the one error every transport answers
alike when a request can never be accepted (docs/design.md §3): gRPC with INVALID_ARGUMENT, HTTP
with 400 or 413, the kafka receiver by skipping the message."""

from __future__ import annotations

import enum
import json

from google.protobuf.message import DecodeError as ProtoDecodeError

from collector.config import Assembly
from collector.core.profiles import Matcher
from collector.formats.decode import Decoded, DecodeError, count_spans, decode_bytes, decode_otlp_json
from collector.live.receivers.telemetry import Telemetry

#: What the decoders raise for a payload that is not a request.
_DECODER_ERRORS = (ProtoDecodeError, RuntimeError, ValueError, DecodeError, RecursionError)


class Fault(enum.Enum):
    """Why a request can never be accepted; the value is the reason it is counted under (and a Kafka
    message skipped for)."""

    #: Not an OTLP trace request (its payload, encoding or compression).
    INVALID = "undecodable"
    #: Over a size limit, or more than the memory budget could ever hold.
    TOO_LARGE = "too_large"
    #: More spans or traces than the assembly could ever take in flight.
    NEVER_FITS = "never_fits"


class Undecodable(Exception):
    """A request no retry makes acceptable; ``message`` is what its sender is told. Raised from the
    decoder's own error where a decoder refused it."""

    def __init__(self, fault: Fault, message: str) -> None:
        super().__init__(message)
        self.fault = fault
        self.message = message


def _refused(exc: Exception) -> Undecodable:
    return Undecodable(Fault.INVALID, f"cannot decode ExportTraceServiceRequest: {exc}")


def spans_in(payload: bytes) -> int:
    """How many spans the serialized request holds, without decoding them."""
    try:
        return count_spans(payload)
    except _DECODER_ERRORS as exc:
        raise _refused(exc) from exc


def decode(payload: bytes, matcher: Matcher, json_doc: bool = False) -> Decoded:
    """``payload``, a serialized request (OTLP/JSON when ``json_doc``), decoded."""
    try:
        if json_doc:
            return decode_otlp_json(json.loads(payload), matcher, strict=False)
        return decode_bytes(payload, matcher)
    except _DECODER_ERRORS as exc:
        raise _refused(exc) from exc


def check_fits(decoded: Decoded, assembly: Assembly, telemetry: Telemetry) -> None:
    """Raise :class:`Undecodable` (``NEVER_FITS``, counted and logged) when even an idle collector
    could not accept ``decoded``: retrying it is then pointless."""
    spans = len(decoded.spans)
    if spans > assembly.max_spans_in_flight:
        reason = f"{spans} spans, more than assembly.max_spans_in_flight ({assembly.max_spans_in_flight})"
    elif spans <= assembly.max_traces_in_flight:  # no more traces than spans
        return
    else:
        traces = len({span.trace_id for span in decoded.spans})
        if traces <= assembly.max_traces_in_flight:
            return
        reason = f"{traces} traces, more than assembly.max_traces_in_flight ({assembly.max_traces_in_flight})"
    telemetry.never_fits(spans, reason)
    raise Undecodable(Fault.NEVER_FITS, f"request can never be accepted: it holds {reason}; send smaller batches")
