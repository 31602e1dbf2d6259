"""Replicas come and go behind a load balancer (docs/scale-out.md, "Load balancer, honest"): a trace
split across replicas by a scale event is merged into one run, or flagged ``split``, never silently
wrong. Two real pipelines share one real store (SQLite and PostgreSQL); the spans are the real SDK's,
split between the replicas as a ring change splits them (children first, the root last)."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from collector.config import CollectorConfig
from collector.formats.decode import decode_request
from collector.live.pipeline import Pipeline
from collector.store import open_store

from mafshape import SCENARIOS, Invocation, Scenario, export_request, ok, record, run_id

#: Quick settings: a trace is quiet after 0.5 s (fake clock), a part handed over after 1 s quiet.
ASSEMBLY = {"quiet_period": 0.5, "handover_after": 1.0, "max_trace_wait": 3.0, "sweep_interval": 0.05,
            "handover": True}
#: A claim goes stale after max_trace_wait.
LEASE = ASSEMBLY["max_trace_wait"]


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "runs.db")
    return request.getfixturevalue("postgres").database()


class Replica:
    """A pipeline on a fake clock (its assembler's), named, on the shared store."""

    def __init__(self, name: str, url: str, journal: Path | None = None, **assembly: float) -> None:
        """``journal``: its journal's directory (what it holds of an earlier life is replayed; needs
        an event loop running: :func:`in_a_loop`)."""
        cfg = CollectorConfig(instance=name, store={"url": url},
                              journal={"enabled": True, "path": str(journal)} if journal else {"enabled": False},
                              assembly={**ASSEMBLY, **assembly})
        self.store = open_store(url)
        self.pipeline = Pipeline(cfg, self.store, None, None)
        self.pipeline.start()
        self.now = 0.0
        self.pipeline.assembler.clock = lambda: self.now
        self.pipeline.replay()

    def send(self, spans: list) -> None:
        if spans:
            self.pipeline.ingest_decoded(decode_request(export_request(spans), self.pipeline.matcher), "grpc")

    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.pipeline.sweep()

    def close(self) -> None:
        self.pipeline.close()
        self.store.close()

    def kill(self) -> None:
        """kill -9: its threads stop where they are (its journal after its group commit); nothing
        more of it reaches the store."""
        p = self.pipeline
        assert not p.writer.backlog, "runs are queued: they could be written meanwhile"
        p.handover._closing.set()
        p.handover._wake.set()
        p.handover._thread.join()
        p.writer.close()  # nothing queued: nothing written
        if p.journal is not None:
            with p.journal._wakeup:
                p.journal._closing = True
                p.journal._wakeup.notify()
            p.journal._thread.join()
            p.journal._lock_file.close()  # no close, no manifest
        self.store.close()


def in_a_loop(test: Callable) -> Callable:
    """Run the test with an event loop running: a journal resolves its appends on one."""
    @functools.wraps(test)
    def run(*args, **kwargs) -> None:
        async def body() -> None:
            test(*args, **kwargs)
        asyncio.run(body())
    return run


def until(replicas: list[Replica], done: Callable[[], bool], step: float = 0.25, timeout: float = 30.0) -> None:
    """Sweep every replica (their clocks moving ``step`` each time) until ``done``, or fail."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the replicas never got there"
        for r in replicas:
            r.tick(step)
        time.sleep(0.02)  # the hand-over threads poll the store


def runs_of(store, trace_id: str) -> dict[str, dict]:
    return {d["run_id"]: d for d in store.list_runs(run_id_prefix=trace_id, with_docs=True)}


def _no_parts(store) -> bool:
    """No part in the store: none waits, none is claimed (each left with the run that merged it)."""
    return not store._query("SELECT COUNT(*) AS n FROM parts", {})[0]["n"]


def _split(spans: list, to_old: Callable) -> tuple[list, list]:
    old = [s for s in spans if to_old(s)]
    return old, [s for s in spans if not to_old(s)]


def _executor_subtree(spans: list, executor: str) -> Callable:
    """Spans at or under the executor's span (what a ring change sends to the old replica when that
    executor ran before it)."""
    by_id = {s.context.span_id: s for s in spans}
    (top,) = [s for s in spans if s.name == f"executor.process {executor}"]

    def under(span) -> bool:
        while span is not None:
            if span is top:
                return True
            span = by_id.get(span.parent.span_id) if span.parent else None
        return False
    return under


def test_a_failing_executor_held_by_another_replica_is_merged_before_the_root_is_finalized(url):
    """The issue's FAIL stored as a clean PASS: the old replica held the under-reporting executor,
    the new one the root. The old one hands its part over; the new one merges it: one run, FAIL."""
    spans, (trace,) = record([SCENARIOS["fail_under_report"][0]])
    old, new = _split(spans, _executor_subtree(spans, "writer"))
    a, b = Replica("a", url), Replica("b", url)
    try:
        a.send(old)
        until([a], lambda: bool(a.store.waiting_parts(LEASE)))  # quiet for handover_after: handed over
        assert not runs_of(a.store, trace)  # nothing published of it as a run
        until([], lambda: trace in b.pipeline.handover.waiting)  # b's poll has seen it
        b.send(new)
        until([a, b], lambda: run_id(trace) in runs_of(b.store, trace))
        runs = runs_of(b.store, trace)
        assert list(runs) == [run_id(trace)]
        doc = runs[run_id(trace)]
        assert doc["status"] == "FAIL" and doc["revision"] == 1 and not doc["split"]
        assert {e["executor_id"]: e["verdict"] for e in doc["executors"]} == {"researcher": "Agree",
                                                                            "writer": "TokenMismatch"}
        assert any("held by a" in n and "merged into this run by b" in n for n in doc["notes"])
        assert _no_parts(b.store)
    finally:
        a.close()
        b.close()


def test_a_part_that_comes_after_the_root_was_finalized_makes_a_new_revision(url):
    """The root's replica finalized first (a PASS on the units it had): the part merges into a new
    revision, as late spans do, which replaces it."""
    spans, (trace,) = record([SCENARIOS["fail_under_report"][0]])
    old, new = _split(spans, _executor_subtree(spans, "writer"))
    a, b = Replica("a", url), Replica("b", url)
    try:
        b.send(new)
        until([b], lambda: run_id(trace) in runs_of(b.store, trace))
        assert runs_of(b.store, trace)[run_id(trace)]["status"] == "PASS"  # all it could know
        a.send(old)
        until([a, b], lambda: runs_of(b.store, trace)[run_id(trace)]["revision"] == 2)
        doc = runs_of(b.store, trace)[run_id(trace)]
        assert doc["status"] == "FAIL" and doc["finalized_by"] == "b" and len(runs_of(b.store, trace)) == 1
        assert {e["executor_id"]: e["verdict"] for e in doc["executors"]}["writer"] == "TokenMismatch"
    finally:
        a.close()
        b.close()


def test_a_split_inside_one_agent_is_reconciled_on_all_its_calls(url):
    """The writer's first chat call went to the old replica; its last call and the ledger (which
    reports only the last call) to the new one, where they alone would Agree."""
    spans, (trace,) = record([SCENARIOS["fail_under_report"][0]])
    first_call = min((s for s in spans if s.name == "chat fake-model"
                      and any(p.name == "invoke_agent writer" and p.context.span_id == s.parent.span_id
                              for p in spans)),
                     key=lambda s: s.start_time)
    old, new = _split(spans, lambda s: s is first_call)
    a, b = Replica("a", url), Replica("b", url)
    try:
        a.send(old)
        b.send(new)
        until([a, b], lambda: run_id(trace) in runs_of(b.store, trace) and _no_parts(b.store)
              and not b.pipeline.handover.pending)
        until([a, b], lambda: runs_of(b.store, trace)[run_id(trace)]["status"] == "FAIL")
        doc = runs_of(b.store, trace)[run_id(trace)]
        writer = next(e for e in doc["executors"] if e["executor_id"] == "writer")
        assert writer["verdict"] == "TokenMismatch" and len(writer["evidence"]["chat_calls"]) == 2
    finally:
        a.close()
        b.close()


def test_a_stopping_replica_hands_its_parts_over_and_publishes_none(url):
    """SIGTERM (close) on the replica holding the first executor: its part goes to the store, not
    into a run of its own, and the replica with the root merges it."""
    spans, (trace,) = record([SCENARIOS["fail_under_report"][0]])
    old, new = _split(spans, _executor_subtree(spans, "writer"))
    a, b = Replica("a", url), Replica("b", url)
    try:
        a.send(old)
        a.close()
        assert not runs_of(b.store, trace) and [p.held_by for p in b.store.waiting_parts(LEASE)] == ["a"]
        b.send(new)
        until([b], lambda: run_id(trace) in runs_of(b.store, trace) and _no_parts(b.store))
        until([b], lambda: runs_of(b.store, trace)[run_id(trace)]["status"] == "FAIL")
    finally:
        b.close()


def test_a_part_no_replica_with_the_root_claims_is_flagged_split_with_the_runs_of_its_trace(url):
    """The root's replica let the trace go (no late window) before the part came: the part is
    reconciled apart after max_trace_wait, flagged split, and the stored PASS is flagged too
    (never a PASS); each says which replica held which part."""
    spans, (trace,) = record([SCENARIOS["fail_under_report"][0]])
    old, new = _split(spans, _executor_subtree(spans, "writer"))
    a, b = Replica("a", url, max_trace_wait=1.5), Replica("b", url, late_window=0, max_trace_wait=1.5)
    try:
        b.send(new)
        until([b], lambda: run_id(trace) in runs_of(b.store, trace))
        a.send(old)
        until([a, b], lambda: len(runs_of(b.store, trace)) == 2 and runs_of(b.store, trace)[run_id(trace)]["split"])
        runs = runs_of(b.store, trace)
        whole, part = runs[run_id(trace)], runs[trace]
        assert whole["status"] == "WARN" and whole["split"]  # was PASS
        assert part["split"] and part["status"] == "FAIL" and part["executors"][0]["verdict"] == "TokenMismatch"
        for doc in (whole, part):
            assert any(n.startswith("Split across replicas") and "held by a" in n for n in doc["notes"]), doc["notes"]
    finally:
        a.close()
        b.close()


def test_nothing_goes_to_the_store_for_a_trace_held_whole(url):
    """Steady state: a trace held whole by one replica writes its run and nothing else."""
    scenario = Scenario({"writer": [Invocation([ok(100, 10)])]}, name="steady")
    spans, (trace,) = record([scenario])
    a = Replica("a", url)
    try:
        a.send(spans)
        until([a], lambda: run_id(trace) in runs_of(a.store, trace))
        for _ in range(20):
            a.tick(0.5)
        assert _no_parts(a.store) and list(runs_of(a.store, trace)) == [run_id(trace)]
    finally:
        a.close()


def test_a_replica_whose_root_comes_after_a_long_gap_claims_its_own_part_back(url):
    """One replica, a trace quiet for longer than handover_after before its root (a long LLM call):
    its part goes to the store and comes back when the root does; one exact run, nothing to note."""
    spans, (trace,) = record([SCENARIOS["fail_under_report"][0]])
    early, late = _split(spans, _executor_subtree(spans, "writer"))
    a = Replica("a", url)
    try:
        a.send(early)
        until([a], lambda: bool(a.store.waiting_parts(LEASE)) and trace in a.pipeline.handover.waiting)
        a.send(late)
        until([a], lambda: run_id(trace) in runs_of(a.store, trace) and _no_parts(a.store))
        doc = runs_of(a.store, trace)[run_id(trace)]
        assert (doc["status"], doc["revision"], doc["split"]) == ("FAIL", 1, False)
        assert not any("across replicas" in n for n in doc["notes"])
    finally:
        a.close()


# --- a claim outlives its claimer (issue 43) -----------------------------------------------------

def _claim_answered(replica: Replica, trace: str) -> None:
    """The replica asks for the trace's parts (it holds the root) and the store has answered; the
    parts are not merged yet (that is the next sweep's)."""
    replica.tick(0.05)
    until([], lambda: any(t == trace for t, _, _ in replica.pipeline.handover._claimed))


def _exact(store, trace: str, revision: int = 1, incomplete: bool = False) -> dict:
    """The trace's one run, with every unit (``incomplete``: flagged so, as a trace cut short by a stop)."""
    runs = runs_of(store, trace)
    assert list(runs) == [run_id(trace)], runs
    doc = runs[run_id(trace)]
    assert (doc["status"], doc["split"], doc["incomplete"]) == ("FAIL", False, incomplete), doc
    units = {e["executor_id"]: e for e in doc["executors"]}
    assert {k: u["verdict"] for k, u in units.items()} == {"researcher": "Agree", "writer": "TokenMismatch"}
    assert doc["revision"] >= revision
    return units


@in_a_loop
def test_a_part_claimed_by_a_replica_killed_before_merging_it_is_merged_by_its_restart(url, tmp_path):
    """kill -9 of the root's replica after its claim, before the part reached its journal or a run:
    the part is still in the store, claimed; the replica started again on its journal releases its
    claims and merges the part: one exact run."""
    spans, (trace,) = record([SCENARIOS["fail_under_report"][0]])
    old, new = _split(spans, _executor_subtree(spans, "writer"))
    a, b = Replica("a", url), Replica("b", url, journal=tmp_path / "b")
    try:
        a.send(old)
        until([a], lambda: trace in b.pipeline.handover.waiting)
        b.send(new)
        _claim_answered(b, trace)
        b.kill()
        b = Replica("b", url, journal=tmp_path / "b")
        until([a, b], lambda: run_id(trace) in runs_of(b.store, trace) and _no_parts(b.store))
        _exact(b.store, trace)
    finally:
        a.close()
        b.close()


@in_a_loop
def test_a_part_merged_by_a_replica_killed_before_storing_it_is_stored_by_its_restart_once(url, tmp_path):
    """The root's replica stored a PASS (all it had), merged the part (journaled) and was killed
    before storing the new revision. Its restart replays the part's spans from its journal and
    claims the part again: the new revision is stored, with the part's spans counted once."""
    spans, (trace,) = record([SCENARIOS["fail_under_report"][0]])
    old, new = _split(spans, _executor_subtree(spans, "writer"))
    a, b = Replica("a", url), Replica("b", url, journal=tmp_path / "b")
    tid = bytes.fromhex(trace)
    try:
        b.send(new)
        until([b], lambda: run_id(trace) in runs_of(b.store, trace))
        assert runs_of(b.store, trace)[run_id(trace)]["status"] == "PASS"
        a.send(old)
        until([a], lambda: trace in b.pipeline.handover.waiting)
        _claim_answered(b, trace)
        b.pipeline.sweep()  # merged (the clock stands still: not finalized again)
        assert b.pipeline.assembler._open[tid].merged == {"a": len(old)}
        b.kill()
        b = Replica("b", url, journal=tmp_path / "b")
        until([a, b], lambda: runs_of(b.store, trace)[run_id(trace)]["status"] == "FAIL" and _no_parts(b.store))
        units = _exact(b.store, trace, revision=2)
        truth = len([s for s in spans if s.name == "chat fake-model"
                     and _executor_subtree(spans, "writer")(s)])
        assert len(units["writer"]["evidence"]["chat_calls"]) == truth  # not twice
    finally:
        a.close()
        b.close()


@in_a_loop
def test_a_replica_that_stops_with_parts_claimed_merges_them_into_the_runs_it_stores(url, tmp_path):
    """SIGTERM (close) of the root's replica after its claim was answered, before it merged the
    part: it merges it into the runs it stores as it stops, and the part leaves the store with them.
    The part just merged, the trace was not quiet: its run is flagged incomplete, as any trace a
    stop cuts short, and its journal keeps the trace, the part's spans too: its next start stores
    the whole run."""
    spans, (trace,) = record([SCENARIOS["fail_under_report"][0]])
    old, new = _split(spans, _executor_subtree(spans, "writer"))
    a, b = Replica("a", url), Replica("b", url, journal=tmp_path / "b")
    try:
        a.send(old)
        until([a], lambda: trace in b.pipeline.handover.waiting)
        b.send(new)
        _claim_answered(b, trace)
        stopping = threading.Thread(target=b.close)  # off the event loop, as the server stops it
        stopping.start()
        stopping.join()
        _exact(a.store, trace, incomplete=True)
        assert _no_parts(a.store)
        b = Replica("b", url, journal=tmp_path / "b")
        until([b], lambda: not runs_of(b.store, trace)[run_id(trace)]["incomplete"])
        _exact(b.store, trace, revision=2)
    finally:
        a.close()
        b.close()


def test_a_part_whose_claimer_is_gone_for_good_is_claimed_again_after_max_trace_wait(url):
    """The root's replica claimed the part and died with its journal (a lost node): its claim goes
    stale after max_trace_wait and the part is reconciled by another replica, flagged split (the
    root's spans are gone with the node), never lost."""
    spans, (trace,) = record([SCENARIOS["fail_under_report"][0]])
    old, new = _split(spans, _executor_subtree(spans, "writer"))
    a, b = Replica("a", url), Replica("b", url)
    try:
        a.send(old)
        until([a], lambda: trace in b.pipeline.handover.waiting)
        b.send(new)
        _claim_answered(b, trace)
        b.kill()
        until([a], lambda: bool(runs_of(a.store, trace)) and _no_parts(a.store))
        (doc,) = runs_of(a.store, trace).values()
        assert doc["split"] and doc["status"] == "FAIL"
        assert {e["executor_id"]: e["verdict"] for e in doc["executors"]} == {"writer": "TokenMismatch"}
    finally:
        a.close()
