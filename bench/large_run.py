"""A very large run's readers (issue 32 item 7): one agent with a million chat calls, reconciled and
stored the way the collector stores it, then read back from a live collector: the stored document's
size, GetRun and ListRuns (include_executors) with gRPC's default client limits, the run page, and
the first message of WatchVerdicts(replay=1) (what ``agenteval watch --replay`` waits for).

    .venv/bin/python bench/large_run.py [--chat-spans 1000000] [--per-invocation 100] [--repeat 5]

The run is built as a RunInput and reconciled (building it through the receivers takes minutes and
measures ingest, not the readers); the store is opened as the collector opens it by default.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import yaml

from collector.api.v1 import fidelity_pb2 as pb
from collector.api.v1.fidelity_pb2_grpc import FidelityServiceStub
from collector.core.model import ChatTurn, ExecutorRecord, LedgerEntry, RunInput, Usage
from collector.core.reconcile import reconcile
from collector.store import StoredRun, open_store, unpack

AGENTEVAL = str(Path(sys.executable).parent / "agenteval")
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
ROOT = "00f067aa0ba902b7"


def large_run(chat_spans: int, per_invocation: int) -> RunInput:
    """One agent unit: ``chat_spans`` chat calls in invocations of ``per_invocation``, one ledger
    entry and one executor span each."""
    invocations = chat_spans // per_invocation
    turns, ledger, executor_spans = [], [], []
    for i in range(invocations):
        agent = f"a{i:015x}"
        executor_spans.append(f"e{i:015x}")
        ledger.append(LedgerEntry(Usage(per_invocation, per_invocation), "stop", i, agent, f"l{i:015x}"))
        turns.extend(ChatTurn(Usage(1, 1), "stop", i * per_invocation + c, agent, f"{i * per_invocation + c:016x}")
                     for c in range(per_invocation))
    unit = ExecutorRecord("writer", tuple(ledger), tuple(turns), "instrumentation", tuple(executor_spans))
    return RunInput((unit,), TRACE_ID, ROOT, "large", run_id=f"{TRACE_ID}-{ROOT}")


def timed(call: Callable[[], object], repeat: int) -> tuple[float, object]:
    """Median seconds of ``repeat`` calls, and the last call's result (or the exception it raised)."""
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        try:
            result = call()
        except grpc.RpcError as exc:
            result = exc
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def serve(tmp: Path, store: Path) -> tuple[subprocess.Popen, dict]:
    config = tmp / "collector.yaml"
    config.write_text(yaml.safe_dump({
        "receivers": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"endpoint": "127.0.0.1:0"}},
        "store": {"url": str(store)}, "journal": {"path": str(tmp / "journal")},
        "exporters": {"prometheus": {"endpoint": "127.0.0.1:0"}}}))
    log = (tmp / "collector.log").open("w+")
    proc = subprocess.Popen([AGENTEVAL, "collector", "serve", "--config", str(config)], stdout=log, stderr=log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in (tmp / "collector.log").read_text().splitlines():
            if '"collector_listening"' in line:
                return proc, json.loads(line)
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the collector did not start: " + (tmp / "collector.log").read_text()[-2000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chat-spans", type=int, default=1_000_000)
    parser.add_argument("--per-invocation", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        start = time.perf_counter()
        verdict = reconcile(large_run(args.chat_spans, args.per_invocation))
        built = time.perf_counter() - start
        store = open_store(tmp / "runs.db")
        run_id = f"{TRACE_ID}-{ROOT}"
        start = time.perf_counter()
        store.save(StoredRun(run_id, "live:grpc", verdict, "bench"))
        saved = time.perf_counter() - start
        store.close()
        with sqlite3.connect(tmp / "runs.db") as db:
            (body,), = db.execute("SELECT body FROM runs").fetchall()
            size, stored = len(unpack(body)), len(body)
        print(f"run: 1 unit, {args.chat_spans:,} chat spans, {args.chat_spans // args.per_invocation:,} invocations "
              f"(reconciled in {built:.2f} s, stored in {saved:.3f} s)")
        print(f"stored document: {size:,} bytes of JSON, {stored:,} stored (compressed)")

        proc, listening = serve(tmp, tmp / "runs.db")
        try:
            with grpc.insecure_channel(listening["grpc"]) as channel:  # gRPC's default limits (4 MiB in)
                api = FidelityServiceStub(channel)

                def get() -> int:
                    return api.GetRun(pb.GetRunRequest(run_id=run_id), timeout=60).ByteSize()

                def listed() -> int:
                    return api.ListRuns(pb.ListRunsRequest(limit=1, include_executors=True), timeout=60).ByteSize()

                def watched() -> int:
                    stream = api.WatchVerdicts(pb.WatchRequest(replay=1), timeout=60)
                    try:
                        return next(stream).ByteSize()
                    finally:
                        stream.cancel()

                def page() -> int:
                    with urllib.request.urlopen(f"{listening['http']}/runs/{run_id}", timeout=60) as resp:
                        return len(resp.read())

                for name, call in (("GetRun", get), ("ListRuns(include_executors)", listed),
                                   ("WatchVerdicts(replay=1), first message", watched), ("run page", page)):
                    seconds, result = timed(call, args.repeat)
                    what = (f"{result.code().name}: {result.details()[:80]}" if isinstance(result, grpc.RpcError)
                            else f"{result:,} bytes")
                    print(f"{name:40s} median {seconds * 1000:8.1f} ms of {args.repeat}  ({what})")
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    os.environ.pop("AGENTEVAL_STORE", None)
    main()
