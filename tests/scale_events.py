"""Ring changes under load, for real (docs/scale-out.md): our OpenTelemetry Collector distribution on
config/otelcol.yaml with the loadbalancing exporter's ``dns`` resolver, in front of agenteval replicas
sharing one PostgreSQL; tests/test_scale_events.py and bench/scale_events.py run it.

The resolver's answer is a private hosts file: the load balancer runs in a mount namespace of its own
(``unshare -m``) with that file bind-mounted over /etc/hosts, and the file is rewritten in place (the
bind mount follows its inode) to add or remove replicas. Go's resolver reads /etc/hosts again when
it changed (it looks at most every 5 s), and the resolver asks every second. The replicas listen on
loopback addresses of their own (127.0.0.2, .3, ...: the dns resolver gives every replica the same
port), so no address outside this machine is ever bound.

Traces are exported as a real SDK does: the real OTLP exporter behind BatchSpanProcessors, each trace's
spans in the order they finished (children first, the workflow-run span last), spread over several
seconds. Each trace is then judged against its scenario (:func:`judge`).
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import yaml
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from collector.store import unpack

from conftest import CollectorProcess
from mafshape import SCENARIOS, record, run_id

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from otelcol.process import Otelcol, free_port

CONFIG = ROOT / "config/otelcol.yaml"
HOSTNAME = "agenteval.test"
#: Replica settings: closed 3 s after its last span; a part handed over after 2 s quiet without its
#: root; parts nobody with the root claimed are reconciled apart after 20 s.
ASSEMBLY = {"quiet_period": 3.0, "handover_after": 2.0, "max_trace_wait": 20.0, "late_window": 120.0,
            "sweep_interval": 0.2}
#: Seconds the load balancer may take to route by a changed hosts file: Go's resolver looks at the
#: file at most every 5 s, the dns resolver asks every second.
RING_LAG = 7.0
#: Status order: a run whose status is before its truth's in this order looks better than the truth.
RANK = {"PASS": 0, "WARN": 1, "PENDING": 1, "FAIL": 2}


class Ring:
    """The hosts file the load balancer resolves the replicas' name in."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.write_text("127.0.0.1 localhost\n")
        self.addresses: list[str] = []

    def set(self, addresses: Sequence[str]) -> None:
        """Rewrite the file in place (same inode: the bind mount shows the new content)."""
        self.addresses = list(addresses)
        text = "127.0.0.1 localhost\n" + "".join(f"{a} {HOSTNAME}\n" for a in addresses)
        with self.path.open("r+") as f:
            f.seek(0)
            f.write(text)
            f.truncate()


@dataclass
class Replica:
    name: str
    address: str
    port: int
    root: Path
    store_url: str
    lives: list[CollectorProcess] = field(default_factory=list)

    #: Run the collector of that source tree (a commit before issue 43, as bench/scale_events.py's
    #: baseline): without the settings it does not know.
    code: str | None = None

    def start(self) -> None:
        overrides = {"shutdown_delay": RING_LAG, "assembly": ASSEMBLY,
                     "receivers": {"grpc": {"endpoint": f"{self.address}:{self.port}"}},
                     "journal": {"path": str(self.root / "journal")}}
        env = {"AGENTEVAL_INSTANCE": self.name}
        if self.code:
            overrides.pop("shutdown_delay")
            overrides["assembly"] = {k: v for k, v in ASSEMBLY.items() if k != "handover_after"}
            env["PYTHONPATH"] = self.code
        self.lives.append(CollectorProcess(self.root / f"life{len(self.lives)}", overrides, env=env,
                                           store_url=self.store_url))

    @property
    def current(self) -> CollectorProcess:
        return self.lives[-1]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.current.stop(sig)

    def verdicts(self) -> list[dict]:
        return [e for life in self.lives for e in life.log_events() if e.get("event") == "run_verdict"]


