"""Parts of split traces handed between replicas through the store (docs/scale-out.md): a replica
that held some of a trace's spans without its workflow-run span, or that stopped, hands them over;
the replica holding the root claims them, merges them into its run, and they leave the store with
that run. A claim marks a part, it does not take it: a claim whose claimer is gone goes stale.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from collector.store.sql import ROWS_PER_STATEMENT, Database, Execute, chunks, marks


@dataclass(frozen=True, slots=True)
class Part:
    """Spans of one trace a replica handed over through the store instead of publishing them as a
    run (docs/scale-out.md): it held them without the trace's workflow-run span, or it stopped.
    ``records`` are journal lines (:mod:`collector.live.journal`'s encoding of span records)."""

    trace_id: str
    held_by: str
    has_root: bool
    spans: int
    records: bytes
    created_at: float = 0.0
    part_id: str = ""


_PART = "part_id, trace_id, held_by, has_root, spans, created_at"
#: A part any replica may claim: unclaimed, or its claim is stale (:meth:`RunStore.claim_parts`).
_WAITING = "(claimed_by IS NULL OR claimed_at < :stale)"


def _part(row: dict[str, Any]) -> Part:
    records = row.get("records") or ""
    return Part(row["trace_id"], row["held_by"], bool(row["has_root"]), row["spans"],
                records.encode() if isinstance(records, str) else bytes(records), row["created_at"], row["part_id"])


def hand_over(db: Database, parts: list[Part]) -> None:
    if not parts:
        return
    now = time.time()
    with db._transaction() as execute:
        for part in parts:
            execute("INSERT INTO parts (part_id, trace_id, held_by, has_root, spans, created_at, records) "
                    "VALUES (:part_id, :trace_id, :held_by, :has_root, :spans, :created_at, :records)",
                    {"part_id": part.part_id or f"{part.held_by}/{part.trace_id}/{uuid.uuid4().hex}",
                     "trace_id": part.trace_id, "held_by": part.held_by, "has_root": int(part.has_root),
                     "spans": part.spans, "created_at": part.created_at or now, "records": part.records.decode()})


def waiting(db: Database, lease: float, limit: int) -> list[Part]:
    return [_part(r) for r in db._query(f"SELECT {_PART} FROM parts WHERE {_WAITING} ORDER BY created_at "
                                        "LIMIT :limit", {"limit": limit, "stale": time.time() - lease})]


def claim(db: Database, trace_ids: list[str], claimer: str, lease: float) -> list[Part]:
    out: list[Part] = []
    now = time.time()
    for chunk in chunks(sorted(set(trace_ids)), ROWS_PER_STATEMENT):
        params = {f"t{i}": t for i, t in enumerate(chunk)}
        with db._transaction() as execute:
            rows = execute(f"UPDATE parts SET claimed_by = :claimer, claimed_at = :now "
                           f"WHERE trace_id IN ({', '.join(':' + k for k in params)}) AND {_WAITING} "
                           f"RETURNING {_PART}, records",
                           {**params, "claimer": claimer, "now": now, "stale": now - lease}).fetchall()
        out.extend(_part(dict(r)) for r in rows)
    return sorted(out, key=lambda p: p.created_at)


def renew(db: Database, part_ids: list[str], claimer: str) -> None:
    now = time.time()
    with db._transaction() as execute:
        for chunk in chunks(sorted(part_ids), ROWS_PER_STATEMENT):
            execute(f"UPDATE parts SET claimed_at = {db._mark} WHERE claimed_by = {db._mark} "
                    f"AND part_id IN ({marks(db._mark, len(chunk))})", [now, claimer, *chunk])


def release(db: Database, claimer: str, part_ids: list[str] | None) -> None:
    with db._transaction() as execute:
        if part_ids is None:
            execute("UPDATE parts SET claimed_by = NULL, claimed_at = NULL WHERE claimed_by = :claimer",
                    {"claimer": claimer})
            return
        for chunk in chunks(sorted(part_ids), ROWS_PER_STATEMENT):
            execute(f"UPDATE parts SET claimed_by = NULL, claimed_at = NULL WHERE claimed_by = {db._mark} "
                    f"AND part_id IN ({marks(db._mark, len(chunk))})", [claimer, *chunk])


def drop(execute: Execute, mark: str, part_ids: list[str]) -> None:
    """Delete these parts, inside the caller's transaction."""
    for chunk in chunks(sorted(set(part_ids)), ROWS_PER_STATEMENT):
        execute(f"DELETE FROM parts WHERE part_id IN ({marks(mark, len(chunk))})", chunk)
