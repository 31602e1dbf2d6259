"""Overload: offer 10x the configured in-flight capacity as fast as a separate process can send it.
The collector must refuse with retryable codes, keep RSS bounded, and lose no accepted span: every
trace sent must end as a stored run with all its executors.

    .venv/bin/python bench/overload.py [--capacity 20000] [--factor 10] [--transport grpc]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pickle
import random
import sqlite3
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from throughput import send  # noqa: E402
from workload import Collector, encode, trace_spans  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", type=int, default=20_000, help="max_spans_in_flight")
    ap.add_argument("--factor", type=int, default=10)
    ap.add_argument("--transport", default="grpc", choices=["grpc", "http"])
    args = ap.parse_args()

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
    rows = {tid: json.loads(doc) for tid, doc in con.execute("SELECT trace_id, doc FROM runs")}
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


if __name__ == "__main__":
    main()
