"""The run store: persistence across processes, PENDING stored, `runs show` equals what bench printed."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace

from test_cli import ROOT, bench, run

from collector.model import ChatTurn, ExecutorRecord, LedgerEntry, RunInput, Usage
from collector.reconcile import reconcile
from collector.store import RunStore, StoredRun


def _verdict(revision: int, truth: int):
    rec = ExecutorRecord("a", (LedgerEntry(Usage(100, 0), "stop"),), (ChatTurn(Usage(truth, 0), "stop"),), "t")
    return replace(reconcile(RunInput((rec,), trace_id="ab" * 16)), revision=revision)


def test_runs_persist_across_processes_and_list_newest_first(tmp_path):
    db = tmp_path / "runs.db"
    for example in ("pass_all_agree", "pending_no_chat_truth", "fail_both"):
        bench(ROOT / f"examples/{example}.json", db)
    proc = run("runs", "list", "--json", store=db)
    rows = json.loads(proc.stdout)
    assert [r["status"] for r in rows] == ["FAIL", "PENDING", "PASS"]
    pending = json.loads(run("runs", "list", "--json", "--status", "pending", store=db).stdout)
    assert len(pending) == 1 and pending[0]["score"] is None


def test_runs_show_matches_what_bench_printed(tmp_path):
    db = tmp_path / "runs.db"
    printed = json.loads(bench(ROOT / "examples/warn_partial_truth.json", db, "--json").stdout)["runs"][0]
    shown = json.loads(run("runs", "show", printed["run_id"], "--json", store=db).stdout)
    shown.pop("created_at"), shown.pop("updated_at")
    assert shown == printed
    table_bench = bench(ROOT / "examples/warn_partial_truth.json", db).stdout
    rid = json.loads(run("runs", "list", "--json", "--limit", "1", store=db).stdout)[0]["run_id"]
    table_show = run("runs", "show", rid[:12], store=db).stdout
    assert table_show.split("\n", 1)[1] == table_bench


def test_runs_show_unknown_id_exits_1(tmp_path):
    proc = run("runs", "show", "deadbeef", store=tmp_path / "runs.db")
    assert proc.returncode == 1 and "no run" in proc.stderr


def test_store_is_wal_and_a_newer_revision_supersedes_an_older_one(tmp_path):
    store = RunStore(tmp_path / "r.db")
    store.save(StoredRun("run1", "live", _verdict(2, 100)))
    store.save(StoredRun("run1", "live", _verdict(1, 1000)))  # a stale revision must not win
    assert store.get_run("run1")["revision"] == 2 and store.get_run("run1")["status"] == "PASS"
    store.save(StoredRun("run1", "live", _verdict(3, 1000)))
    doc = store.get_run("run1")
    assert doc["revision"] == 3 and doc["executors"][0]["verdict"] == "TokenMismatch"
    store.close()
    con = sqlite3.connect(tmp_path / "r.db")
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert con.execute("SELECT COUNT(*) FROM executor_verdicts").fetchone()[0] == 1
