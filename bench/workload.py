"""Realistic MAF-shaped OTLP payloads, pre-encoded, plus helpers shared by the bench scripts: the
collector as a subprocess, a multi-stream sender, and per-process CPU and RSS from ``/proc``.

A trace: a ``workflow.run`` root, 3-10 ``executor.process`` spans, under each an ``invoke_agent``
with 1-5 ``chat`` spans; about ten attributes a span (ids, usage, finish reasons, model names).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
import urllib.request
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.queues import Queue
from pathlib import Path
from typing import IO, Protocol

import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

AGENTEVAL = str(Path(sys.executable).parent / "agenteval")


def _kv(key: str, value) -> KeyValue:
    return KeyValue(key=key, value=_value(value))


def _value(value) -> AnyValue:
    """An attribute value as the OpenTelemetry SDK encodes it (a list is an OTLP array, as the MAF
    instrumentation's finish reasons are)."""
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, list):
        return AnyValue(array_value=ArrayValue(values=[_value(item) for item in value]))
    return AnyValue(string_value=str(value))


def _span(rng: random.Random, trace_id: bytes, parent: bytes, name: str, start: int, attrs: dict) -> Span:
    return Span(trace_id=trace_id, span_id=rng.randbytes(8), parent_span_id=parent, name=name,
                kind=Span.SPAN_KIND_INTERNAL, start_time_unix_nano=start, end_time_unix_nano=start + 1000,
                attributes=[_kv(k, v) for k, v in attrs.items()])


def trace_spans(rng: random.Random, executors: int | None = None, chats: int | None = None) -> list[Span]:
    """One workflow trace, children before parents (the order exporters send them in)."""
    tid = rng.randbytes(16)
    t = 1_700_000_000_000_000_000
    root = _span(rng, tid, b"", "workflow.run", t, {"workflow.id": "wf", "workflow.name": "bench",
                                                     "workflow.definition.hash": "abc123"})
    out: list[Span] = []
    for e in range(executors or rng.randint(3, 10)):
        eid = f"agent-{e}"
        ex = _span(rng, tid, root.span_id, f"executor.process {eid}", t + e * 10,
                   {"executor.id": eid, "executor.type": "AgentExecutor", "message.type": "MessageType.STANDARD",
                    "message.payload_type": "WorkflowMessage"})
        total_in = total_out = 0
        agent = _span(rng, tid, ex.span_id, f"invoke_agent {eid}", t + e * 10 + 1, {})
        for c in range(chats or rng.randint(1, 5)):
            i, o = rng.randint(50, 2000), rng.randint(10, 800)
            total_in, total_out = total_in + i, total_out + o
            out.append(_span(rng, tid, agent.span_id, "chat gpt-4o", t + e * 10 + 2 + c, {
                "gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o", "gen_ai.provider.name": "openai",
                "server.address": "api.example", "gen_ai.request.choice.count": 1,
                "gen_ai.usage.input_tokens": i, "gen_ai.usage.output_tokens": o,
                "gen_ai.response.finish_reasons": '["stop"]', "gen_ai.response.id": f"resp-{c}",
                "gen_ai.response.model": "gpt-4o-2024-08-06"}))  # priced, as users' models are
        agent.attributes.extend([_kv(k, v) for k, v in {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": eid, "gen_ai.agent.id": f"id-{eid}",
            "gen_ai.request.model": "gpt-4o", "gen_ai.provider.name": "microsoft.agent_framework",
            "gen_ai.usage.input_tokens": total_in, "gen_ai.usage.output_tokens": total_out,
            "gen_ai.response.finish_reasons": '["stop"]', "gen_ai.request.choice.count": 1}.items()])
        # The framework's own report, as the MAF instrumentation records it under the agent span.
        out.append(_span(rng, tid, agent.span_id, f"agent_response {eid}", t + e * 10 + 9, {
            "fidelity.ledger.source": "AgentResponseEvent", "gen_ai.agent.name": eid, "gen_ai.agent.id": f"id-{eid}",
            "fidelity.stream": False, "gen_ai.usage.input_tokens": total_in, "gen_ai.usage.output_tokens": total_out,
            "gen_ai.response.finish_reasons": ["stop"]}))
        out += [agent, ex]
    out.append(root)
    return out


