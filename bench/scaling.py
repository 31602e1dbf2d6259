"""Scaling: cost per span as traces grow (10 to 100K spans) and as traces interleave (1 to 1000
concurrent). ``sizes`` and ``concurrency``: time through the real pipeline in one process (decode,
classify, assemble, reconcile, store). ``live``: the collector as its own process, sent the same
total spans as traces of each size over gRPC; its CPU-seconds (utime + stime from /proc) from the
first request to the last verdict stored, per 100K spans, and the max/min ratio across sizes.

    .venv/bin/python bench/scaling.py [--total 200000] [--parts sizes concurrency live] [--streams 1]
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
from opentelemetry.proto.trace.v1.trace_pb2 import Span

sys.path.insert(0, str(Path(__file__).parent))  # bench/'s own modules, imported below
from collector.config import CollectorConfig
from collector.formats.decode import decode_bytes
from collector.live.pipeline import Pipeline
from collector.store import open_store

from workload import Collector, encode, send_streams, trace_spans

#: (executors, chats per executor) for each trace size: a root, and per executor its span, the
#: agent's, the agent_response span and the chats: 1 + executors * (3 + chats) spans.
SHAPES = {size: ((size - 1) // 9, 6) for size in (10, 100, 1_000, 10_000, 100_000)}


def run(bodies: list[bytes], traces: int) -> float:
    """Seconds to ingest every body and finalize every trace, store writes included."""
    cfg = CollectorConfig(assembly={"quiet_period": 3600, "max_spans_in_flight": 10_000_000,
                                    "max_traces_in_flight": 1_000_000}, journal={"enabled": False})
    with tempfile.TemporaryDirectory(prefix="agenteval-scaling-") as tmp:
        pipeline = Pipeline(cfg, open_store(Path(tmp) / "runs.db"), None, None)
        pipeline.start()
        matcher = pipeline.matcher
        start = time.perf_counter()
        for body in bodies:
            pipeline.ingest_decoded(decode_bytes(body, matcher), "grpc")  # the receivers' path
        assert pipeline.sweep(force=True) == traces
        pipeline.close()
        return time.perf_counter() - start


def live(bodies: list[bytes], traces: int, streams: int) -> tuple[float, float]:
    """(collector CPU-seconds, end-to-end seconds) to take ``bodies`` and store every run."""
    with Collector() as collector:
        cpu0 = collector.cpu_seconds()
        sent = send_streams("grpc", collector.grpc, bodies, streams)
        stored = collector.wait_stored(traces)
        return collector.cpu_seconds() - cpu0, stored - sent.started


def sized(size: int, total: int) -> list[list[Span]]:
    """About ``total`` spans as traces of ``size`` spans each (at least one trace)."""
    executors, chats = SHAPES[size]
    rng = random.Random(3)
    return [trace_spans(rng, executors, chats) for _ in range(max(1, total // size))]


def spread(costs: list[float]) -> str:
    return f"max/min cost per span across trace sizes: {max(costs) / min(costs):.2f}x (target: within 1.5x)"


def interleave(traces: list[list[Span]], k: int) -> list[list[Span]]:
    """Groups of k traces whose spans alternate (k traces in flight at once), as one span list each."""
    out = []
    for g in range(0, len(traces), k):
        group = traces[g:g + k]
        mixed = [s for row in zip(*group, strict=False) for s in row]
        mixed += [s for t in group for s in t[len(min(group, key=len)):]]
        out.append(mixed)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total", type=int, default=200_000, help="spans per measurement")
    ap.add_argument("--parts", nargs="+", default=["sizes", "concurrency", "live"],
                    choices=["sizes", "concurrency", "live"])
    ap.add_argument("--streams", type=int, default=1, help="concurrent gRPC streams in the live part")
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if "sizes" in args.parts:
        print("In one process:\n")
        print("| trace size (spans) | traces | spans | µs/span | vs smallest |")
        print("|---|---|---|---|---|")
        costs = []
        for size in SHAPES:
            traces = sized(size, args.total)
            n = sum(len(t) for t in traces)
            costs.append(run(encode(traces, 512), len(traces)) / n * 1e6)
            print(f"| {size:,} | {len(traces):,} | {n:,} | {costs[-1]:.1f} | {costs[-1] / costs[0]:.2f}x |")
        print(f"\n{spread(costs)}\n")
    if "concurrency" in args.parts:
        print("| concurrent traces | traces | spans | µs/span | vs 1 |")
        print("|---|---|---|---|---|")
        rng = random.Random(4)
        traces = [trace_spans(rng, 6, 3) for _ in range(args.total // 37)]
        n = sum(len(t) for t in traces)
        base = None
        for k in (1, 10, 100, 1000):
            us = run(encode(interleave(traces, k), 512), len(traces)) / n * 1e6
            base = base or us
            print(f"| {k:,} | {len(traces):,} | {n:,} | {us:.1f} | {us / base:.2f}x |")
        print()
    if "live" in args.parts:
        print(f"The collector process, over gRPC ({args.streams} stream{'s' * (args.streams > 1)}):\n")
        print("| trace size (spans) | traces | spans | collector CPU s /100K spans | end-to-end spans/s "
              "| vs smallest |")
        print("|---|---|---|---|---|---|")
        costs = []
        for size in SHAPES:
            traces = sized(size, args.total)
            n = sum(len(t) for t in traces)
            cpu, seconds = live(encode(traces, 512), len(traces), args.streams)
            costs.append(cpu / n * 1e5)
            print(f"| {size:,} | {len(traces):,} | {n:,} | {costs[-1]:.2f} | {n / seconds:,.0f} | "
                  f"{costs[-1] / costs[0]:.2f}x |", flush=True)
        print(f"\n{spread(costs)}")


if __name__ == "__main__":
    main()
