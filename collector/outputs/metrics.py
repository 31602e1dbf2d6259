"""Metrics through the OpenTelemetry SDK: a Prometheus scrape endpoint and/or OTLP push (docs/design.md §3)."""

from __future__ import annotations

import errno
import platform
import re
import socket
import sys
import threading
import time
from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TypeAlias
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import Exemplar as SdkExemplar
from opentelemetry.sdk.metrics import Histogram as SdkHistogram
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.metrics.export import (
    Histogram as HistogramData,
)
from opentelemetry.sdk.metrics.view import View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.core import Metric as PromMetric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.samples import Exemplar as PromExemplar

from collector.config import CollectorConfig, split_endpoint
from collector.core.model import RunVerdict, over_reported
from collector.security import BearerAuth
from collector.store import StoredRun

SCORE_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.8, 0.9, 0.95, 0.99, 1.0)
DELTA_BUCKETS = (0, 1, 10, 50, 100, 500, 1_000, 5_000, 10_000, 50_000)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
#: The ``subject`` label of runs past the ``exporters.metric_subjects`` distinct subjects (and the
#: ``maf_release`` label past :data:`MAX_RELEASES` releases).
OTHER_SUBJECT = "_other"
#: Distinct ``maf_release`` label values (MAF ships every few weeks: a process sees a handful).
MAX_RELEASES = 20
#: A run counter's labels as :meth:`Metrics.record_runs` counts them: its own label's value, subject, MAF release.
_Labels: TypeAlias = tuple[str, str | None, str | None]


@dataclass(slots=True)
class _BoundedLabel:
    """A label's value as seen for the first ``limit`` distinct values, :data:`OTHER_SUBJECT` past
    them, so senders cannot grow the series; none when ``limit`` is 0 or there is no value."""

    limit: int
    seen: set[str] = field(default_factory=set)

    def __call__(self, value: str | None) -> str | None:
        if value is None or not self.limit:
            return None
        if value in self.seen:
            return value
        if len(self.seen) < self.limit:
            self.seen.add(value)
            return value
        return OTHER_SUBJECT


SCOPE = InstrumentationScope("agenteval.collector")


@dataclass(frozen=True, slots=True)
class RunExemplar:
    """The run a measurement came from (docs/outputs.md "Exemplars"): its trace (hex ids; the span is
    the workflow-run span) and run id, so a dashboard goes from a number to the trace."""

    trace_id: str
    span_id: str | None
    run_id: str
    time_ns: int

    @classmethod
    def of(cls, run: RunVerdict, run_id: str) -> RunExemplar | None:
        """None for a run without a usable trace id (nothing to link to)."""
        trace_id = run.trace_id
        if not trace_id or len(trace_id) != 32 or not _is_hex(trace_id) or not int(trace_id, 16):
            return None
        span_id = run.root_span_id
        span_id = span_id if span_id and len(span_id) == 16 and _is_hex(span_id) and int(span_id, 16) else None
        return cls(trace_id, span_id, run_id, time.time_ns())

    def prometheus(self, value: float) -> PromExemplar:
        """As an OpenMetrics exemplar: ``trace_id`` and ``run_id`` (the latter left out where the two
        would pass the 128 characters OpenMetrics allows an exemplar's labels)."""
        labels = {"trace_id": self.trace_id, "run_id": self.run_id}
        if sum(len(k) + len(v) for k, v in labels.items()) > 128:
            del labels["run_id"]
        return PromExemplar(labels, value, self.time_ns / 1e9)

    def otlp(self, value: float) -> SdkExemplar:
        return SdkExemplar({"run_id": self.run_id}, value, self.time_ns,
                           int(self.span_id, 16) if self.span_id else None, int(self.trace_id, 16))

    def context(self) -> Context:
        """A context whose current span is the run's (sampled), so the SDK's trace-based exemplar
        filter keeps the measurement as an exemplar of that trace."""
        span_id = int(self.span_id, 16) if self.span_id else int(self.trace_id[16:], 16) or 1
        return trace.set_span_in_context(NonRecordingSpan(SpanContext(
            int(self.trace_id, 16), span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))))


_HEX = re.compile("[0-9a-fA-F]*")


def _is_hex(text: str) -> bool:
    return _HEX.fullmatch(text) is not None


