"""The run store's interface (docs/design.md §5), which both backends implement and import:
embedded SQLite (WAL, ``sqlite``) by default, PostgreSQL (``postgres``) for a shared history.

One config value picks the backend (``store.url``: a file path, or a ``postgresql://`` URL). Both run
the same SQL, kept in rooms of one job each, which :class:`RunStore` puts behind one facade:

- ``schema``: the tables' versioned migrations, run on open, and the run-document keys added since;
- ``rules``: which verdict of a run is kept (the revision guard, in the upsert itself, so concurrent
  writers can neither lose nor duplicate a run; the keep, supersede and split rules);
- ``documents``: a run as its row and compressed document (``codec``), and the queries reading them;
- ``retention``: the oldest runs deleted in small batches, by a sweeper that owns its thread;
- ``parts``: parts of split traces handed between replicas (claim, renew, release, drop).

``sql`` is what the rooms need of a backend (:class:`collector.store.sql.Database`), ``errors`` how
the store fails.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import platformdirs
import structlog

from collector.core.serialize import MAX_ITEMS
from collector.store import documents, rules, schema
from collector.store import parts as split_parts
from collector.store.codec import pack, unpack
from collector.store.documents import StoredRun
from collector.store.errors import StoreError, StoreUnavailable
from collector.store.parts import Part
from collector.store.retention import Retainer, Retention, RetentionSweeper
from collector.store.sql import Execute

# pack, unpack and Part are imported from here by code written before the rooms (bench/, live/).
__all__ = ["INSTANCE_ENV", "OPEN_RETRY", "STORE_ENV", "Part", "RunStore", "Subscriber", "data_dir_store",
           "default_store_url", "instance_name", "is_postgres", "pack", "unpack"]

log = structlog.get_logger("agenteval.collector")

STORE_ENV = "AGENTEVAL_STORE"
#: Names this collector in each run's ``finalized_by`` (default: the host name), so replicas that
#: share a host and a store stay apart.
INSTANCE_ENV = "AGENTEVAL_INSTANCE"
#: Seconds between attempts to open a store that could not be reached at start: first, most.
OPEN_RETRY = (0.5, 10.0)

Subscriber = Callable[[list[dict[str, Any]]], None]


def instance_name() -> str:
    return os.environ.get(INSTANCE_ENV) or socket.gethostname()


def data_dir_store() -> Path:
    return Path(platformdirs.user_data_dir("agenteval")) / "runs.db"


def default_store_url() -> str:
    return os.environ.get(STORE_ENV) or str(data_dir_store())


def is_postgres(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


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
        self._retainer = Retainer(self, self._closing)
        self._sweeper: RetentionSweeper | None = None

    # --- backend hooks (collector.store.sql.Database) ----------------------------------------------
    #: The driver's positional parameter mark.
    _mark = "?"
    #: The database's type for bytes.
    _blob = "BLOB"

    @abstractmethod
    def _connect(self) -> None:
        """Connect and migrate: :class:`StoreUnavailable` when the store cannot be reached now,
        :class:`StoreError` when it refuses."""

    @abstractmethod
    def _transaction(self) -> AbstractContextManager[Execute]:
        """An ``execute(sql, params) -> cursor`` inside one transaction (named ``:params`` as a
        dict, or ``_mark`` ones as a sequence)."""

    @abstractmethod
    def _query(self, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]: ...

    def _written(self, execute: Execute, run_ids: list[str]) -> None:
        """Called inside the transaction with the runs actually written (PostgreSQL notifies)."""

    @abstractmethod
    def _max_params(self) -> int:
        """Parameters one statement may carry."""

    def _lock_keys(self, execute: Execute, keys: list[str]) -> None:
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

    # --- opening and closing -----------------------------------------------------------------------
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
            self._sweeper.stop()

    # --- retention (collector.store.retention) -------------------------------------------------------
    def oldest(self) -> float | None:
        """When the oldest stored run was last written (unix seconds): how far back the history goes."""
        return self._retainer.oldest()

    def history(self, max_age: float | None = None, now: float | None = None) -> str:
        """How far back the stored runs go, for people (``runs list``, the run page), with the
        retention's maximum age when the caller knows it (the collector's config)."""
        return self._retainer.history(max_age, now)

    def sweep(self, retention: Retention, now: float | None = None) -> int:
        """One pass of retention (:meth:`Retainer.sweep`); returns how many runs it deleted."""
        return self._retainer.sweep(retention, now)

    def start_sweeping(self, retention: Retention, on_deleted: Callable[[int], None] = lambda n: None) -> None:
        """Sweep every ``retention.interval`` seconds on a thread of its own (a
        :class:`RetentionSweeper`, stopped by :meth:`close`), keeping :attr:`size` and
        :attr:`oldest_kept` current for the metrics and telling ``on_deleted`` how many runs each
        batch deleted. A store has one sweeper: a second call changes nothing."""
        if self._sweeper is not None:
            return
        self._retainer.on_deleted = on_deleted
        self._sweeper = RetentionSweeper(self._retainer, retention, self.wait_open)
        self._sweeper.start()

    @property
    def runs_deleted(self) -> int:
        return self._retainer.runs_deleted

    @property
    def size(self) -> int:
        """The store's size on disk as of the sweeper's last pass (0 before it)."""
        return self._retainer.size

    @property
    def oldest_kept(self) -> float | None:
        """When the oldest run was last written, as of the sweeper's last pass (None before it)."""
        return self._retainer.oldest_kept

    @property
    def longest_batch(self) -> float:
        """The longest batch a sweep took (s) since the sweeper's last pass began."""
        return self._retainer.longest_batch

    # --- change notification ---------------------------------------------------------------------
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

    # --- writing runs (collector.store.rules) ------------------------------------------------------
    def save(self, run: StoredRun) -> None:
        self.save_many([run])

    def save_many(self, runs: Iterable[StoredRun]) -> list[str]:
        """Write a batch in one transaction, as if each run were written alone and in order, in a
        few statements whatever its size; returns the ids of the runs written (stale revisions are
        not), in order. The parts the runs merged (:attr:`StoredRun.parts`) leave the store in it,
        written or stale: the store's rules decided on the verdict holding them."""
        start = time.time()
        rows: list[rules.Row] = []
        merged: list[str] = []
        for index, run in enumerate(runs):
            merged.extend(run.parts)
            rows.append(rules.to_row(run, start + index * 1e-6, self.max_items))  # distinct times keep a batch's order
        if not rows:
            return []
        with self._transaction() as execute:
            written = rules.write(self, execute, rows)
            split_parts.drop(execute, self._mark, merged)
            run_ids: list[str] = [row[0] for row in written]
            if run_ids:
                self._written(execute, run_ids)
        if written and not self.notifies_all_writers and self._listening():
            self._notify(rules.published(written))
        return run_ids

    def flag_split(self, trace_id: str, note: str) -> list[str]:
        """Flag every stored run of a trace ``split`` (docs/scale-out.md): spans of it reached
        another replica and could not be merged into it, so units may be missing: a PASS becomes a
        WARN, the note says which replica held which part, as a new revision. Returns the run ids."""
        return rules.flag_split(self, trace_id, note)

    def revisions(self, run_ids: list[str]) -> dict[str, tuple[int, bool]]:
        """Run id -> (stored revision, incomplete) of those of these runs that are stored."""
        return rules.revisions(self, run_ids)

    # --- parts of split traces (collector.store.parts) -----------------------------------------------
    def hand_over(self, parts: list[Part]) -> None:
        """Store parts for the replica holding their traces' roots to merge (:meth:`claim_parts`)."""
        split_parts.hand_over(self, parts)

    def waiting_parts(self, lease: float, limit: int = 10_000) -> list[Part]:
        """The parts any replica may claim (:meth:`claim_parts`), oldest first, without their records
        (a cheap poll: the table is empty while no trace is split)."""
        return split_parts.waiting(self, lease, limit)

    def claim_parts(self, trace_ids: list[str], claimer: str, lease: float) -> list[Part]:
        """Claim for ``claimer`` every part of these traces that is not claimed, or whose claim is
        older than ``lease`` seconds (its claimer is gone), with its records: each part goes to one
        claimer at a time. A claim marks the part, it does not take it: the part leaves the store
        with the run that merged it (:attr:`StoredRun.parts`) or when dropped (:meth:`drop_parts`);
        its claimer keeps the claim fresh while it lives (:meth:`renew_claims`), and releases it
        when it stops, or when it starts again after being killed (:meth:`release_claims`)."""
        return split_parts.claim(self, trace_ids, claimer, lease)

    def renew_claims(self, part_ids: list[str], claimer: str) -> None:
        """``claimer`` lives on: its claims on these parts are fresh again (one taken over meanwhile
        stays the other claimer's)."""
        split_parts.renew(self, part_ids, claimer)

    def release_claims(self, claimer: str, part_ids: list[str] | None = None) -> None:
        """``claimer``'s claims (on these parts, else all of them) are withdrawn: the parts wait again,
        for any replica to claim at once."""
        split_parts.release(self, claimer, part_ids)

    def drop_parts(self, part_ids: list[str]) -> None:
        """Delete parts whose claimer merged them into no new run (their spans make none)."""
        with self._transaction() as execute:
            split_parts.drop(execute, self._mark, part_ids)

    # --- reading runs (collector.store.documents) --------------------------------------------------
    def list_runs(self, statuses: Iterable[str] = (), subject: str | None = None, limit: int = 50,
                  with_docs: bool = False, maf_release: str | None = None,
                  run_id_prefix: str | None = None, since: float | None = None) -> list[dict[str, Any]]:
        """Newest first; summary rows, or whole run documents with ``with_docs``. ``maf_release``
        matches a release whole or as a prefix of dotted parts (1.26: 1.26.0 and 1.26.1).
        ``run_id_prefix`` (e.g. a trace id) scans the runs. ``since``: only runs written at or after
        it (Unix seconds)."""
        return documents.list_runs(self, statuses, subject, limit, with_docs, maf_release, run_id_prefix, since)

    def count_by_status(self, subject: str | None = None, since: float | None = None) -> dict[str, int]:
        """How many runs of each status (every status, 0 where none), of one subject or all, written
        at or after ``since`` (Unix seconds) or ever."""
        return documents.count_by_status(self, subject, since)

    def traces_with_runs(self, trace_ids: list[str]) -> set[str]:
        """Those of these traces that have a run stored (a scan: for the few a shutdown cuts)."""
        return documents.traces_with_runs(self, trace_ids)

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        """The stored run document; a unique prefix of the run id is enough."""
        return documents.get_run(self, run_id)

    def missing_run(self, run_id: str, remote: bool = False) -> str:
        """Why :meth:`get_run` found nothing: no such run, or a prefix that names several. ``remote``:
        for a client of the collector's API, which is not told where the store is."""
        return documents.missing_run(self, run_id, remote)

    def runs_matching(self, prefix: str, limit: int) -> list[str]:
        """The ids of at most ``limit`` runs whose id starts with ``prefix``, in order (a scan)."""
        return documents.runs_matching(self, prefix, limit)

    def docs(self, run_ids: Iterable[str]) -> list[dict[str, Any]]:
        return documents.docs(self, run_ids)

    def updated_since(self, since: float, limit: int = 1000) -> list[dict[str, Any]]:
        return documents.updated_since(self, since, limit)
