"""Runs as the store keeps them (docs/store.md), and the queries that read them back.

A run is one row: its summary columns (what the lists filter and sort on) and its document,
compressed JSON (``body``), which holds every unit's verdict and evidence once. Rows hold verdicts
and evidence (numbers, reasons, span ids), never prompt or response text: the classifier never
extracts any, so there is none to store.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from collector.core.model import RunVerdict, Status
from collector.core.serialize import from_json, run_to_json
from collector.store.codec import pack, unpack
from collector.store.schema import add_missing_keys
from collector.store.sql import Database, like_prefix, rows_in


@dataclass(frozen=True, slots=True)
class StoredRun:
    run_id: str
    source: str
    #: None once handed to the store writer (:meth:`for_writer`): ``body`` and ``columns`` hold what it writes.
    verdict: RunVerdict | None
    finalized_by: str | None = None
    #: Parts claimed from the store whose spans this run (or one queued before it) merged: they
    #: leave the store in the transaction that writes it, or finds it stale (docs/scale-out.md).
    parts: tuple[str, ...] = ()
    #: The run's document as the store keeps it, made with ``columns`` where the run was published
    #: (:meth:`packed`); either None: :meth:`RunStore.save_many` makes both from the verdict.
    body: bytes | None = field(default=None, repr=False, compare=False)
    #: The verdict's own columns (:func:`run_columns`).
    columns: tuple[Any, ...] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def packed(cls, run_id: str, source: str, verdict: RunVerdict, finalized_by: str | None, parts: tuple[str, ...],
               max_items: int) -> StoredRun:
        """A run with its document and columns made now (the live pipeline, as it publishes the run:
        its verdict's objects are then still in the CPU's caches; the JSON took ~40% less time than
        in the store writer, later: bench/RESULTS.md issue 39)."""
        return cls(run_id, source, verdict, finalized_by, parts,
                   pack(run_to_json(verdict, max_items, run_id=run_id, source=source, finalized_by=finalized_by)),
                   run_columns(verdict))

    def for_writer(self) -> StoredRun:
        """This run without its verdict where its body and columns are made: all the store writer
        needs, and a queued run then holds its ~3 KB document, not the verdict's objects."""
        if self.columns is None or self.body is None:
            return self
        return StoredRun(self.run_id, self.source, None, self.finalized_by, self.parts, self.body, self.columns)

    @property
    def trace_id(self) -> str | None:
        if self.verdict is not None:
            return self.verdict.trace_id
        assert self.columns is not None  # for_writer leaves out only a verdict whose columns are made
        return self.columns[0]


def run_columns(run: RunVerdict) -> tuple[Any, ...]:
    """The ``runs`` columns a verdict gives (:meth:`RunStore.save_many` puts the rest around them):
    trace id, subject, status, score, preset, revision, incomplete, checked, unchecked, MAF release,
    unit names, unreported spend."""
    return (run.trace_id, run.subject, run.status.value, run.score, run.preset, run.revision, int(run.incomplete),
            run.checked, run.unchecked, run.maf_release, unit_names(run),
            run.spend.unreported_usd if run.spend is not None else None)


def unit_names(run: RunVerdict) -> str:
    """The ``units`` column: a run's unit names, one a line."""
    return "\n".join(sorted({e.executor_id for e in run.executors}))


def units(column: str | None) -> frozenset[str] | None:
    """The unit names of a ``units`` column (None: a run stored before they were kept)."""
    return None if column is None else frozenset(column.split("\n")) - {""}


_SUMMARY = ("run_id, trace_id, subject, status, score, preset, source, revision, incomplete, checked, "
            "unchecked, created_at, updated_at, finalized_by, maf_release, unreported_usd")
_DOC = "body, revision, created_at, updated_at, finalized_by"


def _doc(row: dict[str, Any]) -> dict[str, Any]:
    doc = from_json(unpack(row["body"]))
    add_missing_keys(doc)
    doc.update(created_at=row["created_at"], updated_at=row["updated_at"], finalized_by=row["finalized_by"],
               revision=row["revision"])  # the store may have raised it past the verdict's own
    return doc


