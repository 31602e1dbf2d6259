"""Shared fixtures: the collector as a subprocess (the way users run it) on ports chosen at run time,
and an in-test OTLP receiver that captures what the collector exports."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export import SpanExportResult
from prometheus_client.parser import text_string_to_metric_families

from collector.store import RunStore, open_store

sys.path.insert(0, str(Path(__file__).parent))
#: The CLI's piped output honours $COLUMNS; tests read it at its piped default width (160) unless a
#: test sets COLUMNS itself, whatever the shell that runs them has set.
os.environ.pop("COLUMNS", None)
os.unsetenv("COLUMNS")  # also from the C environment that subprocesses inherit

AGENTEVAL = str(Path(sys.executable).parent / "agenteval")
PROTOBUF, JSON = "application/x-protobuf", "application/json"

#: pytest-xdist workers for the suite (pyproject addopts: -n auto). The tests mostly wait on the
#: processes they start, so more workers than cores; on 2 cores, 4 ran the suite as fast as 5 and
#: 6 was slower (issue 34: about 4.5 minutes, against 15.5 serially).
WORKERS = 4


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """WORKERS, or one per test file when only files or tests are named (none for one file: a worker
    would only add its start-up to the run)."""
    files = {arg.split("::")[0] for arg in config.args}
    if all(name.endswith(".py") for name in files):
        return min(WORKERS, len(files)) if len(files) > 1 else 0
    return WORKERS


def export_spans(collector, spans, transport: str = "grpc") -> None:
    """Send SDK spans to the collector with the real OTLP exporter of that transport."""
    exporter = (GrpcExporter(endpoint=collector.grpc, insecure=True) if transport == "grpc"
                else HttpExporter(endpoint=f"{collector.http}/v1/traces"))
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    exporter.shutdown()


def runs_of(collector, traces: list[str], timeout: float = 20.0) -> list[dict]:
    """Every run stored for these traces, once the collector holds nothing more of them: no trace in
    assembly and no verdict waiting for the store (its gauges), twice in a row with the same runs
    stored (a sweep closes traces, then hands their runs to the store: the gauges can read 0
    between the two)."""
    wanted = set(traces)
    deadline = time.monotonic() + timeout
    found: list[dict] = []
    seen_idle: list[tuple[str, int]] | None = None
    while time.monotonic() < deadline:
        gauges = collector.metrics()
        idle = all(gauges.get((name, ()), 1) == 0
                   for name in ("agenteval_traces_in_flight", "agenteval_store_queued_runs"))
        found = sorted((d for d in collector.store().list_runs(limit=1000, with_docs=True) if d["trace_id"] in wanted),
                       key=lambda d: d["run_id"])
        stored = [(d["run_id"], d["revision"]) for d in found]
        if idle and found and stored == seen_idle:
            return found
        seen_idle = stored if idle else None
        time.sleep(0.2)
    if not found:
        raise AssertionError(f"no stored run for traces {sorted(wanted)}")
    return found


def post(url: str, body: bytes, ctype: str = PROTOBUF, headers: dict | None = None, context=None):
    """A raw OTLP/HTTP POST; returns (status, body, headers) whatever the status."""
    req = urllib.request.Request(f"{url}/v1/traces", data=body, method="POST",
                                 headers={"Content-Type": ctype, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=15, context=context) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def verdicts(run: dict) -> dict[str, str]:
    return {e["executor_id"]: e["verdict"] for e in run["executors"]}


#: A duration shown in µs, ms or s (the run page, `runs show`): its unit in seconds.
_SHOWN_UNITS = {"µs": 1e-6, "ms": 1e-3, "s": 1.0}


def shown_seconds(text: str) -> float:
    """A duration as shown under a second's minutes ("2.34 ms"), read back in seconds."""
    number, unit = text.split()
    return float(number) * _SHOWN_UNITS[unit]


