"""Metrics through the OpenTelemetry SDK: a Prometheus scrape endpoint and/or OTLP push (DESIGN §3)."""

from __future__ import annotations

from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, start_http_server

from collector.config import CollectorConfig, split_endpoint
from collector.model import RunVerdict

SCORE_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.8, 0.9, 0.95, 0.99, 1.0)
DELTA_BUCKETS = (0, 1, 10, 50, 100, 500, 1_000, 5_000, 10_000, 50_000)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """The collector's instruments; ``gauges`` supplies in-flight figures at collection time."""

    def __init__(self, config: CollectorConfig, resource: Resource,
                 gauges: Callable[[], dict[str, int]]) -> None:
        readers: list[MetricReader] = []
        self.registry = CollectorRegistry()
        self._http: WSGIServer | None = None
        self.prometheus_port: int | None = None
        prom = config.exporters.prometheus
        if prom.enabled:
            readers.append(PrometheusMetricReader(registry=self.registry))
            host, port = split_endpoint(prom.endpoint)
            self._http, _ = start_http_server(port, addr=host, registry=self.registry)
            self.prometheus_port = self._http.server_port
        otlp = config.exporters.otlp
        if otlp.endpoint and otlp.push_metrics:
            readers.append(PeriodicExportingMetricReader(
                _otlp_metric_exporter(otlp.endpoint, otlp.protocol, otlp.insecure),
                export_interval_millis=otlp.metrics_interval * 1000,
            ))
        views = [
            View(instrument_name="fidelity.run.score", aggregation=ExplicitBucketHistogramAggregation(SCORE_BUCKETS)),
            View(instrument_name="fidelity.token.delta", aggregation=ExplicitBucketHistogramAggregation(DELTA_BUCKETS)),
            View(instrument_name="fidelity.verdict.latency",
                 aggregation=ExplicitBucketHistogramAggregation(LATENCY_BUCKETS)),
        ]
        self.provider = MeterProvider(metric_readers=readers, resource=resource, views=views)
        meter = self.provider.get_meter("agenteval.collector")
        self.runs = meter.create_counter("fidelity.runs", description="Run verdicts by status (revisions included)")
        self.verdicts = meter.create_counter("fidelity.executor.verdicts", description="Executor verdicts by verdict")
        self.no_truth = meter.create_counter("fidelity.no_truth.executors", description="NoTruth executors by reason")
        self.score = meter.create_histogram("fidelity.run.score", description="Run score (PENDING runs have none)")
        self.delta = meter.create_histogram("fidelity.token.delta", unit="{token}",
                                            description="Absolute framework-vs-truth token delta per checked executor")
        self.latency = meter.create_histogram("fidelity.verdict.latency", unit="s",
                                              description="Root span arrival to stored verdict")
        self.received = meter.create_counter("collector.spans.received", description="Spans accepted, by transport")
        self.refused = meter.create_counter("collector.spans.refused",
                                            description="Spans refused with a retryable status (over capacity)")
        self.rejected = meter.create_counter("collector.spans.rejected",
                                             description="Spans rejected as unusable (partial_success) or undecodable")
        self.duplicates = meter.create_counter("collector.spans.duplicate", description="Spans already seen")
        self.ignored = meter.create_counter("collector.traces.ignored",
                                            description="Finalized traces without executor, agent or chat spans")
        self.own = meter.create_counter("collector.spans.own",
                                        description="Our own verdict spans received back and ignored")
        self.store_errors = meter.create_counter("collector.store.errors", description="Failed store writes")
        self.failed = meter.create_counter("collector.runs.failed",
                                           description="Traces or runs that could not be finalized, published or "
                                                       "stored, by stage (each also logged and shown on /runs)")

        def observe(name: str):
            def callback(_: CallbackOptions):
                yield Observation(gauges()[name])
            return callback

        for name, desc in [("traces_in_flight", "Traces being assembled"),
                           ("spans_in_flight", "Spans of traces being assembled"),
                           ("late_traces", "Finalized traces still accepting late spans"),
                           ("late_bytes", "Estimated memory of the late window's state (bounded by max_late_bytes)"),
                           ("journal_bytes", "Size of the crash journal (bounded by journal.max_bytes)"),
                           ("watchers", "WatchVerdicts streams attached"),
                           ("store_queued_runs", "Verdicts waiting for the run store (e.g. during an outage)")]:
            meter.create_observable_gauge(f"collector.{name}", [observe(name)], description=desc)

    def record_run(self, run: RunVerdict) -> None:
        self.runs.add(1, {"status": run.status.value})
        if run.score is not None:
            self.score.record(run.score)
        for e in run.executors:
            self.verdicts.add(1, {"verdict": e.verdict.value})
            if e.no_truth_reason is not None:
                self.no_truth.add(1, {"reason": e.no_truth_reason.value})
            elif e.evidence.delta is not None:
                self.delta.record(abs(e.evidence.delta), {"direction": e.evidence.direction or "equal"})

    def shutdown(self) -> None:
        self.provider.shutdown()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


def _otlp_metric_exporter(endpoint: str, protocol: str, insecure: bool):
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(endpoint=endpoint, insecure=insecure)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpExporter

    return HttpExporter(endpoint=endpoint.rstrip("/") + "/v1/metrics")
