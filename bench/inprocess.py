"""Where the time goes, without network or store: the same payload through protobuf parse, decode
(protobuf + Python, and the compiled decoder from the serialized bytes), ingest (decode + classify +
assemble) and sweep (finalize + reconcile), in one process.

    .venv/bin/python bench/inprocess.py [--traces 2000]
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import structlog
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

sys.path.insert(0, str(Path(__file__).parent))
from workload import encode, trace_spans  # noqa: E402

from collector.config import CollectorConfig  # noqa: E402
from collector.formats.decode import NATIVE, decode_bytes, decode_request  # noqa: E402
from collector.live.pipeline import Pipeline  # noqa: E402
from collector.store import open_store  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=2000)
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    rng = random.Random(7)
    payload = [trace_spans(rng) for _ in range(args.traces)]
    n = sum(len(t) for t in payload)
    bodies = encode(payload)
    cfg = CollectorConfig(assembly={"quiet_period": 0.0001}, journal={"enabled": False})
    matcher = cfg.matcher()

    def timed(fn: Callable[[], object]) -> float:
        t = time.perf_counter()
        fn()
        return n / (time.perf_counter() - t)

    parse = timed(lambda: [ExportTraceServiceRequest.FromString(b) for b in bodies])
    decode = timed(lambda: [decode_request(ExportTraceServiceRequest.FromString(b), matcher) for b in bodies])
    decode_native = timed(lambda: [decode_bytes(b, matcher) for b in bodies])
    with tempfile.TemporaryDirectory(prefix="agenteval-inprocess-") as tmp:
        pipeline = Pipeline(cfg, open_store(Path(tmp) / "runs.db"), None, None)
        t0 = time.perf_counter()
        for b in bodies:
            pipeline.ingest_decoded(decode_bytes(b, matcher), "grpc")  # the receivers' path
        ingest_s = time.perf_counter() - t0
        time.sleep(0.01)
        t1 = time.perf_counter()
        pipeline.sweep()
        sweep_s = time.perf_counter() - t1
        pipeline.close()
    print(f"spans {n}")
    native = "decode (native, from bytes)" if NATIVE else "decode (no native: protobuf)"
    for name, rate in [("parse", parse), ("decode", decode), (native, decode_native),
                       ("ingest (decode_bytes+classify)", n / ingest_s), ("sweep (finalize+reconcile)", n / sweep_s),
                       ("ingest+sweep", n / (ingest_s + sweep_s))]:
        print(f"{name:31} {rate:10.0f} spans/s")


if __name__ == "__main__":
    main()
