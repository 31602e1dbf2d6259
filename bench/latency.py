"""Verdict latency under steady load: from sending a trace's root span to its stored verdict, p50/p99,
reported minus the configured quiet period (the collector sweeps when the earliest quiet period
ends, so what is left is its own work). The load (a separate process) sends whole traces, one per
gRPC request, at a fixed rate, open loop: by default 10,000 spans/s, about half the end-to-end
capacity of ``bench/throughput.py`` on the project's box. The achieved rate is printed beside the
target. Latency = wall time from sending the request to the run's ``created_at`` in the store
(the start of the store transaction that writes it). It runs a minute by default: the late window
(10,000 traces) is full after ~40 s at 10,000 spans/s, and the pauses a full window brings (the
garbage collector's, issue 39) never showed in the 20 s it used to run.

    .venv/bin/python bench/latency.py [--spans-per-s 10000] [--seconds 60] [--quiet 0.2] [--slowest 50]
    .venv/bin/python bench/latency.py --code /tmp/base   # another tree's collector (its own .venv if it has one)
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
from workload import EXPORT, Collector, encode, trace_spans


def paced_sender(target: str, path: str, rate: float, out: str) -> None:
    """Send one request (one whole trace) every 1/rate seconds without waiting for earlier answers
    (open loop: a slow answer does not lower the offered rate); record the wall time of each send
    and, last, the seconds the schedule took."""
    import grpc

    items = pickle.loads(Path(path).read_bytes())
    channel = grpc.insecure_channel(target)
    grpc.channel_ready_future(channel).result(timeout=30)
    call = channel.unary_unary(EXPORT)
    sent, pending = {}, []
    start = time.monotonic()
    for i, (trace_id, body) in enumerate(items):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sent[trace_id] = time.time()
        pending.append(call.future(body, timeout=60))
    took = time.monotonic() - start
    for answer in pending:
        answer.result()
    Path(out).write_bytes(pickle.dumps((sent, took)))
    channel.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans-per-s", type=float, default=10_000)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--quiet", type=float, default=0.2)
    ap.add_argument("--slowest", type=int, default=0, metavar="N",
                    help="also list the N slowest traces by send time: traces sent close together and "
                         "finalized at one moment point at a stall (a full GC, a blocked loop)")
    ap.add_argument("--code", default=None, help="source tree whose collector to run (default: the installed one)")
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
    with Collector({"quiet_period": args.quiet}, code=args.code) as collector:
        path, out = collector.dir / "items.pickle", collector.dir / "sent.pickle"
        path.write_bytes(pickle.dumps(items))
        sender = mp.Process(target=paced_sender, args=(collector.grpc, str(path), rate, str(out)))
        sender.start()
        sender.join()
        if sender.exitcode:
            raise RuntimeError(f"the paced sender failed (exit code {sender.exitcode})")
        collector.wait_stored(len(items))
        sent, took = pickle.loads(out.read_bytes())
        con = sqlite3.connect(collector.store)
        # Run ids are <trace id>-<workflow span id>; each trace here is one run.
        stored = dict(con.execute("SELECT trace_id, MIN(created_at) FROM runs GROUP BY trace_id"))
        con.close()
    lat = sorted((stored[tid] - t0) * 1000 for tid, t0 in sent.items())
    p50, p99 = statistics.median(lat), lat[int(0.99 * (len(lat) - 1))]
    q = args.quiet * 1000
    print(f"{len(lat)} traces, {spans} spans over gRPC: target {spans / args.seconds:.0f} spans/s, achieved "
          f"{spans / took:.0f} spans/s; quiet period {q:.0f} ms")
    print(f"{'':6} {'latency ms':>11} {'minus quiet':>12}")
    for name, v in (("p50", p50), ("p99", p99), ("max", lat[-1])):
        print(f"{name:6} {v:11.1f} {v - q:12.1f}")
    if args.slowest:
        first = min(sent.values())
        slow = sorted(sorted(sent.items(), key=lambda kv: kv[1] - stored[kv[0]])[:args.slowest], key=lambda kv: kv[1])
        print(f"{'sent at s':>10} {'minus quiet ms':>15} {'stored at s':>12}")
        for tid, t0 in slow:
            print(f"{t0 - first:10.3f} {(stored[tid] - t0) * 1000 - q:15.1f} {stored[tid] - first:12.3f}")


if __name__ == "__main__":
    main()
