"""The run store's interface (docs/design.md §5), which both backends implement and import:
embedded SQLite (WAL, ``sqlite``) by default, PostgreSQL (``postgres``) for a shared history.

One config value picks the backend (``store.url``: a file path, or a ``postgresql://`` URL). Both run
the same SQL (named ``:params``, or the driver's positional mark for the batched writes), the same
versioned migrations on open (refusing a schema newer than this code), and the same revision guard:
a run is replaced only by a higher revision, in the upsert itself, so concurrent writers can neither
lose nor duplicate a run.

Rows hold verdicts and evidence (numbers, reasons, span ids), never prompt or response text: the
classifier never extracts any, so there is none to store. A run is one row: its summary columns
(what the lists filter and sort on) and its document, compressed JSON (``body``: zstd; zlib in stores written before), which holds
every unit's verdict and evidence once (docs/store.md).

Retention (:meth:`RunStore.sweep`): the oldest runs are deleted in small batches, by age and by the
store's size, never a run still within its late window.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import platformdirs
import structlog

from collector.core.model import RunVerdict, Status
from collector.core.serialize import MAX_ITEMS, from_json, run_to_json, to_json
from collector.store import schema
from collector.store.codec import pack, unpack
from collector.store.errors import RETRY_READ_AFTER, UNREADABLE, StoreError, StoreUnavailable
from collector.store.schema import add_missing_keys

log = structlog.get_logger("agenteval.collector")

STORE_ENV = "AGENTEVAL_STORE"
#: Names this collector in each run's ``finalized_by`` (default: the host name), so replicas that
#: share a host and a store stay apart.
INSTANCE_ENV = "AGENTEVAL_INSTANCE"

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
#: The oldest runs last written before a time (an index walk: runs_by_time), and their deletion,
#: which checks the time again: a revision written meanwhile made the run young.
_OLDEST = "SELECT run_id FROM runs WHERE updated_at < :before ORDER BY updated_at LIMIT :limit"
_DELETE = "DELETE FROM runs WHERE run_id IN ({ids}) AND updated_at < {mark}"
#: Rows per upsert at most; fewer where the database allows fewer parameters (a row has 18).
_ROWS_PER_STATEMENT = 256
_COLUMNS = 18


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
            "unchecked, created_at, updated_at, finalized_by, maf_release, unreported_usd")
_DOC = "body, revision, created_at, updated_at, finalized_by"


#: A row's values, in the order of the upsert's columns.
_Row = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Held:
    """What the store holds of a run, as far as the write rules need it."""

    revision: int
    incomplete: bool
    finalized_by: str | None = None
    #: The run's unit names (None: a run stored before they were kept, or not known).
    units: frozenset[str] | None = None


def _units(text: str | None) -> frozenset[str] | None:
    return None if text is None else frozenset(text.split("\n")) - {""}


def unit_names(run: RunVerdict) -> str:
    """The ``units`` column: a run's unit names, one a line."""
    return "\n".join(sorted({e.executor_id for e in run.executors}))


def keeps(stored: Held | None, units: frozenset[str], finalized_by: str | None) -> bool:
    """Whether ``stored`` is kept against a verdict of the same run from ``finalized_by`` holding
    ``units``, whatever its revision: another instance's verdict lacking a unit the stored run has is
    a part of the trace (a replica that got only some of its spans, a tail read again after a Kafka
    rebalance), never written over the whole. A replica's own later revisions hold all it held."""
    return (stored is not None and stored.units is not None and stored.finalized_by is not None
            and stored.finalized_by != finalized_by and not stored.units <= units)


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


