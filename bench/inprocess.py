"""Where the time goes, without network: the same payload through protobuf parse, decode (protobuf +
Python, and the compiled decoder from the serialized bytes), ingest (decode + classify + assemble),
sweep (finalize + reconcile + price; since issue 39 also the run documents, made as runs are
published) and store (the store writer's ``save_many`` on SQLite, and letting go of what it wrote),
in one process; each stage's CPU time, the best of ``--repeat`` passes. ``ingest+sweep+store`` is
the whole path whichever thread does which part.

    .venv/bin/python bench/inprocess.py [--traces 2000]
    .venv/bin/python bench/inprocess.py --code . ~/.cache/agenteval/bench-base/<commit> --rounds 5

With ``--code``, each tree's collector (its own ``.venv`` when it has one, as bench/base.sh builds)
runs this script on the same payload, the trees alternating round by round and each round starting
with the next tree (use an even number of rounds for two trees); the medians of the rounds are
printed with each tree's ratio to the first (above 1: faster).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # bench/'s own modules, imported below
from workload import encode, trace_spans

STAGES = ("parse", "decode", "decode (native, from bytes)", "ingest (decode_bytes+classify)",
          "sweep (finalize+reconcile)", "ingest+sweep", "store (save_many)", "ingest+sweep+store", "classify+assemble",
          "finalize", "reconcile", "reconcile+price", "document (JSON)", "compress")


def measure(traces: int, repeat: int) -> dict[str, float]:
    """Spans/s per stage in this process (the collector importable from ``sys.path``)."""
    import structlog
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from collector.config import CollectorConfig
    from collector.store import open_store
    try:
        from collector.core.reconcile import reconcile
        from collector.core.serialize import run_to_json
        from collector.formats.decode import NATIVE, decode_bytes, decode_request
        from collector.live.assembler import Assembler
        from collector.live.pipeline import Pipeline
    except ImportError:  # a collector before the stage packages
        from collector.assembler import Assembler  # type: ignore[no-redef]
        from collector.decode import NATIVE, decode_bytes, decode_request  # type: ignore[no-redef]
        from collector.pipeline import Pipeline  # type: ignore[no-redef]
        from collector.reconcile import reconcile  # type: ignore[no-redef]
        from collector.serialize import run_to_json  # type: ignore[no-redef]
    try:
        from collector.outputs.pricing import Pricing
    except ImportError:  # before spend (issue 40)
        Pricing = None  # type: ignore[assignment,misc]
    try:
        from collector.store.base import pack
    except ImportError:  # before compressed documents (issue 42)
        pack = None  # type: ignore[assignment]

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    # Garbage collection as `agenteval collector serve` has it (collector/ui/cli.py, live/server.py
    # _tune_gc): the young generations every 50,000 allocations, the oldest never on its own (the
    # sweeper collects it every few minutes); each pass starts after a full collection.
    gc.freeze()
    gc.set_threshold(50_000, 20, 2**31 - 1)
    rng = random.Random(7)
    payload = [trace_spans(rng) for _ in range(traces)]
    n = sum(len(t) for t in payload)
    bodies = encode(payload)
    cfg = CollectorConfig(assembly={"quiet_period": 0.0001}, journal={"enabled": False})
    matcher = cfg.matcher()

    def best(fn: Callable[[], float]) -> float:
        return min(fn() for _ in range(repeat))

    def cpu(fn: Callable[[], object]) -> float:
        gc.collect()
        t = time.process_time()
        fn()
        return time.process_time() - t

    def stage_pass() -> dict[str, float]:
        """Each stage of the sweep apart, on the assembler's own runs (collectors before the stage
        packages, e.g. 8fe69c1, too: their modules at their old paths)."""
        decoded = [decode_bytes(b, matcher) for b in bodies]
        assembler = Assembler(cfg.assembly, matcher)
        out = {"classify+assemble": cpu(lambda: [assembler.offer(d.spans) for d in decoded])}
        time.sleep(0.01)
        finalized: list = []
        # a tree before issue 60 sweeps into a list, later ones into one Sweep
        out["finalize"] = cpu(lambda: finalized.extend(getattr(swept := assembler.sweep(True), "finalized", swept)))
        runs = [item.run for item in finalized]
        policy, preset = cfg.scoring.policy(), cfg.scoring.preset
        verdicts: list = []
        out["reconcile"] = cpu(lambda: verdicts.extend(reconcile(r, policy, preset, 1) for r in runs))
        if Pricing is not None:
            pricer = Pricing(cfg.pricing)
            out["reconcile+price"] = cpu(lambda: [reconcile(r, policy, preset, 1, pricer) for r in runs])
        docs: list = []
        out["document (JSON)"] = cpu(lambda: docs.extend(run_to_json(v) for v in verdicts))
        if pack is not None:
            out["compress"] = cpu(lambda: [pack(d) for d in docs])
        return out

    def pipeline_pass() -> tuple[float, float, float]:
        """Ingest, sweep, and the store writer's work on what the sweep published (in this thread,
        after the sweep: a tree that makes documents as it publishes does that in its sweep)."""
        with tempfile.TemporaryDirectory(prefix="agenteval-inprocess-") as tmp:
            store = open_store(Path(tmp) / "runs.db")
            pipeline = Pipeline(cfg, store, None, None)
            if hasattr(pipeline, "start"):  # a tree before issue 60 starts its threads as it is made
                pipeline.start()
            published: list = []
            pipeline.writer.put = published.extend  # the writer's work is timed apart, below
            ingest = cpu(lambda: [pipeline.ingest_decoded(decode_bytes(b, matcher), "grpc") for b in bodies])
            time.sleep(0.01)
            sweep = cpu(pipeline.sweep)
            runs = [item[0] if isinstance(item, tuple) else item for item in published]  # (run, arrival) since 4e81d70
            stored = cpu(lambda: [store.save_many(runs[i:i + 256]) for i in range(0, len(runs), 256)])
            # what the store writer lets go of, timed: since issue 39 the sweep frees the verdicts it
            # hands over (a queued run holds its document), before that the writer, once written
            t = time.process_time()
            runs.clear()
            published.clear()
            stored += time.process_time() - t
            pipeline.close()
        return ingest, sweep, stored

    passes = [pipeline_pass() for _ in range(repeat)]
    stages = {name: min(p[name] for p in [stage_pass() for _ in range(repeat)]) for name in stage_pass()}
    ingest, sweep, stored = (min(p[i] for p in passes) for i in range(3))
    seconds = {
        "parse": best(lambda: cpu(lambda: [ExportTraceServiceRequest.FromString(b) for b in bodies])),
        "decode": best(lambda: cpu(lambda: [decode_request(ExportTraceServiceRequest.FromString(b), matcher)
                                            for b in bodies])),
        "decode (native, from bytes)": best(lambda: cpu(lambda: [decode_bytes(b, matcher) for b in bodies])),
        "ingest (decode_bytes+classify)": ingest,
        "sweep (finalize+reconcile)": sweep,
        "ingest+sweep": min(i + s for i, s, _ in passes),
        "store (save_many)": stored,
        "ingest+sweep+store": min(sum(p) for p in passes),
        **stages,
    }
    if not NATIVE:
        seconds.pop("decode (native, from bytes)")
    return {"spans": n, **{stage: n / s for stage, s in seconds.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3, help="passes per stage, the best kept")
    ap.add_argument("--code", nargs="+", help="source trees to run side by side (the first is the base of the ratios)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one tree's figures, for --code
    args = ap.parse_args()
    if args.json:
        print(json.dumps(measure(args.traces, args.repeat)))
        return
    if not args.code:
        got = measure(args.traces, args.repeat)
        print(f"spans {got.pop('spans')}")
        for stage, rate in got.items():
            print(f"{stage:31} {rate:10.0f} spans/s")
        return
    rounds: dict[str, list[dict[str, float]]] = {code: [] for code in args.code}
    for n in range(args.rounds):
        # Each round starts with the next tree: on a shared box the tree run second in a round read
        # slower, identical code included (0.68x), so no tree may always go first.
        for code in args.code[n % len(args.code):] + args.code[:n % len(args.code)]:
            tree = Path(code).resolve()
            python = tree / ".venv/bin/python"
            out = subprocess.run([str(python if python.exists() else sys.executable), __file__, "--json",
                                  "--traces", str(args.traces), "--repeat", str(args.repeat)],
                                 cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                                 capture_output=True, text=True, check=True)
            rounds[code].append(json.loads(out.stdout.splitlines()[-1]))
    first = args.code[0]
    medians = {code: {stage: statistics.median(r[stage] for r in runs) for stage in STAGES if stage in runs[0]}
               for code, runs in rounds.items()}
    print(f"spans {rounds[first][0]['spans']}, medians of {args.rounds} rounds (spans/s; ratio to {first})\n")
    print("| stage | " + " | ".join(args.code) + " |\n|---|" + "---|" * len(args.code))
    for stage in STAGES:
        if any(stage in figures for figures in medians.values()):
            cells = [("-" if stage not in medians[c] else f"{medians[c][stage]:,.0f}" if stage not in medians[first]
                      else f"{medians[c][stage]:,.0f} ({medians[c][stage] / medians[first][stage]:.2f}x)")
                     for c in args.code]
            print(f"| {stage} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
