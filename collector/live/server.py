"""``agenteval collector serve``: wires config -> receivers -> pipeline -> sinks, and its lifecycle.

SIGTERM / SIGINT: stop accepting, finalize in-flight traces, flush the store and exporters, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import gc
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass

import structlog
from opentelemetry.sdk.resources import Resource

from collector.config import CollectorConfig, ConfigError, split_endpoint
from collector.formats import decode
from collector.live import logs
from collector.live.budget import MemoryBudget
from collector.live.health import Health
from collector.live.pipeline import Pipeline
from collector.live.receivers import Receiver, start_all, stop_all
from collector.live.receivers.grpc_receiver import GrpcTraceReceiver
from collector.live.receivers.http_receiver import HttpTraceReceiver
from collector.live.receivers.kafka_offsets import KafkaOffsets
from collector.live.receivers.kafka_receiver import KafkaTraceReceiver, kafka_client
from collector.outputs.emit_spans import VerdictSpans, otlp_span_exporter
from collector.outputs.export_queue import RetryingSpanExporter
from collector.outputs.fidelity_service import FidelityService
from collector.outputs.metrics import Metrics
from collector.outputs.run_page import RunPage
from collector.outputs.stream import VerdictHub
from collector.security import BearerAuth, ssl_context
from collector.store import open_store

log = structlog.get_logger("agenteval.collector")


@dataclass
class Listening:
    grpc: str | None
    http: str | None
    prometheus: str | None
    store: str
    #: The crash journal's directory; None when it is off.
    journal: str | None
    #: The kafka receiver's topic and brokers; None when it is off.
    kafka: str | None = None


class Collector:
    """One collector instance; ``start`` binds everything, ``stop`` shuts down in order."""

    def __init__(self, config: CollectorConfig) -> None:
        self.config = config
        self.resource = Resource.create({"service.name": "agenteval-collector"})
        # A store that cannot be reached now is opened later: the collector starts without it.
        self.store = open_store(config.store.url, config.store.password(), config.store.pool_size,
                                max_items=config.store.max_span_ids_per_unit, retry=True)
        otlp = config.exporters.otlp
        self.spans = None
        self._span_exporter: RetryingSpanExporter | None = None
        if otlp.endpoint:
            exporter = self._span_exporter = RetryingSpanExporter(
                otlp_span_exporter(otlp.endpoint, otlp.protocol, otlp.insecure), max_spans=otlp.max_backlog_spans,
                retry_interval=otlp.retry_interval, shutdown_timeout=otlp.shutdown_timeout)
            self.spans = VerdictSpans(exporter, self.resource, config.store.max_span_ids_per_unit)
        self.pipeline: Pipeline | None = None
        #: Memory of the requests being received and decoded, both receivers (receivers.max_inflight_bytes).
        self.budget = MemoryBudget(config.receivers.max_inflight_bytes, config.assembly.retry_after)
        self.hub: VerdictHub | None = None
        self.metrics: Metrics | None = None
        #: The receivers the config enables, once all of them started (see :meth:`_receivers`).
        self.receivers: list[Receiver] = []
        self._grpc: GrpcTraceReceiver | None = None
        self._http: HttpTraceReceiver | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.health: Health | None = None
        self.listening: Listening | None = None

    async def start(self) -> Listening:
        cfg = self.config
        self.hub = VerdictHub(asyncio.get_running_loop(), cfg.stream.max_watchers, cfg.stream.buffer)
        auth = check(cfg)
        prometheus = cfg.exporters.prometheus
        check_ports(cfg)
        files = raise_file_limit()
        self.metrics = Metrics(cfg, self.resource, self._gauges,
                               scrape_auth=auth if prometheus.require_auth else None)
        kafka = cfg.receivers.kafka
        offsets = KafkaOffsets(kafka.max_metadata_bytes) if kafka.enabled else None
        self.pipeline = Pipeline(cfg, self.store, self.metrics, self.spans, cfg.store.url or "", offsets)
        self.pipeline.start()
        journal = self.pipeline.journal
        if journal is not None and (replayed := self.pipeline.replay()):  # before any receiver: journaled spans first
            log.info("journal_replayed", spans=replayed, journal=str(journal.directory))
        hub = self.hub
        self.store.subscribe(hub.publish_threadsafe, lambda: hub.watchers > 0)
        receivers = self._receivers(self.pipeline, hub, auth, offsets)
        await start_all(receivers)
        self.receivers = receivers
        grpc_addr = self._grpc.address if self._grpc else None
        http_addr = self._http.address if self._http else None
        prom = None
        if self.metrics.prometheus_port is not None:
            prom = f"{split_endpoint(cfg.exporters.prometheus.endpoint)[0]}:{self.metrics.prometheus_port}"
        self._sweeper = asyncio.create_task(self._sweep_forever(self.pipeline))
        tls = cfg.receivers.tls
        scheme = "https" if tls.enabled else "http"
        self.listening = Listening(grpc_addr, http_addr and f"{scheme}://{http_addr}", prom, self.store.display,
                                   str(journal.directory) if journal is not None else None,
                                   f"{kafka.topic} @ {','.join(kafka.brokers)}" if kafka.enabled else None)
        log.info("collector_listening", grpc=grpc_addr, http=self.listening.http, prometheus=prom,
                 store=self.store.display, store_open=self.store.is_open, journal=self.listening.journal,
                 kafka=self.listening.kafka, otlp_out=cfg.exporters.otlp.endpoint, tls=tls.enabled,
                 mtls=bool(tls.client_ca_file), auth=auth.enabled, metrics_auth=prometheus.require_auth,
                 open_files_limit=files, decoder="native" if decode.NATIVE else "python")
        return self.listening

    def _receivers(self, pipeline: Pipeline, hub: VerdictHub, auth: BearerAuth,
                   offsets: KafkaOffsets | None) -> list[Receiver]:
        """The receivers the config enables, in the order they start; they stop in the reverse order,
        the kafka receiver first (its open traces are dropped, not finalized as cut short)."""
        cfg = self.config
        receivers: list[Receiver] = []
        if cfg.receivers.http.enabled:
            self.health = Health(pipeline.writer)
            routes = [self.health.register]
            if cfg.receivers.http.run_page:
                routes.append(RunPage(self.store, auth, cfg.ui.trace_url, lambda: pipeline.failures,
                                      cfg.store.retention.max_age).register)
            self._http = HttpTraceReceiver(cfg.receivers.http, cfg.receivers.tls, pipeline, auth, self.budget, routes)
            receivers.append(self._http)
        if cfg.receivers.grpc.enabled:
            self._grpc = GrpcTraceReceiver(cfg.receivers.grpc, cfg.receivers.tls, pipeline, auth, self.budget,
                                           [FidelityService(self.store, hub, auth).handler()])
            receivers.append(self._grpc)
        if offsets is not None:
            receivers.append(KafkaTraceReceiver(cfg.receivers.kafka, pipeline, offsets))
        return receivers

    def _gauges(self) -> dict[str, float]:
        return {**(self.pipeline.gauges() if self.pipeline else {}),
                "watchers": self.hub.watchers if self.hub else 0, "inflight_bytes": self.budget.used,
                "verdict_spans_dropped": self._span_exporter.dropped if self._span_exporter else 0}

    async def _sweep_forever(self, pipeline: Pipeline) -> None:
        """Sweep when the earliest deadline is due, not on a fixed tick: a verdict waits its trace's
        quiet period and no longer. Accepted spans wake the sweeper when their deadline is earlier
        than the one it sleeps towards (e.g. the first trace after an idle spell)."""
        wake = asyncio.Event()
        planned = float("inf")

        def on_deadline(due: float) -> None:
            if due < planned:
                wake.set()

        pipeline.on_deadline = on_deadline
        next_full_gc = time.monotonic() + FULL_GC_INTERVAL
        next_young_gc = 0.0
        while True:
            due = pipeline.next_deadline()
            planned = due
            wake.clear()
            delay = due - pipeline.assembler.clock()
            if delay > 0:
                try:
                    await asyncio.wait_for(wake.wait(), delay)
                    continue  # an earlier deadline arrived: recompute
                except TimeoutError:
                    pass
            try:
                pipeline.sweep()
            except Exception:  # a bug in one trace must not stop every later verdict
                log.exception("sweep_failed")
            logs.flush()  # the sweep's run_verdict lines
            now = time.monotonic()
            if now >= next_full_gc:
                next_full_gc = now + FULL_GC_INTERVAL
                full_collection()
            elif now >= next_young_gc:
                next_young_gc = now + YOUNG_GC_INTERVAL
                gc.collect(0)  # see _tune_gc: CPython's own trigger lags once the late window is full
            await asyncio.sleep(0)  # let receivers run between back-to-back sweeps

    async def stop(self) -> None:
        if self.hub is not None:
            self.hub.close()
        await stop_all(self.receivers)
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self.pipeline is not None:
            open_traces = self.pipeline.assembler.traces_in_flight
            kept = await asyncio.to_thread(self.pipeline.close)
            # kept: traces whose spans the journal holds for the next start (cut short, or not stored)
            log.info("collector_stopped", finalized_on_shutdown=open_traces, journal_traces=kept)
        logs.flush()
        if self.spans is not None:
            self.spans.shutdown()
        if self.metrics is not None:
            self.metrics.shutdown()
        self.store.close()


#: glibc malloc arenas the collector's threads share (``MALLOC_ARENA_MAX`` in the environment wins).
MALLOC_ARENAS = 1
_M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)


def _tune_malloc() -> None:
    """One malloc arena for every thread, set before the first thread starts.

    glibc gives each thread that allocates under contention an arena of its own (up to 8 per core),
    and memory freed in an arena is seldom returned: the gRPC, store, journal and export threads each
    kept theirs at its peak. Under ``bench/throughput.py`` over 16 streams one arena held peak RSS at
    147-153 MiB against 157-165, at no measurable cost per span (Python's own allocator serves small
    objects without malloc). Not glibc (musl, macOS): nothing to do.
    """
    if "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, MALLOC_ARENAS)


#: Seconds between the full garbage collections the sweeper runs (see :func:`_tune_gc`).
FULL_GC_INTERVAL = 600.0
#: Allocations (less deallocations) between two young collections CPython makes in the live collector.
YOUNG_GC = 10_000
#: Seconds between the young collections the sweeper makes itself (see :func:`_tune_gc`).
YOUNG_GC_INTERVAL = 0.1


def _tune_gc() -> None:
    """Garbage collection for a process that holds many objects for a long time.

    - What is alive at start (imports, config, servers: ~80K objects) lives as long as the process:
      it is frozen out of every later collection.
    - Traces in flight and finalized traces kept for the late window (up to ``max_late_traces``) are
      hundreds of thousands of objects. CPython's own policy walks them again and again: the middle
      generation every 20 young collections (bench/latency.py: a 200-250 ms pause every ~30 s at
      10,000 spans/s, p99 +90-180 ms over a minute), the oldest whenever a quarter as many as it
      holds have survived into it (0.2-0.5 s every few seconds).
    - So CPython collects only the young generation by itself, every ``YOUNG_GC`` allocations, and
      each young collection's survivors are frozen out of the later ones: a pause is the young
      generation's own walk, for the same CPU a span (bench/peers.py). Nearly all cyclic garbage
      (gRPC's, a few objects a request) dies young and is collected there.
    - CPython counts allocations less deallocations, frozen objects' included: once the late window
      is full, each trace it lets go of frees about as many objects as a new one makes, the count
      hardly grows, and a young collection came every few seconds, walking 80-200K objects (20-120
      ms; bench/latency.py after ~40 s). So the sweeper also collects the young generation every
      ``YOUNG_GC_INTERVAL``.
    - A cycle that becomes garbage after it was frozen waits for :func:`full_collection`, which the
      sweeper runs every ``FULL_GC_INTERVAL`` (one pause of the whole heap, ~0.6 s at a full late
      window).
    """
    gc.freeze()
    gc.set_threshold(YOUNG_GC, 2**31 - 1, 2**31 - 1)
    gc.callbacks.append(_freeze_survivors)


def _freeze_survivors(phase: str, info: dict[str, int]) -> None:
    """After a young collection: what survived it out of every later automatic collection."""
    if phase == "stop" and info["generation"] == 0:
        gc.freeze()


def full_collection() -> None:
    """Every object, the frozen ones included (cycles that became garbage after they were frozen), then
    what is alive frozen again."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def check(cfg: CollectorConfig) -> BearerAuth:
    """What a loaded config still needs before anything starts (``serve`` first, ``collector validate``
    alone, as ``otelcol validate``): its secrets readable, a token where /metrics requires one, its TLS
    files loadable, the kafka receiver's client installed. Raises :class:`ConfigError` naming the key;
    returns the receivers' auth. Ports and the store are not touched: they are the running machine's."""
    cfg.store.password()
    auth = BearerAuth(cfg.receivers.auth.token())
    prometheus = cfg.exporters.prometheus
    if prometheus.enabled and prometheus.require_auth and not auth.enabled:
        raise ConfigError("exporters.prometheus.require_auth: set receivers.auth.bearer_token_file or "
                          "bearer_token_env, whose token /metrics will then require")
    if cfg.receivers.tls.enabled:
        ssl_context(cfg.receivers.tls)  # loads the certificate, key and client CA as both listeners will
    if cfg.receivers.kafka.enabled:
        kafka_client()
    return auth


def _endpoints(cfg: CollectorConfig) -> list[tuple[str, str]]:
    """(config key, host:port) of every listener this config opens."""
    out = []
    if cfg.receivers.grpc.enabled:
        out.append(("receivers.grpc.endpoint", cfg.receivers.grpc.endpoint))
    if cfg.receivers.http.enabled:
        out.append(("receivers.http.endpoint", cfg.receivers.http.endpoint))
    if cfg.exporters.prometheus.enabled:
        out.append(("exporters.prometheus.endpoint", cfg.exporters.prometheus.endpoint))
    return out


def check_ports(cfg: CollectorConfig) -> None:
    """Fail before binding anything, naming the address and its config key, when a port is taken.

    A probe bind (closed at once) rather than the listeners' own errors: gRPC reports only "Failed to
    bind" after logging to stderr, and a half-started collector would have to be unwound.
    """
    for key, endpoint in _endpoints(cfg):
        host, port = split_endpoint(endpoint)
        if port == 0:
            continue
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
            socket.create_server((host, port), family=family).close()
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"{key}: {endpoint} is already in use (another collector, e.g. `make run`, or another "
                    f"program listens there): stop it, or set {key} to a free port in --config (port 0 picks one)"
                ) from None
            raise ConfigError(f"{key}: cannot listen on {endpoint}: {exc.strerror or exc}") from None


