"""Reliability and security: bad input, fuzzing, overload, downstream outage, kill -9, TLS, auth."""

from __future__ import annotations

import asyncio
import datetime
import gzip
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult

from collector.config import CollectorConfig
from collector.core.reconcile import reconcile
from collector.formats.decode import decode_request
from collector.formats.loader import workflow_trace_run
from collector.live.assembler import Assembler, Backpressure
from collector.live.journal import Journal, JournalError
from collector.live.pipeline import IngestResult, Pipeline
from collector.live.store_writer import StoreWriter
from collector.outputs.export_queue import RetryingSpanExporter
from collector.outputs.metrics import Metrics
from collector.store import StoredRun, open_store

from conftest import AGENTEVAL, JSON, PROTOBUF, CaptureReceiver, CollectorProcess, free_port, post
from mafshape import SCENARIOS, export_request, record, run_id
from test_cli import ROOT

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def grpc_raw(target: str, body: bytes):
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(EXPORT)
        try:
            payload = call(body, timeout=10)
            return grpc.StatusCode.OK, ExportTraceServiceResponse.FromString(payload), ()
        except grpc.RpcError as exc:
            return exc.code(), exc.details(), exc.trailing_metadata() or ()


def valid_request() -> tuple[bytes, str]:
    spans, (trace_id,) = record([SCENARIOS["pass"][0]])
    return export_request(spans).SerializeToString(), trace_id


def healthy(collector) -> None:
    """The collector is alive and still reaches verdicts."""
    assert collector.proc.poll() is None
    body, trace_id = valid_request()
    assert grpc_raw(collector.grpc, body)[0] is grpc.StatusCode.OK
    assert collector.run(trace_id)["status"] == "PASS"


