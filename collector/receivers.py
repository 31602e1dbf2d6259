"""OTLP receivers (DESIGN §3): gRPC ``TraceService/Export`` and HTTP ``POST /v1/traces``.

Both follow the OTLP specification's response rules and feed one :class:`Pipeline`:
- undecodable request: gRPC INVALID_ARGUMENT / HTTP 400 with a ``google.rpc.Status`` body;
- oversize: gRPC RESOURCE_EXHAUSTED (grpc's own receive limit) / HTTP 413;
- unusable spans inside a good request: success with ``partial_success.rejected_spans``;
- over capacity: gRPC UNAVAILABLE with ``RetryInfo`` / HTTP 503 with ``Retry-After``.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import grpc
import structlog
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import DecodeError as ProtoDecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from collector.assembler import Backpressure
from collector.decode import DecodeError, decode_otlp_json, decode_request
from collector.journal import JournalError
from collector.pipeline import IngestResult, Pipeline
from collector.security import BearerAuth, grpc_authorization

log = structlog.get_logger("agenteval.collector")

TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"


def _response(result: IngestResult) -> ExportTraceServiceResponse:
    if not result.rejected:
        return ExportTraceServiceResponse()
    return ExportTraceServiceResponse(
        partial_success=ExportTracePartialSuccess(rejected_spans=result.rejected, error_message=result.message)
    )


async def _durable(result: IngestResult) -> None:
    """Answer only once the accepted spans are journaled; a failed journal write is retryable (the
    spans are in memory and will be reconciled; a retry is deduplicated)."""
    if result.durable is None:
        return
    try:
        await result.durable
    except JournalError as exc:
        raise Backpressure(str(exc), 1.0) from exc


def _retry_info(seconds: float) -> error_details_pb2.RetryInfo:
    delay = Duration()
    delay.FromNanoseconds(int(seconds * 1e9))
    return error_details_pb2.RetryInfo(retry_delay=delay)


# --- gRPC -----------------------------------------------------------------------------------------

class GrpcTraceService:
    """``TraceService/Export`` over raw bytes, so a bad payload is INVALID_ARGUMENT, not INTERNAL."""

    def __init__(self, pipeline: Pipeline, auth: BearerAuth) -> None:
        self.pipeline = pipeline
        self.auth = auth

    async def export(self, payload: bytes, context: grpc.aio.ServicerContext) -> ExportTraceServiceResponse:
        if not self.auth.allows(grpc_authorization(context)):
            _count_unauthenticated(self.pipeline, "grpc")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
        try:
            request = ExportTraceServiceRequest.FromString(payload)
        except (ProtoDecodeError, RuntimeError) as exc:
            self._count_undecodable()
            log.warning("request_invalid", transport="grpc", error=str(exc), bytes=len(payload))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot decode ExportTraceServiceRequest: {exc}")
        try:
            result = self.pipeline.ingest(request, "grpc")
            await _durable(result)
        except Backpressure as exc:
            retry = _retry_info(exc.retry_after)
            status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message=exc.reason)
            status.details.add().Pack(retry)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"collector over capacity: {exc.reason}; retry later",
                trailing_metadata=(
                    ("google.rpc.retryinfo-bin", retry.SerializeToString()),
                    ("grpc-status-details-bin", status.SerializeToString()),
                ),
            )
        return _response(result)

    def _count_undecodable(self) -> None:
        if self.pipeline.metrics:
            self.pipeline.metrics.rejected.add(1, {"transport": "grpc", "reason": "undecodable_request"})

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(TRACE_SERVICE, {
            "Export": grpc.unary_unary_rpc_method_handler(
                self.export, request_deserializer=None,
                response_serializer=ExportTraceServiceResponse.SerializeToString),
        })


def grpc_server(max_message_bytes: int) -> grpc.aio.Server:
    return grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ])


def _count_unauthenticated(pipeline: Pipeline, transport: str) -> None:
    log.warning("request_unauthenticated", transport=transport)
    if pipeline.metrics:
        pipeline.metrics.rejected.add(1, {"transport": transport, "reason": "unauthenticated"})


# --- HTTP -----------------------------------------------------------------------------------------

class HttpTraceReceiver:
    def __init__(self, pipeline: Pipeline, max_body_bytes: int, auth: BearerAuth) -> None:
        self.pipeline = pipeline
        self.max_body_bytes = max_body_bytes
        self.auth = auth

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/traces", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        ctype = request.content_type
        if not self.auth.allows(request.headers.get("Authorization")):
            _count_unauthenticated(self.pipeline, "http")
            resp = self._error(401, "missing or invalid bearer token", ctype if ctype in (PROTOBUF, JSON) else JSON)
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        if ctype not in (PROTOBUF, JSON):
            return self._error(415, f"unsupported Content-Type {ctype!r}; use {PROTOBUF} or {JSON}", JSON)
        try:
            body = await self._body(request)
        except _TooLarge as exc:
            return self._error(413, str(exc), ctype)
        except _BadRequest as exc:
            return self._error(400, str(exc), ctype)
        wanted = self.pipeline.matcher.wanted_keys
        try:
            if ctype == PROTOBUF:
                decoded = decode_request(ExportTraceServiceRequest.FromString(body), wanted)
            else:
                decoded = decode_otlp_json(json.loads(body), wanted, strict=False)
        except (ProtoDecodeError, RuntimeError, ValueError, DecodeError, RecursionError) as exc:
            if self.pipeline.metrics:
                self.pipeline.metrics.rejected.add(1, {"transport": "http", "reason": "undecodable_request"})
            log.warning("request_invalid", transport="http", content_type=ctype, error=str(exc)[:300])
            return self._error(400, f"cannot decode ExportTraceServiceRequest: {exc}", ctype)
        try:
            result = self.pipeline.ingest_decoded(decoded, "http")
            await _durable(result)
        except Backpressure as exc:
            resp = self._error(503, f"collector over capacity: {exc.reason}; retry later", ctype)
            resp.headers["Retry-After"] = str(max(1, round(exc.retry_after)))
            return resp
        return self._message(200, _response(result), ctype)

    async def _body(self, request: web.Request) -> bytes:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise _TooLarge(f"request body over the {self.max_body_bytes}-byte limit") from exc
        encoding = request.headers.get("Content-Encoding", "identity").lower()
        if encoding in ("identity", ""):
            return raw
        if encoding != "gzip":
            raise _BadRequest(f"unsupported Content-Encoding {encoding!r}; use gzip or none")
        inflater = zlib.decompressobj(wbits=31)
        try:
            body = inflater.decompress(raw, self.max_body_bytes + 1)
        except zlib.error as exc:
            raise _BadRequest(f"invalid gzip body: {exc}") from exc
        if len(body) > self.max_body_bytes or inflater.unconsumed_tail:
            raise _TooLarge(f"decompressed body over the {self.max_body_bytes}-byte limit")
        return body

    def _error(self, status: int, message: str, ctype: str) -> web.Response:
        return self._message(status, status_pb2.Status(code=_RPC_CODES.get(status, code_pb2.UNKNOWN),
                                                       message=message), ctype)

    @staticmethod
    def _message(status: int, message: Any, ctype: str) -> web.Response:
        if ctype == PROTOBUF:
            return web.Response(status=status, body=message.SerializeToString(), content_type=PROTOBUF)
        return web.Response(status=status, text=json_format.MessageToJson(message, indent=None), content_type=JSON)


_RPC_CODES = {400: code_pb2.INVALID_ARGUMENT, 401: code_pb2.UNAUTHENTICATED, 413: code_pb2.RESOURCE_EXHAUSTED, 415: code_pb2.INVALID_ARGUMENT,
              503: code_pb2.UNAVAILABLE}


class _TooLarge(Exception):
    pass


class _BadRequest(Exception):
    pass