def raise_file_limit() -> int | None:
    """Raise the soft open-files limit to the hard one (as Go servers do): every connection costs a
    descriptor, and a low soft limit (often 1024) is a cheap denial of service. Returns the limit."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # e.g. an unlimited hard limit above the kernel's nr_open
            pass
    return None if soft == resource.RLIM_INFINITY else soft


async def serve(config: CollectorConfig, stop: asyncio.Event | None = None) -> None:
    """Run until SIGTERM / SIGINT (or ``stop`` is set)."""
    _tune_malloc()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    collector = Collector(config)
    listening = await collector.start()
    _tune_gc()  # here, not in start(): it sets the process's collector, once everything started is alive
    print(
        "agenteval collector listening:"
        + (f"\n  OTLP/gRPC  {listening.grpc}  (also FidelityService: agenteval watch --endpoint {listening.grpc})"
           if listening.grpc else "")
        + (f"\n  OTLP/HTTP  {listening.http}/v1/traces" if listening.http else "")
        + (f"\n  run page   {listening.http}/runs" if listening.http and config.receivers.http.run_page else "")
        + (f"\n  health     {listening.http}/healthz, {listening.http}/readyz" if listening.http else "")
        + (f"\n  metrics    http://{listening.prometheus}/metrics" if listening.prometheus else "")
        + f"\n  run store  {listening.store}"
        + ("" if collector.store.is_open else "  (not reachable yet: retrying; spans are journaled meanwhile)")
        + (f"\n  kafka      {listening.kafka}  (group {config.receivers.kafka.group_id}; Kafka is the durable log)"
           if listening.kafka else
           f"\n  journal    {listening.journal or 'off: an accepted span is in memory only until its run is stored'}")
        + "\nPress Ctrl-C to stop.",
        flush=True,
    )
    logs.flush()  # the start's info lines (store migrations, collector_listening) after the banner, not above it
    await stop.wait()
    if config.shutdown_delay:
        # still accepting, so spans a load balancer routes here until it learns of the stop are not refused
        log.info("collector_stopping", shutdown_delay=config.shutdown_delay)
        if collector.health is not None:
            collector.health.stopping = True
        await asyncio.sleep(config.shutdown_delay)
    await collector.stop()