def plain_trace_spans(rng: random.Random) -> list[Span]:
    """One trace of a service in which no agent runs (the bulk of a production feed tee'd to the
    collector): an HTTP server span, its database queries, outgoing HTTP calls and a message published,
    with the attributes their OpenTelemetry instrumentations set; children before parents. Nothing in
    it is a run: the collector counts it ignored."""
    tid = rng.randbytes(16)
    t = 1_700_000_000_000_000_000
    root = _span(rng, tid, b"", "GET /orders/{id}", t, {
        "http.request.method": "GET", "http.route": "/orders/{id}", "url.path": f"/orders/{rng.randint(1, 99999)}",
        "url.scheme": "https", "server.address": "shop.example", "server.port": 443,
        "http.response.status_code": 200, "user_agent.original": "Mozilla/5.0 (X11; Linux x86_64)",
        "network.protocol.version": "1.1", "client.address": "10.0.0.7"})
    root.kind = Span.SPAN_KIND_SERVER
    out: list[Span] = []
    for q in range(rng.randint(3, 12)):
        table = rng.choice(["orders", "order_items", "customers", "inventory"])
        out.append(_span(rng, tid, root.span_id, f"SELECT shop.{table}", t + 10 + q, {
            "db.system.name": "postgresql", "db.namespace": "shop", "db.collection.name": table,
            "db.operation.name": "SELECT", "db.query.text": f"SELECT * FROM {table} WHERE id = $1",
            "server.address": "db.internal", "server.port": 5432}))
    for c in range(rng.randint(1, 6)):
        call = _span(rng, tid, root.span_id, "GET", t + 30 + c, {
            "http.request.method": "GET", "url.full": f"https://pricing.internal/v1/quote/{c}",
            "server.address": "pricing.internal", "server.port": 443, "http.response.status_code": 200})
        call.kind = Span.SPAN_KIND_CLIENT
        out.append(call)
    publish = _span(rng, tid, root.span_id, "orders publish", t + 50, {
        "messaging.system": "kafka", "messaging.operation.type": "publish", "messaging.destination.name": "orders",
        "messaging.kafka.message.key": f"order-{rng.randint(1, 99999)}"})
    publish.kind = Span.SPAN_KIND_PRODUCER
    out += [publish, root]
    return out


def stored_docs(con: sqlite3.Connection, where: str = "") -> list[tuple[str, dict]]:
    """(trace id, run document) of the runs in a SQLite store of any version: the document as
    JSON text (``doc``, before issue 42) or compressed (``body``: zlib, zstd since issue 39)."""
    from collector.store.base import unpack  # here: bench/inprocess.py imports this module in older trees

    columns = {row[1] for row in con.execute("PRAGMA table_info(runs)")}
    column = "body" if "body" in columns else "doc"
    return [(tid, json.loads(unpack(value) if column == "body" else value))
            for tid, value in con.execute(f"SELECT trace_id, {column} FROM runs {where}")]


def encode(traces: list[list[Span]], spans_per_request: int = 512) -> list[bytes]:
    """Pack whole traces into requests of about ``spans_per_request`` spans, serialized."""
    bodies, current, count = [], ExportTraceServiceRequest(), 0

    def scope():
        rs = current.resource_spans.add()
        rs.resource.attributes.append(_kv("service.name", "bench-app"))
        ss = rs.scope_spans.add()
        ss.scope.name = "agent_framework"
        return ss

    ss = scope()
    for spans in traces:
        ss.spans.extend(spans)
        count += len(spans)
        if count >= spans_per_request:
            bodies.append(current.SerializeToString())
            current, count = ExportTraceServiceRequest(), 0
            ss = scope()
    if count:
        bodies.append(current.SerializeToString())
    return bodies


def walk_limit(bodies: list[bytes]) -> int:
    """What any consumer must do: parse, and touch every span's ids, parent, name and attributes."""
    n = 0
    for body in bodies:
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    _ = (span.trace_id, span.span_id, span.parent_span_id, span.name)
                    for kv in span.attributes:
                        _ = (kv.key, kv.value.WhichOneof("value"))
                    n += 1
    return n


EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (every thread), plus that of the children it has waited for."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # fields from the 3rd (state) on; comm may hold spaces
    return sum(int(f) for f in fields[11:15]) / CLK_TCK  # utime, stime, cutime, cstime


