"""The live pipeline's internal contracts (issue 60): one span log protocol that the crash journal and
Kafka's offsets both keep, a sweep that returns what it found, a store writer that can be flushed,
one retry helper, and nothing running before ``start()``."""

from __future__ import annotations

import asyncio
import inspect
import json
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

from collector.config import CollectorConfig
from collector.core.reconcile import reconcile
from collector.formats.decode import Decoded, decode_request
from collector.formats.loader import workflow_trace_run
from collector.live.assembler import Assembler, Sweep
from collector.live.handover import Handover
from collector.live.journal import Journal
from collector.live.pipeline import Pipeline
from collector.live.receivers.kafka_offsets import KafkaOffsets
from collector.live.retry import Backoff, until_stored
from collector.live.spanlog import SpanLog
from collector.live.store_writer import StoreWriter
from collector.store import StoredRun, StoreError, open_store
from collector.store.sqlite import SqliteRunStore

from mafshape import SCENARIOS, export_request, record

ROOT = Path(__file__).resolve().parents[1]


def _decoded() -> Decoded:
    """One request holding one MAF-shaped run."""
    spans, _ = record([SCENARIOS["pass"][0]])
    return decode_request(export_request(spans), CollectorConfig().matcher())


def _spans() -> list:
    return _decoded().spans


def _verdict():
    return reconcile(workflow_trace_run(json.loads((ROOT / "examples/pass_all_agree.json").read_text()), "x"))


# --- SpanLog: the journal and Kafka's offsets --------------------------------------------------------

@pytest.mark.parametrize("log_type", [Journal, KafkaOffsets])
def test_the_journal_and_kafkas_offsets_each_take_the_span_logs_calls_as_declared(log_type):
    for name in ("append", "mark", "release"):
        declared = inspect.signature(getattr(SpanLog, name)).parameters
        assert inspect.signature(getattr(log_type, name)).parameters == declared, name


def test_kafkas_offsets_carry_none_of_the_journals_own_members():
    """What only the journal does (replay, keep traces cut short, fill up) is not on the offsets."""
    for journal_only in ("replay", "cut", "unpin", "full", "size", "directory", "keep_cut_for", "first_cut",
                         "close", "at"):
        assert not hasattr(KafkaOffsets(4096), journal_only), journal_only


async def _held_until_its_last_append_is_released(log: SpanLog, held: Callable[[], bool],
                                                  at: Callable[[int], tuple[int, int]]) -> None:
    """A trace appended twice, released as of a mark between the appends, is still held; released as
    of a mark after both, it is let go."""
    spans = _spans()
    trace = spans[0].trace_id
    for n in (0, 1):
        if (durable := log.append(spans, at=at(n))) is not None:
            await durable
        if n == 0:
            settled = log.mark()
    assert held()
    log.release([(trace, settled)])
    assert held(), "a release covers only what was appended before its mark"
    log.release([(trace, log.mark())])
    assert not held()


def test_the_journal_keeps_a_trace_until_it_is_released_past_its_last_append(tmp_path):
    journal = Journal(tmp_path, 1 << 20, 1)  # full while any span is still needed
    journal.start()

    try:
        assert isinstance(journal, SpanLog)
        asyncio.run(_held_until_its_last_append_is_released(journal, journal.full, lambda n: (0, n)))
    finally:
        assert journal.close() == 0


def test_kafkas_offsets_hold_the_commit_until_a_trace_is_released_past_its_last_message():
    offsets = KafkaOffsets(4096)
    offsets.assign(0, None, None)

    def at(offset: int) -> tuple[int, int]:
        offsets.taken(0, offset)
        return 0, offset

    assert isinstance(offsets, SpanLog)
    asyncio.run(_held_until_its_last_append_is_released(offsets, lambda: offsets.commit_point(0).offset < 2, at))
    assert offsets.commit_point(0).offset == 2


def test_the_message_a_run_came_in_is_committed_past_once_the_pipeline_stored_the_run(tmp_path):
    """``ingest_decoded(..., at=)`` hands the Kafka message's position to the offsets; the commit
    stays at it until the run is stored, then moves past it."""
    offsets = KafkaOffsets(4096)
    offsets.assign(3, 7, None)
    store = open_store(tmp_path / "runs.db")
    cfg = CollectorConfig(assembly={"quiet_period": 1.0}, journal={"enabled": False})
    pipeline = Pipeline(cfg, store, None, None, offsets=offsets)
    now = [0.0]
    pipeline.assembler.clock = lambda: now[0]
    pipeline.start()
    try:
        decoded = _decoded()
        pipeline.ingest_decoded(decoded, "kafka", at=(3, 7))
        offsets.taken(3, 7)
        assert offsets.commit_point(3).offset == 7 and offsets.pending_traces(3) == {decoded.spans[0].trace_id}
        now[0] += 2.0
        assert pipeline.sweep() == 1 and pipeline.writer.flush(30)
        assert offsets.commit_point(3).offset == 8 and not offsets.pending_traces(3)
    finally:
        pipeline.close()
        store.close()


# --- Assembler.sweep: one result ----------------------------------------------------------------------

