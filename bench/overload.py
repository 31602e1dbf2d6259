"""Overload: offer 10x the configured in-flight capacity as fast as a separate process can send it.
The collector must refuse with retryable codes, keep RSS bounded, and lose no accepted span: every
trace sent must end as a stored run with all its executors.

    .venv/bin/python bench/overload.py [--capacity 20000] [--factor 10] [--transport grpc]

Two more modes (issue 32 items 4 and 5), each run against every ``--code`` tree in turn (``.``: this
one; another: e.g. ``git archive <base> collector | tar -x -C /tmp/base``):

    .venv/bin/python bench/overload.py bodies --transport http --requests 200 --body-mib 4 --code . /tmp/base
    .venv/bin/python bench/overload.py gzip --members 209715 --code . /tmp/base

``bodies``: that many requests of that size (one span-dense request, ~2,900 MAF spans a MiB, sent
by every client, so the decode work is real while the run store holds one copy) sent at once, one
connection each; the collector's peak RSS (VmHWM), its RSS 5 s later, and the answers.
``gzip``: one HTTP body of that many empty gzip members (~20 bytes each), while a gRPC and an HTTP
client each send a small export every 100 ms (10 s deadline): how long the hostile request takes,
and each client's slowest and median export meanwhile.
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import multiprocessing as mp
import pickle
import random
import sqlite3
import statistics
import sys
import threading
import time
import urllib.parse
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).parent))
from throughput import send
from workload import EXPORT, Collector, encode, stored_docs, trace_spans

#: The receivers section of the ``bodies`` and ``gzip`` runs: the shipped request limits.
RECEIVERS = {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"endpoint": "127.0.0.1:0"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="spans", choices=["spans", "bodies", "gzip"])
    ap.add_argument("--capacity", type=int, default=20_000, help="max_spans_in_flight")
    ap.add_argument("--factor", type=int, default=10)
    ap.add_argument("--transport", default="grpc", choices=["grpc", "http"])
    ap.add_argument("--requests", type=int, default=200, help="bodies: requests sent at once")
    ap.add_argument("--body-mib", type=float, default=4.0, help="bodies: size of each")
    ap.add_argument("--members", type=int, default=209_715, help="gzip: empty members in the hostile body")
    ap.add_argument("--code", nargs="+", default=[None], help="bodies, gzip: source trees to run, in turn")
    ap.add_argument("--receivers", type=json.loads, default={},
                    help='bodies, gzip: JSON merged into receivers (e.g. \'{"max_inflight_bytes": 16777216}\')')
    args = ap.parse_args()
    if args.mode == "bodies":
        body = dense_body(args.body_mib)
        print(f"{args.requests} concurrent {len(body) / 2**20:.2f} MiB requests over {args.transport}")
        for code in args.code:
            concurrent_bodies(code, {**RECEIVERS, **args.receivers}, args.transport, args.requests, body)
        return
    if args.mode == "gzip":
        print(f"one HTTP body of {args.members} empty gzip members beside a gRPC and an HTTP exporter")
        for code in args.code:
            gzip_members(code, {**RECEIVERS, **args.receivers}, args.members)
        return

    rng = random.Random(11)
    traces, spans = [], 0
    while spans < args.capacity * args.factor:
        t = trace_spans(rng)
        traces.append(t)
        spans += len(t)
    expected = {t[-1].trace_id.hex(): len({s.attributes[0].value.string_value for s in t
                                            if s.name.startswith("executor.process")}) for t in traces}
    bodies = encode(traces, 256)
    collector = Collector({"max_spans_in_flight": args.capacity, "quiet_period": 1.0, "retry_after": 0.05})
    idle_rss = collector.rss_kib()[0]
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(collector.rss_kib()[0])
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    path = collector.dir / "bodies.pickle"
    path.write_bytes(pickle.dumps(bodies))
    started, refused = mp.Value("d", 0.0), mp.Value("i", -1)
    target = collector.grpc if args.transport == "grpc" else collector.http
    sender = mp.Process(target=send, args=(args.transport, target, str(path), started, refused))
    sender.start()
    sender.join()
    collector.wait_stored(len(traces))
    stop.set()
    sampler.join()
    con = sqlite3.connect(collector.store)
    rows = dict(stored_docs(con))
    con.close()
    collector.stop()
    lost = [tid for tid, n in expected.items() if tid not in rows or len(rows[tid]["executors"]) != n]
    print(f"capacity {args.capacity} spans in flight; offered {spans} spans ({args.factor}x) in "
          f"{len(bodies)} requests over {args.transport}")
    print(f"{'refused (retried) requests':28} {refused.value}")
    print(f"{'traces stored / sent':28} {len(rows)} / {len(traces)}")
    print(f"{'traces lost or short':28} {len(lost)}")
    print(f"{'idle RSS MiB':28} {idle_rss / 1024:.1f}")
    print(f"{'peak RSS MiB under load':28} {max(samples) / 1024:.1f}")
    print(f"{'RSS growth per capacity span':28} {(max(samples) - idle_rss) * 1024 / args.capacity:.0f} bytes")


def dense_body(mib: float) -> bytes:
    """One request of whole MAF-shaped traces, just under ``mib`` MiB."""
    rng, traces, size = random.Random(3), [], 0
    while True:
        trace = trace_spans(rng)
        size += sum(s.ByteSize() + 4 for s in trace)
        if size > mib * 2**20 - 1024:
            return encode(traces, 10**9)[0]
        traces.append(trace)


def _post_http(url: str, body: bytes, headers: dict | None = None) -> str:
    """One POST on a connection of its own; the status code, or what broke it."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        conn.request("POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf", **(headers or {})})
        resp = conn.getresponse()
        resp.read()
        return str(resp.status)
    except OSError as exc:
        return type(exc).__name__
    finally:
        conn.close()


