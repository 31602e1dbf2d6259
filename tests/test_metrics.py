"""The collector's own histograms (recorded without the SDK's per-record cost) read the same as the
OpenTelemetry SDK's would, on the Prometheus scrape and on the OTLP push, cumulative and delta."""

from __future__ import annotations

import time

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from collector.config import CollectorConfig
from collector.outputs.metrics import DELTA_BUCKETS, LATENCY_BUCKETS, SCORE_BUCKETS, Metrics

from conftest import CaptureReceiver

#: Values on, between, below and above the bounds, per label value (a negative one is dropped).
VALUES = {"under": [0, 1, 1, 9, 10, 11, 340, 50_000, 50_001, 10**9], "over": [5, 500, -5], "equal": [0]}
SCORES = [0.0, 0.25, 0.5, 0.75, 0.76, 0.99, 1.0, 1.0]
LATENCIES = [0.001, 0.005, 0.2, 0.25, 31.0]


def _samples(registry: CollectorRegistry, prefix: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(generate_latest(registry).decode())
            for s in f.samples if s.name.startswith(prefix)}


def _sdk(readers: list) -> tuple[MeterProvider, dict]:
    """The SDK's own histograms, as the collector configured them before it kept its own."""
    views = [View(instrument_name="agenteval.run.score",
                  aggregation=ExplicitBucketHistogramAggregation(SCORE_BUCKETS)),
             View(instrument_name="agenteval.token.delta",
                  aggregation=ExplicitBucketHistogramAggregation(DELTA_BUCKETS)),
             View(instrument_name="agenteval.verdict.latency",
                  aggregation=ExplicitBucketHistogramAggregation(LATENCY_BUCKETS))]
    provider = MeterProvider(metric_readers=readers, views=views)
    meter = provider.get_meter("agenteval.collector")
    return provider, {"score": meter.create_histogram("agenteval.run.score",
                                                      description="Run score (PENDING runs have none)"),
                      "delta": meter.create_histogram("agenteval.token.delta", unit="{token}",
                                                      description="Absolute framework-vs-truth token delta per "
                                                                  "checked executor"),
                      "latency": meter.create_histogram("agenteval.verdict.latency", unit="s",
                                                        description="A run's arrival (its trace's root span, or the "
                                                                    "spans re-opening a finalized trace: a later "
                                                                    "human-in-the-loop turn) to its first stored "
                                                                    "verdict")}


def _record(ours: Metrics | None, sdk: dict | None, scale: int = 1) -> None:
    for direction, values in VALUES.items():
        for v in values * scale:
            if ours is not None:
                ours.delta.record(v, direction)
            if sdk is not None:
                sdk["delta"].record(v, {"direction": direction})
    for v in SCORES * scale:
        ours is not None and ours.score.record(v)
        sdk is not None and sdk["score"].record(v)
    for v in LATENCIES * scale:
        ours is not None and ours.latency.record(v)
        sdk is not None and sdk["latency"].record(v)


def _gauges() -> dict[str, int]:
    return dict.fromkeys(("traces_in_flight", "spans_in_flight", "late_traces", "late_bytes", "journal_bytes",
                          "watchers", "store_queued_runs"), 0)


def test_the_scrape_reads_as_the_sdks_histograms_did():
    ours = Metrics(CollectorConfig(exporters={"prometheus": {"endpoint": "127.0.0.1:0"}}), Resource.create({}), _gauges)
    registry = CollectorRegistry()
    provider, sdk = _sdk([PrometheusMetricReader(registry=registry, scope_info_enabled=False)])
    _record(ours, sdk)
    try:
        # (the SDK's reader drops a {token} unit; ours names it, as Prometheus asks: _tokens)
        for sdk_name, name in (("agenteval_run_score", "agenteval_run_score"),
                               ("agenteval_token_delta", "agenteval_token_delta_tokens"),
                               ("agenteval_verdict_latency_seconds", "agenteval_verdict_latency_seconds")):
            want = {(n.replace(sdk_name, name, 1), labels): v
                    for (n, labels), v in _samples(registry, sdk_name).items()}
            assert want and _samples(ours.registry, name) == want, name
        count = _samples(ours.registry, "agenteval_token_delta_tokens_count")
        assert count[("agenteval_token_delta_tokens_count", (("direction", "under"),))] == len(VALUES["under"])
    finally:
        ours.shutdown()
        provider.shutdown()


def _points(receiver: CaptureReceiver, request: int) -> dict[tuple, tuple]:
    """name, attributes -> (count, sum, min, max, bucket counts, bounds, temporality) in one export."""
    out = {}
    for rm in receiver.metrics.requests[request].resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.HasField("histogram"):
                    for p in m.histogram.data_points:
                        attrs = tuple(sorted((a.key, a.value.string_value) for a in p.attributes))
                        out[(sm.scope.name, m.name, m.unit, m.description, attrs)] = (
                            p.count, p.sum, p.min, p.max, tuple(p.bucket_counts), tuple(p.explicit_bounds),
                            m.histogram.aggregation_temporality)
    return out


