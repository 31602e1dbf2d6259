"""Ingest -> stored verdict throughput over gRPC and HTTP/protobuf, beside "the limit" (parse + walk
of the same payload, best of 5), in one run. The load generator is separate processes sending
pre-encoded requests over ``--streams`` concurrent connections, so the client is not the bottleneck.

    .venv/bin/python bench/throughput.py [--traces 2000] [--transport grpc http] [--streams 1 16]
    .venv/bin/python bench/throughput.py --code . /tmp/base --rounds 3   # this tree vs a worktree of another commit
    .venv/bin/python bench/throughput.py --journal on off --rounds 3      # the crash journal's cost
    .venv/bin/python bench/throughput.py --code . /tmp/base --handover-in . --rounds 3  # hand-over's steady-state cost
"""

from __future__ import annotations

import argparse
import pickle
import random
import sys
import time
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from workload import Collector, encode, export, open_stream, send_streams, trace_spans, walk_limit

LIMIT_RUNS = 5


def send(transport: str, target: str, path: str, started: Synchronized, done: Synchronized) -> None:
    """One stream from its own process (overload.py, soak.py): every pre-encoded body pickled at
    ``path``, honouring retryable refusals; ``started`` gets the start time, ``done`` the refusals."""
    bodies = pickle.loads(Path(path).read_bytes())
    stream = open_stream(transport, target)
    started.value = time.monotonic()
    done.value = export(stream, bodies)
    stream.close()


def best_limit(bodies: list[bytes], runs: int = LIMIT_RUNS) -> float:
    """The limit in spans/s: the fastest of ``runs`` parse + walk passes over ``bodies``."""
    best = 0.0
    for _ in range(runs):
        t0 = time.perf_counter()
        walked = walk_limit(bodies)
        best = max(best, walked / (time.perf_counter() - t0))
    return best


def run(transport: str, bodies: list[bytes], traces: int, n_spans: int, limit: float, streams: int,
        code: str | None = None, journal: bool = True, handover: bool = False) -> dict:
    with Collector(code=code, journal=journal, assembly={"handover": True} if handover else None) as collector:
        target = collector.grpc if transport == "grpc" else collector.http
        sent = send_streams(transport, target, bodies, streams)
        finished = collector.wait_stored(traces)
        rss = collector.rss_kib()
    elapsed = finished - sent.started
    return {"transport": transport, "traces": traces, "spans": n_spans, "requests": len(bodies),
            "accepted_spans_per_s": n_spans / sent.seconds,
            "end_to_end_spans_per_s": n_spans / elapsed, "limit_spans_per_s": limit,
            "ratio_to_limit": (n_spans / elapsed) / limit, "refused_retries": sent.refused,
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
    ap.add_argument("--handover-in", nargs="*", default=[],
                    help="trees (of --code) whose collector runs with assembly.handover on (docs/scale-out.md): "
                         "what a replica sharing a PostgreSQL store runs, here on its own SQLite store")
    ap.add_argument("--streams", type=int, nargs="+", default=[1],
                    help="concurrent connections the load is spread over (several values: side by side)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    payload = [trace_spans(rng) for _ in range(args.traces)]
    n_spans = sum(len(t) for t in payload)
    bodies = encode(payload, args.spans_per_request)
    limit = best_limit(bodies)
    variants = [(code, journal, streams) for code in args.code for journal in args.journal for streams in args.streams]
    results: dict[tuple[str, str | None, str, int], list[dict]] = {}
    for _ in range(args.rounds):
        for transport in args.transport:
            for code, journal, streams in variants:
                r = run(transport, bodies, args.traces, n_spans, limit, streams, code, journal == "on",
                        code in args.handover_in)
                results.setdefault((transport, code, journal, streams), []).append(r)
    print(f"limit (parse + walk, best of {LIMIT_RUNS}): {limit:.0f} spans/s")
    print(f"{'transport':9} {'code':24} {'journal':7} {'streams':>7} {'spans':>8} {'accepted/s':>11} "
          f"{'e2e spans/s':>12} {'limit spans/s':>14} {'ratio':>6} {'refused':>8} {'peak RSS MiB':>12}")
    median = {}
    for (transport, code, journal, streams), rs in results.items():
        r = sorted(rs, key=lambda x: x["end_to_end_spans_per_s"])[len(rs) // 2]  # the median round
        median[(transport, code, journal, streams)] = r["end_to_end_spans_per_s"]
        print(f"{transport:9} {str(code or 'installed'):24} {journal:7} {streams:7d} {r['spans']:8d} "
              f"{r['accepted_spans_per_s']:11.0f} {r['end_to_end_spans_per_s']:12.0f} {r['limit_spans_per_s']:14.0f} "
              f"{r['ratio_to_limit']:6.2f} {r['refused_retries']:8d} {r['peak_rss_mib']:12.1f}")
    for (transport, code, journal, streams), e2e in median.items():
        print(f"end-to-end / limit ratio: {e2e / limit:.2f}  ({transport}, {code or 'installed'}, journal {journal}, "
              f"{streams} stream{'s' * (streams > 1)})")
    # Each variant against the last code (then the last journal setting) at the same stream count.
    base_code, base_journal = args.code[-1], args.journal[-1]
    for transport in args.transport:
        for code, journal, streams in variants:
            if (code, journal) == (base_code, base_journal):
                continue
            ratio = median[(transport, code, journal, streams)] / median[(transport, base_code, base_journal, streams)]
            print(f"{transport}: {code or 'installed'} journal {journal} / {base_code or 'installed'} journal "
                  f"{base_journal}, {streams} stream{'s' * (streams > 1)}: end-to-end {ratio:.2f}")


if __name__ == "__main__":
    main()
