"""Crash recovery (docs/design.md §3 Durability): kill -9 the collector under load, restart it on the same store
and config, repeat; every trace whose requests were all acknowledged is stored exactly once with its
expected status and verdicts, as if nothing had happened."""

from __future__ import annotations

import http.client
import json
import random
import signal
import sqlite3
import threading
import time
import urllib.error
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import grpc

from collector.store import unpack

from conftest import CollectorProcess, free_port, post
from mafshape import SCENARIOS, export_request, record, run_id, sent_times
from test_reliability import grpc_raw

SEED = 20261203
KILLS = 3
TRACES = 90
#: Scenarios whose expected status and verdicts every surviving run must have.
NAMES = ["pass", "fail_under_report", "finish_mismatch", "loop", "path2_pending", "partial_warn"]
#: What an OTLP exporter retries (gRPC codes / HTTP statuses); anything else is a final answer.
RETRYABLE_GRPC = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                  grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED}
RETRYABLE_HTTP = {429, 502, 503, 504}


@dataclass
class Trace:
    trace_id: str
    scenario: str
    #: The trace's spans split into 2-3 requests, in the order an exporter sends them (root last).
    chunks: list[bytes]
    #: Per chunk: the collector life (0, 1, ...) that acknowledged it, or None.
    acked_by: list[int | None] = field(default_factory=list)
    #: When its run started and how long it took, from its spans (:func:`mafshape.sent_times`).
    times: tuple[datetime, float] | None = None


def make_traces(rng: random.Random, n: int) -> list[Trace]:
    names = [rng.choice(NAMES) for _ in range(n)]
    spans, ids = record([SCENARIOS[name][0] for name in names])
    by_trace = defaultdict(list)
    for span in spans:  # finish order: children before parents, the workflow.run span last
        by_trace[format(span.context.trace_id, "032x")].append(span)
    traces = []
    for tid, name in zip(ids, names, strict=True):
        ss = by_trace[tid]
        cuts = sorted(rng.sample(range(1, len(ss)), rng.choice([1, 2])))
        chunks = [export_request(ss[a:b]).SerializeToString()
                  for a, b in zip([0, *cuts], [*cuts, len(ss)], strict=True)]
        traces.append(Trace(tid, name, chunks, [None] * len(chunks), sent_times(ss, tid)))
    return traces


def interleave(rng: random.Random, traces: list[Trace], window: int = 4) -> list[tuple[int, int]]:
    """(trace, chunk) in send order: a few traces in progress at once, each trace's chunks in order."""
    order, active, nxt, waiting = [], [], [0] * len(traces), list(range(len(traces)))
    while waiting or active:
        while waiting and len(active) < window:
            active.append(waiting.pop(0))
        t = rng.choice(active)
        order.append((t, nxt[t]))
        nxt[t] += 1
        if nxt[t] == len(traces[t].chunks):
            active.remove(t)
    return order


class Sender(threading.Thread):
    """Sends the schedule like an OTLP exporter: alternating gRPC and HTTP, retrying what is retryable
    (refused connections during a restart included) until acknowledged or ``give_up`` seconds pass."""

    def __init__(self, grpc_target: str, http_target: str, traces: list[Trace], order: list[tuple[int, int]],
                 give_up: float = 60.0) -> None:
        super().__init__(daemon=True)
        self.grpc_target, self.http_target = grpc_target, http_target
        self.traces, self.order, self.give_up = traces, order, give_up
        self.life = 0  # which collector is up (set by the test after each restart)
        self.acked = 0
        self.retries = 0
        self.refused: list[str] = []  # final, non-retryable answers to valid requests

    def run(self) -> None:
        for i, (t, c) in enumerate(self.order):
            self._send(self.traces[t], c, "grpc" if i % 2 else "http")
            time.sleep(0.01)

    def _send(self, trace: Trace, chunk: int, transport: str) -> None:
        deadline, delay = time.monotonic() + self.give_up, 0.05
        while time.monotonic() < deadline:
            life = self.life
            if transport == "grpc":
                code, detail, _ = grpc_raw(self.grpc_target, trace.chunks[chunk])
                ok, retry, answer = code is grpc.StatusCode.OK, code in RETRYABLE_GRPC, f"{code}: {detail}"
            else:
                try:
                    status, body, _ = post(self.http_target, trace.chunks[chunk])
                    ok, retry, answer = status == 200, status in RETRYABLE_HTTP, f"HTTP {status}: {body[:200]!r}"
                except (urllib.error.URLError, ConnectionError, http.client.HTTPException, TimeoutError) as exc:
                    ok, retry, answer = False, True, repr(exc)
            if ok:
                trace.acked_by[chunk] = life
                self.acked += 1
                return
            if not retry:
                self.refused.append(f"{trace.trace_id} chunk {chunk} over {transport}: {answer}")
                return
            self.retries += 1
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        self.refused.append(f"{trace.trace_id} chunk {chunk} over {transport}: gave up after {self.give_up}s")


