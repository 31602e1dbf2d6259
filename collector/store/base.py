"""The run store's interface (docs/design.md §5), which both backends implement and import:
embedded SQLite (WAL, ``sqlite``) by default, PostgreSQL (``postgres``) for a shared history.

One config value picks the backend (``store.url``: a file path, or a ``postgresql://`` URL). Both run
the same SQL (named ``:params``, or the driver's positional mark for the batched writes), the same
versioned migrations on open (refusing a schema newer than this code), and the same revision guard:
a run is replaced only by a higher revision, in the upsert itself, so concurrent writers can neither
lose nor duplicate a run.

Rows hold verdicts and evidence (numbers, reasons, span ids), never prompt or response text: the
classifier never extracts any, so there is none to store.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import platformdirs
import structlog

from collector.core.model import RunVerdict
from collector.core.serialize import BOUNDED_EVIDENCE, BOUNDED_RUN, MAX_ITEMS, from_json, run_to_json

log = structlog.get_logger("agenteval.collector")

STORE_ENV = "AGENTEVAL_STORE"
#: Names this collector in each run's ``finalized_by`` (default: the host name), so replicas that
#: share a host and a store stay apart.
INSTANCE_ENV = "AGENTEVAL_INSTANCE"
#: Postgres channel a store NOTIFYs with the run id of every run it writes.
CHANNEL = "agenteval_runs"

#: Schema migrations, in order; the schema version is how many have been applied. The DDL is the
#: common subset of SQLite and PostgreSQL, so both backends share it.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
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
)
SCHEMA_VERSION = len(MIGRATIONS)

#: A run is replaced only by a higher revision, or an incomplete verdict by a complete one (which
#: then passes the stored revision's number). :func:`_plan` mirrors this rule to know what it wrote.
_UPSERT = """
INSERT INTO runs (run_id, trace_id, subject, status, score, preset, source, revision, incomplete,
                  checked, unchecked, created_at, updated_at, doc, finalized_by, maf_release)
VALUES {rows}
ON CONFLICT (run_id) DO UPDATE SET
    subject = excluded.subject, status = excluded.status, score = excluded.score,
    preset = excluded.preset, incomplete = excluded.incomplete,
    revision = CASE WHEN excluded.revision > runs.revision THEN excluded.revision ELSE runs.revision + 1 END,
    checked = excluded.checked, unchecked = excluded.unchecked, updated_at = excluded.updated_at,
    doc = excluded.doc, finalized_by = excluded.finalized_by, maf_release = excluded.maf_release
WHERE excluded.revision > runs.revision OR (runs.incomplete = 1 AND excluded.incomplete = 0)
"""
#: A workflow run's verdict supersedes the incomplete verdict its trace got when it was cut short
#: before its workflow-run span arrived (e.g. by a restart): that one was stored under the trace id.
_SUPERSEDE = "DELETE FROM runs WHERE incomplete = 1 AND run_id IN ({ids})"
_CURRENT = "SELECT run_id, revision, incomplete FROM runs WHERE run_id IN ({ids})"
#: Rows per upsert at most; fewer where the database allows fewer parameters (a row has 16).
_ROWS_PER_STATEMENT = 256
_COLUMNS = 16


@lru_cache(maxsize=128)
def _upsert(rows: int, mark: str) -> str:
    """The upsert of ``rows`` rows with positional parameters (SQLite looks a named one up by a
    linear search, which made a 256-row statement cost 4x more per row than one row alone)."""
    row = "(" + ", ".join([mark] * _COLUMNS) + ")"
    return _UPSERT.format(rows=", ".join([row] * rows))


def _marks(mark: str, n: int) -> str:
    return ", ".join([mark] * n)


def _chunks(items: list, size: int) -> Iterator[list]:
    for at in range(0, len(items), size):
        yield items[at:at + size]


_SUMMARY = ("run_id, trace_id, subject, status, score, preset, source, revision, incomplete, checked, "
            "unchecked, created_at, updated_at, finalized_by, maf_release")
_DOC = "doc, revision, created_at, updated_at, finalized_by"


#: A row's values, in the order of the upsert's columns.
_Row = tuple[Any, ...]


@dataclass(slots=True)
class _Group:
    """Runs that one upsert and one supersede statement write with the same result in any order."""

    rows: list[_Row] = field(default_factory=list)
    run_ids: set[str] = field(default_factory=set)
    superseded: set[str] = field(default_factory=set)


def replaces(stored: tuple[int, bool] | None, revision: int, incomplete: bool) -> bool:
    """Whether a verdict of ``revision`` is written over ``stored`` (revision, incomplete; None: no
    run): the upsert's rule, a higher revision, or a complete verdict over an incomplete one."""
    return stored is None or revision > stored[0] or (stored[1] and not incomplete)


