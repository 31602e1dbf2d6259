"""Issue 42 on both backends (embedded SQLite and a real PostgreSQL server): retention (the sweeper
deletes runs past the maximum age and the oldest runs over the size cap, never a run within its
late window, in batches beside the writer) and the compact run record (a store written by the
previous schema migrates, and reads back every run as the same JSON)."""

from __future__ import annotations

import json
import random
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest

from collector.core.model import ChatTurn, ExecutorRecord, LedgerEntry, RunInput, Usage
from collector.core.reconcile import reconcile
from collector.core.serialize import run_to_json, to_json
from collector.live.store_writer import StoreWriter
from collector.store import Retention, StoredRun, open_store, unpack
from collector.store.retention import _OLDEST, Retainer, RetentionSweeper
from collector.store.schema import MIGRATIONS

from conftest import AGENTEVAL, CollectorProcess, post

DAY = 86400.0


def _verdict(trace_id: str, truth: int = 100, executors: int = 1, chats: int = 1):
    recs = tuple(ExecutorRecord(f"e{i}", (LedgerEntry(Usage(100, 0), "stop"),),
                                tuple(ChatTurn(Usage(truth, 0), "stop", c, None, f"{i:04x}{c:012x}")
                                      for c in range(chats)),
                                "t") for i in range(executors))
    return reconcile(RunInput(recs, trace_id=trace_id))


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "runs.db")
    return request.getfixturevalue("postgres").database()


def _sql(url: str, sql: str, params: tuple = ()) -> list[tuple]:
    """Run one statement directly (``?`` marks), the way an older agenteval or an operator would."""
    if url.startswith("postgresql://"):
        with psycopg.connect(url, autocommit=True) as conn:
            cur = conn.execute(sql.replace("?", "%s"), params)
            return cur.fetchall() if cur.description else []
    con = sqlite3.connect(url)
    try:
        with con:
            return con.execute(sql, params).fetchall()
    finally:
        con.close()


def _age(url: str, run_id: str, seconds: float) -> None:
    """Make a run last written ``seconds`` ago."""
    _sql(url, "UPDATE runs SET updated_at = ?, created_at = ? WHERE run_id = ?",
         (time.time() - seconds, time.time() - seconds, run_id))


def _ids(store) -> set[str]:
    return {r["run_id"] for r in store.list_runs(limit=100_000)}


def test_runs_older_than_the_maximum_age_are_deleted_and_younger_ones_kept(url):
    store = open_store(url)
    try:
        store.save_many([StoredRun(f"run{i}", "live", _verdict(f"{i:032x}")) for i in range(6)])
        for i, days in enumerate([30, 15, 14.01, 13.9, 1, 0]):
            _age(url, f"run{i}", days * DAY)
        assert store.sweep(Retention(max_age=14 * DAY)) == 3
        assert _ids(store) == {"run3", "run4", "run5"}
        assert store.runs_deleted == 3
        assert store.oldest() == pytest.approx(time.time() - 13.9 * DAY, abs=60)
        assert store.sweep(Retention(max_age=14 * DAY)) == 0  # nothing more is old enough
        assert store.get_run("run3")["executors"][0]["verdict"] == "Agree"  # a kept run reads whole
    finally:
        store.close()


def test_a_run_within_its_late_window_is_never_deleted(url):
    store = open_store(url)
    try:
        store.save_many([StoredRun(f"run{i}", "live", _verdict(f"{i:032x}")) for i in range(3)])
        _age(url, "run0", 400)
        _age(url, "run1", 200)
        kept = Retention(max_age=1.0, max_size=1, late_window=300)  # everything is over both bounds
        assert store.sweep(kept) == 1
        assert _ids(store) == {"run1", "run2"}  # written within the late window: may still get a revision
        assert store.sweep(kept) == 0
    finally:
        store.close()


def test_a_revision_written_while_the_sweeper_deletes_keeps_its_run(url, monkeypatch):
    """The sweeper picks its batch, then a revision of one of those runs is written before the
    batch is deleted (the race of a late span with the sweeper): the run is kept, revised."""
    store = open_store(url)
    try:
        store.save_many([StoredRun(f"run{i}", "live", _verdict(f"{i:032x}")) for i in range(4)])
        for i in range(4):
            _age(url, f"run{i}", 2 * DAY)
        query = store._query

        def revised_meanwhile(sql, params):
            rows = query(sql, params)
            if sql == _OLDEST:  # the batch is picked: run2 is old
                assert "run2" in {r["run_id"] for r in rows}
                store.save(StoredRun("run2", "live", replace(_verdict(f"{2:032x}", truth=999), revision=2)))
            return rows

        monkeypatch.setattr(store, "_query", revised_meanwhile)
        assert store.sweep(Retention(max_age=DAY)) == 3
        monkeypatch.undo()
        assert _ids(store) == {"run2"}
        doc = store.get_run("run2")
        assert doc["revision"] == 2 and doc["executors"][0]["evidence"]["truth_tokens"] == 999
    finally:
        store.close()