@lru_cache(maxsize=1)
def build_info() -> dict[str, str]:
    """Labels of ``agenteval_build_info``: what is running, for dashboards and support."""
    from importlib.metadata import version

    from collector.formats import decode

    return {"version": version("agenteval-collector"), "python": platform.python_version(),
            "decoder": "native" if decode.NATIVE else "python"}


@dataclass(slots=True)
class _Series:
    counts: list[int]  # per bucket, the last one above every bound
    #: Per bucket, the latest measurement with its run (value, run), or None.
    exemplars: list[tuple[float, RunExemplar] | None]
    total: float = 0.0
    low: float = float("inf")
    high: float = float("-inf")
    #: Sum and extremes since the delta exporter last took them (a delta point carries its interval's).
    since_total: float = 0.0
    since_low: float = float("inf")
    since_high: float = float("-inf")


class Histogram:
    """A cumulative explicit-bucket histogram, by the value of at most one label.

    Recorded in about a microsecond; the SDK's ``Histogram.record`` validates and hashes its
    attributes on every call (7-10 µs), and a run records one per checked unit. Both sinks read it:
    the Prometheus registry through :class:`_PrometheusHistograms`, the OTLP push through
    :class:`_WithHistograms`, in the shape the SDK gives its own histograms.
    """

    def __init__(self, name: str, prometheus_name: str, unit: str, description: str,
                 buckets: Sequence[float], label: str | None = None) -> None:
        self.name, self.prometheus_name, self.unit, self.description = name, prometheus_name, unit, description
        self.buckets = tuple(float(b) for b in buckets)
        #: Bucket bounds as Prometheus labels, spelt as configured (``0`` or ``0.0``), as the SDK's reader does.
        self.le = (*(str(b) for b in buckets), "+Inf")
        self.label = label
        self.start_ns = time.time_ns()
        self._series: dict[str | None, _Series] = {}
        self._lock = threading.Lock()

    def record(self, value: float, label_value: str | None = None, exemplar: RunExemplar | None = None) -> None:
        if value < 0:  # as the SDK's histogram: a negative measurement is dropped
            return
        with self._lock:
            series = self._series.get(label_value)
            if series is None:
                size = len(self.buckets) + 1
                series = self._series[label_value] = _Series([0] * size, [None] * size)
            bucket = bisect_left(self.buckets, value)  # bucket i holds (bound[i-1], bound[i]]
            series.counts[bucket] += 1
            if exemplar is not None:
                series.exemplars[bucket] = (value, exemplar)
            series.total += value
            series.since_total += value
            if value < series.low:
                series.low = value
            if value > series.high:
                series.high = value
            if value < series.since_low:
                series.since_low = value
            if value > series.since_high:
                series.since_high = value

    def snapshot(self, interval: bool = False) -> list[tuple[str | None, _Series]]:
        """A copy of each series by label value; with ``interval`` its sum and extremes are those
        since the last such call (which starts a new interval), its counts still cumulative."""
        with self._lock:
            out = []
            for key, s in self._series.items():
                if interval:
                    out.append((key, _Series(list(s.counts), list(s.exemplars), s.since_total, s.since_low,
                                             s.since_high)))
                    s.since_total, s.since_low, s.since_high = 0.0, float("inf"), float("-inf")
                else:
                    out.append((key, _Series(list(s.counts), list(s.exemplars), s.total, s.low, s.high)))
            return out

    def attributes(self, label_value: str | None) -> dict[str, str]:
        return {} if self.label is None or label_value is None else {self.label: label_value}


class _PrometheusHistograms:
    """A prometheus_client collector for :class:`Histogram` (cumulative ``le`` buckets)."""

    def __init__(self, histograms: Sequence[Histogram]) -> None:
        self.histograms = histograms

    def collect(self) -> Iterator[HistogramMetricFamily]:
        for h in self.histograms:
            family = HistogramMetricFamily(h.prometheus_name, h.description, labels=[h.label] if h.label else [])
            for key, series in h.snapshot():
                running, buckets = 0, []
                for le, count, seen in zip(h.le, series.counts, series.exemplars, strict=True):
                    running += count
                    buckets.append((le, running) if seen is None else (le, running, seen[1].prometheus(seen[0])))
                family.add_metric([key] if h.label and key is not None else [], buckets, series.total)
            yield family


#: The counters whose samples carry an exemplar (their Prometheus family names).
EXEMPLAR_COUNTERS = ("agenteval_runs", "agenteval_unit_verdicts", "agenteval_unreported_tokens",
                     "agenteval_unreported_cost_usd")


