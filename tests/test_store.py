"""The run store: one suite, run on both backends (embedded SQLite and a real PostgreSQL server)."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import jsonschema
import psycopg
import pytest

from collector.core.model import ChatTurn, ExecutorRecord, LedgerEntry, NoTruthReason, RunInput, Status, Usage
from collector.core.reconcile import reconcile
from collector.core.serialize import BOUNDED_EVIDENCE, run_to_dict
from collector.store import Part, StoredRun, StoreError, open_store, pack
from collector.store.schema import MIGRATIONS, SCHEMA_VERSION
from collector.store.sqlite import CHECKPOINT_INTERVAL

from test_cli import ROOT, bench, run


def _verdict(revision: int, truth: int, trace_id: str = "ab" * 16, executors: int = 1):
    recs = tuple(ExecutorRecord(f"e{i}", (LedgerEntry(Usage(100, 0), "stop"),),
                                (ChatTurn(Usage(truth, 0), "stop"),), "t")
                 for i in range(executors))
    return replace(reconcile(RunInput(recs, trace_id=trace_id)), revision=revision)


def _pending(trace_id: str):
    rec = ExecutorRecord("e0", (LedgerEntry(Usage(100, 0), "stop"),), (ChatTurn(Usage(), None),), "t")
    return reconcile(RunInput((rec,), trace_id=trace_id))


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "runs.db")
    return request.getfixturevalue("postgres").database()


def _tables(url: str) -> set[str]:
    if url.startswith("postgresql://"):
        with psycopg.connect(url) as conn:
            return {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    with sqlite3.connect(url) as con:
        return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _raw_doc(url: str, run_id: str, doc: dict, packed: Callable[[bytes], bytes] = pack) -> None:
    """Store ``doc`` as run ``run_id``'s document, the way the store packs it (or ``packed``)."""
    params = (packed(json.dumps(doc).encode()), run_id)
    if url.startswith("postgresql://"):
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE runs SET body = %s WHERE run_id = %s", params)
    else:
        with sqlite3.connect(url) as con:
            con.execute("UPDATE runs SET body = ? WHERE run_id = ?", params)


def _rows(url: str, sql: str) -> list[tuple]:
    if url.startswith("postgresql://"):
        with psycopg.connect(url) as conn:
            return conn.execute(sql).fetchall()
    with sqlite3.connect(url) as con:
        return con.execute(sql).fetchall()


def _raw(url: str, sql: str) -> None:
    """Run DDL/DML directly, the way an older agenteval (or an operator) would have."""
    if url.startswith("postgresql://"):
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql)
    else:
        with sqlite3.connect(url) as con:
            con.executescript(sql)


def test_a_newer_revision_supersedes_an_older_one_and_a_stale_one_never_wins(url):
    store = open_store(url)
    store.save(StoredRun("run1", "live", _verdict(2, 100, executors=2)))
    assert store.save_many([StoredRun("run1", "live", _verdict(1, 1000))]) == []  # stale: not written
    doc = store.get_run("run1")
    assert doc["revision"] == 2 and doc["status"] == "PASS" and len(doc["executors"]) == 2
    store.save(StoredRun("run1", "live", _verdict(3, 1000)))
    doc = store.get_run("run1")
    assert doc["revision"] == 3 and doc["executors"][0]["verdict"] == "TokenMismatch"
    assert len(doc["executors"]) == 1  # the superseded revision's units are gone
    assert "executor_verdicts" not in _tables(url)  # one write per run: the document holds every unit
    store.close()


def test_list_filters_orders_and_limits(url):
    store = open_store(url)
    store.save(StoredRun("a-pass", "live", replace(_verdict(1, 100, "a" * 32), subject="s1")))
    time.sleep(0.01)
    store.save(StoredRun("b-fail", "live", replace(_verdict(1, 1000, "b" * 32), subject="s2")))
    time.sleep(0.01)
    store.save(StoredRun("c-pending", "file:x", replace(_pending("c" * 32), subject="s1")))
    assert [r["run_id"] for r in store.list_runs()] == ["c-pending", "b-fail", "a-pass"]
    assert [r["run_id"] for r in store.list_runs(["pending", "PASS"])] == ["c-pending", "a-pass"]
    assert [r["run_id"] for r in store.list_runs(subject="s1", limit=1)] == ["c-pending"]
    (pending,) = store.list_runs(["PENDING"], with_docs=True)
    assert pending["score"] is None
    assert pending["executors"][0]["no_truth_reason"] == NoTruthReason.RESPONSE_MISSING.value
    assert pending["created_at"] <= pending["updated_at"]
    store.close()