def rss_kib(pid: int) -> tuple[int, int]:
    """(current RSS, peak RSS) of a process in KiB, from /proc (VmHWM: this process image's own peak;
    ``wait4``/``getrusage`` maxrss can instead report its parent's, inherited across fork and exec)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


class RssSampler:
    """VmRSS of a process sampled on a thread while the ``with`` block runs."""

    def __init__(self, pid: int, every: float = 0.02) -> None:
        self.pid, self.every = pid, every
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(rss_kib(self.pid)[0])
            self._stop.wait(self.every)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def steady_kib(self) -> float:
        """The median sample: the RSS the process holds under this load."""
        return statistics.median(self.samples)


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (for servers that cannot bind port 0)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def agenteval(code: str | None) -> str:
    """The ``agenteval`` command that runs the collector of source tree ``code`` (None: this venv's)."""
    own = Path(code or ".", ".venv", "bin", "agenteval")
    return str(own) if code and own.exists() else AGENTEVAL


class Collector:
    """The collector as a subprocess on ports chosen at run time. Its temp folder (store, journal,
    log) is removed by :meth:`stop`, on leaving a ``with`` block, and at interpreter exit if the
    caller never got that far; a collector that fails to start is stopped and removed at once."""

    def __init__(self, assembly: dict | None = None, code: str | None = None, journal: bool = True,
                 receivers: dict | None = None, store: dict | None = None, pricing: dict | None = None) -> None:
        """``code``: run the collector package from that source tree (e.g. a worktree of another
        commit) instead of the installed one, to compare commits side by side on one payload; with
        the tree's own ``.venv`` when it has one (its compiled decoder and dependencies too, as
        ``make bench-check`` builds), else this venv with the tree first on ``PYTHONPATH``.
        ``receivers``: that section instead of the bench's own (64 MiB requests). ``store``: store
        settings besides its URL (e.g. ``retention``). ``pricing``: that section (e.g. ``{"enabled":
        False}``; a tree from before spend, issue 40, has none)."""
        self.dir = Path(tempfile.mkdtemp(prefix="agenteval-bench-"))
        self.store = self.dir / "runs.db"
        cfg = {"receivers": receivers or {"grpc": {"endpoint": "127.0.0.1:0", "max_message_bytes": 64 << 20},
                                          "http": {"endpoint": "127.0.0.1:0", "max_body_bytes": 64 << 20}},
               "assembly": {"quiet_period": 0.2, **(assembly or {})},
               "store": {"url": str(self.store), **(store or {})},
               # the journal in the temp folder also when the store is elsewhere (a PostgreSQL URL)
               "journal": {"path": str(self.dir / "runs.db.journal")} if journal else {"enabled": False},
               "exporters": {"prometheus": {"endpoint": "127.0.0.1:0"}},
               "logging": {"level": "info"},
               **({"pricing": pricing} if pricing is not None else {})}
        (self.dir / "c.yaml").write_text(yaml.safe_dump(cfg))
        self.log = (self.dir / "log").open("w+")
        self.proc = subprocess.Popen([agenteval(code), "collector", "serve", "--config", str(self.dir / "c.yaml")],
                                     stdout=subprocess.DEVNULL, stderr=self.log,
                                     env={**os.environ, **({"PYTHONPATH": code} if code else {})})
        self._cleanup = weakref.finalize(self, _stop_and_remove, self.proc, self.log, self.dir)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.proc.poll() is None:
            for line in (self.dir / "log").read_text().splitlines():
                if '"collector_listening"' in line:
                    event = json.loads(line)
                    self.grpc, self.http, self.prometheus = event["grpc"], event["http"], event["prometheus"]
                    return
            time.sleep(0.05)
        tail = (self.dir / "log").read_text()[-2000:]
        self.stop()
        raise RuntimeError(f"collector did not start (exit code {self.proc.returncode}): {tail}")

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stored(self) -> int:
        try:
            con = sqlite3.connect(self.store)
            try:
                return con.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
            finally:
                con.close()
        except sqlite3.Error:
            return 0

    def wait_stored(self, n: int, timeout: float = 600) -> float:
        """When ``n`` runs were stored."""
        return _wait_for(self.stored, n, "runs stored", timeout)

    def ignored(self) -> int:
        """Traces finalized without a run (no agent, no chat call), from the scrape endpoint."""
        text = urllib.request.urlopen(f"http://{self.prometheus}/metrics", timeout=5).read().decode()
        return int(sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("agenteval_traces_ignored_total")))

    def wait_ignored(self, n: int, timeout: float = 600) -> float:
        """When ``n`` traces were finalized without a run (the payload of :func:`plain_trace_spans`)."""
        return _wait_for(self.ignored, n, "traces finalized without a run", timeout)

    def rss_kib(self) -> tuple[int, int]:
        """(current RSS, peak RSS) in KiB from /proc."""
        return rss_kib(self.proc.pid)

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        """SIGTERM (the collector drains), then remove the temp folder; safe to call twice."""
        self._cleanup()