def test_a_sweep_returns_what_it_found_and_leaves_nothing_for_the_next():
    now = [0.0]
    assembler = Assembler(CollectorConfig().assembly, CollectorConfig().matcher(), clock=lambda: now[0])
    spans = _spans()
    assembler.offer(spans)
    swept = assembler.sweep(force=True)  # shutdown before the quiet period ended: cut short
    trace = spans[0].trace_id
    assert len(swept.finalized) == 1 and swept.finalized[0].run.incomplete
    assert swept.cut == [trace] and trace in swept.settled
    assert (swept.failures, swept.ignored, swept.handed, swept.spent) == ([], [], [], [])
    with pytest.raises(FrozenInstanceError):
        swept.finalized = []  # type: ignore[misc]
    assert assembler.sweep(force=True) == Sweep()


# --- StoreWriter.flush ------------------------------------------------------------------------------------

def test_flush_is_true_once_everything_handed_over_is_written_and_false_while_the_store_is_held(tmp_path):
    path = tmp_path / "runs.db"
    store = open_store(path)
    writer = StoreWriter(store, lambda batch: None)
    writer.start()
    verdict = _verdict()
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        assert writer.flush(0)  # nothing handed over yet
        writer.put([(StoredRun(f"first{i}", "live", verdict), None) for i in range(3)])
        assert writer.flush(30) and len(store.list_runs(limit=10)) == 3
        holder.execute("BEGIN EXCLUSIVE")  # another process's transaction holds the database
        writer.put([(StoredRun("held", "live", verdict), None)])
        assert not writer.flush(0.5)
        holder.execute("ROLLBACK")
        assert writer.flush(30) and store.get_run("held") is not None
    finally:
        holder.close()
        writer.close()
        store.close()


def test_flush_without_a_started_writer_times_out():
    writer = StoreWriter(SqliteRunStore(Path("/nonexistent/runs.db")), lambda batch: None)
    writer.put([(StoredRun("never", "live", _verdict()), None)])
    assert not writer.flush(0.1)
    writer.close()


# --- the retry helper --------------------------------------------------------------------------------------

def test_a_store_call_is_retried_with_doubling_delays_until_it_lands(tmp_path):
    store = open_store(tmp_path / "runs.db")
    refusals: list[float] = []
    attempts = iter([StoreError("locked")] * 4 + [None])

    def attempt() -> None:
        if (error := next(attempts)) is not None:
            raise error

    try:
        took = until_stored(attempt, store, lambda: False, lambda exc, delay: refusals.append(delay),
                            Backoff(0.01, 0.04))
        assert took is not None and took >= 0
        assert refusals == [0.01, 0.02, 0.04, 0.04]
    finally:
        store.close()


def test_a_store_call_is_given_up_only_when_stopping_with_the_store_not_open():
    never_open = SqliteRunStore(Path("/nonexistent/runs.db"))  # not opened: nothing to write to
    called: list[int] = []
    assert until_stored(lambda: called.append(1), never_open, lambda: True, lambda exc, delay: None,
                        Backoff(0.01, 0.04)) is None
    assert not called


def test_a_failure_about_the_data_is_raised_not_retried(tmp_path):
    store = open_store(tmp_path / "runs.db")
    try:
        with pytest.raises(ValueError):
            until_stored(lambda: int("not a run"), store, lambda: False, lambda exc, delay: None, Backoff(0.01, 0.04))
    finally:
        store.close()


def test_a_backoff_starts_over_once_reset():
    backoff = Backoff(1.0, 3.0)
    assert [backoff.failed() for _ in range(4)] == [1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert backoff.failed() == 1.0


# --- nothing runs before start() ------------------------------------------------------------------------

def _new_threads(before: set[threading.Thread]) -> set[str]:
    """Threads started since ``before``, but the store's own (started by its first write)."""
    return {thread.name for thread in threading.enumerate() if thread not in before} - {"store-checkpoint"}


def test_a_pipeline_starts_its_journal_writer_handover_and_sweeper_only_in_start(tmp_path):
    store = open_store(tmp_path / "runs.db")
    before = set(threading.enumerate())
    cfg = CollectorConfig(journal={"path": str(tmp_path / "j")}, assembly={"handover": True})
    pipeline = Pipeline(cfg, store, None, None)
    try:
        assert _new_threads(before) == set()
        pipeline.start()
        assert _new_threads(before) == {"journal", "store-writer", "handover", "store-sweeper"}
    finally:
        pipeline.close()
        store.close()


@pytest.mark.parametrize("component", ["journal", "store-writer", "handover"])
def test_a_component_starts_its_thread_only_in_start(tmp_path, component):
    store = open_store(tmp_path / "runs.db")
    before = set(threading.enumerate())
    made: Journal | StoreWriter | Handover = {
        "journal": lambda: Journal(tmp_path / "j", 1 << 20, 1 << 30),
        "store-writer": lambda: StoreWriter(store, lambda batch: None),
        "handover": lambda: Handover(store, "replica-a", 0.05, 60.0),
    }[component]()
    try:
        assert _new_threads(before) == set()
        made.start()
        assert _new_threads(before) == {component}
    finally:
        made.close()
        store.close()