def _plan(rows: list[_Row], current: dict[str, Held]) -> tuple[list[int], list[_Group]]:
    """Which rows of a batch are written (by index), applying the revision guard and :func:`keeps`
    in order against ``current`` (run id -> what is stored), and the statements that write them.

    Exact because no other writer changes these runs meanwhile: SQLite's transaction holds the write
    lock, PostgreSQL's takes :meth:`RunStore._lock_keys`.
    """
    written: list[int] = []
    groups = [_Group()]
    for index, row in enumerate(rows):
        run_id, trace_id, revision, incomplete, finalized_by = row[0], row[1], row[7], bool(row[8]), row[14]
        units = _units(row[16]) or frozenset()
        before = current.get(run_id)
        if not replaces(before and (before.revision, before.incomplete), revision, incomplete):
            continue  # an equal or newer revision is stored
        if keeps(before, units, finalized_by):
            continue  # a part of the trace: the whole stays
        current[run_id] = Held(revision if before is None or revision > before.revision else before.revision + 1,
                               incomplete, finalized_by, units)
        cut = current.get(trace_id) if trace_id and trace_id != run_id and not incomplete else None
        supersedes = trace_id if cut is not None and cut.incomplete and cut.units is not None and cut.units <= units else None
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


#: Seconds between attempts to open a store that could not be reached at start: first, most.
OPEN_RETRY = (0.5, 10.0)


@dataclass(frozen=True, slots=True)
class Retention:
    """What the store keeps (``store.retention``, docs/store.md): runs written within ``max_age``
    seconds, the newest first within ``max_size`` bytes; never one written within ``late_window``
    seconds (``assembly.late_window``), which may still get a revision. None: no such bound."""

    max_age: float | None = 14 * 86400.0
    max_size: int | None = None
    late_window: float = 300.0
    #: Seconds between the sweeper's passes.
    interval: float = 60.0
    #: Runs deleted per transaction: the longest the sweeper holds the write lock (measured in
    #: bench/store_size.py and logged by each pass as ``longest_batch_ms``).
    batch: int = 200


#: Over ``max_size``, the sweeper deletes down to this share of it, so the runs written until its
#: next pass fit under the cap too.
LOW_WATER = 0.9
#: Seconds the sweeper waits between two batches of a pass, so writers and readers queued on the
#: store go first.
BATCH_PAUSE = 0.005


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
        return self.verdict.trace_id if self.verdict is not None else self.columns[0]  # type: ignore[index]


def run_columns(run: RunVerdict) -> tuple[Any, ...]:
    """The ``runs`` columns a verdict gives (:meth:`RunStore.save_many` puts the rest around them):
    trace id, subject, status, score, preset, revision, incomplete, checked, unchecked, MAF release,
    unit names, unreported spend."""
    return (run.trace_id, run.subject, run.status.value, run.score, run.preset, run.revision, int(run.incomplete),
            run.checked, run.unchecked, run.maf_release, unit_names(run),
            run.spend.unreported_usd if run.spend is not None else None)


Subscriber = Callable[[list[dict[str, Any]]], None]


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


def instance_name() -> str:
    return os.environ.get(INSTANCE_ENV) or socket.gethostname()


def data_dir_store() -> Path:
    return Path(platformdirs.user_data_dir("agenteval")) / "runs.db"


def default_store_url() -> str:
    return os.environ.get(STORE_ENV) or str(data_dir_store())