def _ld(field: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field, written by hand (the library refuses to build this deep)."""
    size, out = len(payload), bytearray([field << 3 | 2])
    while size > 0x7F:
        out.append(size & 0x7F | 0x80)
        size >>= 7
    out.append(size)
    return bytes(out) + payload


def nested(depth: int) -> bytes:
    """An AnyValue nested ``depth`` kvlists deep, serialized."""
    value = AnyValue(string_value="leaf").SerializeToString()
    for _ in range(depth):
        value = _ld(6, _ld(1, _ld(1, b"k") + _ld(2, value)))  # kvlist_value.values[0] = {k: value}
    return value


def with_bad_ids() -> ExportTraceServiceRequest:
    spans, _ = record([SCENARIOS["pass"][0]])
    request = export_request(spans)
    request.resource_spans[0].scope_spans[0].spans[0].span_id = b"\x01\x02\x03"
    request.resource_spans[0].scope_spans[0].spans[1].trace_id = b"\x01" * 5
    return request


def huge_attribute() -> ExportTraceServiceRequest:
    spans, _ = record([SCENARIOS["pass"][0]])
    request = export_request(spans)
    span = request.resource_spans[0].scope_spans[0].spans[0]
    span.attributes.add(key="executor.id", value=AnyValue(string_value="x" * 1_000_000))
    return request


def deep_nesting() -> bytes:
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = b"\x01" * 16, b"\x02" * 8, "deep"
    attribute = _ld(9, _ld(1, b"executor.id") + _ld(2, nested(5000)))  # Span.attributes
    return _ld(1, _ld(2, _ld(2, span.SerializeToString() + attribute)))


HTTP_CASES = {
    "random_bytes": (lambda: (b"\x8f\x00\xff\x13garbage", PROTOBUF, {}), 400),
    "truncated_protobuf": (lambda: (valid_request()[0][:-7], PROTOBUF, {}), 400),
    "wrong_content_type": (lambda: (valid_request()[0], "text/plain", {}), 415),
    "invalid_json": (lambda: (b'{"resourceSpans": [', JSON, {}), 400),
    "json_wrong_types": (lambda: (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": 7, "kind": "x"}]}]}]}',
                                  JSON, {}), 400),
    "absurd_json_nesting": (lambda: (b"[" * 200_000 + b"]" * 200_000, JSON, {}), 400),
    "absurd_protobuf_nesting": (lambda: (deep_nesting(), PROTOBUF, {}), 200),  # its one span rejected
    "empty_request": (lambda: (b"", PROTOBUF, {}), 200),
    "empty_json_request": (lambda: (b"{}", JSON, {}), 200),
    "bad_gzip": (lambda: (b"not gzip at all", PROTOBUF, {"Content-Encoding": "gzip"}), 400),
    "unknown_encoding": (lambda: (valid_request()[0], PROTOBUF, {"Content-Encoding": "br"}), 400),
    "over_size_limit": (lambda: (b"\x0a" * (5 * 1024 * 1024), PROTOBUF, {}), 413),
    "gzip_bomb": (lambda: (gzip.compress(b"\x00" * (200 * 1024 * 1024)), PROTOBUF, {"Content-Encoding": "gzip"}), 413),
}


@pytest.mark.parametrize("case", HTTP_CASES)
def test_http_bad_input_gets_the_otlp_status_and_a_message(collector, case):
    make, expected = HTTP_CASES[case]
    body, ctype, headers = make()
    status, payload, resp_headers = post(collector.http, body, ctype, headers)
    assert status == expected, payload[:300]
    if status != 200:
        if resp_headers.get("Content-Type", "").startswith(JSON):
            assert json.loads(payload)["message"]
        else:
            from google.rpc import status_pb2
            assert status_pb2.Status.FromString(payload).message
    healthy(collector)


def test_http_invalid_spans_are_rejected_with_reasons_and_the_rest_kept(collector):
    request = with_bad_ids()
    trace_id = request.resource_spans[0].scope_spans[0].spans[2].trace_id.hex()
    series = ("agenteval_spans_rejected_total", (("reason", "invalid_span"), ("transport", "http")))
    before = collector.metrics().get(series, 0)
    status, payload, _ = post(collector.http, request.SerializeToString())
    partial = ExportTraceServiceResponse.FromString(payload).partial_success
    assert status == 200 and partial.rejected_spans == 2
    assert "span_id must be 8" in partial.error_message and "trace_id must be 16" in partial.error_message
    run = collector.run(trace_id)
    assert run["executors"]  # the good spans of the trace were kept and reconciled
    assert collector.metrics()[series] == before + 2  # counted under a reason, as every rejection is


def test_spans_of_a_trace_past_its_late_window_are_rejected_as_late(tmp_path):
    """Not invalid: named in partial_success and counted under reason="late"."""
    proc = CollectorProcess(tmp_path, overrides={"assembly": {"late_window": 0}})
    try:
        spans, (trace_id,) = record([SCENARIOS["pass"][0]])
        assert post(proc.http, export_request(spans[:-1]).SerializeToString())[0] == 200
        proc.run(trace_id)
        status, payload, _ = post(proc.http, export_request(spans[-1:]).SerializeToString())
        partial = ExportTraceServiceResponse.FromString(payload).partial_success
        assert status == 200 and partial.rejected_spans == 1 and "late_window" in partial.error_message
        counted = {labels: v for (name, labels), v in proc.metrics().items()
                   if name == "agenteval_spans_rejected_total" and v}  # (every reason is there at 0 from the start)
        assert counted == {(("reason", "late"), ("transport", "http")): 1}
    finally:
        proc.stop()


def test_spans_of_a_trace_evicted_by_the_late_byte_bound_are_rejected_naming_that_bound(tmp_path):
    """A trace the late window let go for its memory (max_late_bytes), well within late_window: its
    late spans are refused naming that bound, not as finalized longer ago than late_window."""
    proc = CollectorProcess(tmp_path, overrides={"assembly": {"late_window": 300, "max_late_bytes": 1}})
    try:
        spans, (trace_id,) = record([SCENARIOS["pass"][0]])
        assert post(proc.http, export_request(spans[:-1]).SerializeToString())[0] == 200
        proc.run(trace_id)
        status, payload, _ = post(proc.http, export_request(spans[-1:]).SerializeToString())
        partial = ExportTraceServiceResponse.FromString(payload).partial_success
        assert status == 200 and partial.rejected_spans == 1
        assert "assembly.max_late_bytes" in partial.error_message, partial.error_message
        assert "longer ago than" not in partial.error_message
    finally:
        proc.stop()


def test_huge_attribute_values_are_truncated_not_fatal(collector):
    request = huge_attribute()
    status, _, _ = post(collector.http, request.SerializeToString())
    assert status == 200
    trace_id = request.resource_spans[0].scope_spans[0].spans[0].trace_id.hex()
    run = collector.run(trace_id)
    assert all(len(e["executor_id"]) <= 1024 for e in run["executors"])


GRPC_CASES = {
    "random_bytes": (lambda: b"\x8f\x00\xff\x13garbage", grpc.StatusCode.INVALID_ARGUMENT),
    "truncated_protobuf": (lambda: valid_request()[0][:-7], grpc.StatusCode.INVALID_ARGUMENT),
    "absurd_nesting": (deep_nesting, grpc.StatusCode.OK),  # its one span rejected
    "empty_request": (lambda: b"", grpc.StatusCode.OK),
    "over_size_limit": (lambda: b"\x0a" * (5 * 1024 * 1024), grpc.StatusCode.RESOURCE_EXHAUSTED),
}


@pytest.mark.parametrize("case", GRPC_CASES)
def test_grpc_bad_input_gets_the_otlp_status(collector, case):
    make, expected = GRPC_CASES[case]
    code, detail, _ = grpc_raw(collector.grpc, make())
    assert code is expected, detail
    healthy(collector)


def test_grpc_invalid_spans_are_counted_in_partial_success(collector):
    code, response, _ = grpc_raw(collector.grpc, with_bad_ids().SerializeToString())
    assert code is grpc.StatusCode.OK and response.partial_success.rejected_spans == 2
    assert response.partial_success.error_message


def _mutations():
    base = valid_request()[0]
    flips = st.lists(st.tuples(st.integers(0, len(base) - 1), st.integers(0, 255)), min_size=1, max_size=8)
    return st.one_of(
        st.binary(max_size=2048),
        flips.map(lambda fs: bytes(dict(fs).get(i, b) for i, b in enumerate(base))),
        st.integers(0, len(base)).map(lambda n: base[:n]),
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["resourceSpans", "scopeSpans", "spans", "traceId", "spanId", "parentSpanId", "name",
                         "attributes", "key", "value", "stringValue", "intValue", "kind", "links"]),
        children, max_size=5),
    max_leaves=30)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_mutations())
def test_fuzzed_protobuf_never_crashes_either_receiver(collector, body):
    status, _, _ = post(collector.http, body)
    assert status in (200, 400)
    code, _, _ = grpc_raw(collector.grpc, body)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT)
    assert collector.proc.poll() is None


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=json_values)
def test_fuzzed_json_never_crashes_the_http_receiver(collector, doc):
    status, _, _ = post(collector.http, json.dumps(doc).encode(), JSON)
    assert status in (200, 400)
    assert collector.proc.poll() is None


def test_collector_is_healthy_after_fuzzing(collector):
    healthy(collector)


# --- overload -----------------------------------------------------------------------------------

@pytest.fixture
def small(tmp_path):
    proc = CollectorProcess(tmp_path, overrides={"assembly": {
        "max_spans_in_flight": 40, "max_traces_in_flight": 3, "quiet_period": 0.5, "retry_after": 0.2}})
    yield proc
    proc.stop()


def test_over_capacity_is_refused_with_retryable_codes_and_nothing_accepted_is_lost(small):
    requests = []
    for _ in range(6):
        spans, (trace_id,) = record([SCENARIOS["pass"][0]])
        per_trace = len(spans)
        requests.append((export_request(spans).SerializeToString(), trace_id))
    accepted, refused_grpc, refused_http = [], [], []
    for i, (body, trace_id) in enumerate(requests):
        if i % 2:
            status, _, headers = post(small.http, body)
            if status == 503:
                refused_http.append((body, trace_id))
                assert float(headers["Retry-After"]) >= 1
                continue
            assert status == 200
        else:
            code, detail, trailers = grpc_raw(small.grpc, body)
            if code is grpc.StatusCode.UNAVAILABLE:
                from google.rpc import error_details_pb2
                retry = error_details_pb2.RetryInfo.FromString(dict(trailers)["google.rpc.retryinfo-bin"])
                assert retry.retry_delay.ToNanoseconds() > 0 and "max_" in detail
                refused_grpc.append((body, trace_id))
                continue
            assert code is grpc.StatusCode.OK
        accepted.append(trace_id)
    assert refused_grpc and refused_http and len(accepted) == 3
    for trace_id in accepted:  # every accepted span reached its verdict
        assert small.run(trace_id)["status"] == "PASS"
    refused = small.metrics()
    assert sum(v for (name, _), v in refused.items() if name == "agenteval_spans_refused_total") == \
        per_trace * (len(refused_grpc) + len(refused_http))
    # Retried once capacity is free, the real exporters get through.
    for body, trace_id in refused_grpc + refused_http:
        spans = ExportTraceServiceRequest.FromString(body)
        assert grpc_raw(small.grpc, spans.SerializeToString())[0] is grpc.StatusCode.OK
        assert small.run(trace_id)["status"] == "PASS"


def test_the_trace_bound_counts_only_traces_not_yet_open():
    """max_traces_in_flight: a request is refused only for the traces it would open; spans of open
    traces (however many) are accepted, as are as many new traces as there is room for."""
    cfg = CollectorConfig(assembly={"max_traces_in_flight": 3})
    assembler = Assembler(cfg.assembly, cfg.matcher())
    traces = [decode_request(export_request(record([SCENARIOS["pass"][0]])[0]), cfg.matcher()).spans
              for _ in range(4)]
    for spans in traces[:2]:
        assembler.check_capacity(len(spans), [s.trace_id for s in spans])
        assembler.offer(spans[:1])
    ids = [spans[0].trace_id for spans in traces]
    assembler.check_capacity(40, ids[:2] * 20)  # 40 spans of the 2 open traces
    assembler.check_capacity(41, ids[:2] * 20 + ids[2:3])  # and one new: 3 in flight
    with pytest.raises(Backpressure, match="max_traces_in_flight"):
        assembler.check_capacity(2, ids[2:4])  # two new: 4
    assembler.offer(traces[2][:1])
    assembler.check_capacity(60, ids[:3] * 20)
    with pytest.raises(Backpressure, match="max_traces_in_flight"):
        assembler.check_capacity(1, ids[3:4])


def test_real_exporter_retries_through_backpressure(small):
    batches = [record([SCENARIOS["loop"][0]]) for _ in range(5)]
    exporter = GrpcExporter(endpoint=small.grpc, insecure=True, timeout=30)
    for spans, _ in batches:  # beyond capacity: the exporter honours RetryInfo and retries
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    exporter.shutdown()
    for _, (trace_id,) in batches:
        assert small.run(trace_id)["status"] == "PASS"


def test_a_full_journal_refuses_over_both_transports_counting_each_refused_span(tmp_path):
    """Refused for a full journal: retryable on both receivers, every span of the refused request
    counted; a payload that is not a request is still INVALID_ARGUMENT / 400 (never "retry later"),
    and the traces accepted before reach their verdicts."""
    # The first trace stays open (its spans journaled) until the collector drains it on SIGTERM.
    proc = CollectorProcess(tmp_path, overrides={"journal": {"max_bytes": 1000}, "assembly": {"quiet_period": 600}})
    try:
        spans, (first,) = record([SCENARIOS["pass"][0]])
        assert post(proc.http, export_request(spans).SerializeToString())[0] == 200  # journaled: now full
        refused = 0
        for transport in ("http", "grpc"):
            body, _ = valid_request()
            if transport == "http":
                status, _, headers = post(proc.http, body)
                assert status == 503 and float(headers["Retry-After"]) > 0
                assert post(proc.http, b"\xff\xfe not protobuf")[0] == 400
            else:
                code, detail, _ = grpc_raw(proc.grpc, body)
                assert code is grpc.StatusCode.UNAVAILABLE and "journal.max_bytes" in detail
                assert grpc_raw(proc.grpc, b"\xff\xfe not protobuf")[0] is grpc.StatusCode.INVALID_ARGUMENT
            refused += len(ExportTraceServiceRequest.FromString(body).resource_spans[0].scope_spans[0].spans)
            counted = {labels: value for (name, labels), value in proc.metrics().items()
                       if name == "agenteval_spans_refused_total"}
            assert sum(counted.values()) == refused
            assert counted[(("reason", "journal"), ("transport", transport))] > 0
    finally:
        proc.stop()
    assert proc.run(first)["status"] == "PASS"


def test_a_journal_full_of_one_segment_accepts_again_once_its_traces_are_done(tmp_path):
    """The journal counts only what may still be needed: a segment whose traces are all stored frees
    its room even while it is the one being written (a max_bytes below segment_bytes, or one request
    over max_bytes, refused everything after it for good)."""
    proc = CollectorProcess(tmp_path, overrides={"journal": {"max_bytes": 1000}})
    try:
        for _ in range(3):  # each request alone is over max_bytes
            spans, (trace_id,) = record([SCENARIOS["pass"][0]])
            body = export_request(spans).SerializeToString()
            deadline = time.monotonic() + 15
            while (status := post(proc.http, body)[0]) == 503:  # the previous trace's run not yet stored
                assert time.monotonic() < deadline, "still refused after the journaled trace was stored"
                time.sleep(0.1)
            assert status == 200
            assert proc.run(trace_id)["status"] == "PASS"
    finally:
        proc.stop()


@pytest.mark.parametrize("late_window", [300.0, 0.0], ids=["duplicate", "expired"])
def test_spans_of_a_done_trace_beside_new_ones_do_not_keep_the_journal_full(tmp_path, late_window):
    """An exporter retrying a stored trace's spans in a request with new traces (duplicates within
    the late window, expired after it): the journal counted the done trace as still needed in that
    segment, where nothing would ever release it, and refused every request once it was full."""
    now = [0.0]
    cfg = CollectorConfig(store={"url": str(tmp_path / "runs.db")},
                          journal={"path": str(tmp_path / "j"), "max_bytes": 1},  # any needed span fills it
                          assembly={"quiet_period": 1.0, "late_window": late_window})
    pipeline = Pipeline(cfg, open_store(tmp_path / "runs.db"), None, None)
    pipeline.start()
    pipeline.assembler.clock = lambda: now[0]
    done, _ = record([SCENARIOS["pass"][0]])
    fresh, (fresh_id,) = record([SCENARIOS["pass"][0]])

    async def ingest(spans: list) -> None:
        result = pipeline.ingest_decoded(decode_request(export_request(spans), pipeline.matcher), "grpc")
        await result.durable

    def swept_and_released() -> None:
        now[0] += 2.0
        assert pipeline.sweep() == 1
        deadline = time.monotonic() + 10
        while pipeline.journal.full():
            assert time.monotonic() < deadline, "the journal still counts spans of stored traces as needed"
            time.sleep(0.01)

    try:
        asyncio.run(ingest(done))
        swept_and_released()
        asyncio.run(ingest(done[:2] + fresh))  # two spans of the stored trace again, and a new trace
        swept_and_released()
        assert pipeline.writer.store.get_run(run_id(fresh_id))["status"] == "PASS"
    finally:
        pipeline.close()


def test_a_trace_released_before_its_spans_reach_the_disk_is_not_counted_as_needed(tmp_path, monkeypatch):
    """A trace can be done (its runs stored) before the journal's thread has written its last
    request: tracked at that write, after the release, it stayed needed for good."""
    spans = decode_request(export_request(record([SCENARIOS["pass"][0]])[0]), CollectorConfig().matcher()).spans
    trace = spans[0].trace_id
    writing, go = threading.Event(), threading.Event()
    fsync = os.fsync

    def slow_fsync(fd: int) -> None:  # a slow disk: the first group is still being written
        writing.set()
        go.wait(10)
        fsync(fd)

    async def scenario() -> None:
        journal = Journal(tmp_path, 1 << 20, 1)
        journal.start()
        monkeypatch.setattr(os, "fsync", slow_fsync)
        try:
            first = journal.append(spans[:3])
            assert writing.wait(10)
            second = journal.append(spans[3:])  # waits for the next group commit
            journal.release([(trace, journal.mark())])
            go.set()
            await asyncio.gather(first, second)
            assert not journal.full()
            after = journal.append(spans[:1])  # appended after the release: needed again
            await after
            assert journal.full()
        finally:
            go.set()
            journal.close()

    asyncio.run(scenario())


async def _journaled(pipeline: Pipeline, spans: list) -> None:
    await pipeline.journal.append(spans)


def test_admitting_a_request_counts_its_spans_only_to_refuse_it(tmp_path):
    """The span count is for the refusal's metric and log: an admitted request is not walked for it."""
    cfg = CollectorConfig(store={"url": str(tmp_path / "runs.db")},
                          journal={"path": str(tmp_path / "j"), "max_bytes": 1})
    pipeline = Pipeline(cfg, open_store(tmp_path / "runs.db"), None, None)
    pipeline.start()
    counted: list[int] = []

    def count() -> int:
        counted.append(7)
        return 7
    try:
        pipeline.admit(count, "grpc")  # an empty journal is not full
        assert counted == []
        spans = decode_request(export_request(record([SCENARIOS["pass"][0]])[0]), pipeline.matcher).spans
        asyncio.run(_journaled(pipeline, spans))  # one trace not yet done, over max_bytes
        with pytest.raises(Backpressure, match="journal.max_bytes"):
            pipeline.admit(count, "grpc")
        assert counted == [7]
    finally:
        pipeline.close()