def test_the_size_cap_holds_under_sustained_writes_which_are_never_refused(url):
    """A writer stores batches as fast as it can while the sweeper runs beside it: every batch is
    written, the oldest runs go, the newest stay, and after the last pass the store is within the cap."""
    store = open_store(url)
    cap = 400_000
    kept = Retention(max_age=None, max_size=cap, late_window=0, interval=0.02, batch=50)
    deleted: list[int] = []
    store.start_sweeping(kept, deleted.append)
    written = []
    try:
        for batch in range(40):
            runs = [StoredRun(f"b{batch:02d}-{i:02d}", "live", _verdict(f"{batch:02x}{i:030x}", executors=3, chats=3))
                    for i in range(25)]
            written += store.save_many(runs)  # raises if the store refused it
        assert len(written) == 1000
        deadline = time.monotonic() + 120
        while ((store._usage()[0] > cap or sum(deleted) != store.runs_deleted)  # the passes after the last write
               and time.monotonic() < deadline):
            time.sleep(0.05)
        used, runs = store._usage()
        assert used <= cap
        assert 0 < sum(deleted) == store.runs_deleted  # each pass reported what it deleted (the metric)
        assert runs + store.runs_deleted == 1000  # nothing written was lost other than by the sweeper
        newest = [r["run_id"] for r in store.list_runs(limit=runs)]
        assert newest == sorted(written, reverse=True)[:runs]  # the oldest went first, none of the newest
        assert runs >= 100  # the cap holds ~the newest 10% of what was written, not less
    finally:
        store.close()
    if not url.startswith("postgresql://"):  # SQLite gives the space back to the file system
        assert store.size_bytes() <= cap


def test_the_sweeper_starts_no_thread_until_started_and_ends_it_when_stopped(tmp_path):
    url = str(tmp_path / "runs.db")
    store = open_store(url)
    try:
        store.save_many([StoredRun(f"run{i}", "live", _verdict(f"{i:032x}")) for i in range(3)])
        for i in range(3):
            _age(url, f"run{i}", 2 * DAY)
        before = set(threading.enumerate())
        retainer = Retainer(store, threading.Event())
        sweeper = RetentionSweeper(retainer, Retention(max_age=DAY, interval=0.05), store.wait_open)
        time.sleep(0.2)
        assert set(threading.enumerate()) == before and len(_ids(store)) == 3  # made, not started: nothing runs
        sweeper.start()
        sweeper.start()  # once
        [thread] = set(threading.enumerate()) - before
        assert thread.name == "store-sweeper"
        deadline = time.monotonic() + 10
        while retainer.size == 0 and time.monotonic() < deadline:  # a pass ends by measuring the store
            time.sleep(0.02)
        assert _ids(store) == set() and retainer.runs_deleted == 3 and retainer.size > 0
        sweeper.stop()
        assert not thread.is_alive()
        sweeper.start()  # stopped for good: no thread again
        assert set(threading.enumerate()) == before
    finally:
        store.close()


def test_a_stores_one_sweeper_ends_with_the_store(url):
    """``start_sweeping`` (the pipeline's entry point) starts one sweeper however often it is called,
    keeps the figures the metrics read current, and :meth:`close` ends its thread."""
    store = open_store(url)
    store.save(StoredRun("run0", "live", _verdict(f"{0:032x}")))
    before = set(threading.enumerate())
    deleted: list[int] = []
    store.start_sweeping(Retention(max_age=DAY, interval=0.05), deleted.append)
    store.start_sweeping(Retention(max_age=DAY, interval=0.05), deleted.append)
    [thread] = [t for t in set(threading.enumerate()) - before if t.name == "store-sweeper"]
    deadline = time.monotonic() + 10
    while store.oldest_kept is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.size > 0 and store.oldest_kept == store.oldest() and deleted == [] and store.runs_deleted == 0
    store.close()
    assert not thread.is_alive()