class _MetricsCapture(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self) -> None:
        self.requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []

    def Export(self, request, context):
        self.requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def metric_names(self) -> set[str]:
        return {m.name for req in list(self.requests) for rm in req.resource_metrics
                for sm in rm.scope_metrics for m in sm.metrics}


class CaptureReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC receiver (traces and metrics) standing in for Jaeger or an OTel Collector."""

    def __init__(self, port: int = 0) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metrics = _MetricsCapture()
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self.metrics, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def Export(self, request, context):
        with self.lock:
            self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self, trace_id: str | None = None) -> list[tuple]:
        """(scope name, span) pairs, optionally of one trace."""
        out = []
        with self.lock:
            for req in self.requests:
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            if trace_id is None or span.trace_id.hex() == trace_id:
                                out.append((ss.scope.name, span))
        return out

    def wait_spans(self, trace_id: str, name_prefix: str, count: int, timeout: float = 15.0) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for _, s in self.spans(trace_id) if s.name.startswith(name_prefix)]
            if len(found) >= count:
                return found
            time.sleep(0.05)
        raise AssertionError(f"{count} {name_prefix!r} spans for {trace_id} not exported in {timeout}s")


def _merge(into: dict, values: dict) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def free_port() -> int:
    """A loopback port that was free a moment ago (for a receiver started later on purpose)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CollectorProcess:
    def __init__(self, tmp: Path, overrides: dict | None = None, otlp_out: str | None = None,
                 env: dict | None = None, store_url: str | None = None) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.store_path = tmp / "runs.db"
        self.store_url = store_url or str(self.store_path)
        self._store: RunStore | None = None
        cfg = {
            "receivers": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"endpoint": "127.0.0.1:0"}},
            "assembly": {"quiet_period": 0.3, "max_trace_wait": 2.0, "late_window": 60.0, "sweep_interval": 0.02},
            "store": {"url": self.store_url},
            # replicas sharing a PostgreSQL store each keep their own journal
            "journal": {"path": str(tmp / "runs.db.journal")},
            "exporters": {"prometheus": {"endpoint": "127.0.0.1:0"},
                          "otlp": {"endpoint": otlp_out, "metrics_interval": 0.5} if otlp_out else {}},
        }
        _merge(cfg, overrides or {})
        self.config_path = tmp / "collector.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg))
        self.stderr_path = tmp / "collector.log"
        self.stderr = self.stderr_path.open("w+")
        self.stdout_path = tmp / "collector.out"
        with self.stdout_path.open("w") as stdout:
            self.proc = subprocess.Popen([AGENTEVAL, "collector", "serve", "--config", str(self.config_path)],
                                         stdout=stdout, stderr=self.stderr, text=True,
                                         env={**os.environ, **(env or {})})
        self.listening = self._wait_listening()
        self.grpc = self.listening["grpc"]
        self.http = self.listening["http"]
        self.prometheus = f"http://{self.listening['prometheus']}/metrics"

    def _wait_listening(self) -> dict:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for event in self.log_events():
                if event.get("event") == "collector_listening":
                    return event
            if self.proc.poll() is not None:
                raise RuntimeError(f"collector exited {self.proc.returncode}: {self.stderr_path.read_text()}")
            time.sleep(0.05)
        raise RuntimeError("collector did not start listening")

    def log_events(self) -> list[dict]:
        events = []
        for line in self.stderr_path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
        return events

    def run(self, trace_id: str, revision: int = 1, timeout: float = 15.0) -> dict:
        """Wait for the stored run of a trace (at least ``revision``) and return its document."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            doc = self.store().get_run(trace_id)
            if doc is not None and doc["run_id"].startswith(trace_id) and doc["revision"] >= revision:
                doc.pop("created_at"), doc.pop("updated_at")
                return doc
            time.sleep(0.05)
        raise AssertionError(f"no stored run for {trace_id} revision {revision}; log:\n"
                             f"{self.stderr_path.read_text()[-3000:]}")

    def store(self) -> RunStore:
        """The collector's run store, opened the way `agenteval runs` opens it."""
        if self._store is None:
            self._store = open_store(self.store_url)
        return self._store

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = urllib.request.urlopen(self.prometheus, timeout=5).read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                # a label a series lacks is exposed as "" where others of its family have it: absent
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if v))
                out[(sample.name, labels)] = sample.value
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()
        if self._store is not None:
            self._store.close()
            self._store = None
        return self.proc.returncode


