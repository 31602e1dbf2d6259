"""What the store holds in each version, and how older data reads as current (docs/store.md): the
tables' versioned migrations, run on open (a schema newer than this code is refused), and the keys
added to run documents since the first ones, with what an older document that lacks one means.

Adding a column is a migration here; adding a key to the run document is an entry here too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from collector.core.serialize import BOUNDED_EVIDENCE, BOUNDED_RUN
from collector.store.codec import pack
from collector.store.errors import StoreError

log = structlog.get_logger("agenteval.collector")

#: A migration step: a statement, or a function of (execute, the driver's parameter mark) for what
#: one statement cannot do (rewriting every row).
Step = str | Callable[[Callable[..., Any], str], None]
#: Rows a data migration reads and writes per statement.
_MIGRATE_ROWS = 256


def _compress_documents(execute: Callable[..., Any], mark: str) -> None:
    """5: each run's JSON document (``doc``) compressed into ``body``, in batches by run id. ``doc``
    is emptied as well: PostgreSQL's DROP COLUMN that follows leaves the values in the rows, where
    an emptied one leaves only the old row versions, which vacuum reclaims."""
    after = ""
    while rows := execute(f"SELECT run_id, doc FROM runs WHERE run_id > {mark} ORDER BY run_id LIMIT {_MIGRATE_ROWS}",
                          (after,)).fetchall():
        values = ", ".join([f"({mark}, {mark})"] * len(rows))
        execute(f"WITH packed (run_id, body) AS (VALUES {values}) UPDATE runs SET doc = '', body = "
                f"(SELECT body FROM packed WHERE packed.run_id = runs.run_id) "
                f"WHERE run_id IN (SELECT run_id FROM packed)",
                [v for r in rows for v in (r["run_id"], pack(r["doc"].encode()))])
        after = rows[-1]["run_id"]


#: Schema migrations, in order; the schema version is how many have been applied. The DDL is the
#: common subset of SQLite and PostgreSQL, so both backends share it; ``{blob}`` is the backend's
#: binary type.
MIGRATIONS: tuple[tuple[Step, ...], ...] = (
    (  # 1: runs and their executor verdicts (the latter dropped by 3)
        """CREATE TABLE IF NOT EXISTS runs (
            run_id TEXT PRIMARY KEY, trace_id TEXT, subject TEXT, status TEXT NOT NULL, score REAL,
            preset TEXT NOT NULL, source TEXT NOT NULL, revision INTEGER NOT NULL,
            incomplete INTEGER NOT NULL, checked INTEGER NOT NULL, unchecked INTEGER NOT NULL,
            created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL, doc TEXT NOT NULL)""",
        "CREATE INDEX IF NOT EXISTS runs_by_time ON runs (updated_at DESC)",
        "CREATE INDEX IF NOT EXISTS runs_by_status ON runs (status, updated_at DESC)",
        "CREATE INDEX IF NOT EXISTS runs_by_subject ON runs (subject, updated_at DESC)",
        """CREATE TABLE IF NOT EXISTS executor_verdicts (
            run_id TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE, executor_id TEXT NOT NULL,
            verdict TEXT NOT NULL, score REAL, no_truth_reason TEXT, evidence TEXT NOT NULL,
            PRIMARY KEY (run_id, executor_id))""",
    ),
    (  # 2: which collector instance finalized the run (one of N replicas)
        "ALTER TABLE runs ADD COLUMN finalized_by TEXT",
    ),
    (  # 3: one write per run: the run document already holds every unit's verdict and evidence
        "DROP TABLE IF EXISTS executor_verdicts",
    ),
    (  # 4: the MAF release the run's spans came from (fidelity by release)
        "ALTER TABLE runs ADD COLUMN maf_release TEXT",
        "CREATE INDEX IF NOT EXISTS runs_by_release ON runs (maf_release, updated_at DESC)",
    ),
    (  # 5: the document compressed (issue 42): ~6x smaller on disk, read back as the same JSON
        "ALTER TABLE runs ADD COLUMN body {blob}",
        _compress_documents,
        "ALTER TABLE runs DROP COLUMN doc",
    ),
    (  # 6: replicas come and go (docs/scale-out.md): each run's unit names, for the rules that keep a
        # verdict no other run holds; parts of traces handed over between replicas
        "ALTER TABLE runs ADD COLUMN units TEXT",
        """CREATE TABLE IF NOT EXISTS parts (
            part_id TEXT PRIMARY KEY, trace_id TEXT NOT NULL, held_by TEXT NOT NULL, has_root INTEGER NOT NULL,
            spans INTEGER NOT NULL, created_at DOUBLE PRECISION NOT NULL, records TEXT NOT NULL)""",
        "CREATE INDEX IF NOT EXISTS parts_by_trace ON parts (trace_id)",
    ),
    (  # 7: the spend the framework did not report (USD; NULL: not priced, as every earlier run)
        "ALTER TABLE runs ADD COLUMN unreported_usd DOUBLE PRECISION",
    ),
    (  # 8: a claim marks a part (issue 43): it leaves the store with the run that merged it, and a
        # claim whose claimer is gone goes stale (RunStore.claim_parts)
        "ALTER TABLE parts ADD COLUMN claimed_by TEXT",
        "ALTER TABLE parts ADD COLUMN claimed_at DOUBLE PRECISION",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(display: str, version: int, execute: Callable[..., Any], reached: Callable[[int], Any], mark: str,
            blob: str) -> None:
    """Bring the store ``display`` at schema ``version`` to :data:`SCHEMA_VERSION`, inside the
    caller's transaction: ``execute(sql[, params])`` runs one statement, ``reached`` records each
    version reached; ``mark`` and ``blob`` are the backend's parameter mark and type for bytes."""
    if version > SCHEMA_VERSION:
        raise StoreError(f"{display}: schema version {version} is newer than this agenteval knows "
                         f"({SCHEMA_VERSION}); upgrade agenteval")
    for number in range(version, SCHEMA_VERSION):
        for step in MIGRATIONS[number]:
            if isinstance(step, str):
                execute(step.format(blob=blob))
            else:
                step(execute, mark)
        reached(number + 1)
        log.info("store_migrated", store=display, to_version=number + 1)