def _wait(receiver: CaptureReceiver, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(receiver.metrics.requests) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(receiver.metrics.requests) >= n


@pytest.mark.parametrize("preference", ["cumulative", "delta"])
def test_the_otlp_push_carries_what_the_sdk_pushed(preference, monkeypatch):
    """Two exports, with more values between them: every point as the SDK exports it, whichever
    temporality the user asks the exporter for (the SDK's own environment variable)."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", preference)
    ours_rx, sdk_rx = CaptureReceiver(), CaptureReceiver()
    try:
        cfg = CollectorConfig(exporters={"prometheus": {"enabled": False},
                                         "otlp": {"endpoint": f"127.0.0.1:{ours_rx.port}", "metrics_interval": 3600}})
        ours = Metrics(cfg, Resource.create({}), _gauges)
        provider, sdk = _sdk([PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=f"127.0.0.1:{sdk_rx.port}", insecure=True), export_interval_millis=3_600_000)])
        for round_, scale in enumerate((1, 2)):
            _record(ours, sdk, scale)
            ours.provider.force_flush()
            provider.force_flush()
            _wait(ours_rx, round_ + 1)
            _wait(sdk_rx, round_ + 1)
            got, want = _points(ours_rx, round_), _points(sdk_rx, round_)
            assert len(want) == 5 and got == want, round_
        under = next(v for k, v in got.items() if k[1] == "agenteval.token.delta" and k[4] == (("direction", "under"),))
        assert under[0] == len(VALUES["under"]) * (2 if preference == "delta" else 3)
        assert under[6] == (AggregationTemporality.DELTA if preference == "delta"
                            else AggregationTemporality.CUMULATIVE)
        ours.shutdown()
        provider.shutdown()
    finally:
        ours_rx.server.stop(0)
        sdk_rx.server.stop(0)


def _scrape(proc) -> list:
    import urllib.request

    return list(text_string_to_metric_families(urllib.request.urlopen(proc.prometheus, timeout=5).read().decode()))


def test_the_scrape_follows_prometheus_naming_with_no_placeholder_series(tmp_path):
    """Three prefixes (collector_*, fidelity_*, agenteval_build_info), otel_scope_* labels on every
    series, a token histogram without its unit, and before any run zero series labelled subject=""
    and maf_release="unknown", values no run has. Now: one prefix, units as suffixes, no scope
    labels; self-metrics at 0 from the start; a verdict series appears with the run that has it."""
    from conftest import CollectorProcess, export_spans
    from mafshape import SCENARIOS, Invocation, Scenario, ok, record

    proc = CollectorProcess(tmp_path)
    try:
        before = _scrape(proc)
        # an under-report, and a ledger a third above its chat call (Agree: counted as over-reported)
        over = Scenario({"writer": [Invocation([ok(300, 150)], reported=(400, 200, "stop"))]}, name="over-report")
        spans, (trace_id, over_id) = record([SCENARIOS["fail_under_report"][0], over], service="billing")
        export_spans(proc, spans)
        proc.run(trace_id)
        proc.run(over_id)
        time.sleep(0.2)
        after = _scrape(proc)
    finally:
        proc.stop()
    for families in (before, after):
        names = {f.name for f in families}
        assert {n for n in names if not n.startswith("agenteval_")} <= {"target_info", "process_cpu_seconds",
            "process_virtual_memory_bytes", "process_resident_memory_bytes", "process_start_time_seconds",
            "process_open_fds", "process_max_fds"}, names
        for family in families:
            for sample in family.samples:
                assert not [k for k in sample.labels if k.startswith("otel_scope_")], sample
                assert "" not in sample.labels.values() and "unknown" not in sample.labels.values(), sample
    zero = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in before for s in f.samples}
    assert zero[("agenteval_spans_received_total", (("transport", "grpc"),))] == 0
    assert zero[("agenteval_verdict_spans_dropped_total", ())] == 0
    assert [v for (name, _), v in zero.items() if name == "agenteval_build_info"] == [1]
    assert not [k for k in zero if k[0].startswith(("agenteval_runs", "agenteval_unit_verdicts", "agenteval_unreported",
                                                    "agenteval_overreported"))]
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in after for s in f.samples}
    subject = dict(next(k[1] for k in got if k[0] == "agenteval_runs_total"))["subject"]
    # no release announced: no label
    assert got[("agenteval_runs_total", (("status", "FAIL"), ("subject", subject)))] == 1
    # the over-report is Agree, and counted as what it is; the under-report is not an over-report
    assert got[("agenteval_runs_total", (("status", "PASS"), ("subject", "over-report")))] == 1
    assert {k: v for k, v in got.items() if k[0] == "agenteval_overreported_units_total"} == {
        ("agenteval_overreported_units_total", (("subject", "over-report"), ("verdict", "Agree"))): 1}
    assert any(name == "agenteval_token_delta_tokens_bucket" for name, _ in got)
    assert any(name == "agenteval_verdict_latency_seconds_count" for name, _ in got)


def test_verdict_spans_dropped_from_a_full_export_backlog_are_counted(tmp_path):
    """export_queue.py said dropped spans were counted; they were only logged."""
    from conftest import CollectorProcess, export_spans, free_port
    from mafshape import SCENARIOS, record

    dead = f"127.0.0.1:{free_port()}"  # nothing listens: every export fails, the backlog fills
    proc = CollectorProcess(tmp_path, {"exporters": {"otlp": {"max_backlog_spans": 1, "retry_interval": 60}}},
                            otlp_out=dead, env={"OTEL_BSP_SCHEDULE_DELAY": "20"})  # a batch per run
    try:
        for name in ("pass", "fail_under_report", "loop"):
            spans, (trace_id,) = record([SCENARIOS[name][0]])
            export_spans(proc, spans)
            proc.run(trace_id)
            time.sleep(0.3)  # its verdict spans reach the export backlog
        deadline = time.monotonic() + 10
        while not proc.metrics().get(("agenteval_verdict_spans_dropped_total", ())) and time.monotonic() < deadline:
            time.sleep(0.1)
        dropped = proc.metrics()[("agenteval_verdict_spans_dropped_total", ())]
        logged = sum(e["spans"] for e in proc.log_events() if e.get("event") == "verdict_spans_dropped")
    finally:
        proc.stop()
    assert dropped > 0 and dropped == logged
