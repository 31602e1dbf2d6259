"""The run store (DESIGN §5): embedded SQLite in WAL mode, schema created on first use.

Rows hold verdicts and evidence (numbers, reasons, span ids), never prompt or response text: the
classifier never extracts any, so there is none to store.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs

from collector.model import RunVerdict
from collector.serialize import run_to_dict

SCHEMA_VERSION = 1
STORE_ENV = "AGENTEVAL_STORE"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    trace_id TEXT,
    subject TEXT,
    status TEXT NOT NULL,
    score REAL,
    preset TEXT NOT NULL,
    source TEXT NOT NULL,
    revision INTEGER NOT NULL,
    incomplete INTEGER NOT NULL,
    checked INTEGER NOT NULL,
    unchecked INTEGER NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    doc TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_by_time ON runs (updated_at DESC);
CREATE INDEX IF NOT EXISTS runs_by_status ON runs (status, updated_at DESC);
CREATE INDEX IF NOT EXISTS runs_by_subject ON runs (subject, updated_at DESC);
CREATE TABLE IF NOT EXISTS executor_verdicts (
    run_id TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
    executor_id TEXT NOT NULL,
    verdict TEXT NOT NULL,
    score REAL,
    no_truth_reason TEXT,
    evidence TEXT NOT NULL,
    PRIMARY KEY (run_id, executor_id)
);
"""

_UPSERT = """
INSERT INTO runs (run_id, trace_id, subject, status, score, preset, source, revision, incomplete,
                  checked, unchecked, created_at, updated_at, doc)
VALUES (:run_id, :trace_id, :subject, :status, :score, :preset, :source, :revision, :incomplete,
        :checked, :unchecked, :now, :now, :doc)
ON CONFLICT (run_id) DO UPDATE SET
    subject = excluded.subject, status = excluded.status, score = excluded.score,
    preset = excluded.preset, revision = excluded.revision, incomplete = excluded.incomplete,
    checked = excluded.checked, unchecked = excluded.unchecked, updated_at = excluded.updated_at,
    doc = excluded.doc
WHERE excluded.revision > runs.revision
"""


_SUMMARY = ("run_id, trace_id, subject, status, score, preset, source, revision, incomplete, checked, "
            "unchecked, created_at, updated_at")


def _doc(row: sqlite3.Row) -> dict[str, Any]:
    doc = json.loads(row["doc"])
    doc.update(created_at=row["created_at"], updated_at=row["updated_at"])
    return doc


class StoreError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class StoredRun:
    run_id: str
    source: str
    verdict: RunVerdict


def default_store_path() -> Path:
    env = os.environ.get(STORE_ENV)
    if env:
        return Path(env)
    return Path(platformdirs.user_data_dir("agenteval")) / "runs.db"


class RunStore:
    """Thread-safe SQLite run store; writes of a batch share one transaction."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.execute("PRAGMA busy_timeout=5000")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path}: schema version {version} is newer than this agenteval knows ({SCHEMA_VERSION})"
                )
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"{self.path}: {exc}") from exc
        self._lock = threading.Lock()

    def save(self, run: StoredRun) -> None:
        self.save_many([run])

    def save_many(self, runs: Iterable[StoredRun]) -> None:
        now = time.time()
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                for item in runs:
                    self._write(item, now)
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise StoreError(f"{self.path}: {exc}") from exc

    def _write(self, item: StoredRun, now: float) -> None:
        run = item.verdict
        doc = run_to_dict(run, run_id=item.run_id, source=item.source)
        cur = self._db.execute(
            _UPSERT,
            {
                "run_id": item.run_id,
                "trace_id": run.trace_id,
                "subject": run.subject,
                "status": run.status.value,
                "score": run.score,
                "preset": run.preset,
                "source": item.source,
                "revision": run.revision,
                "incomplete": int(run.incomplete),
                "checked": run.checked,
                "unchecked": run.unchecked,
                "now": now,
                "doc": json.dumps(doc),
            },
        )
        if cur.rowcount == 0:  # an equal or newer revision is already stored
            return
        self._db.execute("DELETE FROM executor_verdicts WHERE run_id = ?", (item.run_id,))
        self._db.executemany(
            "INSERT INTO executor_verdicts VALUES (?, ?, ?, ?, ?, ?)",
            [
                (item.run_id, e["executor_id"], e["verdict"], e["score"], e["no_truth_reason"],
                 json.dumps(e["evidence"]))
                for e in doc["executors"]
            ],
        )

    def list_runs(self, statuses: Iterable[str] = (), subject: str | None = None, limit: int = 50,
                  with_docs: bool = False) -> list[dict[str, Any]]:
        """Newest first; summary rows, or whole run documents with ``with_docs``."""
        clauses, params = [], []
        wanted = sorted({s.upper() for s in statuses})
        if wanted:
            clauses.append(f"status IN ({', '.join('?' * len(wanted))})")
            params.extend(wanted)
        if subject:
            clauses.append("subject = ?")
            params.append(subject)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        columns = "doc, created_at, updated_at" if with_docs else _SUMMARY
        sql = f"SELECT {columns} FROM runs {where} ORDER BY updated_at DESC, rowid DESC LIMIT ?"
        with self._lock:
            rows = self._db.execute(sql, [*params, limit]).fetchall()
        return [_doc(r) for r in rows] if with_docs else [dict(r) for r in rows]

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        """The stored run document; a unique prefix of the run id is enough."""
        with self._lock:
            rows = self._db.execute(
                "SELECT doc, created_at, updated_at FROM runs WHERE run_id = ? OR run_id LIKE ? "
                "ORDER BY run_id = ? DESC LIMIT 2",
                (run_id, f"{run_id}%", run_id),
            ).fetchall()
        if not rows or (len(rows) > 1 and json.loads(rows[0]["doc"])["run_id"] != run_id):
            return None
        return _doc(rows[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
