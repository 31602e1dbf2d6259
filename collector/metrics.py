"""Metrics through the OpenTelemetry SDK: a Prometheus scrape endpoint and/or OTLP push (DESIGN §3)."""

from __future__ import annotations

import errno
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from collector.config import CollectorConfig, split_endpoint
from collector.model import RunVerdict
from collector.security import BearerAuth

SCORE_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.8, 0.9, 0.95, 0.99, 1.0)
DELTA_BUCKETS = (0, 1, 10, 50, 100, 500, 1_000, 5_000, 10_000, 50_000)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


#: One attributes dict per delta direction, made once.
_DIRECTIONS = {d: {"direction": d} for d in ("under", "over", "equal")}


class Metrics:
    """The collector's instruments; ``gauges`` supplies in-flight figures at collection time."""

    def __init__(self, config: CollectorConfig, resource: Resource,
                 gauges: Callable[[], dict[str, int]], scrape_auth: BearerAuth | None = None) -> None:
        readers: list[MetricReader] = []
        self.registry = CollectorRegistry()
        self._http: WSGIServer | None = None
        self.prometheus_port: int | None = None
        prom = config.exporters.prometheus
        if prom.enabled:
            readers.append(PrometheusMetricReader(registry=self.registry))
            host, port = split_endpoint(prom.endpoint)
            self._http = scrape_server(host, port, self.registry, scrape_auth, config.receivers.http.read_timeout)
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
        self.shed = meter.create_counter("collector.http.connections.shed",
                                         description="Idle HTTP connections closed to make room when the process "
                                                     "ran out of file descriptors")
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

    def record_runs(self, runs: list[RunVerdict]) -> None:
        """A sweep's verdicts: counted locally, then one ``add`` per attribute set (the SDK hashes a
        record's attributes on every call, which per run and per unit was a tenth of the main thread)."""
        statuses: Counter[str] = Counter()
        verdicts: Counter[str] = Counter()
        reasons: Counter[str] = Counter()
        for run in runs:
            statuses[run.status.value] += 1
            if run.score is not None:
                self.score.record(run.score)
            for e in run.executors:
                verdicts[e.verdict.value] += 1
                if e.no_truth_reason is not None:
                    reasons[e.no_truth_reason.value] += 1
                elif e.evidence.delta is not None:
                    self.delta.record(abs(e.evidence.delta), _DIRECTIONS[e.evidence.direction or "equal"])
        for counter, counts, key in ((self.runs, statuses, "status"), (self.verdicts, verdicts, "verdict"),
                                     (self.no_truth, reasons, "reason")):
            for value, n in counts.items():
                counter.add(n, {key: value})

    def shutdown(self) -> None:
        self.provider.shutdown()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


class _ScrapeHandler(WSGIRequestHandler):
    """Quiet; a client that does not send its request within ``timeout`` is disconnected."""

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass

    def handle(self) -> None:
        try:
            super().handle()
        except (TimeoutError, ConnectionError):
            self.close_connection = True


class _ScrapeServer(ThreadingWSGIServer):
    def get_request(self) -> tuple[socket.socket, object]:
        try:
            return super().get_request()
        except OSError as exc:  # out of descriptors: the socket stays readable; don't spin on it
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                time.sleep(0.1)
            raise

    def handle_error(self, request: object, client_address: object) -> None:
        """One short line, not socketserver's traceback on stderr."""
        structlog.get_logger("agenteval.collector").warning("metrics_request_failed",
                                                             error=repr(sys.exc_info()[1])[:200])


def scrape_server(host: str, port: int, registry: CollectorRegistry, auth: BearerAuth | None,
                  read_timeout: float) -> WSGIServer:
    """The ``/metrics`` endpoint on a daemon thread (prometheus_client's app and server), with an
    optional bearer token and a bound on how long a client may take to send its request."""
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        if auth is not None and not auth.allows(environ.get("HTTP_AUTHORIZATION")):
            start_response("401 Unauthorized", [("WWW-Authenticate", "Bearer"), ("Content-Type", "text/plain")])
            return [b"missing or invalid bearer token\n"]
        return metrics_app(environ, start_response)

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("ScrapeServer", (_ScrapeServer,), {"address_family": family})
    handler_class = type("ScrapeHandler", (_ScrapeHandler,), {"timeout": read_timeout})
    httpd = make_server(host, port, app, server_class, handler_class=handler_class)
    threading.Thread(target=httpd.serve_forever, name="prometheus-scrape", daemon=True).start()
    return httpd


def _otlp_metric_exporter(endpoint: str, protocol: str, insecure: bool):
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(endpoint=endpoint, insecure=insecure)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpExporter

    return HttpExporter(endpoint=endpoint.rstrip("/") + "/v1/metrics")