class Acked(SpanExporter):
    """The real OTLP/gRPC exporter, counting what the load balancer acknowledged."""

    def __init__(self, endpoint: str) -> None:
        self.inner = OTLPSpanExporter(endpoint=endpoint, insecure=True)
        self.acked = 0
        self.refused = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self.inner.export(spans)
        if result is SpanExportResult.SUCCESS:
            self.acked += len(spans)
        else:
            self.refused += len(spans)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()


def traffic(traces: int, seed: int) -> tuple[dict[str, list[ReadableSpan]], dict[str, str]]:
    """Recorded workflow runs: spans by trace (finish order, root last), and each trace's scenario."""
    names = [random.Random(seed + i).choice(sorted(SCENARIOS)) for i in range(traces)]
    spans, ids = record([SCENARIOS[name][0] for name in names])
    by_trace: dict[str, list[ReadableSpan]] = {tid: [] for tid in ids}
    for span in spans:
        by_trace[format(span.context.trace_id, "032x")].append(span)
    return by_trace, dict(zip(ids, names, strict=True))


class Feed:
    """Each trace's spans handed to one of ``senders`` BatchSpanProcessors (500 ms schedule) over
    ``duration`` seconds from its start, the traces starting evenly over ``spread`` seconds."""

    def __init__(self, endpoint: str, spans: dict[str, list[ReadableSpan]], spread: float,
                 duration: tuple[float, float] = (4.0, 8.0), senders: int = 4, seed: int = 43) -> None:
        rng = random.Random(seed)
        total = sum(len(s) for s in spans.values())
        self.exporters = [Acked(endpoint) for _ in range(senders)]
        self.processors = [BatchSpanProcessor(e, max_queue_size=total + 1, schedule_delay_millis=500,
                                              max_export_batch_size=128) for e in self.exporters]
        schedule = []
        #: trace -> (first span handed over, last), seconds from the start
        self.window: dict[str, tuple[float, float]] = {}
        for k, (tid, trace) in enumerate(spans.items()):
            start, length = spread * k / max(len(spans), 1), rng.uniform(*duration)
            for i, span in enumerate(trace):
                schedule.append((start + length * i / max(len(trace) - 1, 1), k % senders, span))
            self.window[tid] = (start, start + length)
        schedule.sort(key=lambda item: item[0])
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(schedule,), daemon=True)
        self._thread.start()

    def _run(self, schedule: list) -> None:
        for at, sender, span in schedule:
            delay = self.started + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self.processors[sender].on_end(span)

    def now(self) -> float:
        return time.monotonic() - self.started

    def finish(self) -> None:
        self._thread.join()
        for processor in self.processors:
            processor.shutdown()  # exports what is queued first

    def in_flight(self, began: float, ended: float, quiet: float = ASSEMBLY["quiet_period"]) -> set[str]:
        """Traces ring changes made from ``began`` to ``ended`` can split: sent (or still open on a
        replica) while they happen and the load balancer takes them in (:data:`RING_LAG`)."""
        return {tid for tid, (first, last) in self.window.items()
                if first <= ended + RING_LAG and began <= last + quiet}


