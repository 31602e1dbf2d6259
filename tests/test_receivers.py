"""The receivers as components (docs/design.md §3): each does nothing when made, opens its transport
in start() and closes it in stop(); the collector starts the ones its config enables, whole or not at
all; a config that enables none is refused. Real servers and clients, real OTLP protobuf."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from collector.config import CollectorConfig, ConfigError, load_config
from collector.live.budget import MemoryBudget
from collector.live.pipeline import Pipeline
from collector.live.receivers import start_all
from collector.live.receivers.grpc_receiver import GrpcTraceReceiver
from collector.live.receivers.http_receiver import HttpTraceReceiver
from collector.live.receivers.kafka_offsets import KafkaOffsets
from collector.live.receivers.kafka_receiver import KafkaTraceReceiver
from collector.live.server import Collector
from collector.security import BearerAuth
from collector.store import open_store

from conftest import free_port

PROTOBUF = "application/x-protobuf"
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
#: Kafka brokers nobody listens on: the consumer is made and polls, and reaches none.
NO_BROKER = ["127.0.0.1:9"]


def _config(tmp_path: Path, **receivers: object) -> CollectorConfig:
    return CollectorConfig(store={"url": str(tmp_path / "runs.db")}, journal={"enabled": False},
                           receivers={"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"endpoint": "127.0.0.1:0"},
                                      **receivers},
                           exporters={"prometheus": {"endpoint": "127.0.0.1:0"}})


@pytest.fixture
def cfg(tmp_path: Path) -> CollectorConfig:
    return _config(tmp_path, kafka={"enabled": True, "brokers": NO_BROKER})


@pytest.fixture
def pipeline(cfg: CollectorConfig, tmp_path: Path) -> Iterator[Pipeline]:
    made = Pipeline(cfg, open_store(tmp_path / "runs.db"), None, None, offsets=KafkaOffsets(4096))
    yield made
    made.close()


def _grpc(cfg: CollectorConfig, pipeline: Pipeline, endpoint: str = "127.0.0.1:0") -> GrpcTraceReceiver:
    return GrpcTraceReceiver(cfg.receivers.grpc.model_copy(update={"endpoint": endpoint}), cfg.receivers.tls,
                             pipeline, BearerAuth(None), MemoryBudget(cfg.receivers.max_inflight_bytes, 1.0))


def _http(cfg: CollectorConfig, pipeline: Pipeline, routes=()) -> HttpTraceReceiver:
    return HttpTraceReceiver(cfg.receivers.http, cfg.receivers.tls, pipeline, BearerAuth(None),
                             MemoryBudget(cfg.receivers.max_inflight_bytes, 1.0), routes)


def _kafka(cfg: CollectorConfig, pipeline: Pipeline) -> KafkaTraceReceiver:
    assert isinstance(pipeline.spanlog, KafkaOffsets)
    return KafkaTraceReceiver(cfg.receivers.kafka, pipeline, pipeline.spanlog)


def _threads() -> int:
    """Threads of this process, native ones included (grpc's, librdkafka's)."""
    return len(os.listdir("/proc/self/task"))


def _free(port: int) -> bool:
    try:
        socket.create_server(("127.0.0.1", port)).close()
    except OSError:
        return False
    return True


def _port(address: str | None) -> int:
    assert address is not None
    return int(address.rsplit(":", 1)[1])


def _request() -> ExportTraceServiceRequest:
    span = Span(trace_id=os.urandom(16), span_id=os.urandom(8), name="chat gpt-4o",
                start_time_unix_nano=1_000_000_000, end_time_unix_nano=2_000_000_000)
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=[span])])])


async def _grpc_export(address: str, payload: bytes) -> ExportTraceServiceResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        export = channel.unary_unary(EXPORT, response_deserializer=ExportTraceServiceResponse.FromString)
        return await export(payload, timeout=5)


def test_a_receiver_made_but_not_started_holds_no_port_thread_or_task(cfg, pipeline):
    """Making a receiver opens nothing (no socket, server, consumer, thread or task); stopping one that
    never started is a no-op."""
    port = free_port()

    async def main() -> None:
        threads, tasks = _threads(), asyncio.all_tasks()
        made = [_grpc(cfg, pipeline, f"127.0.0.1:{port}"), _http(cfg, pipeline), _kafka(cfg, pipeline)]
        assert _threads() == threads and asyncio.all_tasks() == tasks
        assert _free(port)
        for receiver in made:
            await receiver.stop()
        assert _threads() == threads and asyncio.all_tasks() == tasks

    asyncio.run(main())


def test_the_grpc_receiver_serves_exports_on_its_port_until_stopped(cfg, pipeline):
    async def main() -> None:
        receiver = _grpc(cfg, pipeline)
        await receiver.start()
        address = receiver.address
        assert address is not None and _port(address) != 0 and not _free(_port(address))
        answer = await _grpc_export(address, _request().SerializeToString())
        assert answer == ExportTraceServiceResponse()
        await receiver.stop()
        assert _free(_port(address))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _grpc_export(address, _request().SerializeToString())
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_the_http_receiver_serves_exports_and_its_routes_on_its_port_until_stopped(cfg, pipeline):
    async def ping(_: web.Request) -> web.Response:
        return web.Response(text="pong")

    async def main() -> None:
        receiver = _http(cfg, pipeline, [lambda app: app.router.add_get("/ping", ping)])
        await receiver.start()
        assert receiver.address is not None
        url = f"http://{receiver.address}"
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/v1/traces", data=_request().SerializeToString(),
                                    headers={"Content-Type": PROTOBUF}) as resp:
                assert resp.status == 200
                assert ExportTraceServiceResponse.FromString(await resp.read()) == ExportTraceServiceResponse()
            async with session.get(f"{url}/ping") as resp:
                assert (resp.status, await resp.text()) == (200, "pong")
        await receiver.stop()
        assert _free(_port(receiver.address))
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientConnectionError):
                await session.get(f"{url}/ping")

    asyncio.run(main())


def test_the_kafka_receiver_consumes_from_start_until_stopped(cfg, pipeline):
    """The consumer (librdkafka's threads) exists from start() to stop(), a broker reached or not."""
    async def main() -> None:
        receiver = _kafka(cfg, pipeline)
        threads = _threads()
        await receiver.start()
        assert _threads() > threads
        await asyncio.sleep(0.2)  # it polls meanwhile, reaching no broker
        await receiver.stop()
        assert _threads() == threads

    asyncio.run(main())


def test_a_request_that_is_not_otlp_gets_the_same_refusal_from_both_otlp_receivers(cfg, pipeline):
    """One decode error, answered alike: gRPC INVALID_ARGUMENT, HTTP 400, the same message."""
    garbage = b"\x0a\x05\xff\xff\xff\xff\xff"

    async def main() -> tuple[str, str]:
        grpc_receiver, http_receiver = _grpc(cfg, pipeline), _http(cfg, pipeline)
        await start_all([grpc_receiver, http_receiver])
        try:
            assert grpc_receiver.address and http_receiver.address
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _grpc_export(grpc_receiver.address, garbage)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            async with (aiohttp.ClientSession() as session,
                        session.post(f"http://{http_receiver.address}/v1/traces", data=garbage,
                                     headers={"Content-Type": PROTOBUF}) as resp):
                assert resp.status == 400
                status = status_pb2.Status.FromString(await resp.read())
            return refused.value.details() or "", status.message
        finally:
            await grpc_receiver.stop()
            await http_receiver.stop()

    grpc_message, http_message = asyncio.run(main())
    assert grpc_message == http_message and grpc_message.startswith("cannot decode ExportTraceServiceRequest: ")


def test_when_a_receiver_cannot_start_those_started_before_it_are_stopped(cfg, pipeline):
    """The gRPC port is taken: start_all raises the bind error, and the HTTP receiver, started first,
    is stopped again (its port free, nothing answering there)."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        http_receiver = _http(cfg, pipeline)
        grpc_receiver = _grpc(cfg, pipeline, f"127.0.0.1:{taken.getsockname()[1]}")

        async def main() -> None:
            with pytest.raises(RuntimeError, match="Failed to bind"):
                await start_all([http_receiver, grpc_receiver])

        asyncio.run(main())
    assert http_receiver.address is not None and _free(_port(http_receiver.address))
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", _port(http_receiver.address)), timeout=5).close()


def test_a_collector_whose_last_receiver_fails_to_start_closes_the_others_and_raises(tmp_path):
    """The kafka receiver starts last and fails (a client property librdkafka does not know): the
    collector's start raises its error with the HTTP and gRPC ports free again, and stops cleanly."""
    grpc_port, http_port = free_port(), free_port()
    cfg = _config(tmp_path, grpc={"endpoint": f"127.0.0.1:{grpc_port}"},
                  http={"endpoint": f"127.0.0.1:{http_port}", "run_page": False},
                  kafka={"enabled": True, "brokers": NO_BROKER, "client": {"no.such.property": "x"}})

    async def main() -> None:
        collector = Collector(cfg)
        with pytest.raises(Exception, match="No such configuration property"):
            await collector.start()
        assert _free(grpc_port) and _free(http_port)
        assert collector.listening is None and collector.receivers == []
        await collector.stop()

    asyncio.run(main())


def test_a_config_with_no_receiver_enabled_is_refused_by_name(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"receivers": {"grpc": {"enabled": False}, "http": {"enabled": False}}}))
    with pytest.raises(ConfigError, match="receivers: .*no receiver is enabled"):
        load_config(path)
    path.write_text(yaml.safe_dump({"receivers": {"grpc": {"enabled": False}, "http": {"enabled": False},
                                                  "kafka": {"enabled": True}}, "journal": {"enabled": False}}))
    assert load_config(path).receivers.kafka.enabled  # one is enough
