"""``agenteval.fidelity.v1.FidelityService`` (docs/design.md §4) on the collector's gRPC port.

Store reads run on a worker thread so a slow disk never stalls OTLP ingest on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

import grpc
import structlog
from google.protobuf.message import DecodeError, Message

from collector.api.v1 import fidelity_pb2 as pb
from collector.outputs.stream import RunFilter, VerdictHub, WatcherClosed, WatcherLagged
from collector.outputs.wire import run_message, status_name
from collector.security import BearerAuth, grpc_authorization
from collector.store import UNREADABLE, RunStore, StoreError

log = structlog.get_logger("agenteval.collector")

MAX_LIST = 1000
SERVICE = pb.DESCRIPTOR.services_by_name["FidelityService"].full_name

T = TypeVar("T")
M = TypeVar("M", bound=Message)


def _filter(subject: str | None, statuses: Iterable[int]) -> RunFilter:
    return RunFilter(subject or None, frozenset(name for s in statuses if (name := status_name(s)) is not None))


class FidelityService:
    def __init__(self, store: RunStore, hub: VerdictHub, auth: BearerAuth) -> None:
        self.store = store
        self.hub = hub
        self.auth = auth

    def handler(self) -> grpc.GenericRpcHandler:
        """The service, its requests parsed here rather than by gRPC, whose own parsing answered
        bytes that are not a request with UNKNOWN ("Unexpected DecodeError")."""
        def unary(method: Callable, request: type[Message], response: type[Message]) -> grpc.RpcMethodHandler:
            async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Message:
                return await method(await self._request(raw, request, context), context)
            return grpc.unary_unary_rpc_method_handler(call, response_serializer=response.SerializeToString)

        async def watch(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.RunVerdict]:
            async for message in self.watch_verdicts(await self._request(raw, pb.WatchRequest, context), context):
                yield message

        return grpc.method_handlers_generic_handler(SERVICE, {
            "WatchVerdicts": grpc.unary_stream_rpc_method_handler(
                watch, response_serializer=pb.RunVerdict.SerializeToString),
            "GetRun": unary(self.get_run, pb.GetRunRequest, pb.RunVerdict),
            "ListRuns": unary(self.list_runs, pb.ListRunsRequest, pb.ListRunsResponse),
        })

    async def _request(self, raw: bytes, request: type[M], context: grpc.aio.ServicerContext) -> M:
        """The caller authorized (first, so a client without the token learns nothing more), then
        its request parsed: bytes that are not one are INVALID_ARGUMENT."""
        if not self.auth.allows(grpc_authorization(context)):
            log.warning("request_unauthenticated", transport="grpc", service="FidelityService")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
        try:
            return request.FromString(raw)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request is not an {request.DESCRIPTOR.full_name}: {exc}")
            raise  # abort raises; this tells type checkers so

    async def _read(self, context: grpc.aio.ServicerContext, read: Callable[..., T], *args: Any) -> T:
        """A store read on a worker thread; a store that cannot answer is UNAVAILABLE (retryable)."""
        try:
            return await asyncio.to_thread(read, *args)
        except StoreError as exc:
            log.warning("store_read_failed", transport="grpc", error=str(exc))
            await context.abort(grpc.StatusCode.UNAVAILABLE, UNREADABLE)
            raise  # abort raises; this tells type checkers so

    async def _recent(self, context: grpc.aio.ServicerContext, run_filter: RunFilter, limit: int,
                      with_docs: bool) -> list[dict]:
        return await self._read(context, self.store.list_runs, run_filter.statuses, run_filter.subject,
                                limit, with_docs)

    async def watch_verdicts(self, request: pb.WatchRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[pb.RunVerdict]:
        run_filter = _filter(request.subject if request.HasField("subject") else None, request.statuses)
        watcher = self.hub.subscribe(run_filter)
        if watcher is None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.hub.max_watchers} watchers already attached (stream.max_watchers)")
        try:
            replayed: set[tuple[str, int]] = set()
            if request.replay:
                for doc in reversed(await self._recent(context, run_filter, min(request.replay, MAX_LIST), True)):
                    replayed.add((doc["run_id"], doc["revision"]))
                    message = run_message(doc)
                    message.replayed = True
                    yield message
            while True:
                doc = await watcher.next()
                if (doc["run_id"], doc["revision"]) not in replayed:
                    yield run_message(doc)
        except WatcherClosed:
            return
        except WatcherLagged:
            log.warning("watcher_lagged", buffer=self.hub.buffer)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"watcher fell {self.hub.buffer} runs behind; reconnect (with replay) to resume")
        finally:
            self.hub.unsubscribe(watcher)

    async def get_run(self, request: pb.GetRunRequest,
                      context: grpc.aio.ServicerContext) -> pb.RunVerdict:
        if not request.run_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "run_id is required")
        doc = await self._read(context, self.store.get_run, request.run_id)
        if doc is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                await self._read(context, self.store.missing_run, request.run_id, True))
        return run_message(doc)

    async def list_runs(self, request: pb.ListRunsRequest,
                        context: grpc.aio.ServicerContext) -> pb.ListRunsResponse:
        run_filter = _filter(request.subject if request.HasField("subject") else None, request.statuses)
        rows = await self._recent(context, run_filter, min(request.limit or 50, MAX_LIST), request.include_executors)
        return pb.ListRunsResponse(runs=[run_message(r, request.include_executors) for r in rows])