def _plan(rows: list[_Row], current: dict[str, tuple[int, bool]]) -> tuple[list[int], list[_Group]]:
    """Which rows of a batch are written (by index), applying the revision guard in order against
    ``current`` (run id -> stored revision, incomplete), and the statements that write them.

    Exact because no other writer changes these runs meanwhile: SQLite's transaction holds the write
    lock, PostgreSQL's takes :meth:`RunStore._lock_keys`.
    """
    written: list[int] = []
    groups = [_Group()]
    for index, row in enumerate(rows):
        run_id, trace_id, revision, incomplete = row[0], row[1], row[7], row[8]
        before = current.get(run_id)
        if not replaces(before, revision, bool(incomplete)):
            continue  # an equal or newer revision is stored
        current[run_id] = (revision if before is None or revision > before[0] else before[0] + 1, bool(incomplete))
        supersedes = trace_id if trace_id and trace_id != run_id and not incomplete else None
        group = groups[-1]
        if run_id in group.run_ids or run_id in group.superseded:  # its order against the group's would matter
            group = _Group()
            groups.append(group)
        group.rows.append(row)
        group.run_ids.add(run_id)
        if supersedes is not None:
            group.superseded.add(supersedes)
            if current.get(supersedes, (0, False))[1]:
                del current[supersedes]
        written.append(index)
    return written, groups


class StoreError(Exception):
    pass


class StoreUnavailable(StoreError):
    """The store cannot be reached right now (the database down, the file locked by another
    process): a later attempt can succeed, unlike a store that refuses (a newer schema, a wrong
    password, a path that is a directory)."""


#: What an API client or run page reader is told when a store read fails: the error itself names
#: the store (path, database URL) and goes to the collector's log only.
UNREADABLE = "the run store cannot be read right now (the collector's log says why); retry later"
#: Seconds a reader is told to wait before it retries an unreadable store (the run page's Retry-After).
RETRY_READ_AFTER = 5
#: Seconds between attempts to open a store that could not be reached at start: first, most.
OPEN_RETRY = (0.5, 10.0)


@dataclass(frozen=True, slots=True)
class StoredRun:
    run_id: str
    source: str
    verdict: RunVerdict
    finalized_by: str | None = None


Subscriber = Callable[[list[dict[str, Any]]], None]


def instance_name() -> str:
    return os.environ.get(INSTANCE_ENV) or socket.gethostname()


def data_dir_store() -> Path:
    return Path(platformdirs.user_data_dir("agenteval")) / "runs.db"


def default_store_url() -> str:
    return os.environ.get(STORE_ENV) or str(data_dir_store())


