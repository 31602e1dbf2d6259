"""Verdict latency under steady load: from sending a trace's root span to its stored verdict, p50/p99,
reported minus the configured quiet period. The load (a separate process) sends whole traces at a
fixed rate, by default 50% of the throughput measured by ``bench/throughput.py`` on this box.

    .venv/bin/python bench/latency.py [--spans-per-s 7000] [--seconds 20] [--quiet 0.2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import random
import sqlite3
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from throughput import EXPORT  # noqa: E402
from workload import Collector, encode, trace_spans  # noqa: E402


def paced_sender(target: str, path: str, rate: float, out: str) -> None:
    """Send one request (one whole trace) every 1/rate seconds; record the wall time of each send."""
    import grpc

    items = pickle.loads(Path(path).read_bytes())
    call = grpc.insecure_channel(target).unary_unary(EXPORT)
    sent = {}
    start = time.monotonic()
    for i, (trace_id, body) in enumerate(items):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sent[trace_id] = time.time()
        call(body, timeout=30)
    Path(out).write_bytes(pickle.dumps(sent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans-per-s", type=float, default=7000)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--quiet", type=float, default=0.2)
    args = ap.parse_args()
    rng = random.Random(5)
    traces = []
    spans = 0
    while spans < args.spans_per_s * args.seconds:
        t = trace_spans(rng)
        traces.append(t)
        spans += len(t)
    items = [(t[-1].trace_id.hex(), encode([t], 10_000)[0]) for t in traces]
    rate = len(items) / args.seconds
    collector = Collector({"quiet_period": args.quiet})
    path, out = collector.dir / "items.pickle", collector.dir / "sent.pickle"
    path.write_bytes(pickle.dumps(items))
    sender = mp.Process(target=paced_sender, args=(collector.grpc, str(path), rate, str(out)))
    sender.start()
    sender.join()
    collector.wait_stored(len(items))
    sent = pickle.loads(out.read_bytes())
    con = sqlite3.connect(collector.store)
    stored = dict(con.execute("SELECT run_id, created_at FROM runs"))
    con.close()
    collector.stop()
    lat = sorted((stored[tid] - t0) * 1000 for tid, t0 in sent.items())
    p50, p99 = statistics.median(lat), lat[int(0.99 * (len(lat) - 1))]
    q = args.quiet * 1000
    print(f"{len(lat)} traces, {spans} spans at {spans / args.seconds:.0f} spans/s over gRPC, quiet period {q:.0f} ms")
    print(f"{'':6} {'latency ms':>11} {'minus quiet':>12}")
    for name, v in (("p50", p50), ("p99", p99), ("max", lat[-1])):
        print(f"{name:6} {v:11.1f} {v - q:12.1f}")


if __name__ == "__main__":
    main()