def is_postgres(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


def _doc(row: dict[str, Any]) -> dict[str, Any]:
    doc = from_json(unpack(row["body"]))
    add_missing_keys(doc)
    doc.update(created_at=row["created_at"], updated_at=row["updated_at"], finalized_by=row["finalized_by"],
               revision=row["revision"])  # the store may have raised it past the verdict's own
    return doc


def _days(seconds: float) -> str:
    """A span of time in days, hours or minutes, whichever reads best."""
    for unit, size in (("days", 86400), ("hours", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.3g} {unit}"
    return f"{max(seconds, 0):.0f} s"


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
        self._sweeper: threading.Thread | None = None
        #: Told how many runs each sweeper batch deleted (start_sweeping: the metric).
        self._on_deleted: Callable[[int], None] | None = None
        #: Retention's figures: runs deleted, the store's size on disk and when its oldest run was
        #: last written, as of the sweeper's last pass (0 / None before it), its longest batch (s).
        self.runs_deleted = 0
        self.size = 0
        self.oldest_kept: float | None = None
        self.longest_batch = 0.0

    # --- backend hooks ---------------------------------------------------------------------------
    #: The driver's positional parameter mark.
    _mark = "?"
    #: The database's type for bytes.
    _blob = "BLOB"

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

    def _migrate_from(self, version: int, execute: Callable[..., Any], reached: Callable[[int], Any]) -> None:
        """Bring a store at schema ``version`` to the current one inside the caller's transaction
        (:func:`collector.store.schema.migrate`)."""
        schema.migrate(self.display, version, execute, reached, self._mark, self._blob)

    def _reclaim(self) -> None:
        """Called after a transaction deleted runs: give their space back (SQLite)."""

    @abstractmethod
    def size_bytes(self) -> int:
        """What the store takes on disk (the ``agenteval_store_bytes`` metric)."""

    @abstractmethod
    def _usage(self) -> tuple[int, int]:
        """(bytes the stored runs take, how many there are): what ``max_size`` bounds."""

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
        """First in :meth:`close`: no attempt to open (and no sweep) is left running."""
        self._closing.set()
        if self._opener is not None:
            self._opener.join()
        if self._sweeper is not None:
            self._sweeper.join()

    # --- retention -------------------------------------------------------------------------------
    def oldest(self) -> float | None:
        """When the oldest stored run was last written (unix seconds): how far back the history goes."""
        rows = self._query("SELECT MIN(updated_at) AS oldest FROM runs", {})
        return rows[0]["oldest"] if rows else None

    def history(self, max_age: float | None = None, now: float | None = None) -> str:
        """How far back the stored runs go, for people (``runs list``, the run page), with the
        retention's maximum age when the caller knows it (the collector's config)."""
        oldest = self.oldest()
        kept = f"; runs are kept {_days(max_age)} (store.retention.max_age)" if max_age else ""
        if oldest is None:
            return f"no runs stored{kept}"
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(oldest))
        return f"history goes back to {since} ({_days((time.time() if now is None else now) - oldest)} ago){kept}"

    def sweep(self, retention: Retention, now: float | None = None) -> int:
        """One pass of retention: delete the runs last written more than ``max_age`` ago, then the
        oldest runs until the store is within :data:`LOW_WATER` of ``max_size``; never a run written
        within the late window. In batches of ``retention.batch`` runs, a transaction each, so a
        writer or reader waits at most one batch. Returns how many runs it deleted."""
        now = time.time() if now is None else now
        young = now - retention.late_window
        deleted = 0
        if retention.max_age is not None:
            deleted += self._delete_before(min(now - retention.max_age, young), retention.batch)
        if retention.max_size is not None:
            used, runs = self._usage()
            if used > retention.max_size and runs:
                excess = used - retention.max_size * LOW_WATER
                wanted = min(runs, -int(-excess * runs // used))  # runs of the average size, rounded up
                gone = self._delete_before(young, retention.batch, wanted)
                deleted += gone
                if gone < wanted:
                    log.warning("store_over_max_size", store=self.display, max_size=retention.max_size, used=used,
                                detail="every run left is within its late window (assembly.late_window)")
        return deleted

    def _delete_before(self, before: float, batch: int, at_most: int | None = None) -> int:
        deleted = 0
        while at_most is None or deleted < at_most:
            limit = batch if at_most is None else min(batch, at_most - deleted)
            ids = [r["run_id"] for r in self._query(_OLDEST, {"before": before, "limit": limit})]
            if not ids:
                break
            started = time.perf_counter()
            with self._transaction() as execute:
                self._lock_keys(execute, ids)  # a revision being written finishes first (then is young)
                gone = execute(_DELETE.format(ids=_marks(self._mark, len(ids)), mark=self._mark), [*ids, before]).rowcount
            self._reclaim()
            self.longest_batch = max(self.longest_batch, time.perf_counter() - started)
            deleted += gone
            self.runs_deleted += gone
            if gone and self._on_deleted is not None:  # counted per batch: the metric keeps up with the store
                self._on_deleted(gone)
            if len(ids) < limit or self._closing.wait(BATCH_PAUSE):
                break
        return deleted

    def start_sweeping(self, retention: Retention, on_deleted: Callable[[int], None] = lambda n: None) -> None:
        """Sweep every ``retention.interval`` seconds on a thread of its own (stopped by
        :meth:`close`), keeping :attr:`size` and :attr:`oldest_kept` current for the metrics. A
        store has one sweeper: a second call changes nothing."""
        if self._sweeper is not None:
            return
        self._on_deleted = on_deleted
        self._sweeper = threading.Thread(target=self._sweep_forever, args=(retention,),
                                         name="store-sweeper", daemon=True)
        self._sweeper.start()

    def _sweep_forever(self, retention: Retention) -> None:
        while not self._opened.wait(0.5):
            if self._closing.is_set():
                return
        while not self._closing.is_set():
            started, self.longest_batch = time.perf_counter(), 0.0
            try:
                deleted = self.sweep(retention)
                self.size, self.oldest_kept = self.size_bytes(), self.oldest()
            except StoreError as exc:
                log.warning("store_sweep_failed", store=self.display, error=str(exc), retry_in=retention.interval)
            else:
                if deleted:
                    log.info("store_swept", store=self.display, deleted=deleted, size_bytes=self.size,
                             oldest_kept=self.oldest_kept, seconds=round(time.perf_counter() - started, 3),
                             longest_batch_ms=round(self.longest_batch * 1000, 1))
            self._closing.wait(retention.interval)

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
        not), in order. The parts the runs merged (:attr:`StoredRun.parts`) leave the store in it,
        written or stale: the store's rules decided on the verdict holding them."""
        start = time.time()
        rows, parts = [], []
        for index, item in enumerate(runs):
            parts.extend(item.parts)
            c = item.columns
            if c is None or item.body is None:
                assert item.verdict is not None
                item = StoredRun.packed(item.run_id, item.source, item.verdict, item.finalized_by, item.parts,
                                        self.max_items)
                c = item.columns
            now = start + index * 1e-6  # distinct times keep a batch's order in "newest first"
            rows.append((item.run_id, c[0], c[1], c[2], c[3], c[4], item.source, c[5], c[6], c[7], c[8], now, now,
                         item.body, item.finalized_by, c[9], c[10], c[11]))
        if not rows:
            return []
        with self._transaction() as execute:
            limit = self._max_params()
            per_upsert, per_list = max(1, min(_ROWS_PER_STATEMENT, limit // _COLUMNS)), min(2 * _ROWS_PER_STATEMENT, limit)
            keys = list({row[0]: None for row in rows} | {row[1]: None for row in rows if row[1]})
            self._lock_keys(execute, keys)
            current: dict[str, Held] = {}
            for part in _chunks(keys, per_list):
                for r in execute(_CURRENT.format(ids=_marks(self._mark, len(part))), part).fetchall():
                    current[r["run_id"]] = Held(r["revision"], bool(r["incomplete"]), r["finalized_by"],
                                                _units(r["units"]))
            written, groups = _plan(rows, current)
            for group in groups:
                for part in _chunks(group.rows, per_upsert):
                    execute(_upsert(len(part), self._mark), [value for row in part for value in row])
                for part in _chunks(list(group.superseded), per_list):
                    execute(_SUPERSEDE.format(ids=_marks(self._mark, len(part))), part)
            self._drop_parts(execute, parts)
            if written:
                self._written(execute, [rows[i][0] for i in written])
        if written and not self.notifies_all_writers and self._listening():
            # (the bodies were packed where the runs were published: unpacked only for a listener)
            self._notify([from_json(unpack(rows[i][13])) | {"created_at": None, "updated_at": rows[i][12]}
                          for i in written])
        return [rows[i][0] for i in written]

    def hand_over(self, parts: list[Part]) -> None:
        """Store parts for the replica holding their traces' roots to merge (:meth:`claim_parts`)."""
        if not parts:
            return
        now = time.time()
        with self._transaction() as execute:
            for part in parts:
                execute("INSERT INTO parts (part_id, trace_id, held_by, has_root, spans, created_at, records) "
                        "VALUES (:part_id, :trace_id, :held_by, :has_root, :spans, :created_at, :records)",
                        {"part_id": part.part_id or f"{part.held_by}/{part.trace_id}/{uuid.uuid4().hex}",
                         "trace_id": part.trace_id, "held_by": part.held_by, "has_root": int(part.has_root),
                         "spans": part.spans, "created_at": part.created_at or now, "records": part.records.decode()})

    def waiting_parts(self, lease: float, limit: int = 10_000) -> list[Part]:
        """The parts any replica may claim (:meth:`claim_parts`), oldest first, without their records
        (a cheap poll: the table is empty while no trace is split)."""
        return [_part(r) for r in self._query(f"SELECT {_PART} FROM parts WHERE {_WAITING} ORDER BY created_at "
                                              "LIMIT :limit", {"limit": limit, "stale": time.time() - lease})]

    def claim_parts(self, trace_ids: list[str], claimer: str, lease: float) -> list[Part]:
        """Claim for ``claimer`` every part of these traces that is not claimed, or whose claim is
        older than ``lease`` seconds (its claimer is gone), with its records: each part goes to one
        claimer at a time. A claim marks the part, it does not take it: the part leaves the store
        with the run that merged it (:attr:`StoredRun.parts`) or when dropped (:meth:`drop_parts`);
        its claimer keeps the claim fresh while it lives (:meth:`renew_claims`), and releases it
        when it stops, or when it starts again after being killed (:meth:`release_claims`)."""
        out: list[Part] = []
        now = time.time()
        for chunk in _chunks(sorted(set(trace_ids)), _ROWS_PER_STATEMENT):
            params = {f"t{i}": t for i, t in enumerate(chunk)}
            with self._transaction() as execute:
                rows = execute(f"UPDATE parts SET claimed_by = :claimer, claimed_at = :now "
                               f"WHERE trace_id IN ({', '.join(':' + k for k in params)}) AND {_WAITING} "
                               f"RETURNING {_PART}, records",
                               {**params, "claimer": claimer, "now": now, "stale": now - lease}).fetchall()
            out.extend(_part(dict(r)) for r in rows)
        return sorted(out, key=lambda p: p.created_at)

    def renew_claims(self, part_ids: list[str], claimer: str) -> None:
        """``claimer`` lives on: its claims on these parts are fresh again (one taken over meanwhile
        stays the other claimer's)."""
        now = time.time()
        with self._transaction() as execute:
            for chunk in _chunks(sorted(part_ids), _ROWS_PER_STATEMENT):
                execute(f"UPDATE parts SET claimed_at = {self._mark} WHERE claimed_by = {self._mark} "
                        f"AND part_id IN ({_marks(self._mark, len(chunk))})", [now, claimer, *chunk])

    def release_claims(self, claimer: str, part_ids: list[str] | None = None) -> None:
        """``claimer``'s claims (on these parts, else all of them) are withdrawn: the parts wait again,
        for any replica to claim at once."""
        with self._transaction() as execute:
            if part_ids is None:
                execute("UPDATE parts SET claimed_by = NULL, claimed_at = NULL WHERE claimed_by = :claimer",
                        {"claimer": claimer})
                return
            for chunk in _chunks(sorted(part_ids), _ROWS_PER_STATEMENT):
                execute(f"UPDATE parts SET claimed_by = NULL, claimed_at = NULL WHERE claimed_by = {self._mark} "
                        f"AND part_id IN ({_marks(self._mark, len(chunk))})", [claimer, *chunk])

    def drop_parts(self, part_ids: list[str]) -> None:
        """Delete parts whose claimer merged them into no new run (their spans make none)."""
        with self._transaction() as execute:
            self._drop_parts(execute, part_ids)

    def _drop_parts(self, execute: Callable[[str, Any], Any], part_ids: list[str]) -> None:
        for chunk in _chunks(sorted(set(part_ids)), _ROWS_PER_STATEMENT):
            execute(f"DELETE FROM parts WHERE part_id IN ({_marks(self._mark, len(chunk))})", chunk)

    def flag_split(self, trace_id: str, note: str) -> list[str]:
        """Flag every stored run of a trace ``split`` (docs/scale-out.md): spans of it reached
        another replica and could not be merged into it, so units may be missing: a PASS becomes a
        WARN, the note says which replica held which part, as a new revision. Returns the run ids."""
        flagged = []
        with self._transaction() as execute:
            self._lock_keys(execute, [trace_id])
            rows = execute("SELECT run_id, revision, status, body FROM runs WHERE trace_id = :t",
                           {"t": trace_id}).fetchall()
            for row in rows:
                doc = from_json(unpack(row["body"]))
                if note in doc.get("notes", []):
                    continue
                status = "WARN" if row["status"] == "PASS" else row["status"]
                doc.update(status=status, split=True, notes=[*doc.get("notes", []), note], revision=row["revision"] + 1)
                execute("UPDATE runs SET status = :status, revision = :revision, body = :body, "
                        "updated_at = :now WHERE run_id = :id",
                        {"status": status, "revision": row["revision"] + 1, "body": pack(to_json(doc)),
                         "now": time.time(), "id": row["run_id"]})
                flagged.append(row["run_id"])
            if flagged:
                self._written(execute, flagged)
        return flagged

    def list_runs(self, statuses: Iterable[str] = (), subject: str | None = None, limit: int = 50,
                  with_docs: bool = False, maf_release: str | None = None,
                  run_id_prefix: str | None = None, since: float | None = None) -> list[dict[str, Any]]:
        """Newest first; summary rows, or whole run documents with ``with_docs``. Several statuses
        are read as one index walk each, merged (``status IN`` read every run of those statuses and
        sorted them all, for the newest few). ``run_id_prefix`` (e.g. a trace id) scans the runs.
        ``since``: only runs written at or after it (Unix seconds)."""
        wanted = sorted({s.upper() for s in statuses})
        # a release is matched whole or as a prefix of dotted parts: 1.26 matches 1.26.0 and 1.26.1
        params: dict[str, Any] = {"limit": limit, "subject": subject, "release": maf_release,
                                  "releases": _like_prefix(f"{maf_release}.") if maf_release else None,
                                  "prefix": _like_prefix(run_id_prefix) if run_id_prefix else None,
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
        rows = self._query(sql, params)
        return [_doc(r) for r in rows] if with_docs else rows

    def count_by_status(self, subject: str | None = None, since: float | None = None) -> dict[str, int]:
        """How many runs of each status (every status, 0 where none), of one subject or all, written
        at or after ``since`` (Unix seconds) or ever."""
        clauses = [c for c in (subject and "subject = :subject", since is not None and "updated_at >= :since") if c]
        rows = self._query(f"SELECT status, COUNT(*) AS n FROM runs {'WHERE ' + ' AND '.join(clauses) if clauses else ''} "
                           "GROUP BY status", {"subject": subject, "since": since})
        counts = dict.fromkeys((s.value for s in Status), 0)
        counts.update({r["status"]: int(r["n"]) for r in rows})
        return counts

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
