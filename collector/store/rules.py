"""Which verdict of a run the store keeps (docs/store.md, docs/scale-out.md), and the statements
that apply it.

A run is replaced only by a higher revision, or an incomplete verdict by a complete one, in the
upsert itself, so concurrent writers can neither lose nor duplicate a run. Another replica's verdict
lacking a unit the stored run has is a part of the trace and never written over the whole
(:func:`keeps`); a workflow run's verdict supersedes the incomplete one its trace got when cut short;
a trace whose spans could not all be merged is flagged ``split``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from collector.core.serialize import from_json, to_json
from collector.store.codec import pack, unpack
from collector.store.documents import StoredRun, units
from collector.store.sql import ROWS_PER_STATEMENT, Database, Execute, chunks, marks, rows_in

#: A run is replaced only by a higher revision, or an incomplete verdict by a complete one (which
#: then passes the stored revision's number). :func:`_plan` mirrors this rule to know what it wrote,
#: and leaves out of the statement the rows its further rule keeps out (see :func:`keeps`).
_UPSERT = """
INSERT INTO runs (run_id, trace_id, subject, status, score, preset, source, revision, incomplete,
                  checked, unchecked, created_at, updated_at, body, finalized_by, maf_release, units,
                  unreported_usd)
VALUES {rows}
ON CONFLICT (run_id) DO UPDATE SET
    subject = excluded.subject, status = excluded.status, score = excluded.score,
    preset = excluded.preset, incomplete = excluded.incomplete,
    revision = CASE WHEN excluded.revision > runs.revision THEN excluded.revision ELSE runs.revision + 1 END,
    checked = excluded.checked, unchecked = excluded.unchecked, updated_at = excluded.updated_at,
    body = excluded.body, finalized_by = excluded.finalized_by, maf_release = excluded.maf_release,
    units = excluded.units, unreported_usd = excluded.unreported_usd
WHERE excluded.revision > runs.revision OR (runs.incomplete = 1 AND excluded.incomplete = 0)
"""
#: A workflow run's verdict supersedes the incomplete verdict its trace got when it was cut short
#: before its workflow-run span arrived (e.g. by a restart): that one was stored under the trace id.
#: Only when the workflow run holds every unit the incomplete one does (:func:`_plan` picks them):
#: a verdict no other run carries is never deleted.
_SUPERSEDE = "DELETE FROM runs WHERE incomplete = 1 AND run_id IN ({ids})"
_CURRENT = "SELECT run_id, revision, incomplete, finalized_by, units FROM runs WHERE run_id IN ({ids})"
#: A row has this many values (fewer rows per upsert where the database allows fewer parameters).
_COLUMNS = 18

#: A row's values, in the order of the upsert's columns (the run id first).
Row = tuple[Any, ...]


@lru_cache(maxsize=128)
def _upsert(rows: int, mark: str) -> str:
    """The upsert of ``rows`` rows with positional parameters (SQLite looks a named one up by a
    linear search, which made a 256-row statement cost 4x more per row than one row alone)."""
    row = "(" + ", ".join([mark] * _COLUMNS) + ")"
    return _UPSERT.format(rows=", ".join([row] * rows))


@dataclass(frozen=True, slots=True)
class Held:
    """What the store holds of a run, as far as the write rules need it."""

    revision: int
    incomplete: bool
    finalized_by: str | None = None
    #: The run's unit names (None: a run stored before they were kept, or not known).
    units: frozenset[str] | None = None


def keeps(stored: Held | None, units: frozenset[str], finalized_by: str | None) -> bool:
    """Whether ``stored`` is kept against a verdict of the same run from ``finalized_by`` holding
    ``units``, whatever its revision: another instance's verdict lacking a unit the stored run has is
    a part of the trace (a replica that got only some of its spans, a tail read again after a Kafka
    rebalance), never written over the whole. A replica's own later revisions hold all it held."""
    return (stored is not None and stored.units is not None and stored.finalized_by is not None
            and stored.finalized_by != finalized_by and not stored.units <= units)


def replaces(stored: tuple[int, bool] | None, revision: int, incomplete: bool) -> bool:
    """Whether a verdict of ``revision`` is written over ``stored`` (revision, incomplete; None: no
    run): the upsert's rule, a higher revision, or a complete verdict over an incomplete one."""
    return stored is None or revision > stored[0] or (stored[1] and not incomplete)


@dataclass(slots=True)
class _Group:
    """Runs that one upsert and one supersede statement write with the same result in any order."""

    rows: list[Row] = field(default_factory=list)
    run_ids: set[str] = field(default_factory=set)
    superseded: set[str] = field(default_factory=set)