def test_the_writers_queue_bound_is_what_the_store_clears_whatever_a_few_runs_took(url, monkeypatch):
    """Ingest is refused (retryable) while more verdicts wait than the store writes in
    store.max_queue_seconds. A transaction of a run or two measures its fixed cost (a cold store, a
    wait behind a sweeper batch), not how fast the store clears a backlog in full batches: after a
    trickle of them the bound fell to one batch (256 runs) and the next burst of verdicts was
    refused (the collector under load below, on PostgreSQL). Full batches kept slow, as behind a
    sweeper holding the store, still bring it down."""
    store = open_store(url)
    wait = 0.02  # each write waits this long first, as behind a sweeper batch
    save_many = store.save_many
    monkeypatch.setattr(store, "save_many", lambda runs: time.sleep(wait) or save_many(runs))
    verdict = _verdict(f"{7:032x}")
    writer = StoreWriter(store, lambda batch: None)
    writer.start()
    try:
        for i in range(10):  # a trickle: one run a transaction
            writer.put([(StoredRun(f"trickle{i}", "live", verdict), None)])
            assert writer.flush(60)
        after_trickle = writer.queue_limit(2.0, 10_000)
        started = time.monotonic()
        writer.put([(StoredRun(f"burst{i:04d}", "live", verdict), None) for i in range(4 * StoreWriter.BATCH)])
        assert writer.flush(60)
        clears = int(2.0 * 4 * StoreWriter.BATCH / (time.monotonic() - started))  # what the store writes in 2 s
        assert after_trickle >= min(10_000, clears)
        assert writer.queue_limit(2.0, 10**6) >= clears // 2  # measured on the burst's full batches
    finally:
        writer.close()
    wait = 0.5
    blocked = StoreWriter(store, lambda batch: None)
    blocked.start()
    try:
        blocked.put([(StoredRun(f"blocked{i:04d}", "live", verdict), None) for i in range(2 * StoreWriter.BATCH)])
        assert blocked.flush(60)
        assert blocked.queue_limit(2.0, 10_000) <= 2.0 * StoreWriter.BATCH / wait  # at most a batch per 0.5 s
    finally:
        blocked.close()
        store.close()


def test_the_sqlite_file_gives_deleted_runs_space_back(tmp_path):
    """A store made before retention (auto_vacuum off, the version 4 schema) is switched to
    incremental auto-vacuum when it is opened, and shrinks as runs are deleted."""
    path = tmp_path / "runs.db"
    _old_store(str(path), 600)
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA auto_vacuum").fetchone()[0] == 0
    con.close()
    open_store(path).close()  # migrated, switched over, its WAL checkpointed into the file
    assert _sql(str(path), "PRAGMA auto_vacuum") == [(2,)]
    before = path.stat().st_size
    for i in range(550):
        _age(str(path), f"old-{i:04d}", 20 * DAY)
    store = open_store(path)
    try:
        assert store.sweep(Retention()) == 550
    finally:
        store.close()
    assert path.stat().st_size < before / 3  # 50 of 600 runs left, and the schema's pages


def _old_document(i: int) -> bytes:
    """Run documents as the previous version wrote them, of every shape: a mismatch, a large run
    with bounded lists, one that only ``json`` can encode (a lone surrogate), quotes and accents."""
    if i % 50 == 1:  # a unit of 40 invocations x 25 chat calls: lists cut at 100, counts whole
        verdict = _verdict(f"{i:032x}", executors=1, chats=1000)
    else:
        verdict = _verdict(f"{i:032x}", truth=100 + i % 3, executors=1 + i % 7, chats=1 + i % 4)
    if i % 97 == 3:
        verdict = replace(verdict, subject="caf\u00e9 'quoted' \"run\"", workflow_errors=("bad \ud800 surrogate",))
    return run_to_json(verdict, run_id=f"old-{i:04d}", source="live", finalized_by="replica-a")


def _old_store(url: str, runs: int) -> list[tuple]:
    """A store of schema version 4 (before issue 42) holding ``runs`` runs, written with its DDL and
    its row shape (the document as JSON text in ``doc``); returns the rows written."""
    for migration in MIGRATIONS[:4]:
        for statement in migration:
            _sql(url, statement)
    if url.startswith("postgresql://"):
        _sql(url, "CREATE TABLE agenteval_schema (version INTEGER NOT NULL)")
        _sql(url, "INSERT INTO agenteval_schema VALUES (4)")
    else:
        _sql(url, "PRAGMA user_version=4")
    rows, now = [], time.time()
    for i in range(runs):
        doc = json.loads(_old_document(i))
        rows.append((doc["run_id"], doc["trace_id"], doc["subject"], doc["status"], doc["score"], doc["preset"], "live",
                     1 + i % 3, 0, doc["checked"], doc["unchecked"], now - 7200 + i, now - 3600 + i,
                     _old_document(i).decode(), "replica-a", None))
    marks = ", ".join("?" * 16)
    for row in rows:
        _sql(url, "INSERT INTO runs (run_id, trace_id, subject, status, score, preset, source, revision, incomplete, "
                  f"checked, unchecked, created_at, updated_at, doc, finalized_by, maf_release) VALUES ({marks})", row)
    return rows