class _CounterExemplars:
    """The SDK's metrics as its Prometheus reader renders them (read from the registry it fills), with
    the latest run's exemplar on each sample of :data:`EXEMPLAR_COUNTERS`: the SDK's reader writes
    none, and OpenMetrics shows them to a scraper that asks for it (text 0.0.4 leaves them out)."""

    def __init__(self, sdk: CollectorRegistry) -> None:
        self.sdk = sdk
        #: (family, labels) -> (the counter's increment, its run)
        self.latest: dict[tuple[str, frozenset], tuple[float, RunExemplar]] = {}

    def seen(self, family: str, labels: dict[str, str], value: float, run: RunExemplar) -> None:
        self.latest[family, frozenset(labels.items())] = (value, run)

    def collect(self) -> Iterator[PromMetric]:
        for family in self.sdk.collect():
            if family.name in EXEMPLAR_COUNTERS:
                family.samples = [self._with_exemplar(family.name, sample) for sample in family.samples]
            yield family

    def _with_exemplar(self, name: str, sample):
        if not sample.name.endswith("_total"):
            return sample
        # the exposition gives a label a series does not have the value "" (absent, to Prometheus)
        seen = self.latest.get((name, frozenset((k, v) for k, v in sample.labels.items() if v)))
        return sample if seen is None else sample._replace(exemplar=seen[1].prometheus(seen[0]))


class _WithHistograms(MetricExporter):
    """The OTLP metric exporter, with :class:`Histogram` s added to each export under our scope,
    cumulative or delta as the exporter prefers for histograms."""

    def __init__(self, inner: MetricExporter, histograms: Sequence[Histogram], resource: Resource) -> None:
        # the inner exporter's preferences, read through its private attributes: the reader reads them here
        super().__init__(preferred_temporality=inner._preferred_temporality,
                         preferred_aggregation=inner._preferred_aggregation)
        self.inner, self.histograms, self.resource = inner, histograms, resource
        self.temporality = (inner._preferred_temporality or {}).get(SdkHistogram, AggregationTemporality.CUMULATIVE)
        self._last: dict[tuple[str, str | None], list[int]] = {}  # cumulative counts at the last export
        self._last_ns: int | None = None

    def _metrics(self) -> list[Metric]:
        now = time.time_ns()
        delta = self.temporality is AggregationTemporality.DELTA
        out = []
        for h in self.histograms:
            points = []
            for key, series in h.snapshot(interval=delta):
                counts, total, start = series.counts, series.total, h.start_ns
                if delta:  # what was recorded since the last export
                    before = self._last.get((h.name, key), [0] * len(counts))
                    self._last[(h.name, key)] = counts
                    counts = [a - b for a, b in zip(counts, before, strict=True)]
                    start = self._last_ns or h.start_ns
                    if not any(counts):
                        continue
                exemplars = [run.otlp(value) for seen in series.exemplars if seen is not None
                             for value, run in (seen,) if not delta or run.time_ns >= start]
                points.append(HistogramDataPoint(h.attributes(key), start, now, sum(counts), total, counts,
                                                 h.buckets, series.low, series.high, exemplars))
            if points:
                out.append(Metric(h.name, h.description, h.unit, HistogramData(points, self.temporality)))
        self._last_ns = now
        return out

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object) -> MetricExportResult:
        ours = self._metrics()
        if ours:
            resources = list(metrics_data.resource_metrics) or [ResourceMetrics(self.resource, [], "")]
            first = resources[0]
            scopes = [s for s in first.scope_metrics if s.scope.name != SCOPE.name]
            scope = next((s for s in first.scope_metrics if s.scope.name == SCOPE.name), ScopeMetrics(SCOPE, [], ""))
            scopes.append(replace(scope, metrics=[*scope.metrics, *ours]))
            metrics_data = MetricsData([replace(first, scope_metrics=scopes), *resources[1:]])
        return self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)