def _plan(rows: list[Row], current: dict[str, Held]) -> tuple[list[int], list[_Group]]:
    """Which rows of a batch are written (by index), applying the revision guard and :func:`keeps`
    in order against ``current`` (run id -> what is stored), and the statements that write them.

    Exact because no other writer changes these runs meanwhile: SQLite's transaction holds the write
    lock, PostgreSQL's takes :meth:`RunStore._lock_keys`.
    """
    written: list[int] = []
    groups = [_Group()]
    for index, row in enumerate(rows):
        run_id, trace_id, revision, incomplete, finalized_by = row[0], row[1], row[7], bool(row[8]), row[14]
        held = units(row[16]) or frozenset()
        before = current.get(run_id)
        if not replaces(before and (before.revision, before.incomplete), revision, incomplete):
            continue  # an equal or newer revision is stored
        if keeps(before, held, finalized_by):
            continue  # a part of the trace: the whole stays
        current[run_id] = Held(revision if before is None or revision > before.revision else before.revision + 1,
                               incomplete, finalized_by, held)
        cut = current.get(trace_id) if trace_id and trace_id != run_id and not incomplete else None
        supersedes = (trace_id if cut is not None and cut.incomplete and cut.units is not None and cut.units <= held
                      else None)
        group = groups[-1]
        if run_id in group.run_ids or run_id in group.superseded:  # its order against the group's would matter
            group = _Group()
            groups.append(group)
        group.rows.append(row)
        group.run_ids.add(run_id)
        if supersedes is not None:
            group.superseded.add(supersedes)
            del current[supersedes]
        written.append(index)
    return written, groups


def to_row(run: StoredRun, at: float, max_items: int) -> Row:
    """``run``'s row, written at ``at``; its document and columns made now unless the run came with them."""
    if run.columns is None or run.body is None:
        assert run.verdict is not None
        run = StoredRun.packed(run.run_id, run.source, run.verdict, run.finalized_by, run.parts, max_items)
    c = run.columns
    assert c is not None
    return (run.run_id, c[0], c[1], c[2], c[3], c[4], run.source, c[5], c[6], c[7], c[8], at, at,
            run.body, run.finalized_by, c[9], c[10], c[11])


def write(db: Database, execute: Execute, rows: list[Row]) -> list[Row]:
    """Write a batch inside the caller's transaction, as if each row were written alone and in
    order, in a few statements whatever its size. Returns the rows written, in order."""
    limit = db._max_params()
    per_upsert, per_list = max(1, min(ROWS_PER_STATEMENT, limit // _COLUMNS)), min(2 * ROWS_PER_STATEMENT, limit)
    keys = list({r[0]: None for r in rows} | {r[1]: None for r in rows if r[1]})
    db._lock_keys(execute, keys)
    current: dict[str, Held] = {}
    for part in chunks(keys, per_list):
        for r in execute(_CURRENT.format(ids=marks(db._mark, len(part))), part).fetchall():
            current[r["run_id"]] = Held(r["revision"], bool(r["incomplete"]), r["finalized_by"], units(r["units"]))
    written, groups = _plan(rows, current)
    for group in groups:
        for part in chunks(group.rows, per_upsert):
            execute(_upsert(len(part), db._mark), [value for r in part for value in r])
        for part in chunks(list(group.superseded), per_list):
            execute(_SUPERSEDE.format(ids=marks(db._mark, len(part))), part)
    return [rows[i] for i in written]


def published(rows: list[Row]) -> list[dict[str, Any]]:
    """The documents of written rows as this process's subscribers get them (the bodies were packed
    where the runs were published: unpacked only for a listener)."""
    return [from_json(unpack(r[13])) | {"created_at": None, "updated_at": r[12]} for r in rows]


def revisions(db: Database, run_ids: list[str]) -> dict[str, tuple[int, bool]]:
    return {r["run_id"]: (r["revision"], bool(r["incomplete"])) for r in rows_in(db, _CURRENT, run_ids)}


def flag_split(db: Database, trace_id: str, note: str) -> list[str]:
    flagged: list[str] = []
    with db._transaction() as execute:
        db._lock_keys(execute, [trace_id])
        stored = execute("SELECT run_id, revision, status, body FROM runs WHERE trace_id = :t",
                         {"t": trace_id}).fetchall()
        for r in stored:
            doc = from_json(unpack(r["body"]))
            if note in doc.get("notes", []):
                continue
            status = "WARN" if r["status"] == "PASS" else r["status"]
            doc.update(status=status, split=True, notes=[*doc.get("notes", []), note], revision=r["revision"] + 1)
            execute("UPDATE runs SET status = :status, revision = :revision, body = :body, "
                    "updated_at = :now WHERE run_id = :id",
                    {"status": status, "revision": r["revision"] + 1, "body": pack(to_json(doc)),
                     "now": time.time(), "id": r["run_id"]})
            flagged.append(r["run_id"])
        if flagged:
            db._written(execute, flagged)
    return flagged
