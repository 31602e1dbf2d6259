"""A very large run (one trace of a quarter million chat spans) through the live collector: its run
document stays bounded, so every reader (GetRun, the run page, watch --replay) still answers it."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time
import urllib.request

import grpc
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult

from collector.api.v1 import fidelity_pb2 as pb
from collector.api.v1.fidelity_pb2_grpc import FidelityServiceStub
from collector.outputs.wire import to_doc
from collector.store import unpack

from conftest import AGENTEVAL, CollectorProcess
from mafshape import Invocation, Scenario, emit, ok, run_id

INVOCATIONS, CALLS = 2_500, 100  # 250,000 chat spans, 2,500 executor and ledger spans, one agent
SHOWN = 100  # store.max_span_ids_per_unit's default
#: Far above what a bounded document of one unit takes, far below what its 250,000 span ids take.
DOC_BOUND = 200_000


class _Batches(SpanProcessor):
    """Exports ended spans in batches of ``size`` with the real OTLP/gRPC exporter, waiting for each
    (the SDK's BatchSpanProcessor drops what overflows its queue, and a test emits faster than it sends)."""

    def __init__(self, endpoint: str, size: int = 5_000) -> None:
        self.exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
        self.size = size
        self.batch: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.batch.append(span)
        if len(self.batch) >= self.size:
            self.force_flush()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        if self.batch:
            assert self.exporter.export(self.batch) is SpanExportResult.SUCCESS
            self.batch = []
        return True

    def shutdown(self) -> None:
        self.force_flush()
        self.exporter.shutdown()


def _send_large_run(endpoint: str) -> str:
    """One workflow run whose one agent made INVOCATIONS x CALLS chat calls; its last invocation's
    finish reason differs (past the comparisons a bounded document keeps). Returns the trace id."""
    invocations = [Invocation([ok(1, 1)] * CALLS) for _ in range(INVOCATIONS - 1)]
    invocations.append(Invocation([ok(1, 1)] * CALLS, reported=(CALLS, CALLS, "length")))
    provider = TracerProvider(resource=Resource.create({"service.name": "large-app"}))
    provider.add_span_processor(_Batches(endpoint))
    trace_id = emit(provider.get_tracer("agent_framework"), Scenario({"writer": invocations}, name="large",
                                                                      sensitive=False))
    provider.shutdown()
    return trace_id


def test_a_quarter_million_span_run_keeps_a_bounded_document_every_reader_answers(tmp_path):
    proc = CollectorProcess(tmp_path, overrides={"assembly": {"max_trace_wait": 600}})
    try:
        trace_id = _send_large_run(proc.grpc)
        doc = proc.run(trace_id, timeout=300)
        rid = run_id(trace_id)
        with sqlite3.connect(proc.store_path) as db:
            (body,), = db.execute("SELECT body FROM runs WHERE run_id = ?", (rid,)).fetchall()
        assert len(body) < len(unpack(body)) < DOC_BOUND  # the document bounded, and stored compressed

        (unit,) = doc["executors"]
        ev = unit["evidence"]
        assert (unit["verdict"], ev["response_turns"], ev["ledger_entries"]) == ("FinishMismatch", INVOCATIONS * CALLS,
                                                                                 INVOCATIONS)
        assert (len(ev["chat_span_ids"]), ev["chat_span_ids_more"]) == (SHOWN, INVOCATIONS * CALLS - SHOWN)
        for key in ("ledger_span_ids", "executor_span_ids", "finish_comparisons"):
            assert (len(ev[key]), ev[f"{key}_more"]) == (SHOWN, INVOCATIONS - SHOWN), key

        with grpc.insecure_channel(proc.grpc) as channel:  # a client with gRPC's default 4 MiB limit
            got = to_doc(FidelityServiceStub(channel).GetRun(pb.GetRunRequest(run_id=rid), timeout=60))
        assert got["executors"][0]["evidence"] == ev

        with urllib.request.urlopen(f"http://{proc.http.removeprefix('http://')}/runs/{rid}", timeout=60) as resp:
            page = resp.read().decode()
        assert len(page) < DOC_BOUND
        assert f"and {INVOCATIONS * CALLS - SHOWN:,} more" in page
        assert f"In an invocation after the first {SHOWN} of {INVOCATIONS:,}, the framework" in page  # it differs

        out = tmp_path / "watch.out"
        with out.open("w") as sink:
            watcher = subprocess.Popen([AGENTEVAL, "watch", "--endpoint", proc.grpc, "--replay", "1", "--json"],
                                       stdout=sink, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not out.read_text().endswith("\n") and watcher.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            watcher.kill()
            _, stderr = watcher.communicate()
        assert json.loads(out.read_text().splitlines()[0])["run_id"] == rid, stderr
    finally:
        proc.stop()