def _wait_for(count: Callable[[], int], n: int, what: str, timeout: float) -> float:
    """The monotonic time at which ``count()`` reached ``n``; raises after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (got := count()) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {got} of {n} {what}")
        time.sleep(0.02)
    return time.monotonic()


def _stop_and_remove(proc: subprocess.Popen, log: IO[str], folder: Path) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()
    shutil.rmtree(folder, ignore_errors=True)


class Stream(Protocol):
    def post(self, body: bytes) -> bool:
        """Send one export request; False when it was refused with a retryable status."""

    def close(self) -> None: ...


class GrpcStream:
    """One gRPC channel on its own TCP connection (gRPC sets TCP_NODELAY on it)."""

    def __init__(self, target: str) -> None:
        import grpc

        self._grpc = grpc
        # A local subchannel pool: channels with equal arguments in one process would otherwise share
        # one connection, and N "streams" would be one.
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20),
                                                              ("grpc.use_local_subchannel_pool", 1)])
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.call = self.channel.unary_unary(EXPORT)

    def post(self, body: bytes) -> bool:
        try:
            self.call(body, timeout=60)
            return True
        except self._grpc.RpcError as exc:
            if exc.code() is not self._grpc.StatusCode.UNAVAILABLE:
                raise
            return False

    def close(self) -> None:
        self.channel.close()


class HttpStream:
    """One keep-alive HTTP/1.1 connection with TCP_NODELAY, POSTing OTLP/protobuf to ``/v1/traces``."""

    def __init__(self, target: str) -> None:
        url = urllib.parse.urlsplit(target)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        self.conn.connect()
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def post(self, body: bytes) -> bool:
        self.conn.request("POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf"})
        resp = self.conn.getresponse()
        text = resp.read()
        if resp.status in (429, 503):
            return False
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {text[:500]!r}")
        return True

    def close(self) -> None:
        self.conn.close()


def open_stream(transport: str, target: str) -> Stream:
    """A connected stream: ``target`` is host:port for gRPC, the base URL for HTTP."""
    return GrpcStream(target) if transport == "grpc" else HttpStream(target)


def export(stream: Stream, bodies: Sequence[bytes]) -> int:
    """Send every body in order, retrying retryable refusals after 50 ms; the number of refusals."""
    refused = 0
    for body in bodies:
        while not stream.post(body):
            refused += 1
            time.sleep(0.05)
    return refused


@dataclass
class Sent:
    started: float   #: monotonic time every stream was connected and sending began
    finished: float  #: monotonic time the last answer arrived
    refused: int     #: retryable refusals (each retried)
    cpu: float       #: CPU seconds the sender processes spent sending (not starting or connecting)

    @property
    def seconds(self) -> float:
        return self.finished - self.started


def _sender(transport: str, target: str, shares: list[list[bytes]], go: threading.Barrier, results: Queue) -> None:
    """One sender process: a thread and a connection per share, started together at ``go``."""
    try:
        streams = [open_stream(transport, target) for _ in shares]
        go.wait(60)
        before = resource.getrusage(resource.RUSAGE_SELF)
        with ThreadPoolExecutor(len(streams)) as pool:
            refused = sum(pool.map(export, streams, shares))
        finished = time.monotonic()
        after = resource.getrusage(resource.RUSAGE_SELF)
        for stream in streams:
            stream.close()
        results.put((finished, refused, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime))
    except BaseException:  # reported to the parent, which raises it
        go.abort()  # release the others waiting to start
        results.put(traceback.format_exc())


def send_streams(transport: str, target: str, bodies: list[bytes], streams: int = 1,
                 processes: int | None = None) -> Sent:
    """Send ``bodies`` over ``streams`` concurrent connections (stream i sends bodies i, i+streams, ...;
    whole traces stay on one stream) from ``processes`` sender processes (default up to 4, threads
    within each), so neither one connection nor one sender's GIL caps what a server can take."""
    processes = min(streams, processes or 4)
    ctx = mp.get_context("fork")  # the children inherit ``bodies`` instead of unpickling a copy
    go, results = ctx.Barrier(processes + 1), ctx.Queue()
    shares = [bodies[i::streams] for i in range(streams)]
    workers = [ctx.Process(target=_sender, args=(transport, target, shares[p::processes], go, results))
               for p in range(processes)]
    for worker in workers:
        worker.start()
    try:
        with contextlib.suppress(threading.BrokenBarrierError):
            go.wait(60)  # broken: a sender could not connect, its traceback is among the outcomes
        started = time.monotonic()
        outcomes = [results.get(timeout=3600) for _ in workers]
    finally:
        for worker in workers:
            worker.join(60)
            if worker.is_alive():
                worker.kill()
    failed = [o for o in outcomes if isinstance(o, str)]
    if failed:
        raise RuntimeError(f"sender failed:\n{failed[0]}")
    return Sent(started, max(o[0] for o in outcomes), sum(o[1] for o in outcomes), sum(o[2] for o in outcomes))