def test_a_store_of_the_previous_schema_migrates_and_reads_back_every_run_as_the_same_json(url):
    rows = _old_store(url, 600)  # more than one migration batch
    store = open_store(url)
    try:
        stored = {r[0]: unpack(r[1]) for r in _sql(url, "SELECT run_id, body FROM runs")}
        assert len(stored) == 600
        for row in rows:
            run_id, doc = row[0], row[13]
            assert stored[run_id] == doc.encode()  # the document, byte for byte
            expected = json.loads(doc) | {"created_at": row[11], "updated_at": row[12], "finalized_by": "replica-a",
                                          "revision": row[7]}
            assert to_json(store.get_run(run_id)) == to_json(expected), run_id  # what the API and CLI answer
        listed = store.list_runs(limit=1000, with_docs=True)
        assert [d["run_id"] for d in listed] == [r[0] for r in reversed(rows)]
        odd = [r[0] for r in reversed(rows) if r[3] == "FAIL" and r[2] == "caf\u00e9 'quoted' \"run\""]
        assert odd and [r["run_id"] for r in store.list_runs(["FAIL"], subject=odd and rows[3][2], limit=1000)] == odd
        columns = {c[1] for c in _sql(url, "PRAGMA table_info(runs)")} if not url.startswith("postgresql://") else {
            c[0] for c in _sql(url, "SELECT column_name FROM information_schema.columns WHERE table_name = 'runs'")}
        assert "doc" not in columns and "body" in columns  # the document is stored once
    finally:
        store.close()


def test_a_collector_under_load_with_a_size_cap_stores_every_verdict_and_says_how_far_back_it_goes(url, tmp_path):
    """The bench workload through a live collector whose cap keeps its sweeper deleting, from a
    store of old runs over it, while the requests come in: no request is refused, every run gets its
    verdict, the oldest runs go; the metrics (present at 0 from the start), `runs list` and the run
    page say what is kept."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from workload import encode, trace_spans

    bodies = list(encode([trace_spans(random.Random(seed)) for seed in range(600)], spans_per_request=200))
    proc = CollectorProcess(tmp_path / "c", store_url=None if url.endswith(".db") else url, overrides={
        "assembly": {"late_window": 0.5},
        "store": {"retention": {"max_size": 600_000, "sweep_interval": 0.05, "batch": 20}}})
    try:
        before = proc.metrics()
        assert before[("agenteval_store_runs_deleted_total", ())] == 0
        assert ("agenteval_store_bytes", ()) in before
        assert ("agenteval_store_oldest_run_timestamp_seconds", ()) in before
        old = 4000  # ~10x the cap: the sweeper deletes them in batches while the requests come in
        verdict = _verdict(f"{1:032x}", executors=3, chats=3)
        proc.store().save_many(StoredRun(f"old-{i:04d}", "live", verdict) for i in range(old))
        _sql(proc.store_url, "UPDATE runs SET updated_at = updated_at - 3600, created_at = created_at - 3600")
        deleted = proc.metrics()[("agenteval_store_runs_deleted_total", ())]
        for body in bodies:
            status, reason, _ = post(proc.http, body)
            assert status == 200, reason  # never refused (a refusal would be 429/503)
        assert proc.metrics()[("agenteval_store_runs_deleted_total", ())] > deleted  # deleting meanwhile
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            m = proc.metrics()
            if sum(v for (name, _), v in m.items() if name == "agenteval_runs_total") >= 600:
                break
            time.sleep(0.2)
        assert sum(v for (name, _), v in m.items() if name == "agenteval_runs_total") == 600
        assert sum(v for (name, _), v in m.items() if name == "agenteval_spans_refused_total") == 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # every run stored, and the passes after the last one
            m = proc.metrics()  # before the count: a run deleted between the two is counted in neither
            used, kept = proc.store()._usage()
            if (used <= 600_000 and m[("agenteval_store_runs_deleted_total", ())] + kept >= old + 600
                    and m[("agenteval_store_oldest_run_timestamp_seconds", ())] > time.time() - 600):
                break
            time.sleep(0.1)
        assert used <= 600_000 and 0 < kept < 600
        assert m[("agenteval_store_runs_deleted_total", ())] + kept >= old + 600  # every run stored, then some deleted
        assert m[("agenteval_store_bytes", ())] > 0
        oldest = m[("agenteval_store_oldest_run_timestamp_seconds", ())]
        assert time.time() - 600 < oldest <= time.time()
        since = time.strftime("%Y-%m-%d", time.gmtime(proc.store().oldest()))
        listed = subprocess.run([AGENTEVAL, "runs", "list", "--store", proc.store_url,
                                 "--config", str(proc.config_path)], capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert f"history goes back to {since}" in listed.stdout and "runs are kept 14 days" in listed.stdout
        with urllib.request.urlopen(f"{proc.http}/runs", timeout=10) as page:
            html = page.read().decode()
        assert f"history goes back to {since}" in html and "runs are kept 14 days" in html
    finally:
        proc.stop()