def _large(invocations: int, calls: int, errors: int):
    """One unit of ``invocations`` x ``calls`` chat calls (a ledger entry and executor span per
    invocation), in a run whose executors raised ``errors`` workflow errors."""
    ledger, turns = [], []
    for i in range(invocations):
        ledger.append(LedgerEntry(Usage(calls, 0), "stop", i, f"{i:016x}", f"{i:015x}f"))
        turns.extend(ChatTurn(Usage(1, 0), "stop", i * calls + c, f"{i:016x}", f"{i * calls + c:015x}c")
                     for c in range(calls))
    unit = ExecutorRecord("writer", tuple(ledger), tuple(turns), "t", tuple(f"{i:015x}e" for i in range(invocations)))
    return reconcile(RunInput((unit,), trace_id="ab" * 16,
                              workflow_errors=tuple(f"writer: boom {i}" for i in range(errors))))


def test_a_document_keeps_the_first_entries_of_each_growing_list_and_counts_the_rest(url):
    store = open_store(url, max_items=5)
    store.save(StoredRun("big", "live", _large(invocations=40, calls=25, errors=7)))
    doc = store.get_run("big")
    schema = json.loads((ROOT / "collector/formats/schemas/run.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(doc)
    ev = doc["executors"][0]["evidence"]
    assert (ev["chat_span_ids"], ev["chat_span_ids_more"]) == ([f"{c:015x}c" for c in range(5)], 995)
    assert (ev["response_turns"], ev["ledger_entries"], ev["truth_tokens"]) == (1000, 40, 1000)  # counts stay whole
    for key in ("ledger_span_ids", "executor_span_ids", "finish_comparisons"):
        assert (len(ev[key]), ev[f"{key}_more"]) == (5, 35), key
    assert (doc["workflow_errors"], doc["workflow_errors_more"]) == ([f"writer: boom {i}" for i in range(5)], 2)
    store.save(StoredRun("small", "live", _large(invocations=2, calls=2, errors=0)))
    ev = store.get_run("small")["executors"][0]["evidence"]
    assert len(ev["chat_span_ids"]) == 4 and not any(ev[f"{key}_more"] for key in BOUNDED_EVIDENCE)


def test_a_document_stored_before_lists_were_bounded_reads_as_leaving_nothing_out(url):
    store = open_store(url)
    store.save(StoredRun("old", "live", _large(invocations=2, calls=2, errors=1)))
    doc = store.get_run("old")
    for unit in doc["executors"]:
        for key in BOUNDED_EVIDENCE:
            del unit["evidence"][f"{key}_more"]
    del doc["workflow_errors_more"]
    _raw_doc(url, "old", doc)
    again = store.get_run("old")
    assert again["workflow_errors_more"] == 0 and again["workflow_errors"] == ["writer: boom 0"]
    assert all(again["executors"][0]["evidence"][f"{key}_more"] == 0 for key in BOUNDED_EVIDENCE)


def test_a_document_compressed_by_an_earlier_release_reads_back_and_new_ones_are_zstd(url):
    """Releases before zstd wrote zlib (issue 42's first format): such a document reads back the same."""
    store = open_store(url)
    try:
        store.save(StoredRun("old", "live", _large(invocations=2, calls=2, errors=1)))
        doc = store.get_run("old")
        (body,) = _rows(url, "SELECT body FROM runs WHERE run_id = 'old'")[0]
        assert bytes(body[:4]) == b"\x28\xb5\x2f\xfd"  # a zstd frame
        _raw_doc(url, "old", doc, lambda raw: zlib.compress(raw, 6))
        (old_body,) = _rows(url, "SELECT body FROM runs WHERE run_id = 'old'")[0]
        assert bytes(old_body[:1]) == b"\x78"
        assert store.get_run("old") == doc
        assert store.list_runs(with_docs=True)[0]["executors"] == doc["executors"]
    finally:
        store.close()


def test_get_run_by_unique_prefix_only(url):
    store = open_store(url)
    store.save(StoredRun("abc123", "live", _verdict(1, 100)))
    store.save(StoredRun("abd456", "live", _verdict(1, 100)))
    store.save(StoredRun("x_y", "live", _verdict(1, 100)))
    assert store.get_run("abc")["run_id"] == "abc123"
    assert store.get_run("ab") is None  # ambiguous
    assert store.get_run("abc123")["run_id"] == "abc123"
    assert store.get_run("x_") is not None and store.get_run("%") is None and store.get_run("x%") is None
    store.close()


def _steps(store, call) -> int:
    """SQLite virtual-machine steps ``call`` costs: they grow with the store only for a scan or a sort."""
    counted = [0]
    store._db.set_progress_handler(lambda: counted.__setitem__(0, counted[0] + 1), 1)
    try:
        call()
    finally:
        store._db.set_progress_handler(None, 1)
    return counted[0]


def test_a_whole_run_id_is_looked_up_in_the_index_not_by_scanning_the_store(tmp_path):
    """The run page, GetRun and the links `watch` prints name whole run ids: each read matched them
    by prefix too, a scan of every run (and, on SQLite, with the writer held off meanwhile)."""
    store = open_store(tmp_path / "runs.db")
    try:
        steps = []
        for size in (200, 4_000):
            store.save_many([StoredRun(f"{size:02x}{i:030x}", "live", _verdict(1, 100)) for i in range(size)])
            wanted = f"{size:02x}{7:030x}"
            steps.append(_steps(store, lambda wanted=wanted: store.get_run(wanted)))
            assert store.get_run(wanted)["run_id"] == wanted
        assert steps[1] < 2 * steps[0], steps  # 4,200 runs cost what 200 do
    finally:
        store.close()


def test_the_newest_runs_of_several_statuses_are_read_without_sorting_all_of_them(tmp_path):
    """`runs list --status FAIL --status PENDING` (an ops view of what needs a look): an IN list read
    every run of those statuses and sorted them all to return the newest few."""
    store = open_store(tmp_path / "runs.db")
    try:
        steps = []
        for size in (100, 2_000):
            store.save_many([StoredRun(f"f{size}-{i}", "live", _verdict(1, 1000, f"{i:032x}")) for i in range(size)]
                            + [StoredRun(f"p{size}-{i}", "live", _pending(f"{i:032x}")) for i in range(size)])
            steps.append(_steps(store, lambda: store.list_runs(["FAIL", "PENDING"], limit=4)))
            assert [r["run_id"] for r in store.list_runs(["FAIL", "PENDING"], limit=4)] == [
                f"p{size}-{size - 1}", f"p{size}-{size - 2}", f"p{size}-{size - 3}", f"p{size}-{size - 4}"]
        assert steps[1] < 2 * steps[0], steps
    finally:
        store.close()


def test_migrates_a_version_1_store_and_keeps_its_runs(url):
    for statement in MIGRATIONS[0]:
        _raw(url, statement)
    doc = {"run_id": "old", "status": "FAIL", "executors": [], "score": 0.5}
    _raw(url, "INSERT INTO runs (run_id, trace_id, subject, status, score, preset, source, revision, incomplete, "
              f"checked, unchecked, created_at, updated_at, doc) VALUES ('old', NULL, 'legacy', 'FAIL', 0.5, "
              f"'standard', 'live', 1, 0, 1, 0, 1.0, 2.0, '{json.dumps(doc)}')")
    if url.startswith("postgresql://"):
        _raw(url, "CREATE TABLE agenteval_schema (version INTEGER NOT NULL); INSERT INTO agenteval_schema VALUES (1)")
    else:
        _raw(url, "PRAGMA user_version=1")
    store = open_store(url)
    old = store.get_run("old")
    assert old["status"] == "FAIL" and old["finalized_by"] is None
    store.save(StoredRun("new", "live", _verdict(1, 100), finalized_by="replica-a"))
    assert store.get_run("new")["finalized_by"] == "replica-a"
    assert [r["run_id"] for r in store.list_runs()] == ["new", "old"]
    assert "executor_verdicts" not in _tables(url)  # version 3 dropped it
    store.close()
    store = open_store(url)  # opening again applies nothing twice
    assert len(store.list_runs()) == 2
    store.close()


def test_migrates_a_version_4_store_whose_runs_read_as_not_priced(url):
    """Migration 5 (runs.unreported_usd): a run written before pricing reads as not priced (spend and
    each unit's cost null, never $0); a run written after carries its unreported spend in its row."""
    from collector.config import CollectorConfig
    from collector.outputs.pricing import Pricing

    for migration in MIGRATIONS[:4]:
        for statement in migration:
            _raw(url, statement)
    doc = run_to_dict(_verdict(1, 1000), run_id="old", source="live")
    del doc["spend"]
    for unit in doc["executors"]:
        del unit["evidence"]["cost"]
    _raw(url, "INSERT INTO runs (run_id, trace_id, subject, status, score, preset, source, revision, incomplete, "
              f"checked, unchecked, created_at, updated_at, doc, finalized_by, maf_release) VALUES ('old', NULL, "
              f"'legacy', 'FAIL', 0.5, 'standard', 'live', 1, 0, 1, 0, 1.0, 2.0, '{json.dumps(doc)}', NULL, NULL)")
    if url.startswith("postgresql://"):
        _raw(url, "CREATE TABLE agenteval_schema (version INTEGER NOT NULL); INSERT INTO agenteval_schema VALUES (4)")
    else:
        _raw(url, "PRAGMA user_version=4")
    store = open_store(url)
    try:
        old = store.get_run("old")
        assert old["spend"] is None and old["executors"][0]["evidence"]["cost"] is None
        turn = ChatTurn(Usage(1000, 0), "stop", model="gpt-4o-mini", provider="openai")
        priced = reconcile(RunInput((ExecutorRecord("e0", (LedgerEntry(Usage(100, 0), "stop"),), (turn,), "t"),),
                                    trace_id="cd" * 16), pricer=Pricing(CollectorConfig().pricing))
        store.save(StoredRun("new", "live", priced))
        rows = {r["run_id"]: r for r in store.list_runs()}
        assert rows["old"]["unreported_usd"] is None
        assert rows["new"]["unreported_usd"] == pytest.approx(900 * 0.15 / 1e6)  # gpt-4o-mini input, per token
        assert store.get_run("new")["spend"]["unreported_tokens"] == 900
    finally:
        store.close()


def test_migrates_a_version_7_store_whose_waiting_parts_stay_claimable(url):
    """Migration 8 (parts.claimed_by, claimed_at): a part handed over before it is unclaimed, as it was."""

    blob = "BYTEA" if url.startswith("postgresql://") else "BLOB"
    for migration in MIGRATIONS[:7]:
        for step in migration:
            if isinstance(step, str):  # (5's data step: no rows to rewrite)
                _raw(url, step.format(blob=blob))
    _raw(url, "INSERT INTO parts (part_id, trace_id, held_by, has_root, spans, created_at, records) "
              f"VALUES ('a/1', '{'ab' * 16}', 'a', 0, 2, 1.0, '[]')")
    if url.startswith("postgresql://"):
        _raw(url, "CREATE TABLE agenteval_schema (version INTEGER NOT NULL); INSERT INTO agenteval_schema VALUES (7)")
    else:
        _raw(url, "PRAGMA user_version=7")
    store = open_store(url)
    try:
        assert [p.part_id for p in store.waiting_parts(lease=60.0)] == ["a/1"]
        assert [p.part_id for p in store.claim_parts(["ab" * 16], "b", lease=60.0)] == ["a/1"]
        store.hand_over([Part("cd" * 16, "b", False, 1, b"[]\n")])
        assert [p.trace_id for p in store.waiting_parts(lease=60.0)] == ["cd" * 16]
    finally:
        store.close()


def test_revisions_are_those_of_the_stored_runs(url):
    store = open_store(url)
    try:
        store.save_many([StoredRun("r1", "live", _verdict(1, 100)), StoredRun("r2", "live", _verdict(3, 100)),
                         StoredRun("r3", "live", replace(_verdict(1, 100), incomplete=True))])
        ids = ["r1", "r2", "r3", "absent"] + [f"x{i}" for i in range(600)]  # more than one statement holds
        assert store.revisions(ids) == {"r1": (1, False), "r2": (3, False), "r3": (1, True)}
        assert store.revisions([]) == {}
    finally:
        store.close()


def test_the_facades_reads_answer_from_what_the_store_holds(url):
    """Reads base.py's facade hands to its rooms: counts by status, documents by id and by time, how
    far back the history goes, id prefixes and why a run is not found."""
    store = open_store(url)
    try:
        before = time.time()
        runs = {"aa-1": _verdict(1, 100), "aa-2": _verdict(1, 150), "bb-1": _pending("cd" * 16)}
        store.save_many([StoredRun(run_id, "live", verdict) for run_id, verdict in runs.items()])
        assert store.count_by_status() == {s.value: 0 for s in Status} | Counter(v.status.value for v in runs.values())
        assert sum(store.count_by_status(since=time.time() + 60).values()) == 0
        assert [d["run_id"] for d in store.docs(["bb-1", "aa-2", "zz"])] == ["aa-2", "bb-1"]
        assert store.docs([]) == []
        assert [d["run_id"] for d in store.updated_since(before)] == list(runs)  # in the order written
        assert store.runs_matching("aa", 5) == ["aa-1", "aa-2"]
        assert store.get_run("bb")["run_id"] == "bb-1" and store.get_run("aa") is None
        assert "matches several runs (aa-1, aa-2)" in store.missing_run("aa")
        assert store.missing_run("zz", remote=True) == "no run 'zz' in this collector's store"
        assert before <= store.oldest() <= time.time()
        history = store.history(max_age=14 * 86400)
        assert history.startswith("history goes back to ")
        assert history.endswith("runs are kept 14 days (store.retention.max_age)")
    finally:
        store.close()


def test_a_claim_released_on_some_parts_leaves_the_others_claimed(url):
    store = open_store(url)
    try:
        trace = "ef" * 16
        store.hand_over([Part(trace, "a", False, 1, b"[]\n", 1.0, "a/1"),
                         Part(trace, "a", False, 1, b"[]\n", 2.0, "a/2")])
        assert [p.part_id for p in store.claim_parts([trace], "b", lease=60.0)] == ["a/1", "a/2"]
        store.release_claims("b", ["a/2"])
        assert [p.part_id for p in store.waiting_parts(lease=60.0)] == ["a/2"]
        store.save(StoredRun(trace, "live", _verdict(1, 100, trace_id=trace), "b", parts=("a/1",)))
        assert [p.part_id for p in store.claim_parts([trace], "c", lease=60.0)] == ["a/2"]  # a/1 left with the run
    finally:
        store.close()


def test_traces_with_runs_are_those_with_a_run_stored_under_any_run_id(url):
    store = open_store(url)
    try:
        one, two = "a1" * 16, "b2" * 16
        store.save_many([StoredRun(f"{one}-{'c3' * 8}", "live", _verdict(1, 100, trace_id=one)),
                         StoredRun(two, "live", _verdict(1, 100, trace_id=two))])
        assert store.traces_with_runs([one, two, "d4" * 16] + [f"{i:032x}" for i in range(600)]) == {one, two}
        assert store.traces_with_runs([]) == set()
    finally:
        store.close()


def test_refuses_a_schema_newer_than_the_code(url):
    open_store(url).close()
    if url.startswith("postgresql://"):
        _raw(url, f"INSERT INTO agenteval_schema VALUES ({SCHEMA_VERSION + 1})")
    else:
        _raw(url, f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match="newer than this agenteval knows"):
        open_store(url)


def test_concurrent_writers_never_lose_or_duplicate_a_run(url):
    """Two writers (as two replicas would be) race on the same runs with interleaved revisions."""
    stores = [open_store(url), open_store(url)]
    runs = [f"run{i:03d}" for i in range(60)]
    errors: list[Exception] = []

    def writer(store, revisions):
        try:
            for rev in revisions:
                store.save_many([StoredRun(r, "live", _verdict(rev, 100 * rev, executors=rev)) for r in runs])
        except Exception as exc:  # any failure: reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(stores[0], [1, 3, 5])),
               threading.Thread(target=writer, args=(stores[1], [2, 4, 6]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    rows = stores[0].list_runs(limit=1000, with_docs=True)
    assert sorted(r["run_id"] for r in rows) == runs  # every run once
    assert {r["revision"] for r in rows} == {6}  # the highest revision won everywhere
    assert all(len(r["executors"]) == 6 for r in rows[:5])
    for s in stores:
        s.close()


def test_subscribers_hear_of_committed_runs(url):
    reader, writer = open_store(url), open_store(url)
    heard: list[dict] = []
    reader.subscribe(heard.extend)
    time.sleep(0.3)  # the PostgreSQL listener attaches
    writer.save(StoredRun("seen", "live", _verdict(1, 100)))
    reader.save(StoredRun("own", "live", _verdict(1, 100)))
    deadline = time.monotonic() + 10
    want = {"own", "seen"} if url.startswith("postgresql://") else {"own"}  # SQLite: this process's writes
    while {d["run_id"] for d in heard} != want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {d["run_id"] for d in heard} == want
    assert all(d["executors"] and d["updated_at"] for d in heard)
    reader.close(), writer.close()


def test_cli_reads_and_writes_either_backend(url):
    printed = json.loads(bench(ROOT / "examples/warn_partial_truth.json", url, "--json").stdout)["runs"][0]
    bench(ROOT / "examples/pending_no_chat_truth.json", url)
    rows = json.loads(run("runs", "list", "--json", store=url).stdout)
    assert [r["status"] for r in rows] == ["PENDING", "WARN"]
    shown = json.loads(run("runs", "show", printed["run_id"][:10], "--json", store=url).stdout)
    assert shown == printed
    table_bench = bench(ROOT / "examples/warn_partial_truth.json", url).stdout
    rid = json.loads(run("runs", "list", "--json", "--limit", "1", store=url).stdout)[0]["run_id"]
    assert run("runs", "show", rid[:12], store=url).stdout.split("\n", 1)[1] == table_bench
    missing = run("runs", "show", "deadbeef", store=url)
    assert missing.returncode == 1 and "no run" in missing.stderr


def test_sqlite_store_is_wal(tmp_path):
    open_store(tmp_path / "r.db").close()
    assert sqlite3.connect(tmp_path / "r.db").execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_batch_keeps_the_meaning_of_its_runs_in_order(url):
    """One batch holding revisions of the same run, a stale one, and a trace's incomplete verdict
    followed by its workflow run's complete one: stored as if written one by one, in order."""
    store = open_store(url)
    trace = "cd" * 16
    cut = replace(_verdict(1, 100, trace_id=trace), incomplete=True)
    batch = [StoredRun("a", "live", _verdict(1, 100)), StoredRun("a", "live", _verdict(3, 1000, executors=3)),
             StoredRun("a", "live", _verdict(2, 100)),  # stale by then: not written
             StoredRun(trace, "live", cut),  # a trace cut short: stored under its trace id
             StoredRun(f"{trace}-01", "live", _verdict(1, 100, trace_id=trace)),  # its run: supersedes it
             StoredRun("b", "live", _verdict(1, 100))]
    assert store.save_many(batch) == ["a", "a", trace, f"{trace}-01", "b"]
    assert sorted(r["run_id"] for r in store.list_runs()) == ["a", "b", f"{trace}-01"]
    doc = store.get_run("a")
    assert doc["revision"] == 3 and doc["status"] == "FAIL" and len(doc["executors"]) == 3
    # a complete verdict replaces an incomplete one of a higher revision, whose number it then passes
    store.save(StoredRun("c", "live", replace(_verdict(5, 100), incomplete=True)))
    assert store.save_many([StoredRun("c", "live", _verdict(2, 100)),
                            StoredRun("c", "live", _verdict(4, 100))]) == ["c"]
    assert store.get_run("c")["revision"] == 6 and not store.get_run("c")["incomplete"]
    store.close()


def test_a_batch_costs_a_few_statements_not_one_per_run(tmp_path):
    """The store writer shares the GIL with the receivers: SQLite releases it for every statement
    and gets it back only after the interpreter's switch interval (5 ms) when the event loop is
    busy, so a statement per run held a batch of 100 runs for up to half a second under load."""
    store = open_store(tmp_path / "runs.db")
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    trace = "ef" * 16
    store.save_many([StoredRun(f"{trace}-{i:02d}", "live", _verdict(1, 100, trace_id=trace)) for i in range(100)])
    assert len(store.list_runs(limit=1000)) == 100
    writes = [s for s in statements if s.split()[0] in ("INSERT", "DELETE", "UPDATE")]
    assert len(statements) <= 6 and len(writes) <= 2, statements
    store.close()


def test_subscribers_hear_only_while_listening(tmp_path):
    """The live collector's stream hub listens only while a watcher is attached: without one, the
    store does not build documents for it, and a subscriber not listening is not called."""
    store = open_store(tmp_path / "runs.db")
    heard: list[str] = []
    deaf: list[str] = []
    listening = False
    store.subscribe(lambda docs: heard.extend(d["run_id"] for d in docs), lambda: listening)
    store.subscribe(lambda docs: deaf.extend(d["run_id"] for d in docs), lambda: False)
    store.save(StoredRun("unheard", "live", _verdict(1, 100)))
    listening = True
    store.save(StoredRun("heard", "live", _verdict(1, 100)))
    assert heard == ["heard"] and deaf == []
    store.close()


def test_a_batch_fits_an_older_sqlites_parameter_limit(tmp_path):
    """SQLite before 3.32 allows 999 parameters a statement: a 300-run batch is still written."""
    store = open_store(tmp_path / "runs.db")
    store._db.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
    trace = "ab" * 16
    ids = store.save_many([StoredRun(f"{trace}-{i:03d}", "live", _verdict(1, 100, trace_id=trace)) for i in range(300)])
    assert len(ids) == 300 and len(store.list_runs(limit=1000)) == 300
    store.close()


def test_racing_writers_of_the_same_new_runs_neither_deadlock_nor_misreport(url):
    """Two writers (two replicas) save batches naming the same new runs in opposite orders, with
    repeats: no transaction fails, and each run is reported written exactly as often as its
    revisions were taken (the first insert, then each higher revision)."""
    stores = [open_store(url), open_store(url)]
    errors: list[Exception] = []
    reported: list[list[str]] = [[], []]
    names = [f"race{i:02d}" for i in range(40)]

    def writer(k: int) -> None:
        order = names if k == 0 else names[::-1]
        try:
            for rev in (1, 2):
                batch = [StoredRun(r, "live", _verdict(rev, 100)) for r in order]
                batch += [StoredRun(r, "live", _verdict(rev, 100)) for r in order[:5]]  # repeats: stale
                reported[k] += stores[k].save_many(batch)
        except Exception as exc:  # any failure: reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for name in names:  # revision 1 taken once, revision 2 once: never both writers for either
        assert reported[0].count(name) + reported[1].count(name) == 2, name
    assert {r["revision"] for r in stores[0].list_runs(limit=100)} == {2}
    for s in stores:
        s.close()


def test_the_wal_is_checkpointed_beside_the_writer_and_stays_bounded(tmp_path):
    """The writer's own COMMIT never checkpoints (that fsync stalled every verdict queued behind it);
    a connection of its own does, so the runs reach the database file and the WAL starts over."""
    path = tmp_path / "runs.db"
    store = open_store(path)
    assert store._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    wal = path.with_name(path.name + "-wal")
    sizes = []
    for round_ in range(4):  # ~0.5 MB of WAL a round
        store.save_many([StoredRun(f"r{round_}-{i:03d}", "live", _verdict(1, 100, executors=6)) for i in range(300)])
        sizes.append(wal.stat().st_size)
        time.sleep(CHECKPOINT_INTERVAL * 1.5)
    (stored,) = store._query("SELECT SUM(LENGTH(body)) AS n FROM runs", {})
    assert path.stat().st_size > stored["n"] > 500_000  # the runs are in the database file
    assert max(sizes) < 1.5 * sizes[0], sizes  # without checkpoints the WAL grows by a round each time
    assert len(store.list_runs(limit=2000)) == 1200
    store.close()
    assert not wal.exists()  # the last connection checkpointed it and removed it


# --- replicas come and go (docs/scale-out.md) -------------------------------------------------------

def _units(trace_id: str, *units: tuple[str, int], incomplete: bool = False, revision: int = 1):
    """A run of these units, each with its ledger 100 tokens against ``truth`` on the chat calls."""
    recs = tuple(ExecutorRecord(name, (LedgerEntry(Usage(100, 0), "stop"),), (ChatTurn(Usage(truth, 0), "stop"),), "t")
                 for name, truth in units)
    return replace(reconcile(RunInput(recs, trace_id=trace_id, incomplete=incomplete, partial=incomplete)),
                   revision=revision)


def test_a_verdict_no_other_run_holds_is_never_deleted(url):
    """Issue 43: a replica stopping mid-trace stored its part (the under-reporting executor: FAIL)
    under the trace id; the replica with the workflow-run span stored a PASS without that unit, and
    the supersede rule deleted the FAIL. It is kept now, and goes only once a run holds its units."""
    store = open_store(url)
    trace = "4a" * 16
    assert store.save_many([StoredRun(trace, "live", _units(trace, ("writer", 500), incomplete=True), "a")]) == [trace]
    whole = f"{trace}-01"
    store.save(StoredRun(whole, "live", _units(trace, ("planner", 100)), "b"))
    runs = {r["run_id"]: r["status"] for r in store.list_runs()}
    assert runs == {trace: "FAIL", whole: "PASS"}  # the FAIL stays beside the run that lacks its unit
    store.save(StoredRun(whole, "live", _units(trace, ("planner", 100), ("writer", 500), revision=2), "b"))
    assert {r["run_id"]: r["status"] for r in store.list_runs()} == {whole: "FAIL"}  # merged: now it goes
    store.close()


def test_a_part_from_another_replica_never_replaces_the_whole_run(url):
    """A re-read tail or a part on another replica (fewer units, whatever its revision) is not
    written over the whole run; the run's own replica's later revisions are, and so is another
    replica's run that holds every unit."""
    store = open_store(url)
    trace = "5b" * 16
    run = f"{trace}-02"
    store.save(StoredRun(run, "live", _units(trace, ("planner", 100), ("writer", 500)), "a"))
    assert store.save_many([StoredRun(run, "live", _units(trace, ("writer", 100), revision=5), "b")]) == []
    assert store.save_many([StoredRun(run, "live", _units(trace, ("writer", 100), incomplete=False, revision=2),
                                      "b")]) == []
    doc = store.get_run(run)
    assert (doc["status"], doc["revision"], doc["finalized_by"]) == ("FAIL", 1, "a")
    assert store.save_many([StoredRun(run, "live", _units(trace, ("planner", 100), ("writer", 100), revision=2),
                                      "a")]) == [run]
    assert store.save_many([StoredRun(run, "live", _units(trace, ("planner", 100), ("writer", 100), ("critic", 100),
                                                          revision=3), "b")]) == [run]
    assert store.get_run(run)["finalized_by"] == "b"
    store.close()


def test_parts_are_handed_over_and_each_claimed_once(url):
    """Two replicas claim the same trace's parts at once: each part goes to exactly one of them,
    with its records as handed over; the poll lists what waits, without records."""

    stores = [open_store(url), open_store(url)]
    trace, other = "6c" * 16, "7d" * 16
    stores[0].hand_over([Part(trace, "a", False, 3, b'[["x"]]\n'), Part(other, "a", True, 1, b'[["y"]]\n')])
    stores[1].hand_over([Part(trace, "b", True, 2, b'[["z"]]\n')])
    waiting = stores[0].waiting_parts(lease=60.0)
    assert sorted((p.trace_id, p.held_by, p.has_root, p.spans) for p in waiting) == [
        (trace, "a", False, 3), (trace, "b", True, 2), (other, "a", True, 1)]
    assert all(p.records == b"" for p in waiting)
    got: list[list] = [[], []]
    barrier = threading.Barrier(2)

    def claim(k: int) -> None:
        barrier.wait()
        got[k] = stores[k].claim_parts([trace], f"r{k}", lease=60.0)

    threads = [threading.Thread(target=claim, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    claimed = got[0] + got[1]
    assert sorted((p.held_by, p.records) for p in claimed) == [("a", b'[["x"]]\n'), ("b", b'[["z"]]\n')]
    assert [p.trace_id for p in stores[1].waiting_parts(lease=60.0)] == [other]
    for s in stores:
        s.close()


def _parts_left(store) -> int:
    return store._query("SELECT COUNT(*) AS n FROM parts", {})[0]["n"]


def test_a_claimed_part_leaves_the_store_only_with_the_run_that_merged_it(url):
    """Issue 43: a claim marks a part, it does not take it out of the store, so a claimer that dies
    before storing the run it merged the part into loses nothing: its claim goes stale after the
    lease unless renewed (another replica then claims the part, records and all), a claimer started
    again under its name releases its claims at once, and the part goes in the transaction that
    stores the run merging it."""

    stores = [open_store(url), open_store(url)]
    trace = "9f" * 16
    stores[0].hand_over([Part(trace, "a", False, 3, b'[["x"]]\n')])
    (part,) = stores[1].claim_parts([trace], "b", lease=0.5)
    assert part.records == b'[["x"]]\n'
    assert stores[0].waiting_parts(lease=0.5) == [] and stores[0].claim_parts([trace], "c", lease=0.5) == []
    time.sleep(0.3)
    stores[1].renew_claims([part.part_id], "b")  # b lives on: its claim stays fresh
    time.sleep(0.3)
    assert stores[0].claim_parts([trace], "c", lease=0.5) == []
    time.sleep(0.6)  # b is gone: its claim is stale, the part is claimable again, whole
    assert [p.part_id for p in stores[0].waiting_parts(lease=0.5)] == [part.part_id]
    (again,) = stores[0].claim_parts([trace], "c", lease=0.5)
    assert (again.part_id, again.records, again.held_by) == (part.part_id, part.records, "a")
    stores[1].renew_claims([part.part_id], "b")  # b's claim was taken over: renewing it changes nothing
    assert stores[1].claim_parts([trace], "b", lease=0.5) == []
    stores[0].release_claims("c")  # c restarted (or stopping): its claims wait again at once
    (claimed,) = stores[1].claim_parts([trace], "b", lease=60.0)
    assert _parts_left(stores[0]) == 1
    run = StoredRun(f"{trace}-01", "live", _units(trace, ("writer", 100)), "b", parts=(claimed.part_id,))
    assert stores[1].save_many([run]) == [run.run_id]
    assert _parts_left(stores[0]) == 0 and stores[0].waiting_parts(lease=0.0) == []
    stores[0].hand_over([Part(trace, "a", False, 1, b'[["y"]]\n')])  # merged into no run (its spans
    (spent,) = stores[1].claim_parts([trace], "b", lease=60.0)        # were stored already): dropped
    stores[1].drop_parts([spent.part_id])
    assert _parts_left(stores[0]) == 0
    for s in stores:
        s.close()


def test_a_run_flagged_split_never_passes_and_says_why(url):
    store = open_store(url)
    trace = "8e" * 16
    store.save(StoredRun(f"{trace}-01", "live", _units(trace, ("planner", 100)), "b"))
    note = "Split across replicas: a holds 3 span(s) that could not be merged"
    assert store.flag_split(trace, note) == [f"{trace}-01"]
    doc = store.get_run(f"{trace}-01")
    assert (doc["status"], doc["split"], doc["revision"], doc["notes"][-1]) == ("WARN", True, 2, note)
    assert store.flag_split(trace, note) == []  # once
    store.close()
