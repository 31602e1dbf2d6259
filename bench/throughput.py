"""Ingest -> stored verdict throughput over gRPC and HTTP/protobuf, beside "the limit" (parse + walk
of the same payload), in one run. The load generator is a separate process sending pre-encoded
requests, so the client is not the bottleneck.

    .venv/bin/python bench/throughput.py [--traces 2000] [--transport grpc http]
    .venv/bin/python bench/throughput.py --code . /tmp/base --rounds 3   # this tree vs a worktree of another commit
    .venv/bin/python bench/throughput.py --journal on off --rounds 3      # the crash journal's cost
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import random
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from workload import Collector, encode, trace_spans, walk_limit  # noqa: E402

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def send(transport: str, target: str, path: str, started, done) -> None:
    """Load generator (own process): send every pre-encoded body, honouring retryable refusals."""
    import grpc

    bodies = pickle.loads(Path(path).read_bytes())
    refused = 0
    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)])
    call = channel.unary_unary(EXPORT)
    started.value = time.monotonic()
    for body in bodies:
        while True:
            try:
                if transport == "grpc":
                    call(body, timeout=60)
                else:
                    req = urllib.request.Request(f"{target}/v1/traces", data=body, method="POST",
                                                 headers={"Content-Type": "application/x-protobuf"})
                    urllib.request.urlopen(req, timeout=60).read()
                break
            except grpc.RpcError as exc:
                if exc.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise
                refused += 1
                time.sleep(0.05)
            except urllib.error.HTTPError as exc:
                if exc.code not in (429, 503):
                    raise
                refused += 1
                time.sleep(0.05)
    done.value = refused
    channel.close()


def run(transport: str, traces: int, seed: int, spans_per_request: int, code: str | None = None,
        journal: bool = True) -> dict:
    rng = random.Random(seed)
    payload = [trace_spans(rng) for _ in range(traces)]
    n_spans = sum(len(t) for t in payload)
    bodies = encode(payload, spans_per_request)
    t0 = time.perf_counter()
    walked = walk_limit(bodies)
    limit = walked / (time.perf_counter() - t0)
    collector = Collector(code=code, journal=journal)
    path = collector.dir / "bodies.pickle"
    path.write_bytes(pickle.dumps(bodies))
    started, done = mp.Value("d", 0.0), mp.Value("i", -1)
    target = collector.grpc if transport == "grpc" else collector.http
    sender = mp.Process(target=send, args=(transport, target, str(path), started, done))
    sender.start()
    sender.join()
    finished = collector.wait_stored(traces)
    rss = collector.rss_kib()
    collector.stop()
    elapsed = finished - started.value
    return {"transport": transport, "traces": traces, "spans": n_spans, "requests": len(bodies),
            "end_to_end_spans_per_s": n_spans / elapsed, "limit_spans_per_s": limit,
            "ratio_to_limit": (n_spans / elapsed) / limit, "refused_retries": done.value,
            "rss_mib": rss[0] / 1024, "peak_rss_mib": rss[1] / 1024, "seconds": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=2000)
    ap.add_argument("--transport", nargs="+", default=["grpc", "http"], choices=["grpc", "http"])
    ap.add_argument("--spans-per-request", type=int, default=512)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--code", nargs="+", default=[None],
                    help="source trees whose collector to run (default: the installed one); compared side by side")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds per tree; medians are reported")
    ap.add_argument("--journal", nargs="+", default=["on"], choices=["on", "off"],
                    help="run with the crash journal on, off, or both side by side")
    args = ap.parse_args()
    variants = [(code, journal) for code in args.code for journal in args.journal]
    results: dict[tuple[str, str | None, str], list[dict]] = {}
    for _ in range(args.rounds):
        for transport in args.transport:
            for code, journal in variants:
                r = run(transport, args.traces, args.seed, args.spans_per_request, code, journal == "on")
                results.setdefault((transport, code, journal), []).append(r)
    print(f"{'transport':9} {'code':24} {'journal':7} {'spans':>8} {'e2e spans/s':>12} {'limit spans/s':>14} "
          f"{'ratio':>6} {'refused':>8} {'peak RSS MiB':>12}")
    median = {}
    for (transport, code, journal), rs in results.items():
        r = sorted(rs, key=lambda x: x["end_to_end_spans_per_s"])[len(rs) // 2]  # the median round
        median[(transport, code, journal)] = r["end_to_end_spans_per_s"]
        print(f"{transport:9} {str(code or 'installed'):24} {journal:7} {r['spans']:8d} "
              f"{r['end_to_end_spans_per_s']:12.0f} {r['limit_spans_per_s']:14.0f} {r['ratio_to_limit']:6.2f} "
              f"{r['refused_retries']:8d} {r['peak_rss_mib']:12.1f}")
    base = variants[-1]
    for transport in args.transport:
        for code, journal in variants[:-1]:
            ratio = median[(transport, code, journal)] / median[(transport, *base)]
            print(f"{transport}: {code or 'installed'} journal {journal} / {base[0] or 'installed'} journal "
                  f"{base[1]} = {ratio:.2f}")


if __name__ == "__main__":
    main()
