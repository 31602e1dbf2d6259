"""Memory a finalized trace keeps per span for the late window (what assembly.max_late_bytes
counts with), measured with tracemalloc for small and large agents.

    .venv/bin/python bench/late_memory.py
"""

from __future__ import annotations

import gc
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from collector.config import CollectorConfig
from collector.formats.decode import decode_request
from collector.live.assembler import Assembler

from workload import encode, trace_spans


def main() -> None:
    for chats in (3, 50):
        rng = random.Random(1)
        payload = [trace_spans(rng, executors=20, chats=chats) for _ in range(200)]
        n = sum(len(t) for t in payload)
        cfg = CollectorConfig(assembly={"quiet_period": 0.0001, "max_late_traces": 100_000})
        matcher = cfg.matcher()
        requests = [decode_request(ExportTraceServiceRequest.FromString(b), matcher).spans
                    for b in encode(payload)]
        gc.collect()
        tracemalloc.start()
        assembler = Assembler(cfg.assembly, matcher)
        base = tracemalloc.get_traced_memory()[0]
        for spans in requests:
            assembler.offer(spans)
        time.sleep(0.01)
        assembler.sweep()
        requests.clear()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        print(f"chat calls per agent {chats:3d}: {n} spans in {assembler.late_traces} late traces, "
              f"{held / n:.0f} bytes per span")


if __name__ == "__main__":
    main()
