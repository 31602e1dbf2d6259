"""The ``grpc`` receiver (docs/design.md §3): OTLP/gRPC ``TraceService/Export`` on
``receivers.grpc.endpoint``, the metrics and logs services beside it (discarded), and whatever other
services the collector serves on that port (the FidelityService).

A request that is not a trace request, or can never fit (:class:`Undecodable`), is INVALID_ARGUMENT;
over capacity is UNAVAILABLE with ``RetryInfo``; a message over ``max_message_bytes`` is grpc's own
RESOURCE_EXHAUSTED. A call that does not send its message within ``read_timeout`` is
DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from collector.config import GrpcReceiver as GrpcConfig
from collector.config import Tls, split_endpoint
from collector.live.assembler import Backpressure
from collector.live.budget import Lease, MemoryBudget
from collector.live.pipeline import Pipeline
from collector.live.receivers.decoding import Fault, Undecodable, check_fits
from collector.live.receivers.limits import clip
from collector.live.receivers.otlp import DISCARDED_SIGNALS, budgeted, decode_request, durable, response
from collector.live.receivers.telemetry import Telemetry
from collector.security import BearerAuth, grpc_authorization, grpc_credentials

TRANSPORT = "grpc"
TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
#: Seconds calls in progress are given to finish when the receiver stops.
STOP_GRACE = 2.0


class GrpcTraceReceiver:
    """The gRPC server: made and bound by :meth:`start`, which also serves ``services`` (the
    collector's own gRPC services) on its port; closed by :meth:`stop`."""

    def __init__(self, config: GrpcConfig, tls: Tls, pipeline: Pipeline, auth: BearerAuth, budget: MemoryBudget,
                 services: Sequence[grpc.GenericRpcHandler] = ()) -> None:
        self.config = config
        self.tls = tls
        self.traces = GrpcTraceService(pipeline, auth, budget, config.max_message_bytes, config.read_timeout)
        self.services = services
        #: host:port, the port bound (once started).
        self.address: str | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        server = _grpc_server(self.config.max_message_bytes, self.config.handshake_timeout)
        server.add_generic_rpc_handlers((self.traces.handler(),
                                         *(GrpcDiscardService(signal, self.traces).handler()
                                           for signal in DISCARDED_SIGNALS),
                                         *self.services))
        endpoint = self.config.endpoint
        try:
            port = (server.add_secure_port(endpoint, grpc_credentials(self.tls)) if self.tls.enabled
                    else server.add_insecure_port(endpoint))
            await server.start()
        except BaseException:
            await server.stop(None)
            raise
        self._server = server
        self.address = f"{split_endpoint(endpoint)[0]}:{port}"

    async def stop(self) -> None:
        """Stop accepting calls; those in progress get :data:`STOP_GRACE` seconds to finish."""
        if self._server is not None:
            await self._server.stop(grace=STOP_GRACE)
            self._server = None


def _grpc_server(max_message_bytes: int, handshake_timeout: float) -> grpc.aio.Server:
    return grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
        # Connections that never finish the TLS / HTTP/2 handshake are closed (gRPC's default: 120 s).
        ("grpc.server_handshake_timeout_ms", max(1, int(handshake_timeout * 1000))),
        # No flow-control window grown from bandwidth estimates: a call's message is then received only
        # as far as the default window (64 KiB) until GrpcTraceService reads it (which opens the window
        # to the message's size), so calls waiting to be handled do not each buffer up to several MiB.
        ("grpc.http2.bdp_probe", 0),
    ])


@dataclass(frozen=True)
class _Refusal:
    """A gRPC status to abort a call with."""
    code: grpc.StatusCode
    message: str
    trailers: tuple[tuple[str, bytes], ...] = ()


def _overloaded(exc: Backpressure) -> _Refusal:
    """UNAVAILABLE with the delay to retry after, as RetryInfo (OTLP exporters read it) and in the
    rich status details."""
    delay = Duration()
    delay.FromNanoseconds(int(exc.retry_after * 1e9))
    retry = error_details_pb2.RetryInfo(retry_delay=delay)
    status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message=exc.reason)
    status.details.add().Pack(retry)
    return _Refusal(grpc.StatusCode.UNAVAILABLE, f"collector over capacity: {exc.reason}; retry later",
                    (("google.rpc.retryinfo-bin", retry.SerializeToString()),
                     ("grpc-status-details-bin", status.SerializeToString())))


def _not_received(timeout: float) -> _Refusal:
    return _Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, f"request message not received within {timeout}s")


async def _message(requests: AsyncIterator[bytes], timeout: float) -> bytes | None:
    """The call's request message (None: the client went away, or half-closed without one); raises
    :class:`TimeoutError` when it has not arrived within ``timeout`` seconds."""
    messages = aiter(requests)  # grpc's receiver hands out an async generator
    try:
        async with asyncio.timeout(timeout):
            return await anext(messages, None)
    finally:
        # Unfinished, grpc's message generator would keep the message until a full collection.
        if isinstance(messages, AsyncGenerator):
            await messages.aclose()


