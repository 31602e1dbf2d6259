"""Soak: minutes of mixed good and hostile traffic at about half the collector's capacity. Nothing
acknowledged may be lost, no request may get a server error, and RSS must stay flat.

Good traffic (a separate process, like an application's exporter): MAF-shaped traces from
``workload.trace_spans``, alternating OTLP/gRPC and OTLP/HTTP protobuf, retrying retryable refusals;
each acknowledged trace must end as a stored run with all its executors. Hostile traffic (this
process): hostile attribute values on every key the classifier reads (protobuf and OTLP/JSON with lone
surrogates, 1e400), bad ids, parent cycles and self-parents, oversize requests (gRPC, HTTP by body,
by Content-Length and by gzip bomb), and half-open HTTP connections held open. RSS is sampled every
10 s. Exit 1 if an acknowledged trace was lost, a request got a server error, the collector died, or
RSS grew more than 20% from the first quarter of the soak to the last (medians).

The same traffic runs for ``--warmup`` seconds first: the late window's compact state fills up to its
bound (``max_late_traces`` / ``max_late_bytes``) in about a minute at this rate, which is bounded memory
by design, not a leak; RSS during warm-up is reported but not compared. Losses count throughout.

    .venv/bin/python bench/soak.py [--minutes 30] [--warmup 120] [--rate SPANS_PER_S] [--json]
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import math
import multiprocessing as mp
import pickle
import random
import socket
import sqlite3
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.trace.v1.trace_pb2 import Span

sys.path.insert(0, str(Path(__file__).parent))
from throughput import send
from workload import Collector, encode, stored_docs, trace_spans

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
PROTOBUF, JSON = "application/x-protobuf", "application/json"
#: workload.Collector's receiver limits (64 MiB): oversize requests go just past them.
LIMIT = 64 << 20
RETRY_GRPC = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
SERVER_ERRORS_GRPC = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS,
                      grpc.StatusCode.UNIMPLEMENTED}
SAMPLE_EVERY = 10.0


# --- good traffic (own process) ---------------------------------------------------------------

def _executors(spans: list[Span]) -> int:
    return sum(1 for s in spans if s.name.startswith("executor.process"))


def good_sender(grpc_target: str, http_url: str, rate: float, seconds: float, seed: int, out: str) -> None:
    """Send MAF-shaped traces at ``rate`` spans/s for ``seconds``; write what was sent and acknowledged."""
    rng = random.Random(seed)
    channel = grpc.insecure_channel(grpc_target, options=[("grpc.max_send_message_length", LIMIT)])
    call = channel.unary_unary(EXPORT)
    per_request = max(1, round(rate / 40 / 40))  # ~40 spans a trace; at most ~40 requests/s
    sent: dict[str, int] = {}
    acked: dict[str, int] = {}
    result = {"requests": 0, "retries": 0, "server_errors": [], "refused": []}
    start = time.monotonic()
    spans_sent = 0
    while time.monotonic() - start < seconds:
        traces = [trace_spans(rng) for _ in range(per_request)]
        (body,) = encode(traces, 1 << 30)
        ids = {t[-1].trace_id.hex(): _executors(t) for t in traces}
        sent.update(ids)
        transport = "grpc" if result["requests"] % 2 else "http"
        if _deliver(call, http_url, body, transport, result):
            acked.update(ids)
        result["requests"] += 1
        spans_sent += sum(map(len, traces))
        due = start + spans_sent / rate
        time.sleep(max(0.0, due - time.monotonic()))
    channel.close()
    result.update(sent=sent, acked=acked, seconds=time.monotonic() - start, spans=spans_sent)
    Path(out).write_text(json.dumps(result))


def _deliver(call, http_url: str, body: bytes, transport: str, result: dict, give_up: float = 60.0) -> bool:
    """Like an OTLP exporter: retry retryable refusals (with backoff) until acknowledged or ``give_up``."""
    deadline, delay = time.monotonic() + give_up, 0.05
    while time.monotonic() < deadline:
        if transport == "grpc":
            try:
                call(body, timeout=30)
                return True
            except grpc.RpcError as exc:
                code, answer = exc.code(), f"gRPC {exc.code().name}: {exc.details()}"[:200]
                if code in SERVER_ERRORS_GRPC:
                    result["server_errors"].append(answer)
                    return False
                if code not in RETRY_GRPC:
                    result["refused"].append(answer)
                    return False
        else:
            req = urllib.request.Request(f"{http_url}/v1/traces", data=body, method="POST",
                                         headers={"Content-Type": PROTOBUF})
            try:
                urllib.request.urlopen(req, timeout=30).read()
                return True
            except urllib.error.HTTPError as exc:
                answer = f"HTTP {exc.code}: {exc.read()[:150]!r}"
                if exc.code >= 500 and exc.code != 503:
                    result["server_errors"].append(answer)
                    return False
                if exc.code not in (429, 503):
                    result["refused"].append(answer)
                    return False
            except (urllib.error.URLError, OSError):
                pass  # connection refused / reset: retry
        result["retries"] += 1
        time.sleep(delay)
        delay = min(delay * 2, 2.0)
    result["refused"].append(f"{transport}: gave up after {give_up}s")
    return False


# --- hostile traffic (this process) -------------------------------------------------------------

#: Every span attribute key the classifier reads, plus the resource's service.name.
HOSTILE_KEYS = ["gen_ai.operation.name", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
                "gen_ai.usage.total_tokens", "gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens",
                "gen_ai.response.finish_reasons", "gen_ai.agent.name", "gen_ai.agent.id", "executor.id",
                "executor.type", "workflow.name", "workflow.id", "error.type", "fidelity.ledger.source"]
HOSTILE_STRINGS = ["\ud800", "²", "١٢", "[" * 1024, "9" * 40, "x" * 5000, '["stop"', "", " ", "NaN", "chat",
                   "AgentResponseEvent", "é\udfff"]


def hostile_value(rng: random.Random, depth: int = 0) -> Any:
    """A plain Python value standing for an AnyValue (str, int, float, bool, list, dict)."""
    pick = rng.randrange(9 if depth < 12 else 6)
    return [lambda: rng.choice(HOSTILE_STRINGS),
            lambda: rng.choice([2**63 - 1, -(2**63), 10**12 + 1, -1, 0]),
            lambda: rng.choice([math.nan, math.inf, -math.inf, 1e300, -0.0]),
            lambda: rng.choice([True, False]),
            lambda: rng.getrandbits(63),
            lambda: "RAW1e400",  # JSON: a bare 1e400 for intValue; protobuf: int64 max
            lambda: [hostile_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
            lambda: {str(i): hostile_value(rng, depth + 1) for i in range(rng.randint(0, 3))},
            lambda: [hostile_value(rng, depth + 1)]][pick]()


def _pb(value: Any) -> AnyValue:
    if value == "RAW1e400":
        return AnyValue(int_value=2**63 - 1)
    if isinstance(value, str):
        return AnyValue(string_value=value.encode("utf-8", "replace").decode())
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, list):
        return AnyValue(array_value=ArrayValue(values=[_pb(v) for v in value]))
    return AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key=k, value=_pb(v)) for k, v in value.items()]))


def _js(value: Any) -> dict:
    if value == "RAW1e400":
        return {"intValue": "\x00RAW1e400"}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value if math.isfinite(value) else "NaN" if math.isnan(value) else
                ("Infinity" if value > 0 else "-Infinity")}
    if isinstance(value, list):
        return {"arrayValue": {"values": [_js(v) for v in value]}}
    return {"kvlistValue": {"values": [{"key": k, "value": _js(v)} for k, v in value.items()]}}


def hostile_trace(rng: random.Random) -> tuple[list[Span], list[dict[str, Any]]]:
    """A MAF-shaped trace with bad ids and bent parents, and per span the hostile values to give it."""
    spans = trace_spans(rng, executors=rng.randint(1, 3), chats=rng.randint(1, 3))
    values = [{rng.choice(HOSTILE_KEYS): hostile_value(rng) for _ in range(rng.randint(0, 2))} for _ in spans]
    for span in spans:
        roll = rng.random()
        if roll < 0.05:
            span.span_id = rng.randbytes(rng.choice([0, 3, 12]))  # bad id: rejected in partial_success
        elif roll < 0.10:
            span.parent_span_id = span.span_id  # self-parented
        elif roll < 0.15:
            span.parent_span_id = rng.choice(spans).span_id  # may close a cycle
        elif roll < 0.18:
            span.trace_id = bytes(16)
    return spans, values


def hostile_request(rng: random.Random) -> tuple[bytes, str]:
    """One hostile request (body, content type): protobuf or OTLP/JSON (lone surrogates, bare 1e400)."""
    spans, values = hostile_trace(rng)
    service = hostile_value(rng)
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="service.name", value=_pb(service))
    ss = rs.scope_spans.add()
    ss.scope.name = "agent_framework"
    ss.spans.extend(spans)
    for span, hostile in zip(ss.spans, values, strict=True):
        kept = [kv for kv in span.attributes if kv.key not in hostile]
        del span.attributes[:]
        span.attributes.extend(kept)
        span.attributes.extend(KeyValue(key=k, value=_pb(v)) for k, v in hostile.items())
    if rng.random() < 0.5:
        return req.SerializeToString(), PROTOBUF
    doc = json_format.MessageToDict(req)
    doc["resourceSpans"][0]["resource"]["attributes"] = [{"key": "service.name", "value": _js(service)}]
    for span_doc, hostile in zip(doc["resourceSpans"][0]["scopeSpans"][0]["spans"], values, strict=True):
        for key in ("traceId", "spanId", "parentSpanId"):
            if key in span_doc:
                span_doc[key] = base64.b64decode(span_doc[key]).hex()
        span_doc["attributes"] = [a for a in span_doc.get("attributes", []) if a["key"] not in hostile] + [
            {"key": k, "value": _js(v)} for k, v in hostile.items()]
    text = json.dumps(doc).replace('"\\u0000RAW1e400"', "1e400")  # ASCII: lone surrogates travel as \ud800
    return text.encode(), JSON


@dataclass
class Hostile:
    """Counts of hostile requests and how the collector answered them."""

    requests: int = 0
    answers: dict[str, int] = field(default_factory=dict)
    server_errors: list[str] = field(default_factory=list)
    half_open_opened: int = 0
    half_open_closed_by_server: int = 0

    def answer(self, what: str) -> None:
        self.answers[what] = self.answers.get(what, 0) + 1


class HostileTraffic(threading.Thread):
    """Hostile requests a few times a second, oversize ones now and then, half-open connections held."""

    def __init__(self, collector: Collector, seed: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.collector, self.rng, self.stop = collector, random.Random(seed), stop
        self.stats = Hostile()
        host, port = collector.http.removeprefix("http://").split(":")
        self.http_addr = (host, int(port))
        self.channel = grpc.insecure_channel(collector.grpc, options=[("grpc.max_send_message_length", 2 * LIMIT)])
        self.call = self.channel.unary_unary(EXPORT)
        self.half_open: list[tuple[float, socket.socket]] = []
        self.bomb = gzip.compress(b"\0" * (LIMIT + 1))
        self.oversize = b"\x0a" * (LIMIT + 1024)

    def run(self) -> None:
        tick = 0
        while not self.stop.wait(0.25):
            tick += 1
            try:
                self._one(tick)
            except Exception as exc:  # the bench reports, it does not die
                self.stats.answer(f"client error {type(exc).__name__}")
        for _, sock in self.half_open:
            sock.close()
        self.channel.close()

    def _one(self, tick: int) -> None:
        body, ctype = hostile_request(self.rng)
        if ctype == PROTOBUF and tick % 2:
            self._grpc(body, "hostile")
        else:
            self._http(body, ctype, {}, "hostile")
        if tick % 40 == 0:  # every ~10 s: oversize by body (gzip bomb) and by announced length
            self._http(self.bomb, PROTOBUF, {"Content-Encoding": "gzip"}, "gzip bomb")
            self._announced_oversize()
        if tick % 240 == 0:  # every ~60 s: an oversize gRPC message
            self._grpc(self.oversize, "oversize grpc")
        self._half_open()

    def _grpc(self, body: bytes, what: str) -> None:
        self.stats.requests += 1
        try:
            self.call(body, timeout=30)
            self.stats.answer(f"{what} grpc OK")
        except grpc.RpcError as exc:
            self.stats.answer(f"{what} grpc {exc.code().name}")
            if exc.code() in SERVER_ERRORS_GRPC:
                self.stats.server_errors.append(f"{what}: {exc.code().name} {exc.details()}"[:200])

    def _http(self, body: bytes, ctype: str, headers: dict, what: str) -> None:
        self.stats.requests += 1
        req = urllib.request.Request(f"{self.collector.http}/v1/traces", data=body, method="POST",
                                     headers={"Content-Type": ctype, **headers})
        try:
            status = urllib.request.urlopen(req, timeout=30).status
        except urllib.error.HTTPError as exc:
            status = exc.code
            if status >= 500 and status != 503:
                self.stats.server_errors.append(f"{what}: HTTP {status} {exc.read()[:150]!r}")
        except (urllib.error.URLError, OSError) as exc:
            status = type(exc).__name__  # e.g. the server closed an oversize upload early
        self.stats.answer(f"{what} http {status}")

    def _announced_oversize(self) -> None:
        """Headers announcing a body past the limit: refused before the body is sent."""
        self.stats.requests += 1
        with socket.create_connection(self.http_addr, timeout=10) as sock:
            sock.sendall(f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: {PROTOBUF}\r\n"
                         f"Content-Length: {LIMIT * 2}\r\n\r\n".encode() + b"\x0a" * 1024)
            try:
                line = sock.recv(64).split(b"\r\n")[0].decode(errors="replace")
            except OSError as exc:
                line = type(exc).__name__
        self.stats.answer(f"announced oversize: {line[:30] or 'closed'}")

    def _half_open(self) -> None:
        """Keep up to 32 connections that stopped mid-request; drop each after 30 s."""
        now = time.monotonic()
        for opened, sock in list(self.half_open):
            try:
                sock.setblocking(False)
                if sock.recv(4096) == b"":
                    self.stats.half_open_closed_by_server += 1
                    raise OSError
            except BlockingIOError:
                pass
            except OSError:
                self.half_open.remove((opened, sock))
                sock.close()
                continue
            if now - opened > 30:
                self.half_open.remove((opened, sock))
                sock.close()
        while len(self.half_open) < 32:
            sock = socket.create_connection(self.http_addr, timeout=10)
            partial = self.rng.choice([b"POST /v1/tr", b"POST /v1/traces HTTP/1.1\r\nHost: x\r\n",
                                       f"POST /v1/traces HTTP/1.1\r\nContent-Type: {PROTOBUF}\r\n"
                                       "Content-Length: 5000\r\n\r\n\x0a\x80".encode()])
            sock.sendall(partial)
            self.half_open.append((now, sock))
            self.stats.half_open_opened += 1


# --- the soak -------------------------------------------------------------------------------------

def measure_capacity(collector: Collector, traces: int = 400) -> float:
    """End-to-end spans/s of a burst of pre-encoded traces over gRPC (throughput.send in its own process)."""
    rng = random.Random(1)
    payload = [trace_spans(rng) for _ in range(traces)]
    path = collector.dir / "burst.pickle"
    path.write_bytes(pickle.dumps(encode(payload, 512)))
    before = collector.stored()
    started, done = mp.Value("d", 0.0), mp.Value("i", -1)
    sender = mp.Process(target=send, args=("grpc", collector.grpc, str(path), started, done))
    sender.start()
    sender.join()
    finished = collector.wait_stored(before + traces, timeout=300)
    return sum(map(len, payload)) / (finished - started.value)


def stored_executors(store: Path) -> dict[str, int]:
    """trace id -> executors of its stored (complete) run."""
    con = sqlite3.connect(store, timeout=30)
    try:
        return {tid: len(doc["executors"]) for tid, doc in stored_docs(con, "WHERE incomplete = 0")}
    finally:
        con.close()


@dataclass
class Report:
    minutes: float
    warmup_seconds: float
    capacity_spans_per_s: float | None
    rate_spans_per_s: float
    good_requests: int
    good_retries: int
    traces_sent: int
    traces_acknowledged: int
    traces_stored: int
    traces_lost: int
    lost_examples: list[str]
    refused_good: list[str]
    server_errors: list[str]
    hostile: dict
    rss_warmup_mib: list[float]
    rss_samples_mib: list[float]
    rss_first_mib: float
    rss_median_mib: float
    rss_max_mib: float
    rss_last_mib: float
    rss_growth: float
    collector_alive: bool
    ok: bool = False


def soak(minutes: float, warmup: float, rate: float | None, seed: int) -> Report:
    collector = Collector()
    capacity = None
    if rate is None:
        capacity = measure_capacity(collector)
        rate = capacity / 2
    samples: list[float] = []
    stop = threading.Event()
    hostile = HostileTraffic(collector, seed + 1, stop)
    out = collector.dir / "good.json"
    good = mp.Process(target=good_sender, args=(collector.grpc, collector.http, rate, warmup + minutes * 60, seed,
                                                str(out)))
    good.start()
    hostile.start()
    alive, warm = True, []
    started = time.monotonic()
    deadline = started + warmup + minutes * 60
    while time.monotonic() < deadline and alive:
        alive = collector.proc.poll() is None
        if alive:
            (warm if time.monotonic() - started < warmup else samples).append(collector.rss_kib()[0] / 1024)
        time.sleep(min(SAMPLE_EVERY, max(0.0, deadline - time.monotonic())))
    stop.set()
    hostile.join(60)
    good.join(120)
    result = json.loads(out.read_text()) if out.exists() else {"sent": {}, "acked": {}, "requests": 0, "retries": 0,
                                                                "server_errors": ["good sender died"], "refused": []}
    acked: dict[str, int] = result["acked"]
    stored: dict[str, int] = {}
    wait_until = time.monotonic() + 120
    while alive and time.monotonic() < wait_until:  # quiet period, store writer backlog
        stored = stored_executors(collector.store)
        if all(stored.get(tid) == n for tid, n in acked.items()):
            break
        time.sleep(1)
    alive = alive and collector.proc.poll() is None
    if alive:
        samples.append(collector.rss_kib()[0] / 1024)
        collector.stop()
    lost = [tid for tid, n in acked.items() if stored.get(tid) != n]
    quarter = max(1, len(samples) // 4)
    first, last = statistics.median(samples[:quarter] or [0]), statistics.median(samples[-quarter:] or [0])
    report = Report(
        minutes=minutes, warmup_seconds=warmup, capacity_spans_per_s=capacity, rate_spans_per_s=rate,
        good_requests=result["requests"],
        good_retries=result["retries"], traces_sent=len(result["sent"]), traces_acknowledged=len(acked),
        traces_stored=sum(1 for tid in acked if stored.get(tid) == acked[tid]), traces_lost=len(lost),
        lost_examples=lost[:10], refused_good=result["refused"][:10],
        server_errors=(result["server_errors"] + hostile.stats.server_errors)[:20], hostile=asdict(hostile.stats),
        rss_warmup_mib=[round(s, 1) for s in warm], rss_samples_mib=[round(s, 1) for s in samples],
        rss_first_mib=samples[0] if samples else 0,
        rss_median_mib=statistics.median(samples) if samples else 0, rss_max_mib=max(samples, default=0),
        rss_last_mib=samples[-1] if samples else 0, rss_growth=(last / first - 1) if first else 0.0,
        collector_alive=alive)
    report.ok = alive and not lost and not report.server_errors and report.rss_growth <= 0.20
    return report


def print_table(r: Report) -> None:
    rows = [
        ("minutes (after warm-up s)", f"{r.minutes:g} (after {r.warmup_seconds:g})"),
        ("capacity spans/s (burst)", f"{r.capacity_spans_per_s:,.0f}" if r.capacity_spans_per_s else "given"),
        ("good rate spans/s", f"{r.rate_spans_per_s:,.0f}"),
        ("good requests / retries", f"{r.good_requests} / {r.good_retries}"),
        ("traces sent", r.traces_sent),
        ("traces acknowledged", r.traces_acknowledged),
        ("traces stored (of acknowledged)", r.traces_stored),
        ("traces LOST", r.traces_lost),
        ("good requests refused for good", len(r.refused_good)),
        ("hostile requests", r.hostile["requests"]),
        ("half-open connections opened / closed by server", f"{r.hostile['half_open_opened']} / "
                                                            f"{r.hostile['half_open_closed_by_server']}"),
        ("server errors (5xx, UNKNOWN, INTERNAL)", len(r.server_errors)),
        ("RSS MiB first / median / max / last", f"{r.rss_first_mib:.1f} / {r.rss_median_mib:.1f} / "
                                                f"{r.rss_max_mib:.1f} / {r.rss_last_mib:.1f}"),
        ("RSS growth first -> last quarter", f"{r.rss_growth:+.1%} (limit +20%)"),
        ("collector alive", r.collector_alive),
        ("RESULT", "OK" if r.ok else "FAIL"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:{width}}  {value}")
    print("RSS MiB every 10 s: warm-up " + " ".join(f"{x:.0f}" for x in r.rss_warmup_mib) + " | soak "
          + " ".join(f"{x:.0f}" for x in r.rss_samples_mib))
    print("hostile answers: " + ", ".join(f"{k}: {v}" for k, v in sorted(r.hostile["answers"].items())))
    for title, items in (("lost", r.lost_examples), ("refused", r.refused_good), ("server errors", r.server_errors)):
        if items:
            print(f"{title}: " + "; ".join(items[:5]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=120.0, help="seconds of the same traffic before RSS counts")
    ap.add_argument("--rate", type=float, help="good spans/s (default: half the capacity measured by a burst)")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args()
    report = soak(args.minutes, args.warmup, args.rate, args.seed)
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        print_table(report)
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
