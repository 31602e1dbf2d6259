"""Scaling: time per span as traces grow (10 to 100K spans) and as traces interleave (1 to 1000
concurrent), through the real pipeline in one process (decode, classify, assemble, reconcile, store).

    .venv/bin/python bench/scaling.py [--total 200000]
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import structlog
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

sys.path.insert(0, str(Path(__file__).parent))
from workload import encode, trace_spans  # noqa: E402

from collector.config import CollectorConfig  # noqa: E402
from collector.pipeline import Pipeline  # noqa: E402
from collector.store import open_store  # noqa: E402

#: (executors, chats per executor) for each trace size: 1 + executors * (2 + chats) spans.
SHAPES = {10: (3, 1), 1_000: (111, 7), 10_000: (1_111, 7), 100_000: (11_111, 7)}


def run(bodies: list[bytes], traces: int) -> float:
    """Seconds to ingest every body and finalize every trace, store writes included."""
    cfg = CollectorConfig(assembly={"quiet_period": 3600, "max_spans_in_flight": 10_000_000,
                                    "max_traces_in_flight": 1_000_000}, journal={"enabled": False})
    pipeline = Pipeline(cfg, open_store(Path(tempfile.mkdtemp()) / "runs.db"), None, None)
    start = time.perf_counter()
    for body in bodies:
        pipeline.ingest(ExportTraceServiceRequest.FromString(body), "grpc")
    assert pipeline.sweep(force=True) == traces
    pipeline.close()
    return time.perf_counter() - start


def interleave(traces: list[list[Span]], k: int) -> list[list[Span]]:
    """Groups of k traces whose spans alternate (k traces in flight at once), as one span list each."""
    out = []
    for g in range(0, len(traces), k):
        group = traces[g:g + k]
        mixed = [s for row in zip(*group) for s in row]
        mixed += [s for t in group for s in t[len(min(group, key=len)):]]
        out.append(mixed)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total", type=int, default=200_000, help="spans per measurement")
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print("| trace size (spans) | traces | spans | µs/span | vs smallest |")
    print("|---|---|---|---|---|")
    base = None
    for size, (executors, chats) in SHAPES.items():
        rng = random.Random(3)
        traces = [trace_spans(rng, executors, chats) for _ in range(max(1, args.total // size))]
        n = sum(len(t) for t in traces)
        us = run(encode(traces, 512), len(traces)) / n * 1e6
        base = base or us
        print(f"| {size:,} | {len(traces):,} | {n:,} | {us:.1f} | {us / base:.2f}x |")
    print()
    print("| concurrent traces | traces | spans | µs/span | vs 1 |")
    print("|---|---|---|---|---|")
    rng = random.Random(4)
    traces = [trace_spans(rng, 6, 3) for _ in range(args.total // 31)]
    n = sum(len(t) for t in traces)
    base = None
    for k in (1, 10, 100, 1000):
        us = run(encode(interleave(traces, k), 512), len(traces)) / n * 1e6
        base = base or us
        print(f"| {k:,} | {len(traces):,} | {n:,} | {us:.1f} | {us / base:.2f}x |")


if __name__ == "__main__":
    main()