def runs_by_trace(store: Path) -> dict[str, list[tuple[str, int, int, dict]]]:
    con = sqlite3.connect(store, timeout=10)
    try:
        out = defaultdict(list)
        for tid, rid, rev, incomplete, body in con.execute(
                "SELECT trace_id, run_id, revision, incomplete, body FROM runs"):
            out[tid].append((rid, rev, incomplete, json.loads(unpack(body))))
        return out
    finally:
        con.close()


def problems(trace: Trace, rows: list[tuple[str, int, int, dict]]) -> str | None:
    """What is wrong with an acknowledged trace's stored runs, or None."""
    _, status, units = SCENARIOS[trace.scenario]
    if not rows:
        return "missing"
    if len(rows) > 1:
        return f"stored {len(rows)} times: {[(r[0], r[1], r[2]) for r in rows]}"
    rid, _, incomplete, doc = rows[0]
    got = (rid, bool(incomplete), doc["status"], {e["executor_id"]: e["verdict"] for e in doc["executors"]})
    want = (run_id(trace.trace_id), False, status, units)
    return None if got == want else f"stored as {got}, expected {want}"


def test_kill_9_under_load_loses_no_acknowledged_trace(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    traces = make_traces(rng, TRACES)
    order = interleave(rng, traces)
    grpc_port, http_port = free_port(), free_port()
    # Default config (journal on), fixed ports so the exporter's endpoint survives restarts; a trace cut
    # short by a crash is not finalized early (max_trace_wait) while its last requests are retried.
    overrides = {"receivers": {"grpc": {"endpoint": f"127.0.0.1:{grpc_port}"},
                               "http": {"endpoint": f"127.0.0.1:{http_port}"}},
                 "assembly": {"max_trace_wait": 30.0}}
    logs: list[Path] = []

    def start() -> CollectorProcess:
        """The collector on the same directory: same config, store and journal (each life's log kept)."""
        proc = CollectorProcess(tmp_path, overrides)
        assert (proc.grpc, proc.http) == (f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}")
        return proc

    def killed(proc: CollectorProcess) -> None:
        proc.proc.send_signal(signal.SIGKILL)  # mid-traffic: requests in flight, runs being written
        proc.stop()
        logs.append(proc.stderr_path.rename(tmp_path / f"life{len(logs)}.log"))

    proc = start()
    store = proc.store_path
    sender = Sender(proc.grpc, proc.http, traces, order)
    try:
        sender.start()
        for life in range(1, KILLS + 1):
            mark = sender.acked + rng.randint(20, 45)
            while sender.acked < mark and sender.is_alive():
                time.sleep(0.005)
            assert sender.is_alive(), f"traffic ended before kill {life}: raise TRACES"
            killed(proc)
            time.sleep(rng.uniform(0, 0.5))  # the exporter keeps retrying against a closed port meanwhile
            proc = start()
            sender.life = life
        sender.join(120)
        assert not sender.is_alive(), "sender still retrying after 120 s"

        acknowledged = [t for t in traces if None not in t.acked_by]
        across = [t for t in acknowledged if len(set(t.acked_by)) > 1]
        # The test exercised what it claims: traffic was interrupted, traces straddled a crash.
        assert sender.retries > 0 and across, (sender.retries, len(across))
        assert not sender.refused, f"valid requests refused for good: {sender.refused[:5]}"

        deadline = time.monotonic() + 30
        while True:
            rows = runs_by_trace(store)
            wrong = {t.trace_id: p for t in acknowledged if (p := problems(t, rows.get(t.trace_id, [])))}
            if not wrong or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        straddled = {t.trace_id for t in across}
        report = [f"{tid} ({'across a crash' if tid in straddled else 'one life'}): {p}" for tid, p in wrong.items()]
        assert not wrong, (f"{len(wrong)} of {len(acknowledged)} acknowledged traces ({len(across)} straddling one of "
                           f"{KILLS} kill -9) not stored exactly once as expected:\n" + "\n".join(report[:15]))
        # a run whose spans straddled a crash (the first ones replayed from the journal) keeps its
        # start and duration, the spans' end times journaled with them
        kept = {t.trace_id: (datetime.fromisoformat(doc["started_at"]), doc["duration_s"])
                for t in across for *_, doc in rows[t.trace_id]}
        assert kept == {t.trace_id: t.times for t in across}
        for log in [*logs, proc.stderr_path]:
            assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    finally:
        sender.give_up = 0
        proc.stop()
    assert proc.proc.returncode == 0