class GrpcTraceService:
    """``TraceService/Export`` over raw bytes, so a bad payload is INVALID_ARGUMENT, not INTERNAL.

    Registered as client-streaming (the same call on the wire as unary): grpc then reads the message
    only when :meth:`export` asks for it, after the call has taken twice ``max_message_bytes`` of the
    memory budget, so what grpc holds of messages being read is within the budget. grpc.aio tells a
    handler nothing of the message's size before it has read all of it (the length prefix stays in
    grpc's transport; a raw deserializer is handed the whole message), so the call holds the largest
    allowed until it has read, then only what its message needs; calls take turns for that room
    (:meth:`Lease.reserve`: waiting at most ``read_timeout``, then refused before their messages are
    read). (A unary handler gets its message read first, and grpc's ``maximum_concurrent_rpcs``
    would count the long-lived FidelityService watch streams.)"""

    def __init__(self, pipeline: Pipeline, auth: BearerAuth, budget: MemoryBudget, max_message_bytes: int,
                 read_timeout: float) -> None:
        self.pipeline = pipeline
        self.auth = auth
        self.budget = budget
        self.telemetry = Telemetry(TRANSPORT, pipeline.metrics)
        self.max_message_bytes = max_message_bytes
        #: Held while a message is read: grpc's receive buffer and the bytes it hands over exist
        #: together then (with one copy held, 400 calls of 4 MiB at once grew RSS 1.4x the budget).
        self.read_hold = 2 * max_message_bytes
        self.read_timeout = read_timeout

    async def authenticate(self, context: grpc.aio.ServicerContext) -> None:
        """Abort the call, counted, without the bearer token."""
        if not self.auth.allows(grpc_authorization(context)):
            self.telemetry.unauthenticated()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    async def read(self, requests: AsyncIterator[bytes], lease: Lease) -> bytes | None:
        """The call's message, read within the budget (``read_hold`` held meanwhile) and ``read_timeout``."""
        with budgeted(self.telemetry):
            await lease.reserve(self.read_hold, "the request message", self.read_timeout)
        return await _message(requests, self.read_timeout)

    async def export(self, requests: AsyncIterator[bytes],
                     context: grpc.aio.ServicerContext) -> ExportTraceServiceResponse:
        await self.authenticate(context)
        lease = self.budget.lease()
        try:
            answer = await self._export(requests, lease)
        finally:
            lease.close()
        if isinstance(answer, _Refusal):
            # Aborted here, not where it was decided: the abort's traceback keeps the frames it is
            # raised through alive until the call is cleaned up, and with them the message they
            # hold, which the budget has already let go of (RSS grew 28x the budget so).
            await context.abort(answer.code, answer.message, trailing_metadata=answer.trailers)
        return answer

    async def _export(self, requests: AsyncIterator[bytes], lease: Lease) -> ExportTraceServiceResponse | _Refusal:
        size = 0
        try:
            payload = await self.read(requests, lease)
            if payload is None:  # the client went away, or half-closed without a message
                self.telemetry.rejected(Fault.INVALID.value)
                return _Refusal(grpc.StatusCode.INVALID_ARGUMENT, "no ExportTraceServiceRequest received")
            size = len(payload)
            lease.free(self.read_hold - size)
            decoded = await decode_request(self.pipeline, self.telemetry, lease, payload, False)
            check_fits(decoded, self.pipeline.config.assembly, self.telemetry)
            result = self.pipeline.ingest_decoded(decoded, TRANSPORT)
            del decoded, payload  # the span records are taken: nothing held while the journal syncs
            lease.close()
            await durable(result)
        except Undecodable as exc:
            if exc.fault is Fault.INVALID:
                self.telemetry.invalid(str(exc.__cause__ or exc), bytes=size)
            elif exc.fault is Fault.TOO_LARGE:
                self.telemetry.too_large(exc.message)
            # Not RESOURCE_EXHAUSTED: OTLP exporters retry that code, and this request can never succeed.
            return _Refusal(grpc.StatusCode.INVALID_ARGUMENT, clip(exc.message))
        except Backpressure as exc:
            return _overloaded(exc)
        except TimeoutError:
            self.telemetry.timed_out(self.read_timeout)
            return _not_received(self.read_timeout)
        return response(result)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(TRACE_SERVICE, {
            "Export": grpc.stream_unary_rpc_method_handler(
                self.export, request_deserializer=None,
                response_serializer=ExportTraceServiceResponse.SerializeToString),
        })


class GrpcDiscardService:
    """``MetricsService/Export`` and ``LogsService/Export``: authenticated, read within the memory
    budget as traces are, counted and discarded."""

    def __init__(self, signal: str, traces: GrpcTraceService) -> None:
        self.signal = signal
        self.traces = traces

    async def export(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Message:
        traces = self.traces
        await traces.authenticate(context)
        lease = traces.budget.lease()
        refusal: _Refusal | None = None
        try:
            await traces.read(requests, lease)
        except Backpressure as exc:
            refusal = _overloaded(exc)
        except TimeoutError:
            refusal = _not_received(traces.read_timeout)
        finally:
            lease.close()
        if refusal is not None:
            await context.abort(refusal.code, refusal.message, trailing_metadata=refusal.trailers)
        traces.telemetry.discarded(self.signal)
        return DISCARDED_SIGNALS[self.signal][2]()

    def handler(self) -> grpc.GenericRpcHandler:
        service, _, response_type = DISCARDED_SIGNALS[self.signal]
        return grpc.method_handlers_generic_handler(service, {
            "Export": grpc.stream_unary_rpc_method_handler(self.export, request_deserializer=None,
                                                          response_serializer=response_type.SerializeToString)})