def _none() -> None:
    return None


#: Run keys added since the first stored documents -> the value an older document means.
_ADDED_KEYS: dict[str, Callable[[], Any]] = {
    "non_agent_executors": list, "workflow_errors": list, "coverage_note": _none, "unattributed_chat": list,
    "maf_release": _none, "instrumentation_version": _none, "instrumentation_status": _none, "service_name": _none,
    "runtime": _none, "started_at": _none, "duration_s": _none, "split": bool, "spend": _none,
    **{f"{name}_more": int for name in BOUNDED_RUN}}
#: Likewise, evidence keys (an older document left nothing out of its lists).
_ADDED_EVIDENCE: dict[str, Callable[[], Any]] = {
    "chat_calls": list, "ledger": list, "framework_input_tokens": _none, "framework_output_tokens": _none,
    "truth_input_tokens": _none, "truth_output_tokens": _none, "truth_cache_read_tokens": _none,
    "truth_cache_write_tokens": _none, "truth_reasoning_tokens": _none, "stacked_chat_spans": int,
    "chat_layers_disagree": list, "ledger_unjoined": int, "ledger_duplicates": int,
    **{f"{name}_more": int for name in BOUNDED_EVIDENCE}}


def add_missing_keys(doc: dict[str, Any]) -> None:
    """Give a stored run document every key an older version did not write, with what its absence meant."""
    for key, empty in _ADDED_KEYS.items():
        doc.setdefault(key, empty())
    for unit in doc["executors"]:
        evidence = unit["evidence"]
        if "ledger_unjoined" not in evidence or "chat_calls_more" not in evidence:  # an earlier version's
            for key, empty in _ADDED_EVIDENCE.items():
                evidence.setdefault(key, empty())
        evidence.setdefault("cost", None)  # written before pricing: unknown