@pytest.fixture(scope="module")
def capture():
    receiver = CaptureReceiver()
    yield receiver
    receiver.server.stop(0)


@pytest.fixture(scope="module")
def collector(tmp_path_factory, capture):
    proc = CollectorProcess(tmp_path_factory.mktemp("collector"), otlp_out=f"127.0.0.1:{capture.port}")
    yield proc
    proc.stop()


# --- PostgreSQL -------------------------------------------------------------------------------

PG_PASSWORD_USER = "agenteval_pw"


def _pg_bindir() -> Path | None:
    if env := os.environ.get("AGENTEVAL_PG_BIN"):
        return Path(env)
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if found:
        return found[-1].parent
    which = shutil.which("initdb")
    return Path(which).parent if which else None


class PostgresServer:
    """A throwaway PostgreSQL cluster on a loopback port chosen at run time, in a temporary dir.

    As root (CI), the server runs as the ``postgres`` user, since initdb refuses to run as root.
    Local connections are trusted, except for PG_PASSWORD_USER, which needs its password.
    """

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="agenteval-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:
            shutil.chown(self.root, "postgres")
        self._pg("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8")
        (self.data / "pg_hba.conf").write_text(
            "local all all trust\n"
            f"host all {PG_PASSWORD_USER} 127.0.0.1/32 scram-sha-256\n"
            "host all all 127.0.0.1/32 trust\n")
        self.start()
        self.admin(f"CREATE ROLE {PG_PASSWORD_USER} LOGIN SUPERUSER PASSWORD 'right-horse-battery'")

    def _pg(self, tool: str, *args: str) -> None:
        subprocess.run([*self._as, str(self.bindir / tool), *args], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        self._pg("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-t", "60", "-o",
                 f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories={self.root} "
                 "-c fsync=off -c synchronous_commit=off -c full_page_writes=off", "start")

    def stop(self) -> None:
        self._pg("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def url(self, dbname: str = "postgres", user: str = "postgres") -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{dbname}"

    def admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(sql)

    def database(self) -> str:
        """A new empty database; its URL."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        self.admin(f"CREATE DATABASE {name}")
        return self.url(name)

    def destroy(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres():
    bindir = _pg_bindir()
    if bindir is None:
        if os.environ.get("AGENTEVAL_REQUIRE_POSTGRES"):
            pytest.fail("PostgreSQL server binaries not found (install Debian's postgresql, or set AGENTEVAL_PG_BIN)")
        pytest.skip("PostgreSQL not installed: `apt-get install postgresql` (CI installs it)")
    server = PostgresServer(bindir)
    yield server
    server.destroy()


#: Every span MAF and the instrumentation finish in this test process (one global TracerProvider:
#: MAF instruments the global provider, which can be set only once per process).
MAF_SPANS = None


@pytest.fixture(scope="session")
def maf_spans():
    """MAF's telemetry on the global provider, plus the fidelity instrumentation; the exporter."""
    global MAF_SPANS
    from agent_framework.observability import enable_instrumentation
    from opentelemetry import trace
    from opentelemetry.instrumentation.maf_fidelity import MafFidelityInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    if MAF_SPANS is None:
        MAF_SPANS = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(MAF_SPANS))
        trace.set_tracer_provider(provider)
        enable_instrumentation(enable_sensitive_data=True)  # prompts go out; the collector must drop them
    instrumentor = MafFidelityInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument()
    return MAF_SPANS