class Topology:
    """The replicas on one port at addresses of their own, the load balancer resolving them by name."""

    def __init__(self, tmp: Path, url: str, replicas: int, code: str | None = None) -> None:
        self.tmp, self.url, self.code = tmp, url, code
        self.port = free_port()
        self.ring = Ring(tmp / "hosts")
        self.replicas: list[Replica] = []
        self._stopping: list[threading.Thread] = []
        self._next = 2
        for _ in range(replicas):
            self.add(join=False)
        self.ring.set([r.address for r in self.replicas])
        config = yaml.safe_load(CONFIG.read_text())
        config["exporters"]["load_balancing"]["resolver"] = {
            "dns": {"hostname": HOSTNAME, "port": str(self.port), "interval": "1s", "timeout": "1s"}}
        del config["exporters"]["otlp_grpc/jaeger"], config["service"]["pipelines"]["traces/jaeger"]
        (tmp / "otelcol.yaml").write_text(yaml.safe_dump(config))
        # its own mount namespace, where the private hosts file is /etc/hosts
        wrap = [shutil.which("unshare") or "unshare", "-m", "--propagation", "private", "sh", "-c",
                'mount --bind "$0" /etc/hosts && exec "$@"', str(self.ring.path)]
        self.otelcol = Otelcol([tmp / "otelcol.yaml"], tmp / "otelcol.log",
                               {"OTELCOL_RETRY_INITIAL_INTERVAL": "100ms", "OTELCOL_RETRY_MAX_INTERVAL": "500ms"},
                               wrap=wrap)

    def add(self, join: bool = True) -> Replica:
        replica = Replica(f"agenteval-{self._next - 1}", f"127.0.0.{self._next}", self.port,
                          self.tmp / f"agenteval-{self._next - 1}", self.url, code=self.code)
        self._next += 1
        replica.start()
        self.replicas.append(replica)
        if join:
            self.ring.set([*self.ring.addresses, replica.address])
        return replica

    def remove(self, replica: Replica) -> None:
        """Out of the resolver's answer and sent SIGTERM at the same moment, as Kubernetes does (it
        then stops within its shutdown_delay and the time to hand its parts over)."""
        self.ring.set([a for a in self.ring.addresses if a != replica.address])
        stopping = threading.Thread(target=replica.stop)
        stopping.start()
        self._stopping.append(stopping)

    # --- the scale events -------------------------------------------------------------------------
    def scale_up(self) -> None:
        self.add()

    def scale_down(self) -> None:
        self.remove(self.serving()[0])

    def kill_9(self) -> None:
        """One replica killed and started again on its address and journal (a pod restarted)."""
        victim = self.serving()[0]
        victim.stop(signal.SIGKILL)
        victim.start()

    def rolling_restart(self, pause: float = 3.0) -> None:
        """Every replica replaced by a new one (a new pod, a new address), one at a time."""
        for old in self.serving():
            self.add()
            self.remove(old)
            time.sleep(pause)

    def serving(self) -> list[Replica]:
        return [r for r in self.replicas if r.address in self.ring.addresses]

    def stop(self) -> None:
        self.otelcol.stop()
        for stopping in self._stopping:
            stopping.join()
        for replica in self.replicas:
            if replica.lives and replica.current.proc.poll() is None:
                replica.stop()


EVENTS: dict[str, Callable[[Topology], None]] = {
    "scale up": Topology.scale_up, "scale down + SIGTERM": Topology.scale_down,
    "rolling restart": Topology.rolling_restart, "kill -9 + restart": Topology.kill_9}


def stored(url: str) -> tuple[dict[str, list[dict]], int]:
    """trace id -> its stored run documents; and how many parts wait unclaimed."""
    with psycopg.connect(url) as conn:
        # the document compressed (issue 42), or as JSON text in a baseline's store
        columns = {c for (c,) in conn.execute("SELECT column_name FROM information_schema.columns "
                                              "WHERE table_name = 'runs'")}
        column = "body" if "body" in columns else "doc"
        rows = conn.execute(f"SELECT trace_id, {column}, revision, finalized_by FROM runs").fetchall()
        known = conn.execute("SELECT to_regclass('parts') IS NOT NULL").fetchone()[0]  # not before issue 43
        parts = conn.execute("SELECT count(*) FROM parts").fetchone()[0] if known else 0
    out: dict[str, list[dict]] = {}
    for tid, doc, revision, host in rows:
        d = json.loads(unpack(doc) if column == "body" else doc)
        d.update(revision=revision, finalized_by=host)
        out.setdefault(tid, []).append(d)
    return out, parts