# --- downstream outage --------------------------------------------------------------------------

def test_verdict_spans_are_exported_when_the_endpoint_comes_back(tmp_path):
    port = free_port()
    proc = CollectorProcess(tmp_path, otlp_out=f"127.0.0.1:{port}",
                            overrides={"exporters": {"otlp": {"retry_interval": 0.3}}})
    try:
        spans, (trace_id,) = record([SCENARIOS["pass"][0]])
        code, _, _ = grpc_raw(proc.grpc, export_request(spans).SerializeToString())
        assert code is grpc.StatusCode.OK
        assert proc.run(trace_id)["status"] == "PASS"  # stored while the endpoint is down
        healthy(proc)  # and ingest is not blocked
        time.sleep(1.0)
        capture = CaptureReceiver(port)
        try:
            capture.wait_spans(trace_id, "fidelity.run", 1, timeout=30)
        finally:
            capture.server.stop(0)
    finally:
        proc.stop()


class _ClosedUnderneath(GrpcExporter):
    """The SDK's OTLP/gRPC exporter as its shutdown() leaves a call already past its shutdown check
    (the endpoint down, the shutdown timeout up while the call waits out a retry backoff): the
    channel closed, so the call raises ValueError ("Cannot invoke RPC on closed channel!"), seen as
    a traceback in a collector's log. Counts the calls."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint=endpoint, insecure=True)
        self._channel.close()
        self.calls = threading.Semaphore(0)

    def export(self, spans):
        self.calls.release()
        return super().export(spans)


def test_an_export_call_that_raises_costs_the_sender_thread_nothing(monkeypatch):
    died: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    inner = _ClosedUnderneath(f"127.0.0.1:{free_port()}")
    exporter = RetryingSpanExporter(inner, retry_interval=0.05, shutdown_timeout=0.5)
    spans, _ = record([SCENARIOS["pass"][0]])
    try:
        exporter.export(spans)
        assert inner.calls.acquire(timeout=10)
        assert inner.calls.acquire(timeout=10), f"no second try: {[str(d.exc_value) for d in died]}"
    finally:
        exporter.shutdown()
    assert not died


# --- crash and restart --------------------------------------------------------------------------

def test_store_survives_kill_9_mid_write_and_history_is_served_after_restart(tmp_path):
    proc = CollectorProcess(tmp_path, overrides={"assembly": {"quiet_period": 0.05, "sweep_interval": 0.01}})
    bodies = []
    for _ in range(8):
        spans, ids = record([SCENARIOS["pass"][0]] * 25)
        bodies.append(export_request(spans).SerializeToString())
    first = None
    for body in bodies:
        assert grpc_raw(proc.grpc, body)[0] is grpc.StatusCode.OK
        if first is None:
            time.sleep(0.5)
            first = sqlite3.connect(proc.store_path).execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    proc.proc.send_signal(signal.SIGKILL)  # verdicts are being written right now
    proc.stop()
    con = sqlite3.connect(proc.store_path)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    stored = con.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    con.close()
    assert first > 0 and stored >= first
    again = CollectorProcess(tmp_path)
    try:
        listed = subprocess.run([AGENTEVAL, "runs", "list", "--json", "--limit", "1000", "--store",
                                 str(proc.store_path)], capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0 and len(json.loads(listed.stdout)) >= stored
        healthy(again)
    finally:
        again.stop()


# --- security -----------------------------------------------------------------------------------

def _certs(tmp_path):
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(key, cert, stem):
        (tmp_path / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (tmp_path / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("test-ca")).issuer_name(name("test-ca"))
          .public_key(ca_key.public_key()).serial_number(1).not_valid_before(now)
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    write(ca_key, ca, "ca")
    for stem, san in (("server", x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                               x509.DNSName("localhost")])), ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(stem)).issuer_name(ca.subject)
                   .public_key(key.public_key()).serial_number(2 if stem == "server" else 3)
                   .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                                  critical=False))
        if san is not None:
            builder = builder.add_extension(san, critical=False)
        write(key, builder.sign(ca_key, hashes.SHA256()), stem)
    return {k: str(tmp_path / f"{k}") for k in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


def test_mtls_on_both_receivers(tmp_path, monkeypatch):
    import ssl

    # requests lets these variables override the exporter's own CA file (requests issue 3829).
    for var in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        monkeypatch.delenv(var, raising=False)
    c = _certs(tmp_path)
    proc = CollectorProcess(tmp_path, overrides={"receivers": {"tls": {
        "cert_file": c["server.crt"], "key_file": c["server.key"], "client_ca_file": c["ca.crt"]}}})
    try:
        assert proc.http.startswith("https://")
        ca, cert, key = (Path(c[k]).read_bytes() for k in ("ca.crt", "client.crt", "client.key"))
        spans, (trace_id,) = record([SCENARIOS["pass"][0]])
        exporter = GrpcExporter(endpoint=proc.grpc, credentials=grpc.ssl_channel_credentials(ca, key, cert))
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        exporter.shutdown()
        assert proc.run(trace_id)["status"] == "PASS"
        spans, (trace_id,) = record([SCENARIOS["loop"][0]])
        http = HttpExporter(endpoint=f"{proc.http}/v1/traces", certificate_file=c["ca.crt"],
                            client_certificate_file=c["client.crt"], client_key_file=c["client.key"])
        assert http.export(spans) is SpanExportResult.SUCCESS
        assert proc.run(trace_id)["status"] == "PASS"
        # Without a client certificate, or in plain text, nothing gets in.
        no_client = ssl.create_default_context(cafile=c["ca.crt"])
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            post(proc.http, valid_request()[0], context=no_client)
        assert grpc_raw(proc.grpc, valid_request()[0])[0] is grpc.StatusCode.UNAVAILABLE
    finally:
        proc.stop()


def test_bearer_token_auth_on_both_receivers(tmp_path):
    token = "s3cr3t-token-value"
    proc = CollectorProcess(tmp_path, overrides={"receivers": {"auth": {"bearer_token_env": "AGENTEVAL_TOKEN"}}},
                            env={"AGENTEVAL_TOKEN": token})
    try:
        body, trace_id = valid_request()
        status, _, headers = post(proc.http, body)
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
        assert post(proc.http, body, headers={"Authorization": "Bearer wrong"})[0] == 401
        assert grpc_raw(proc.grpc, body)[0] is grpc.StatusCode.UNAUTHENTICATED
        spans, (trace_id,) = record([SCENARIOS["pass"][0]])
        exporter = GrpcExporter(endpoint=proc.grpc, insecure=True, headers={"authorization": f"Bearer {token}"})
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        exporter.shutdown()
        assert proc.run(trace_id)["status"] == "PASS"
        spans, (trace_id,) = record([SCENARIOS["loop"][0]])
        http = HttpExporter(endpoint=f"{proc.http}/v1/traces", headers={"Authorization": f"Bearer {token}"})
        assert http.export(spans) is SpanExportResult.SUCCESS
        assert proc.run(trace_id)["status"] == "PASS"
    finally:
        proc.stop()
    assert token not in proc.stderr_path.read_text()


def test_missing_token_env_is_a_setup_error(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("receivers:\n  auth:\n    bearer_token_env: AGENTEVAL_NOT_SET_ANYWHERE\n")
    proc = subprocess.run([AGENTEVAL, "collector", "serve", "--config", str(cfg), "--store", str(tmp_path / "r.db")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "AGENTEVAL_NOT_SET_ANYWHERE" in proc.stderr


def test_the_store_backlog_is_bounded_by_the_stores_measured_rate(tmp_path):
    """Under sustained load, accepted matches stored: the backlog allowed is what the store writes in
    store.max_queue_seconds at the rate it was measured writing full batches (never under one batch,
    never over store.max_queued_runs)."""
    store = open_store(tmp_path / "runs.db")
    writer = StoreWriter(store, lambda batch: None)
    writer.start()
    try:
        assert writer.queue_limit(2.0, 10_000) == 10_000  # nothing measured yet: only the cap
        verdict = _verdict()
        writer.put([(StoredRun(f"r{i}", "live", verdict), None) for i in range(600)])  # two full batches
        assert writer.flush(30)
        rate = writer.rate
        assert rate is not None and rate > 0
        assert writer.queue_limit(2.0, 10**9) == max(StoreWriter.BATCH, int(rate * 2.0))
        assert writer.queue_limit(2.0, 100) == 100  # the hard cap still wins
        assert writer.queue_limit(1e-9, 10**9) == StoreWriter.BATCH  # at least one batch
        assert len(store.list_runs(limit=1000)) == 600
    finally:
        writer.close()
        store.close()


def _verdict():
    return reconcile(workflow_trace_run(json.loads((ROOT / "examples/pass_all_agree.json").read_text()), "x"))


def _ingest_every_scenario(pipeline: Pipeline, times: int) -> int:
    """Each MAF-shaped scenario ``times`` over, one request each time; returns the traces sent."""
    traces = 0
    for _ in range(times):
        spans, trace_ids = record([scenario for scenario, _, _ in SCENARIOS.values()])
        pipeline.ingest_decoded(decode_request(export_request(spans), pipeline.matcher), "grpc")
        traces += len(set(trace_ids))
    return traces


def test_a_failure_after_a_batch_is_written_does_not_write_it_again(tmp_path):
    """on_stored raising once (say the journal's disk) used to send the written batch back through
    the run-by-run path: every run written twice and reported stored twice."""
    store = open_store(tmp_path / "runs.db")
    reported: list[list[str]] = []

    def on_stored(batch):
        reported.append([run.run_id for run, _ in batch])
        if len(reported) == 1:
            raise OSError("journal disk full")

    writer = StoreWriter(store, on_stored)
    writer.start()
    try:
        verdict = _verdict()
        writer.put([(StoredRun(f"r{i}", "live", verdict), None) for i in range(5)])
        writer.put([(StoredRun("r5", "live", verdict), None)])
        writer.close()
        assert sorted(run_id for batch in reported for run_id in batch) == [f"r{i}" for i in range(6)]
        assert sorted(r["revision"] for r in store.list_runs(limit=100)) == [1] * 6
    finally:
        writer.close()
        store.close()


@pytest.mark.parametrize("batch", [StoreWriter.BATCH, 10])
def test_a_sweeps_verdicts_reach_the_store_in_one_transaction_a_batch(tmp_path, monkeypatch, batch):
    """Handed over one by one, the writer woke for the first verdict of a sweep and wrote batches of
    one or two, paying a transaction (and its index pages) per run. A sweep longer than a batch
    hands each batch over as it fills, so the writer is not idle meanwhile."""
    monkeypatch.setattr(StoreWriter, "BATCH", batch)
    store = open_store(tmp_path / "runs.db")
    batches: list[int] = []
    save_many = store.save_many
    store.save_many = lambda runs: batches.append(len(runs := list(runs))) or save_many(runs)
    cfg = CollectorConfig(assembly={"quiet_period": 3600}, journal={"enabled": False})
    pipeline = Pipeline(cfg, store, None, None)
    pipeline.start()
    try:
        traces = _ingest_every_scenario(pipeline, 6)
        runs = pipeline.sweep(force=True)
        pipeline.writer.close()
        assert runs >= traces > 30
        assert batches == [batch] * (runs // batch) + ([runs % batch] if runs % batch else [])
        assert len(store.list_runs(limit=1000)) == runs
    finally:
        pipeline.close()
        store.close()


def test_the_writer_queues_each_runs_document_and_columns_not_its_verdict(tmp_path):
    """A run waiting for the store writer holds its packed document and its columns (a few KB), not
    its verdict's objects (units, evidence, chat calls: freed as the sweep ends); what the writer
    stores from them is what the verdict itself gives."""
    store, twin = open_store(tmp_path / "runs.db"), open_store(tmp_path / "twin.db")
    cfg = CollectorConfig(assembly={"quiet_period": 3600}, journal={"enabled": False})
    pipeline = Pipeline(cfg, store, None, None)
    pipeline.start()
    queued: list[StoredRun] = []
    published: list[StoredRun] = []
    put, publish = pipeline.writer.put, pipeline._publish
    pipeline.writer.put = lambda runs: queued.extend(run for run, _ in runs) or put(runs)
    pipeline._publish = lambda item: published.append(run := publish(item)) or run
    try:
        traces = _ingest_every_scenario(pipeline, 2)
        runs = pipeline.sweep(force=True)
        pipeline.writer.close()
        assert len(queued) == runs >= traces > 10
        assert all(run.verdict is None and run.body and run.columns for run in queued)
        twin.save_many([StoredRun(run.run_id, run.source, run.verdict, run.finalized_by) for run in published])

        def timeless(row):  # when each store wrote it
            return {k: v for k, v in row.items() if k not in ("created_at", "updated_at")}

        assert [timeless(r) for r in store.list_runs(limit=1000)] == [timeless(r) for r in twin.list_runs(limit=1000)]
        assert len(store.list_runs(limit=1000)) == runs
        assert all(timeless(store.get_run(run.run_id)) == timeless(twin.get_run(run.run_id)) for run in published)
    finally:
        pipeline.close()
        store.close()
        twin.close()


def test_a_sweep_whose_metrics_fail_still_stores_each_run_once(tmp_path, monkeypatch):
    """The metrics raising (after each full batch of a sweep, and at its end) costs no run its store
    write nor the sweep its rest, and queues none twice (it would be reported stored twice, letting
    the journal go early)."""
    monkeypatch.setattr(StoreWriter, "BATCH", 10)
    cfg = CollectorConfig(assembly={"quiet_period": 3600}, journal={"enabled": False},
                          exporters={"prometheus": {"endpoint": "127.0.0.1:0"}})
    store = open_store(tmp_path / "runs.db")
    metrics = Metrics(cfg, Resource.create({}), lambda: {})
    pipeline = Pipeline(cfg, store, metrics, None)
    pipeline.start()
    stored: list[str] = []
    on_stored = pipeline.writer._on_stored
    pipeline.writer._on_stored = lambda batch: stored.extend(run.run_id for run, _ in batch) or on_stored(batch)

    def broken(runs):
        raise RuntimeError("metrics backend gone")

    metrics.record_runs = broken
    try:
        traces = _ingest_every_scenario(pipeline, 3)
        runs = pipeline.sweep(force=True)
        pipeline.writer.close()
        assert len(stored) == len(set(stored)) == runs >= traces > 10
        assert len(store.list_runs(limit=1000)) == len(stored)
    finally:
        pipeline.close()
        metrics.shutdown()
        store.close()


def test_a_late_span_stays_journaled_until_its_own_revision_is_stored(tmp_path):
    """Revision 1 of a trace stored after a late span re-opened it: the journal let go of the whole
    trace, the late span's segment too, so a kill -9 before revision 2 was stored lost an
    acknowledged span (review)."""
    held = _HeldStore(tmp_path, late_window=300)  # revision 1's write is slow
    spans, (trace_id,) = record([SCENARIOS["pass"][0]])
    late = next(s for s in spans if s.name.startswith("chat"))
    late_id = format(late.context.span_id, "016x")
    other, _ = record([SCENARIOS["pass"][0]])

    def ingest(batch: list) -> None:
        held.ingest(decode_request(export_request(batch), held.pipeline.matcher))

    def stored(revision: int) -> None:
        deadline = time.monotonic() + 10
        while (held.store.get_run(run_id(trace_id)) or {}).get("revision") != revision:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)  # and the journal told

    try:
        ingest([s for s in spans if s is not late])
        assert held.sweep() == 1  # revision 1, on its way to the store
        ingest([late])  # acknowledged: it re-opens the trace
        held.held.set()
        stored(1)
        ingest(other)  # the late span's segment is no longer the one written
        assert held.journaled(late_id)
        assert held.sweep() == 2
        stored(2)
        assert not held.journaled(late_id)  # its own revision stored: now it may go
    finally:
        held.close()


def _fsync_fails_once(monkeypatch: pytest.MonkeyPatch, error: OSError) -> None:
    """The disk refuses the next fsync (the journal's group commit), then recovers."""
    fsync, failing = os.fsync, [True]

    def flaky(fd: int) -> None:
        if failing[0]:
            failing[0] = False
            raise error
        fsync(fd)

    monkeypatch.setattr(os, "fsync", flaky)


def test_an_exporters_retry_after_a_failed_journal_write_is_journaled(tmp_path, monkeypatch):
    """The write failed (the client was told so) but the spans were taken: the failed write was cut off
    the segment, and the retry, every span of it a duplicate in memory, is journaled whole (its spans
    must survive a kill -9), once."""
    cfg = CollectorConfig(store={"url": str(tmp_path / "runs.db")}, journal={"path": str(tmp_path / "j")},
                          assembly={"quiet_period": 3600})
    pipeline = Pipeline(cfg, open_store(tmp_path / "runs.db"), None, None)
    pipeline.start()
    spans, _ = record([SCENARIOS["pass"][0]])

    async def export() -> IngestResult:
        result = pipeline.ingest_decoded(decode_request(export_request(spans), pipeline.matcher), "grpc")
        if result.durable is not None:
            await result.durable
        return result

    _fsync_fails_once(monkeypatch, OSError(5, "Input/output error"))
    try:
        with pytest.raises(JournalError, match="Input/output error"):
            asyncio.run(export())
        assert pipeline.journal.size == 0  # what the failed write left was cut off
        retried = asyncio.run(export())  # every span a duplicate now
        once = pipeline.journal.size
        assert retried.durable is not None and once > 0
        asyncio.run(export())  # acknowledged once more: journaled again (it may be a retry of a lost answer)
        assert pipeline.journal.size == 2 * once
    finally:
        pipeline.close()


class _HeldStore:
    """A pipeline with a journal whose store writes wait (a database outage) until ``resume``."""

    def __init__(self, tmp_path, **assembly) -> None:
        self.now = [0.0]
        cfg = CollectorConfig(store={"url": str(tmp_path / "runs.db")},
                              journal={"path": str(tmp_path / "j"), "segment_bytes": 1},  # a segment per request
                              assembly={"quiet_period": 1.0, **assembly})
        self.dir = tmp_path / "j"
        self.pipeline = Pipeline(cfg, open_store(tmp_path / "runs.db"), None, None)
        self.pipeline.start()
        self.pipeline.assembler.clock = lambda: self.now[0]
        self.store = self.pipeline.writer.store
        self.held, save_many = threading.Event(), self.store.save_many
        self.store.save_many = lambda runs: (self.held.wait(30), save_many(runs))[1]

    def ingest(self, decoded) -> None:
        async def go() -> None:
            await self.pipeline.ingest_decoded(decoded, "grpc").durable
        asyncio.run(go())

    def sweep(self) -> int:
        self.now[0] += 2.0
        return self.pipeline.sweep()

    def journaled(self, trace_id: str) -> bool:
        for path in self.dir.glob("*.jsonl"):
            try:
                if trace_id in path.read_text():
                    return True
            except FileNotFoundError:  # let go between the listing and the read
                continue
        return False

    def close(self) -> None:
        self.held.set()
        self.pipeline.close()


def test_a_late_span_that_changes_no_run_does_not_release_a_revision_still_unstored(tmp_path):
    """Revision 1 queued in a database outage; a late span re-opens the trace and changes no run:
    settled again with no run, the trace was let go at once, its unstored revision's spans too."""
    import dataclasses

    from collector.core.facts import span_facts
    from collector.formats.decode import Decoded
    held = _HeldStore(tmp_path, late_window=300)
    spans, (trace_id,) = record([SCENARIOS["pass"][0]])
    try:
        decoded = decode_request(export_request(spans), held.pipeline.matcher)
        held.ingest(decoded)
        assert held.sweep() == 1  # revision 1, waiting for the store
        workflow = next(s for s in decoded.spans if s.name.startswith("workflow"))
        late = dataclasses.replace(workflow, span_id=b"\x77" * 8, parent_id=workflow.span_id, name="message.send",
                                   facts=span_facts(held.pipeline.matcher, "message.send", {}))
        held.ingest(Decoded(spans=[late]))
        held.ingest(decode_request(export_request(record([SCENARIOS["pass"][0]])[0]), held.pipeline.matcher))
        assert held.sweep() == 1  # the other trace; the late span changed nothing
        assert held.store.get_run(run_id(trace_id)) is None and held.journaled(trace_id)
    finally:
        held.close()


def test_a_retry_after_a_failed_write_of_a_trace_finalized_meanwhile_stays_journaled(tmp_path, monkeypatch):
    """The only copy on disk of spans whose write failed: the retry, all duplicates of a trace
    finalized from memory whose run is not yet stored. It was written but not waited for."""
    held = _HeldStore(tmp_path, late_window=300)
    spans, (trace_id,) = record([SCENARIOS["pass"][0]])
    _fsync_fails_once(monkeypatch, OSError(28, "No space left on device"))
    try:
        with pytest.raises(JournalError):
            held.ingest(decode_request(export_request(spans), held.pipeline.matcher))
        (failed,) = held.dir.glob("*.jsonl")
        failed.write_bytes(b"")  # the failed write never reached the disk
        assert held.sweep() == 1  # finalized from memory; its run waits for the store
        held.ingest(decode_request(export_request(spans), held.pipeline.matcher))  # the exporter's retry
        held.ingest(decode_request(export_request(record([SCENARIOS["pass"][0]])[0]), held.pipeline.matcher))
        assert held.journaled(trace_id)
        held.held.set()
        deadline = time.monotonic() + 10
        while held.journaled(trace_id):  # stored: now it goes
            assert time.monotonic() < deadline, "the retry stays journaled after its run is stored"
            time.sleep(0.05)
    finally:
        held.close()


def test_without_a_late_window_a_trace_with_orphans_is_finalized_whole_and_let_go(tmp_path):
    """late_window: 0 and spans still waiting for a parent at finalization: nothing would ever
    finalize them, so the trace was never settled and its journal segment stayed needed for good."""
    import dataclasses

    from collector.core.facts import span_facts
    from collector.formats.decode import Decoded
    held = _HeldStore(tmp_path, late_window=0)
    held.pipeline.journal.max_bytes = 1  # full while any span is still needed
    spans, _ = record([SCENARIOS["pass"][0]])
    try:
        decoded = decode_request(export_request(spans), held.pipeline.matcher)
        workflow = next(s for s in decoded.spans if s.name.startswith("workflow"))
        workflow.parent_id = b"\x66" * 8  # a caller's span around the run, not exported
        beside = dataclasses.replace(workflow, span_id=b"\x67" * 8, name="message.send",  # waits for it
                                     facts=span_facts(held.pipeline.matcher, "message.send", {}))
        held.ingest(Decoded(spans=decoded.spans + [beside]))
        held.held.set()
        assert held.sweep() == 1
        deadline = time.monotonic() + 10
        while held.pipeline.journal.full():
            assert time.monotonic() < deadline, "the trace's spans are still needed after its run was stored"
            time.sleep(0.05)
    finally:
        held.close()


GC_POLICY = """
import gc, weakref
from collector.live.server import _tune_gc, full_collection

_tune_gc()
before = [g["collections"] for g in gc.get_stats()]
kept = [[i] for i in range(300_000)]  # state that outlives many young collections (traces, the late window)
young, middle, oldest = (g["collections"] - b for g, b in zip(gc.get_stats(), before))
assert young > 5, young
# the middle and oldest generations are never collected on their own: their pauses walked what the
# young collections had kept (a gen-1 collection paused verdicts ~200-250 ms under bench/latency.py)
assert middle == 0 and oldest == 0, (middle, oldest)
assert gc.get_freeze_count() >= 300_000  # the survivors of young collections are out of later ones


class Node:
    pass


node = Node()
node.self = node  # a reference cycle, alive while young collections freeze it
gone = weakref.ref(node)
kept += [[i] for i in range(50_000)]
del node
kept += [[i] for i in range(50_000)]
assert gone() is not None  # garbage now, frozen: the periodic full collection frees it
full_collection()
assert gone() is None
assert gc.get_freeze_count() >= 400_000  # frozen again after the full collection
print("ok")
"""


def test_the_live_collector_pauses_only_for_young_collections_and_frees_old_cycles_periodically():
    """The live collector's garbage collection (collector/live/server.py ``_tune_gc``), in a process of
    its own: CPython collects only the young generation by itself, each collection's survivors are
    frozen out of the later ones, and the sweeper's periodic full collection still frees a reference
    cycle that became garbage after it was frozen."""
    out = subprocess.run([sys.executable, "-c", GC_POLICY], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
