"""``agenteval demo``: real MAF workflows -> OTLP -> a running collector -> what it concluded.

The verdicts are read back from that collector over its gRPC API (``FidelityService.GetRun``), so the
demo works whatever store the collector uses. Importing this module needs the ``[maf]`` extra
(agent-framework-core) and the MAF fidelity instrumentation: the CLI turns the ImportError into advice.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import grpc
from agent_framework.observability import enable_instrumentation
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.instrumentation.maf_fidelity import MafFidelityInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from collector.api.v1 import fidelity_pb2 as pb
from collector.api.v1.fidelity_pb2_grpc import FidelityServiceStub
from collector.bridge import FidelityBridge
from collector.config import split_endpoint
from collector.demo.maf_fakes import DemoWorkflow, demo_workflows
from collector.outputs.wire import to_doc
from collector.ui.watch import WatchTarget

#: Seconds the collector has to answer the demo's first check, and each later call.
PROBE_TIMEOUT = 2.0
#: Seconds the OTLP exporter may spend on one batch (retries included).
EXPORT_TIMEOUT = 10.0
#: Loggers whose records (exporter retries, export failures) are kept off the terminal during the demo.
QUIET_LOGGERS = ("opentelemetry.exporter", "opentelemetry.sdk")
#: A run id no collector stores: ``GetRun`` answers NOT_FOUND when the API is served and the token is accepted.
PROBE_RUN_ID = "agenteval-demo-probe"
#: API errors that waiting cannot fix, and what to do ({token_env}: the token's variable).
FATAL_CODES = {grpc.StatusCode.UNAUTHENTICATED: "the collector wants its bearer token in ${token_env} "
                                                "(or name another variable with --token-env)",
               grpc.StatusCode.UNIMPLEMENTED: "no agenteval FidelityService on this port (an OpenTelemetry "
                                              "Collector in front?): pass --api with an agenteval collector's "
                                              "gRPC port"}


class DemoError(Exception):
    """The demo cannot go on: the message says what to do."""


@dataclass(frozen=True)
class DemoTarget:
    """Where the demo sends spans (OTLP) and where it reads the verdicts back (the collector's gRPC API)."""

    endpoint: str  #: grpc: host:port; http/protobuf: http(s)://host:port
    protocol: str  #: "grpc" or "http/protobuf"
    api: str  #: host:port of the collector's gRPC port (FidelityService)
    token: str | None = None
    ca_file: str | None = None
    token_env: str = "AGENTEVAL_TOKEN"

    @property
    def address(self) -> tuple[str, int]:
        """The OTLP endpoint's (host, port)."""
        if self.protocol == "grpc":
            return split_endpoint(self.endpoint)
        url = urlsplit(self.endpoint)
        return url.hostname or "", url.port or (443 if url.scheme == "https" else 80)

    def api_client(self) -> WatchTarget:
        """The API connection, set up the way ``agenteval watch`` connects."""
        return WatchTarget(self.api, token=self.token, ca_file=self.ca_file)

    def exporter(self) -> SpanExporter:
        """The OTLP span exporter for the endpoint, with the CA bundle and bearer token if given."""
        if self.protocol == "grpc":
            credentials = None
            if self.ca_file is not None:
                with open(self.ca_file, "rb") as fh:
                    credentials = grpc.ssl_channel_credentials(fh.read())
            return GrpcSpanExporter(endpoint=self.endpoint, insecure=credentials is None, credentials=credentials,
                                    headers={"authorization": f"Bearer {self.token}"} if self.token else None,
                                    timeout=EXPORT_TIMEOUT)
        return HttpSpanExporter(endpoint=self.endpoint.rstrip("/") + "/v1/traces", certificate_file=self.ca_file,
                                headers={"Authorization": f"Bearer {self.token}"} if self.token else None,
                                timeout=EXPORT_TIMEOUT)


@dataclass
class DemoResult:
    name: str
    about: str
    trace_id: str
    expected: str
    run: dict[str, Any] | None

    @property
    def ok(self) -> bool:
        return self.run is not None and self.run["status"] == self.expected


class _Kept(logging.Handler):
    """Keeps log records instead of printing them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def quiet_exporters() -> Iterator[list[str]]:
    """Keep the OpenTelemetry exporter's retry and failure logs off the terminal; yields their messages."""
    kept = _Kept()
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    saved = [lg.propagate for lg in loggers]
    for lg in loggers:
        lg.addHandler(kept)
        lg.propagate = False
    try:
        yield kept.messages
    finally:
        for lg, propagate in zip(loggers, saved, strict=True):
            lg.removeHandler(kept)
            lg.propagate = propagate


def _api_error(target: DemoTarget, exc: grpc.RpcError) -> DemoError | None:
    """The :class:`DemoError` for an API error that waiting cannot fix, else None."""
    advice = FATAL_CODES.get(exc.code())
    if advice is None:
        return None
    return DemoError(f"{target.api}: {exc.code().name}: {exc.details()}: {advice.format(token_env=target.token_env)}")


def probe(target: DemoTarget) -> None:
    """Raise :class:`DemoError` naming the endpoint unless the collector answers within PROBE_TIMEOUT:
    the OTLP port accepts a connection, and the API answers ``GetRun``."""
    try:
        with socket.create_connection(target.address, timeout=PROBE_TIMEOUT):
            pass
    except OSError as exc:
        raise DemoError(f"no collector at {target.endpoint} ({target.protocol}): {exc.strerror or exc}: start one "
                        f"with `agenteval collector serve` (or pass --endpoint)") from None
    client = target.api_client()
    with client.channel() as channel:
        try:
            FidelityServiceStub(channel).GetRun(pb.GetRunRequest(run_id=PROBE_RUN_ID), timeout=PROBE_TIMEOUT,
                                                metadata=client.metadata())
        except grpc.RpcError as exc:
            if fatal := _api_error(target, exc):
                raise fatal from None
            if exc.code() is not grpc.StatusCode.NOT_FOUND:
                raise DemoError(f"no collector API at {target.api} (gRPC): {exc.code().name}: {exc.details()}: if "
                                "that is the collector's HTTP port, give its gRPC port (receivers.grpc.endpoint, "
                                "default 4317); else start one with `agenteval collector serve` (or pass --api with "
                                "its gRPC port)") from None


def install_exporter(target: DemoTarget) -> TracerProvider:
    """A global TracerProvider exporting to the collector (MAF instruments the global provider)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "agenteval-demo"}))
    provider.add_span_processor(BatchSpanProcessor(target.exporter()))
    trace.set_tracer_provider(provider)
    enable_instrumentation(enable_sensitive_data=True)  # prompts go out; the collector must drop them
    MafFidelityInstrumentor().instrument()  # the framework's ledger: every agent response
    return provider


async def run_workflows() -> list[tuple[DemoWorkflow, str]]:
    """Run every demo workflow through the bridge; returns (workflow spec, trace id) pairs."""
    bridge = FidelityBridge()
    out = []
    for spec in demo_workflows():
        await bridge.run(spec.build(), "Write a short report.")
        out.append((spec, bridge.last_trace_id))
    return out


def wait_for_runs(target: DemoTarget, trace_ids: list[str], timeout: float) -> tuple[dict[str, dict[str, Any]], str]:
    """Poll ``GetRun`` (a trace id is a unique prefix of its run id) until every trace has a run or
    ``timeout`` passes; returns the runs found and the last transport error, if any."""
    found: dict[str, dict[str, Any]] = {}
    last_error = ""
    deadline = time.monotonic() + timeout
    client = target.api_client()
    with client.channel() as channel:
        stub = FidelityServiceStub(channel)
        while len(found) < len(trace_ids) and time.monotonic() < deadline:
            for tid in (t for t in trace_ids if t not in found):
                try:
                    found[tid] = to_doc(stub.GetRun(pb.GetRunRequest(run_id=tid), timeout=PROBE_TIMEOUT,
                                                    metadata=client.metadata()))
                except grpc.RpcError as exc:
                    if fatal := _api_error(target, exc):
                        raise fatal from None
                    if exc.code() is not grpc.StatusCode.NOT_FOUND:
                        last_error = f"{target.api}: {exc.code().name}: {exc.details()}"
            if len(found) < len(trace_ids):
                time.sleep(0.2)
    return found, last_error


def demo(target: DemoTarget, timeout: float) -> tuple[list[DemoResult], str]:
    """Probe the collector, run the workflows, read their verdicts back; returns the results and, when
    some verdict is missing, what went wrong on the way (an export or API error), else ""."""
    with quiet_exporters() as exporter_errors:
        probe(target)
        provider = install_exporter(target)
        try:
            ran = asyncio.run(run_workflows())
            provider.force_flush(int(EXPORT_TIMEOUT * 1000))
            runs, api_error = wait_for_runs(target, [tid for _, tid in ran], timeout)
        finally:
            provider.shutdown()  # while the exporter's logs are still kept off the terminal
    results = [DemoResult(spec.name, spec.about, tid, spec.status, runs.get(tid)) for spec, tid in ran]
    problem = exporter_errors[-1] if exporter_errors else api_error
    return results, problem if len(runs) < len(ran) else ""