def settle(url: str, traces: set[str], quiet: float = 5.0, timeout: float = 180.0) -> dict[str, list[dict]]:
    """Wait until every trace has a run, no part waits, and nothing changed for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        runs, parts = stored(url)
        state = (parts, tuple(sorted((t, d["run_id"], d["revision"]) for t, ds in runs.items() for d in ds)))
        if state != last:
            last, since = state, time.monotonic()
        elif traces <= set(runs) and not parts and time.monotonic() - since >= quiet:
            return runs
        time.sleep(0.5)
    return stored(url)[0]


def judge(trace_id: str, scenario: str, runs: list[dict]) -> str:
    """``exact`` (one run, its scenario's status and units), ``merged`` (exact, with parts merged
    from other replicas), ``flagged`` (not exact, but every run that differs from the truth says so:
    split or incomplete), ``lost`` (no run), or ``wrong: why`` (a clean-looking run better than the
    truth), ``missing: why`` (no better than the truth, but missing a unit without saying so)."""
    if not runs:
        return "lost"
    _, status, verdicts = SCENARIOS[scenario]
    units = set(verdicts)
    for doc in runs:
        flagged = doc.get("split") or doc["incomplete"]
        got = {e["executor_id"]: e["verdict"] for e in doc["executors"]}
        if not flagged and RANK[doc["status"]] < RANK[status]:
            return f"wrong: {doc['status']} with units {sorted(got)} for a {status} trace with {sorted(units)}"
        if not flagged and not units <= set(got):  # no better than the truth, but a unit is missing
            return f"missing: {doc['status']} with units {sorted(got)} for a {status} trace with {sorted(units)}"
    if len(runs) == 1:
        doc = runs[0]
        got = {e["executor_id"]: e["verdict"] for e in doc["executors"]}
        if (doc["run_id"] == run_id(trace_id) and doc["status"] == status and got == verdicts
                and not doc.get("split") and not doc["incomplete"]):
            return "merged" if any(n.startswith("Merged across replicas") for n in doc["notes"]) else "exact"
    return "flagged"


def deleted(replicas: list[Replica], runs: dict[str, list[dict]]) -> list[str]:
    """Runs some replica published that the store no longer holds, unless a run of their trace holds
    every unit they had (the supersede rule's one case)."""
    out = []
    for replica in replicas:
        for event in replica.verdicts():
            held = runs.get(event["trace_id"], [])
            if any(d["run_id"] == event["run_id"] for d in held):
                continue
            if not any(set(event["executors"]) <= {e["executor_id"] for e in d["executors"]} for d in held):
                out.append(event["run_id"])
    return out


@dataclass
class Round:
    """One sitting's outcome: per event, the traces in flight and how they were stored."""

    outcome: dict[str, str]
    in_flight: dict[str, set[str]]
    deleted: list[str]
    acked: int
    refused: int

    def table(self) -> dict[str, Counter]:
        rows = {event: Counter(self.outcome[t].split(":")[0] for t in traces)
                for event, traces in self.in_flight.items()}
        rows["all traces"] = Counter(v.split(":")[0] for v in self.outcome.values())
        return rows


def run_round(tmp: Path, url: str, traces: int, seed: int, events: list[tuple[float, str]], replicas: int = 2,
              spread: float = 20.0, code: str | None = None) -> Round:
    """``traces`` traces over ``spread`` seconds, the named events at their times (seconds from the
    start), then everything judged once the store has settled."""
    spans, scenario = traffic(traces, seed)
    top = Topology(tmp, url, replicas, code)
    try:
        feed = Feed(top.otelcol.grpc, spans, spread)
        in_flight = {}
        for at, name in events:
            while feed.now() < at:
                time.sleep(0.05)
            began = feed.now()
            EVENTS[name](top)
            in_flight[name] = feed.in_flight(began, feed.now())
        feed.finish()
        runs = settle(url, set(spans))
        return Round({t: judge(t, scenario[t], runs.get(t, [])) for t in spans}, in_flight,
                     deleted(top.replicas, runs), sum(e.acked for e in feed.exporters),
                     sum(e.refused for e in feed.exporters))
    finally:
        top.stop()