class Metrics:
    """The collector's instruments; ``gauges`` supplies in-flight figures at collection time."""

    def __init__(self, config: CollectorConfig, resource: Resource,
                 gauges: Callable[[], dict[str, float]], scrape_auth: BearerAuth | None = None) -> None:
        readers: list[MetricReader] = []
        self.registry = CollectorRegistry()
        self._http: WSGIServer | None = None
        self.prometheus_port: int | None = None
        self.score = Histogram("agenteval.run.score", "agenteval_run_score", "", "Run score (PENDING runs have none)",
                               SCORE_BUCKETS)
        self.delta = Histogram("agenteval.token.delta", "agenteval_token_delta_tokens", "{token}",
                               "Absolute framework-vs-truth token delta per checked executor", DELTA_BUCKETS,
                               label="direction")
        self.latency = Histogram("agenteval.verdict.latency", "agenteval_verdict_latency_seconds", "s",
                                 "A run's arrival (its trace's root span, or the spans re-opening a finalized "
                                 "trace: a later human-in-the-loop turn) to its first stored verdict", LATENCY_BUCKETS)
        histograms = (self.score, self.delta, self.latency)
        prom = config.exporters.prometheus
        self._exemplars: _CounterExemplars | None = None
        if prom.enabled:
            sdk_registry = CollectorRegistry()
            # no otel_scope_* labels: one scope, ours, on every series (docs/live-collector.md "Metrics")
            readers.append(PrometheusMetricReader(registry=sdk_registry, scope_info_enabled=False))
            self._exemplars = _CounterExemplars(sdk_registry)
            self.registry.register(self._exemplars)
            self.registry.register(_PrometheusHistograms(histograms))
            ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, _resident_memory_bytes, _open_fds
            host, port = split_endpoint(prom.endpoint)
            self._http = scrape_server(host, port, self.registry, scrape_auth, config.receivers.http.read_timeout)
            self.prometheus_port = self._http.server_port
        otlp = config.exporters.otlp
        if otlp.endpoint and otlp.push_metrics:
            readers.append(PeriodicExportingMetricReader(
                _WithHistograms(_otlp_metric_exporter(otlp.endpoint, otlp.protocol, otlp.insecure), histograms,
                                resource),
                export_interval_millis=otlp.metrics_interval * 1000,
            ))
        self._shutdown_timeout = config.exporters.otlp.shutdown_timeout
        self._subject = _BoundedLabel(config.exporters.metric_subjects)
        self._release = _BoundedLabel(MAX_RELEASES)
        # The run id rides on each verdict measurement for the exemplar only: never a label (a series per run).
        views = [View(instrument_name=name, attribute_keys=set(keys) | {"maf_release", "subject"})
                 for name, keys in (("agenteval.runs", {"status"}), ("agenteval.unit.verdicts", {"verdict"}),
                                    ("agenteval.unreported.tokens", ()), ("agenteval.unreported.cost_usd", ()))]
        self.provider = MeterProvider(metric_readers=readers, resource=resource, views=views)
        meter = self.provider.get_meter(SCOPE.name)
        self.runs = meter.create_counter("agenteval.runs", description="Run verdicts by status (revisions included)")
        self.verdicts = meter.create_counter("agenteval.unit.verdicts", description="Executor verdicts by verdict")
        self.no_truth = meter.create_counter("agenteval.notruth.units", description="NoTruth executors by reason")
        self.over_reported = meter.create_counter(
            "agenteval.overreported.units",
            description="Checked units whose framework reported more tokens than the chat boundary, beyond the "
                        "tolerance, by verdict: Agree unless scoring.flag_over_reporting (docs/verdicts.md)")
        self.unreported_tokens = meter.create_counter(
            "agenteval.unreported.tokens", description="Tokens the framework did not report (truth - framework where "
                                                      "it under-reported), summed over checked units")
        self.unreported_cost = meter.create_counter(
            "agenteval.unreported.cost_usd", description="USD of the tokens the framework did not report, over units "
                                                        "whose model could be priced (docs/outputs.md)")
        self.received = meter.create_counter("agenteval.spans.received", description="Spans accepted, by transport")
        self.refused = meter.create_counter("agenteval.spans.refused",
                                            description="Spans refused with a retryable status (over capacity)")
        self.rejected = meter.create_counter("agenteval.spans.rejected",
                                             description="Spans rejected as unusable (partial_success), by reason")
        self.requests_rejected = meter.create_counter(
            "agenteval.requests.rejected",
            description="Requests refused whole, by reason: not OTLP, not authenticated, body not received in time, "
                        "over the size limit, over the memory budget (memory_budget: retryable)")
        self.duplicates = meter.create_counter("agenteval.spans.duplicate", description="Spans already seen")
        self.discarded = meter.create_counter(
            "agenteval.signals.discarded",
            description="OTLP metrics and logs export requests accepted and discarded (an application's "
                        "OpenTelemetry setup sends them to the same endpoint as its traces), by signal")
        self.ignored = meter.create_counter("agenteval.traces.ignored",
                                            description="Finalized traces without executor, agent or chat spans")
        self.own = meter.create_counter("agenteval.spans.own",
                                        description="Our own verdict spans received back and ignored")
        self.store_errors = meter.create_counter("agenteval.store.errors", description="Failed store writes")
        self.runs_deleted = meter.create_counter("agenteval.store.runs.deleted",
                                                 description="Runs the retention sweeper deleted (store.retention)")
        self.shed = meter.create_counter("agenteval.http.connections.shed",
                                         description="Idle HTTP connections closed to make room when the process "
                                                     "ran out of file descriptors")
        self.failed = meter.create_counter("agenteval.pipeline.failures",
                                           description="Traces or runs that could not be finalized, published or "
                                                       "stored, by stage (each also logged and shown on /runs)")
        self.parts = meter.create_counter(
            "agenteval.trace.parts",
            description="Parts of traces split across replicas by a scale event (docs/scale-out.md), by event: "
                        "handed_over (this replica held spans without the trace's root), merged (into a run "
                        "here), split (no replica with the root claimed them: reconciled apart, flagged)")
        self.kafka_skipped = meter.create_counter(
            "agenteval.kafka.messages.skipped",
            description="Kafka messages skipped (the kafka receiver; each logged with its partition and offset), "
                        "by reason: undecodable (not an OTLP protobuf trace request), too_large, never_fits (more "
                        "spans or traces than the assembly can hold), failed (an error handling it)")
        # Present at 0 from the start, so alerts and dashboards see a series before the first event
        # (a rate over nothing is no data, not 0): each counter an alert watches whose label values are
        # known in advance. The verdict counters' are not (each run's subject and MAF release): their
        # series start with the first run that has them, never with a placeholder value no run has.
        for transport in ("grpc", "http", *(("kafka",) if config.receivers.kafka.enabled else ())):
            self.received.add(0, {"transport": transport})
            for reason in ("capacity", "journal", "store_backlog"):
                self.refused.add(0, {"reason": reason, "transport": transport})
            for reason in ("invalid_span", "late", "never_fits"):
                self.rejected.add(0, {"reason": reason, "transport": transport})
            for reason in ("undecodable", "unauthenticated"):
                self.requests_rejected.add(0, {"reason": reason, "transport": transport})
        if config.receivers.kafka.enabled:
            for reason in ("undecodable", "too_large"):
                self.kafka_skipped.add(0, {"reason": reason})
        self.failed.add(0, {"stage": "store"})
        self.runs_deleted.add(0)
        for event in ("handed_over", "merged", "split"):
            self.parts.add(0, {"event": event})
        meter.create_observable_gauge("agenteval.build.info", [lambda _: [Observation(1, build_info())]],
                                      description="The collector's version and build (value 1)")

        def observe(name: str):
            def callback(_: CallbackOptions):
                value = gauges().get(name)  # none before the pipeline exists (a start refused, metrics pushed on exit)
                if value is not None:
                    yield Observation(value)
            return callback

        for name, desc in [("traces_in_flight", "Traces being assembled"),
                           ("spans_in_flight", "Spans of traces being assembled"),
                           ("late_traces", "Finalized traces still accepting late spans"),
                           ("late_bytes", "Estimated memory of the late window's state (bounded by max_late_bytes)"),
                           ("journal_bytes", "Size of the crash journal (bounded by journal.max_bytes)"),
                           ("inflight_bytes", "Memory held by requests being received and decoded (bounded by "
                                              "receivers.max_inflight_bytes)"),
                           ("watchers", "WatchVerdicts streams attached"),
                           ("store_queued_runs", "Verdicts waiting for the run store (e.g. during an outage)"),
                           ("store_bytes", "The run store's size on disk (bytes; as of the sweeper's last pass)"),
                           ("store_oldest_run_timestamp_seconds",
                            "When the oldest stored run was last written (unix seconds; 0: none yet): how far back "
                            "the history goes")]:
            meter.create_observable_gauge(f"agenteval.{name}", [observe(name)], description=desc)
        meter.create_observable_counter(
            "agenteval.verdict_spans.dropped", [observe("verdict_spans_dropped")],
            description="Verdict spans dropped from the OTLP export backlog while exporters.otlp.endpoint was down "
                        "(exporters.otlp.max_backlog_spans; each drop also logged as verdict_spans_dropped)")

    def record_runs(self, runs: Sequence[StoredRun]) -> None:
        """A sweep's verdicts: counted locally, then one ``add`` per attribute set (the SDK hashes a
        record's attributes on every call, which per run and per unit was a tenth of the main thread),
        each carrying the latest run of its set as its exemplar; scores and deltas go to our own
        histograms, each with its run. ``runs`` as published, verdicts included (the pipeline records
        them before :meth:`StoredRun.for_writer` lets the verdicts go)."""
        statuses: Counter[_Labels] = Counter()
        verdicts: Counter[_Labels] = Counter()
        reasons: Counter[_Labels] = Counter()
        over: Counter[_Labels] = Counter()
        tokens: Counter[_Labels] = Counter()
        cost: defaultdict[_Labels, float] = defaultdict(float)
        latest: dict[tuple[str, _Labels], RunExemplar | None] = {}
        for stored in runs:
            run = stored.verdict
            assert run is not None  # published runs, not yet for_writer's
            exemplar = RunExemplar.of(run, stored.run_id)
            subject, release = self._subject(run.subject), self._release(run.maf_release)
            statuses[run.status.value, subject, release] += 1
            latest["status", (run.status.value, subject, release)] = exemplar
            if run.score is not None:
                self.score.record(run.score, exemplar=exemplar)
            for e in run.executors:
                verdicts[e.verdict.value, subject, release] += 1
                latest["verdict", (e.verdict.value, subject, release)] = exemplar
                if e.no_truth_reason is not None:
                    reasons[e.no_truth_reason.value, subject, release] += 1
                elif (ev := e.evidence).delta is not None:
                    self.delta.record(abs(ev.delta), ev.direction or "equal", exemplar)
                    if over_reported(ev.delta, ev.direction, ev.tolerance, ev.truth_tokens):
                        over[e.verdict.value, subject, release] += 1
            if run.spend is not None and run.spend.unreported_tokens:
                tokens["", subject, release] += run.spend.unreported_tokens
                latest["tokens", ("", subject, release)] = exemplar
                # over the units that under-reported at a known price: none adds nothing, not a 0
                if any((c := e.evidence.cost) is not None and c.unreported_tokens and c.unreported_usd is not None
                       for e in run.executors):
                    cost["", subject, release] += run.spend.unreported_usd
                    latest["cost", ("", subject, release)] = exemplar
        # (counter, counts, its kind in ``latest``, its label, its family where it carries exemplars)
        for counter, counts, kind, label, family in (
                (self.runs, statuses, "status", "status", "agenteval_runs"),
                (self.verdicts, verdicts, "verdict", "verdict", "agenteval_unit_verdicts"),
                (self.no_truth, reasons, "reason", "reason", None),
                (self.over_reported, over, "over", "verdict", None),
                (self.unreported_tokens, tokens, "tokens", None, "agenteval_unreported_tokens"),
                (self.unreported_cost, cost, "cost", None, "agenteval_unreported_cost_usd")):
            for labels_key, n in counts.items():
                value, subject, release = labels_key
                # a label whose value is not known (no release announced, subjects off) is left out
                labels = {name: v for name, v in ((label, value), ("maf_release", release), ("subject", subject))
                          if name is not None and v is not None}
                if family is None or (exemplar := latest.get((kind, labels_key))) is None:
                    counter.add(n, labels)
                    continue
                counter.add(n, labels | {"run_id": exemplar.run_id}, context=exemplar.context())
                if self._exemplars is not None:
                    self._exemplars.seen(family, labels, n, exemplar)

    def shutdown(self) -> None:
        """Stop; the last OTLP push may take ``exporters.otlp.shutdown_timeout`` (an endpoint that is
        down is not retried past it)."""
        self.provider.shutdown(timeout_millis=self._shutdown_timeout * 1000)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


class _ScrapeHandler(WSGIRequestHandler):
    """Quiet; a client that does not send its request within ``timeout`` is disconnected."""

    def log_message(self, format: str, *args: object) -> None:
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
    # socketserver listens with a backlog of 5: a burst of scrapers would see dropped connections
    server_class = type("ScrapeServer", (_ScrapeServer,), {"address_family": family,
                                                           "request_queue_size": socket.SOMAXCONN})
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