def _post_grpc(target: str, body: bytes, timeout: float = 120) -> str:
    """One Export on a channel (and connection) of its own; the status code's name."""
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        try:
            channel.unary_unary(EXPORT)(body, timeout=timeout)
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name


def concurrent_bodies(code: str | None, receivers: dict, transport: str, requests: int, body: bytes) -> None:
    with Collector({"quiet_period": 1.0}, code=code, receivers=receivers) as collector:
        time.sleep(1.0)
        idle = collector.rss_kib()[0]
        go = threading.Barrier(requests)

        def one(_: int) -> str:
            go.wait()
            return _post_http(collector.http, body) if transport == "http" else _post_grpc(collector.grpc, body)

        with ThreadPoolExecutor(requests) as pool:
            answers = Counter(pool.map(one, range(requests)))
        peak = collector.rss_kib()[1]
        time.sleep(5.0)
        after = collector.rss_kib()[0]
    print(f"  {code or 'installed'}: idle RSS {idle / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB "
          f"(+{(peak - idle) / 1024:.0f}), 5 s later {after / 1024:.0f} MiB; answers {dict(answers)}")


def gzip_members(code: str | None, receivers: dict, members: int) -> None:
    hostile = gzip.compress(b"", mtime=0) * members
    with Collector({"quiet_period": 1.0}, code=code, receivers=receivers) as collector:
        done = threading.Event()
        latencies: dict[str, list[float]] = {"grpc": [], "http": []}
        failures: Counter = Counter()

        def probe(transport: str) -> None:
            rng = random.Random(transport)
            while not done.is_set():
                small = encode([trace_spans(rng)])[0]
                started = time.monotonic()
                answer = (_post_grpc(collector.grpc, small, timeout=10) if transport == "grpc"
                          else _post_http(collector.http, small))
                latencies[transport].append(time.monotonic() - started)
                if answer not in ("OK", "200"):
                    failures[f"{transport} {answer}"] += 1
                time.sleep(0.1)

        probes = [threading.Thread(target=probe, args=(t,)) for t in latencies]
        for thread in probes:
            thread.start()
        time.sleep(1.0)
        cpu, started = collector.cpu_seconds(), time.monotonic()
        answer = _post_http(collector.http, hostile, {"Content-Encoding": "gzip"})
        took, cpu = time.monotonic() - started, collector.cpu_seconds() - cpu
        time.sleep(1.0)
        done.set()
        for thread in probes:
            thread.join()
    print(f"  {code or 'installed'}: hostile body ({len(hostile) / 2**20:.1f} MiB) answered {answer} after "
          f"{took:.2f} s, collector CPU {cpu:.2f} s; exports meanwhile: " + "; ".join(
              f"{t} slowest {max(v):.3f} s, median {statistics.median(v):.3f} s ({len(v)} sent)"
              for t, v in latencies.items()) + f"; failed {dict(failures) or 'none'}")


if __name__ == "__main__":
    main()
