"""Memory per in-flight span: RSS of a collector holding N spans that cannot complete yet (quiet
period of an hour), against the encoded size of those spans.

    .venv/bin/python bench/memory.py --spans 10000 100000 1000000
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from workload import Collector, encode, send_streams, trace_spans


def gauge(collector: Collector, name: str) -> float:
    text = urllib.request.urlopen(f"http://{collector.prometheus}/metrics", timeout=10).read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    args = parser.parse_args()
    rows = []
    for n in args.spans:
        rng = random.Random(5)
        traces, count = [], 0
        while count < n:
            traces.append(trace_spans(rng))
            count += len(traces[-1])
        bodies = encode(traces, 512)
        encoded = sum(len(b) for b in bodies)
        with Collector({"quiet_period": 3600, "max_trace_wait": 3600, "max_spans_in_flight": 2 * count,
                        "max_traces_in_flight": 2 * len(traces)}) as collector:
            time.sleep(1.0)
            idle = collector.rss_kib()[0]
            send_streams("grpc", collector.grpc, bodies)
            deadline = time.monotonic() + 120
            while gauge(collector, "agenteval_spans_in_flight") < count:
                assert time.monotonic() < deadline, "spans did not all arrive"
                time.sleep(0.2)
            time.sleep(1.0)
            held = collector.rss_kib()[0]
        per_span = (held - idle) * 1024 / count
        rows.append((count, len(traces), encoded / 2**20, idle / 1024, held / 1024, per_span, encoded / count,
                     per_span - encoded / count))
    print("| spans in flight | traces | encoded MiB | idle RSS MiB | RSS MiB | bytes/span | encoded bytes/span | "
          "beyond encoded |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]:,} | {r[1]:,} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.1f} | "
              f"{r[5]:,.0f} | {r[6]:,.0f} | {r[7]:,.0f} |")


if __name__ == "__main__":
    main()