def is_postgres(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


def _none() -> None:
    return None


#: Run keys added since the first stored documents -> the value an older document means.
_ADDED_KEYS: dict[str, Callable[[], Any]] = {
    "non_agent_executors": list, "workflow_errors": list, "coverage_note": _none, "unattributed_chat": list,
    "maf_release": _none, "instrumentation_version": _none, "instrumentation_status": _none, "service_name": _none,
    "started_at": _none, "duration_s": _none, **{f"{name}_more": int for name in BOUNDED_RUN}}
#: Likewise, evidence keys (an older document left nothing out of its lists).
_ADDED_EVIDENCE: dict[str, Callable[[], Any]] = {
    "chat_calls": list, "ledger": list, "framework_input_tokens": _none, "framework_output_tokens": _none,
    "truth_input_tokens": _none, "truth_output_tokens": _none, "truth_cache_read_tokens": _none,
    "truth_cache_write_tokens": _none, "truth_reasoning_tokens": _none, "stacked_chat_spans": int,
    "chat_layers_disagree": list, **{f"{name}_more": int for name in BOUNDED_EVIDENCE}}


def _doc(row: dict[str, Any]) -> dict[str, Any]:
    doc = from_json(row["doc"])
    for key, empty in _ADDED_KEYS.items():
        doc.setdefault(key, empty())
    for unit in doc["executors"]:
        evidence = unit["evidence"]
        if "chat_layers_disagree" not in evidence or "chat_calls_more" not in evidence:  # an earlier version's
            for key, empty in _ADDED_EVIDENCE.items():
                evidence.setdefault(key, empty())
    doc.update(created_at=row["created_at"], updated_at=row["updated_at"], finalized_by=row["finalized_by"],
               revision=row["revision"])  # the store may have raised it past the verdict's own
    return doc


def _like_prefix(value: str) -> str:
    return re.sub(r"([\\%_])", r"\\\1", value) + "%"


class RunStore(ABC):
    """What every read and write path uses; backends supply connections and change notification."""

    #: Where the store is, safe to print or log (never a password).
    display: str
    #: True when the database itself tells subscribers of every writer's runs (PostgreSQL).
    notifies_all_writers = False
    #: Entries each bounded list of a written document keeps (see :mod:`collector.core.serialize`).
    max_items = MAX_ITEMS

    def __init__(self) -> None:
        self._subscribers: list[tuple[Subscriber, Callable[[], bool]]] = []
        self._opened = threading.Event()
        self._closing = threading.Event()
        self._opener: threading.Thread | None = None

    # --- backend hooks ---------------------------------------------------------------------------
    #: The driver's positional parameter mark.
    _mark = "?"

    @abstractmethod
    def _connect(self) -> None:
        """Connect and migrate: :class:`StoreUnavailable` when the store cannot be reached now,
        :class:`StoreError` when it refuses."""

    @abstractmethod
    def _transaction(self) -> Iterator[Callable[[str, Any], Any]]:
        """A context manager: an ``execute(sql, params) -> cursor`` inside one transaction (named
        ``:params`` as a dict, or ``_mark`` ones as a sequence)."""

    @abstractmethod
    def _query(self, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]: ...

    def _written(self, execute: Callable[[str, Any], Any], run_ids: list[str]) -> None:
        """Called inside the transaction with the runs actually written (PostgreSQL notifies)."""

    @abstractmethod
    def _max_params(self) -> int:
        """Parameters one statement may carry."""

    def _lock_keys(self, execute: Callable[[str, Any], Any], keys: list[str]) -> None:
        """Called first in a batch's transaction with every run id it touches: keeps other writers
        off those runs until it commits (SQLite's transaction already holds the write lock)."""

    def _migrate_from(self, version: int, execute: Callable[[str], Any], reached: Callable[[int], Any]) -> None:
        """Bring a store at schema ``version`` to :data:`SCHEMA_VERSION`, inside the caller's
        transaction: ``execute`` runs one statement, ``reached`` records each version reached."""
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.display}: schema version {version} is newer than this agenteval knows "
                             f"({SCHEMA_VERSION}); upgrade agenteval")
        for number in range(version, SCHEMA_VERSION):
            for statement in MIGRATIONS[number]:
                execute(statement)
            reached(number + 1)
            log.info("store_migrated", store=self.display, to_version=number + 1)

    @abstractmethod
    def close(self) -> None: ...

    # --- shared logic ----------------------------------------------------------------------------
    def open(self, retry: bool = False) -> None:
        """Connect and migrate. ``retry`` (the collector): a store that cannot be reached now is not
        an error but opened later, by a thread that tries again with backoff (:data:`OPEN_RETRY`)
        and logs each change of state (``store_unavailable`` with why, ``store_opened``), not each
        attempt; meanwhile every read and write raises :class:`StoreUnavailable`. A store that
        refuses (:class:`StoreError`) raises either way."""
        try:
            self._connect()
        except StoreUnavailable as exc:
            if not retry:
                raise
            log.warning("store_unavailable", store=self.display, error=str(exc),
                        detail="spans are still accepted and journaled; runs are stored once it opens")
            self._opener = threading.Thread(target=self._open_later, args=(str(exc),), name="store-opener",
                                            daemon=True)
            self._opener.start()
            return
        self._opened.set()

    def _open_later(self, error: str) -> None:
        since, delay = time.monotonic(), OPEN_RETRY[0]
        while not self._closing.wait(delay):
            try:
                self._connect()
            except StoreError as exc:  # one that refuses too: it may be fixed meanwhile (a schema, a grant)
                if str(exc) != error:
                    error = str(exc)
                    log.warning("store_unavailable", store=self.display, error=error)
                delay = min(delay * 2, OPEN_RETRY[1])
                continue
            # Logged before anything can see it open (readiness, the first run stored): the log line
            # comes first in the log, as the change of state came first.
            log.info("store_opened", store=self.display, unavailable_for=round(time.monotonic() - since, 1))
            self._opened.set()
            return

    @property
    def is_open(self) -> bool:
        """False until the store has been opened (see :meth:`open`'s ``retry``)."""
        return self._opened.is_set()

    def wait_open(self, timeout: float) -> bool:
        return self._opened.wait(timeout)

    def _require_open(self) -> None:
        if not self._opened.is_set():
            raise StoreUnavailable(f"{self.display}: not open yet (it could not be reached when the collector started)")

    def _stop_opening(self) -> None:
        """First in :meth:`close`: no attempt to open is left running."""
        self._closing.set()
        if self._opener is not None:
            self._opener.join()

    def subscribe(self, subscriber: Subscriber, listening: Callable[[], bool] = lambda: True) -> None:
        """Call ``subscriber`` with the documents of runs written, once they are durable, while
        ``listening()`` says someone wants them (SQLite then skips building the documents).

        SQLite reports this process's own writes; PostgreSQL reports every writer's (LISTEN/NOTIFY).
        """
        self._subscribers.append((subscriber, listening))

    def _listening(self) -> bool:
        return any(listening() for _, listening in self._subscribers)

    def _notify(self, docs: list[dict[str, Any]]) -> None:
        for subscriber, listening in self._subscribers:
            if listening():
                subscriber(docs)

    def save(self, run: StoredRun) -> None:
        self.save_many([run])

    def save_many(self, runs: Iterable[StoredRun]) -> list[str]:
        """Write a batch in one transaction, as if each run were written alone and in order, in a
        few statements whatever its size; returns the ids of the runs written (stale revisions are
        not), in order."""
        start = time.time()
        rows = []
        for index, item in enumerate(runs):
            run = item.verdict
            doc = run_to_json(run, self.max_items, run_id=item.run_id, source=item.source,
                              finalized_by=item.finalized_by)
            now = start + index * 1e-6  # distinct times keep a batch's order in "newest first"
            rows.append((item.run_id, run.trace_id, run.subject, run.status.value, run.score, run.preset, item.source,
                         run.revision, int(run.incomplete), run.checked, run.unchecked, now, now,
                         doc.decode(), item.finalized_by, run.maf_release))
        if not rows:
            return []
        with self._transaction() as execute:
            limit = self._max_params()
            per_upsert, per_list = max(1, min(_ROWS_PER_STATEMENT, limit // _COLUMNS)), min(2 * _ROWS_PER_STATEMENT, limit)
            keys = list({row[0]: None for row in rows} | {row[1]: None for row in rows if row[1]})
            self._lock_keys(execute, keys)
            current: dict[str, tuple[int, bool]] = {}
            for part in _chunks(keys, per_list):
                for r in execute(_CURRENT.format(ids=_marks(self._mark, len(part))), part).fetchall():
                    current[r["run_id"]] = (r["revision"], bool(r["incomplete"]))
            written, groups = _plan(rows, current)
            for group in groups:
                for part in _chunks(group.rows, per_upsert):
                    execute(_upsert(len(part), self._mark), [value for row in part for value in row])
                for part in _chunks(list(group.superseded), per_list):
                    execute(_SUPERSEDE.format(ids=_marks(self._mark, len(part))), part)
            if written:
                self._written(execute, [rows[i][0] for i in written])
        if written and not self.notifies_all_writers and self._listening():
            self._notify([from_json(rows[i][13]) | {"created_at": None, "updated_at": rows[i][12]} for i in written])
        return [rows[i][0] for i in written]

    def list_runs(self, statuses: Iterable[str] = (), subject: str | None = None, limit: int = 50,
                  with_docs: bool = False, maf_release: str | None = None,
                  run_id_prefix: str | None = None) -> list[dict[str, Any]]:
        """Newest first; summary rows, or whole run documents with ``with_docs``. Several statuses
        are read as one index walk each, merged (``status IN`` read every run of those statuses and
        sorted them all, for the newest few). ``run_id_prefix`` (e.g. a trace id) scans the runs."""
        wanted = sorted({s.upper() for s in statuses})
        # a release is matched whole or as a prefix of dotted parts: 1.26 matches 1.26.0 and 1.26.1
        params: dict[str, Any] = {"limit": limit, "subject": subject, "release": maf_release,
                                  "releases": _like_prefix(f"{maf_release}.") if maf_release else None,
                                  "prefix": _like_prefix(run_id_prefix) if run_id_prefix else None,
                                  **{f"s{i}": s for i, s in enumerate(wanted)}}
        columns = f"{_DOC}, run_id" if with_docs else _SUMMARY
        newest = "ORDER BY updated_at DESC, run_id DESC LIMIT :limit"

        def walk(status: str | None) -> str:
            clauses = [c for c in (status and f"status = :{status}", subject and "subject = :subject",
                                   maf_release and "(maf_release = :release OR maf_release LIKE :releases ESCAPE '\\')",
                                   run_id_prefix and "run_id LIKE :prefix ESCAPE '\\'")
                       if c]
            return f"SELECT {columns} FROM runs {'WHERE ' + ' AND '.join(clauses) if clauses else ''} {newest}"

        if len(wanted) > 1:
            sql = " UNION ALL ".join(f"SELECT * FROM ({walk(f's{i}')}) AS s{i}" for i in range(len(wanted))) + f" {newest}"
        else:
            sql = walk("s0" if wanted else None)
        rows = self._query(sql, params)
        return [_doc(r) for r in rows] if with_docs else rows

    def _rows_in(self, sql: str, values: list[str]) -> Iterator[dict[str, Any]]:
        """The rows of ``sql`` whose ``{ids}`` stands for ``values``, a statement per chunk of them."""
        for part in _chunks(values, _ROWS_PER_STATEMENT):
            params = {f"v{i}": value for i, value in enumerate(part)}
            yield from self._query(sql.format(ids=", ".join(f":{name}" for name in params)), params)

    def revisions(self, run_ids: list[str]) -> dict[str, tuple[int, bool]]:
        """Run id -> (stored revision, incomplete) of those of these runs that are stored."""
        return {r["run_id"]: (r["revision"], bool(r["incomplete"])) for r in self._rows_in(_CURRENT, run_ids)}

    def traces_with_runs(self, trace_ids: list[str]) -> set[str]:
        """Those of these traces that have a run stored (a scan: for the few a shutdown cuts)."""
        return {r["trace_id"] for r in self._rows_in("SELECT DISTINCT trace_id FROM runs WHERE trace_id IN ({ids})",
                                                     trace_ids)}

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        """The stored run document; a unique prefix of the run id is enough. A whole id is looked up
        in the index; only an id no run has is matched as a prefix, which scans the runs (LIKE
        cannot use the index on either backend)."""
        rows = self._query(f"SELECT {_DOC} FROM runs WHERE run_id = :id", {"id": run_id})
        if not rows:
            rows = self._query(f"SELECT {_DOC} FROM runs WHERE run_id LIKE :prefix ESCAPE '\\' LIMIT 2",
                               {"prefix": _like_prefix(run_id)})
        return _doc(rows[0]) if len(rows) == 1 else None

    def missing_run(self, run_id: str, remote: bool = False) -> str:
        """Why :meth:`get_run` found nothing: no such run, or a prefix that names several. ``remote``:
        for a client of the collector's API, which is not told where the store is."""
        rows = self.runs_matching(run_id, 4)
        if len(rows) < 2:
            if remote:
                return f"no run {run_id!r} in this collector's store"
            return f"no run {run_id!r} in {self.display}: `agenteval runs list` shows the stored runs"
        more = " and more" if len(rows) > 3 else ""
        shown = ", ".join(rows[:3])
        return f"{run_id!r} matches several runs ({shown}{more}): give more characters of the run id"

    def runs_matching(self, prefix: str, limit: int) -> list[str]:
        """The ids of at most ``limit`` runs whose id starts with ``prefix``, in order (a scan)."""
        rows = self._query("SELECT run_id FROM runs WHERE run_id LIKE :prefix ESCAPE '\\' ORDER BY run_id LIMIT :limit",
                           {"prefix": _like_prefix(prefix), "limit": limit})
        return [r["run_id"] for r in rows]

    def docs(self, run_ids: Iterable[str]) -> list[dict[str, Any]]:
        ids = sorted(set(run_ids))
        if not ids:
            return []
        marks = ", ".join(f":r{i}" for i in range(len(ids)))
        return [_doc(r) for r in self._query(f"SELECT {_DOC} FROM runs WHERE run_id IN ({marks})",
                                             {f"r{i}": rid for i, rid in enumerate(ids)})]

    def updated_since(self, since: float, limit: int = 1000) -> list[dict[str, Any]]:
        return [_doc(r) for r in self._query(f"SELECT {_DOC} FROM runs WHERE updated_at >= :since "
                                             "ORDER BY updated_at LIMIT :limit", {"since": since, "limit": limit})]


class SeenRuns:
    """A bounded memory of (run id, revision) pairs, to drop notifications already delivered."""

    def __init__(self, size: int = 10_000) -> None:
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._size = size

    def fresh(self, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for doc in docs:
            key = (doc["run_id"], doc["revision"])
            if key in self._seen:
                continue
            self._seen[key] = None
            if len(self._seen) > self._size:
                self._seen.popitem(last=False)
            out.append(doc)
        return out