def list_runs(db: Database, statuses: Iterable[str], subject: str | None, limit: int, with_docs: bool,
              maf_release: str | None, run_id_prefix: str | None, since: float | None) -> list[dict[str, Any]]:
    """Several statuses are read as one index walk each, merged (``status IN`` read every run of
    those statuses and sorted them all, for the newest few)."""
    wanted = sorted({s.upper() for s in statuses})
    # a release is matched whole or as a prefix of dotted parts: 1.26 matches 1.26.0 and 1.26.1
    params: dict[str, Any] = {"limit": limit, "subject": subject, "release": maf_release,
                              "releases": like_prefix(f"{maf_release}.") if maf_release else None,
                              "prefix": like_prefix(run_id_prefix) if run_id_prefix else None,
                              "since": since, **{f"s{i}": s for i, s in enumerate(wanted)}}
    columns = f"{_DOC}, run_id" if with_docs else _SUMMARY
    newest = "ORDER BY updated_at DESC, run_id DESC LIMIT :limit"

    def walk(status: str | None) -> str:
        clauses = [c for c in (status and f"status = :{status}", subject and "subject = :subject",
                               maf_release and "(maf_release = :release OR maf_release LIKE :releases ESCAPE '\\')",
                               run_id_prefix and "run_id LIKE :prefix ESCAPE '\\'",
                               since is not None and "updated_at >= :since")
                   if c]
        return f"SELECT {columns} FROM runs {'WHERE ' + ' AND '.join(clauses) if clauses else ''} {newest}"

    if len(wanted) > 1:
        sql = " UNION ALL ".join(f"SELECT * FROM ({walk(f's{i}')}) AS s{i}" for i in range(len(wanted))) + f" {newest}"
    else:
        sql = walk("s0" if wanted else None)
    rows = db._query(sql, params)
    return [_doc(r) for r in rows] if with_docs else rows


def count_by_status(db: Database, subject: str | None, since: float | None) -> dict[str, int]:
    clauses = [c for c in (subject and "subject = :subject", since is not None and "updated_at >= :since") if c]
    rows = db._query(f"SELECT status, COUNT(*) AS n FROM runs {'WHERE ' + ' AND '.join(clauses) if clauses else ''} "
                     "GROUP BY status", {"subject": subject, "since": since})
    counts = dict.fromkeys((s.value for s in Status), 0)
    counts.update({r["status"]: int(r["n"]) for r in rows})
    return counts


def traces_with_runs(db: Database, trace_ids: list[str]) -> set[str]:
    return {r["trace_id"]
            for r in rows_in(db, "SELECT DISTINCT trace_id FROM runs WHERE trace_id IN ({ids})", trace_ids)}


def get_run(db: Database, run_id: str) -> dict[str, Any] | None:
    """A whole id is looked up in the index; only an id no run has is matched as a prefix, which
    scans the runs (LIKE cannot use the index on either backend)."""
    rows = db._query(f"SELECT {_DOC} FROM runs WHERE run_id = :id", {"id": run_id})
    if not rows:
        rows = db._query(f"SELECT {_DOC} FROM runs WHERE run_id LIKE :prefix ESCAPE '\\' LIMIT 2",
                         {"prefix": like_prefix(run_id)})
    return _doc(rows[0]) if len(rows) == 1 else None


def missing_run(db: Database, run_id: str, remote: bool) -> str:
    rows = runs_matching(db, run_id, 4)
    if len(rows) < 2:
        if remote:
            return f"no run {run_id!r} in this collector's store"
        return f"no run {run_id!r} in {db.display}: `agenteval runs list` shows the stored runs"
    more = " and more" if len(rows) > 3 else ""
    shown = ", ".join(rows[:3])
    return f"{run_id!r} matches several runs ({shown}{more}): give more characters of the run id"


def runs_matching(db: Database, prefix: str, limit: int) -> list[str]:
    rows = db._query("SELECT run_id FROM runs WHERE run_id LIKE :prefix ESCAPE '\\' ORDER BY run_id LIMIT :limit",
                     {"prefix": like_prefix(prefix), "limit": limit})
    return [r["run_id"] for r in rows]


def docs(db: Database, run_ids: Iterable[str]) -> list[dict[str, Any]]:
    ids = sorted(set(run_ids))
    if not ids:
        return []
    marks = ", ".join(f":r{i}" for i in range(len(ids)))
    return [_doc(r) for r in db._query(f"SELECT {_DOC} FROM runs WHERE run_id IN ({marks})",
                                       {f"r{i}": rid for i, rid in enumerate(ids)})]


def updated_since(db: Database, since: float, limit: int) -> list[dict[str, Any]]:
    return [_doc(r) for r in db._query(f"SELECT {_DOC} FROM runs WHERE updated_at >= :since "
                                       "ORDER BY updated_at LIMIT :limit", {"since": since, "limit": limit})]
