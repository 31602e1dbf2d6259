"""The scaled-out deployment run for real (docs/design.md §7): our OpenTelemetry Collector distribution
(otelcol/manifest.yaml, `make otelcol`) on config/otelcol.yaml, the very file docker-compose.yml
mounts, routing by trace id to 2 and to 3 agenteval replicas that share one PostgreSQL.

The real OTLP SDK exporter (BatchSpanProcessor + OTLPSpanExporter, four of them at once) sends 1,200
MAF-shaped traces, each split over several requests and interleaved with the others. Every trace is
reconciled exactly once, on one replica, with its scenario's status, and every replica gets a share;
a replica killed with SIGKILL mid-load and restarted on its journal loses nothing the load balancer
acknowledged; a replica refusing for capacity is retried by the load balancer, not dropped. The
source spans reach "Jaeger" (an in-test OTLP receiver) through the same file's second pipeline."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
import yaml
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from conftest import CaptureReceiver, CollectorProcess
from mafshape import SCENARIOS, record, run_id

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from otelcol.process import Otelcol, binary_path, free_port

CONFIG = ROOT / "config/otelcol.yaml"
TRACES = 1_200
SENDERS = 4
SEED = 20261204
#: Replica assembly settings beside conftest's: a trace is closed 3 s after its last span (the load
#: balancer keeps each replica's spans in order, so this only has to cover gaps in the traffic), and
#: one whose root is missing only after a long wait, so a restart never closes a trace early.
ASSEMBLY = {"quiet_period": 3.0, "max_trace_wait": 120.0}
#: The capacity-limited replica: refuses (UNAVAILABLE + RetryInfo 0.2 s) above 2,500 spans in flight,
#: while its share of the traffic (about 4,800 spans), each trace held 6 s after its last span, is
#: more; the limit leaves room for one request of the load balancer's (1,024 spans at most) beside
#: the spans of the traces still in progress, so the queue keeps moving.
TIGHT = {"max_spans_in_flight": 2_500, "quiet_period": 6.0, "retry_after": 0.2}
#: The load balancer retries a replica briskly in the tests (compose: 250 ms to 1 s).
RETRY = {"OTELCOL_RETRY_INITIAL_INTERVAL": "100ms", "OTELCOL_RETRY_MAX_INTERVAL": "500ms"}


# --- the parts ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def otelcol_built() -> Path:
    path = binary_path()
    if not path.exists():
        message = f"our OpenTelemetry Collector distribution is not built ({path}): run `make otelcol`"
        if os.environ.get("AGENTEVAL_REQUIRE_OTELCOL"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@dataclass
class Replica:
    """One agenteval replica on a fixed gRPC port and journal, across restarts (one CollectorProcess
    a life, each with its own log)."""

    name: str
    root: Path
    store_url: str
    assembly: dict
    port: int = field(default_factory=free_port)
    lives: list[CollectorProcess] = field(default_factory=list)

    def start(self) -> None:
        overrides = {"assembly": self.assembly, "receivers": {"grpc": {"endpoint": f"127.0.0.1:{self.port}"}},
                     "journal": {"path": str(self.root / "journal")}}
        self.lives.append(CollectorProcess(self.root / f"life{len(self.lives)}", overrides,
                                           env={"AGENTEVAL_INSTANCE": self.name}, store_url=self.store_url))

    @property
    def current(self) -> CollectorProcess:
        return self.lives[-1]

    def kill_9(self) -> None:
        self.current.proc.send_signal(signal.SIGKILL)
        self.current.stop()

    def events(self, name: str) -> list[dict]:
        return [e for life in self.lives for e in life.log_events() if e.get("event") == name]

    def metric(self, name: str) -> float:
        """A metric of the running life, summed over its labels."""
        return sum(v for (metric, _), v in self.current.metrics().items() if metric == name)


class Acked(SpanExporter):
    """The real OTLP/gRPC exporter, counting the spans the load balancer acknowledged."""

    def __init__(self, endpoint: str) -> None:
        self.inner = OTLPSpanExporter(endpoint=endpoint, insecure=True)
        self.acked: set[tuple[int, int]] = set()
        self.refused = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self.inner.export(spans)
        if result is SpanExportResult.SUCCESS:
            self.acked.update((s.context.trace_id, s.context.span_id) for s in spans)
        else:
            self.refused += len(spans)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()


@dataclass
class Traffic:
    """TRACES recorded workflow runs: their spans by trace (finish order, root last) and scenario."""

    spans: dict[str, list[ReadableSpan]]
    scenario: dict[str, str]

    def total(self) -> int:
        return sum(len(s) for s in self.spans.values())


@pytest.fixture(scope="module")
def traffic() -> Traffic:
    names = [random.Random(SEED + i).choice(sorted(SCENARIOS)) for i in range(TRACES)]
    spans, ids = record([SCENARIOS[name][0] for name in names])
    by_trace: dict[str, list[ReadableSpan]] = {tid: [] for tid in ids}
    for span in spans:
        by_trace[format(span.context.trace_id, "032x")].append(span)
    return Traffic(by_trace, dict(zip(ids, names, strict=True)))


def interleaved(traces: list[list[ReadableSpan]], rng: random.Random, window: int = 40) -> Iterator[ReadableSpan]:
    """Every span, each trace's in its own order, a few at a time from one of ``window`` traces in
    progress at once (so a request carries parts of many traces, and a trace spans many requests)."""
    waiting, active = list(traces), []
    while waiting or active:
        while waiting and len(active) < window:
            active.append(list(waiting.pop()))
        trace = rng.choice(active)
        for _ in range(rng.randint(1, 3)):
            if trace:
                yield trace.pop(0)
        if not trace:
            active.remove(trace)


class Load:
    """SENDERS applications at once, each a BatchSpanProcessor over an :class:`Acked` exporter."""

    def __init__(self, endpoint: str, traffic: Traffic) -> None:
        self.exporters = [Acked(endpoint) for _ in range(SENDERS)]
        self.processors = [BatchSpanProcessor(e, max_queue_size=traffic.total() + 1, schedule_delay_millis=20,
                                              max_export_batch_size=64) for e in self.exporters]
        rng = random.Random(SEED)
        traces = list(traffic.spans.values())
        rng.shuffle(traces)
        for i, processor in enumerate(self.processors):
            for span in interleaved(traces[i::SENDERS], rng):
                processor.on_end(span)

    def acked(self) -> set[tuple[int, int]]:
        return set().union(*(e.acked for e in self.exporters))

    def finish(self) -> None:
        for processor in self.processors:
            processor.shutdown()  # exports what is queued first


def stored_runs(url: str) -> dict[str, list[dict]]:
    """trace id -> its stored runs (one expected), straight from the shared database."""
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT trace_id, run_id, revision, incomplete, status, finalized_by FROM runs").fetchall()
    out: dict[str, list[dict]] = {}
    for tid, rid, revision, incomplete, status, host in rows:
        out.setdefault(tid, []).append({"run_id": rid, "revision": revision, "incomplete": bool(incomplete),
                                        "status": status, "finalized_by": host})
    return out


def wait_stored(url: str, traces: Iterable[str], timeout: float = 120.0) -> dict[str, list[dict]]:
    wanted = set(traces)
    deadline = time.monotonic() + timeout
    while True:
        runs = stored_runs(url)
        if wanted <= set(runs) or time.monotonic() > deadline:
            return runs
        time.sleep(0.25)


# --- the topology ---------------------------------------------------------------------------------

@dataclass
class Topology:
    replicas: list[Replica]
    otelcol: Otelcol
    jaeger: CaptureReceiver

    def stop(self) -> None:
        self.otelcol.stop()
        for replica in self.replicas:
            replica.current.stop()
        self.jaeger.server.stop(0)


def topology(tmp: Path, url: str, assemblies: list[dict]) -> Topology:
    """One replica per entry of ``assemblies`` (its settings beside ASSEMBLY), the load balancer
    in front of them all, and "Jaeger"."""
    replicas = [Replica(f"agenteval-{i + 1}", tmp / f"agenteval-{i + 1}", url, {**ASSEMBLY, **a})
                for i, a in enumerate(assemblies)]
    for replica in replicas:
        replica.start()
    jaeger = CaptureReceiver()
    env = {"AGENTEVAL_REPLICAS": "[" + ", ".join(f"127.0.0.1:{r.port}" for r in replicas) + "]",
           "OTELCOL_JAEGER_ENDPOINT": f"127.0.0.1:{jaeger.port}", **RETRY}
    return Topology(replicas, Otelcol([CONFIG], tmp / "otelcol.log", env), jaeger)


def check_every_trace_once(top: Topology, traffic: Traffic, url: str, load: Load) -> dict[str, int]:
    """Everything sent was acknowledged, and every trace is stored once, as its scenario expects, by
    the one replica that reconciled it; returns runs per replica."""
    assert load.acked() == {(s.context.trace_id, s.context.span_id) for ss in traffic.spans.values() for s in ss}
    assert sum(e.refused for e in load.exporters) == 0
    runs = wait_stored(url, traffic.spans)
    missing = [tid for tid in traffic.spans if tid not in runs]
    assert not missing, f"{len(missing)} of {TRACES} traces never stored, e.g. {missing[:3]}"
    names = {r.name for r in top.replicas}
    wrong = {}
    for tid, scenario in traffic.scenario.items():
        got = runs[tid]
        want = [{"run_id": run_id(tid), "revision": 1, "incomplete": False, "status": SCENARIOS[scenario][1],
                 "finalized_by": got[0]["finalized_by"]}]
        if got != want or got[0]["finalized_by"] not in names:
            wrong[tid] = got
    assert not wrong, f"{len(wrong)} traces stored wrongly, e.g. {list(wrong.items())[:3]}"
    # Reconciled on one replica only (a trace split between replicas would be reconciled on both),
    # and each replica holds no trace open: none of them got part of someone else's trace.
    by_replica = {r.name: {e["trace_id"] for e in r.events("run_verdict")} for r in top.replicas}
    for replica in top.replicas:
        assert by_replica[replica.name] == {t for t, rs in runs.items() if rs[0]["finalized_by"] == replica.name}
        assert replica.metric("agenteval_traces_in_flight") == 0
    # The load balancer dropped nothing it had accepted, and the spans also reached "Jaeger".
    dropped = top.otelcol.metrics()
    assert not any(v for k, v in dropped.items() if k.startswith(("otelcol_exporter_send_failed",
                                                                  "otelcol_exporter_enqueue_failed")))
    deadline = time.monotonic() + 30
    while {s.trace_id.hex() for _, s in top.jaeger.spans()} != set(traffic.spans) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {s.trace_id.hex() for _, s in top.jaeger.spans()} == set(traffic.spans)
    return {name: len(traces) for name, traces in by_replica.items()}


# --- the tests ------------------------------------------------------------------------------------

def test_the_compose_config_validates_with_our_distribution(otelcol_built: Path) -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["otelcol"]
    result = subprocess.run([str(otelcol_built), "validate", f"--config={CONFIG}"], capture_output=True, text=True,
                            env={**os.environ, **compose.get("environment", {})}, timeout=60)
    assert result.returncode == 0, result.stderr


def test_two_replicas_one_killed_mid_load_and_restarted(otelcol_built, postgres, traffic, tmp_path):
    url = postgres.database()
    top = topology(tmp_path, url, [{}, {}])
    victim = top.replicas[0]
    try:
        load = Load(top.otelcol.grpc, traffic)
        while victim.metric("agenteval_spans_received_total") < traffic.total() / 6:  # a third of its share
            time.sleep(0.02)
        victim.kill_9()
        victim.start()  # same port and journal; the load balancer retried meanwhile
        load.finish()
        shares = check_every_trace_once(top, traffic, url, load)
    finally:
        top.stop()
    assert all(shares.values()), shares
    # The crash was real: the restarted replica replayed spans it had acknowledged before SIGKILL,
    # and the load balancer retried what it had not.
    assert sum(e["spans"] for e in victim.events("journal_replayed")) > 0
    assert "Will retry the request after interval" in top.otelcol.log_path.read_text()


def test_three_replicas_one_refusing_for_capacity(otelcol_built, postgres, traffic, tmp_path):
    url = postgres.database()
    top = topology(tmp_path, url, [{}, {}, TIGHT])
    tight = top.replicas[2]
    try:
        load = Load(top.otelcol.grpc, traffic)
        load.finish()
        shares = check_every_trace_once(top, traffic, url, load)
        refused = tight.metric("agenteval_spans_refused_total")
    finally:
        top.stop()
    assert all(shares.values()), shares
    assert refused > 0 and tight.events("request_refused"), "the tight replica never refused: raise TRACES"
    assert "Will retry the request after interval" in top.otelcol.log_path.read_text()
