"""The SQLite backend of the run store (docs/design.md §5): one embedded WAL file, the default.

The file gives deleted runs' space back (``auto_vacuum=INCREMENTAL``, the free pages released after
each of the sweeper's batches); a store made before that mode is switched once, by a VACUUM when it
is opened.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import structlog

from collector.store.base import STORE_ENV, RunStore, data_dir_store
from collector.store.errors import StoreError, StoreUnavailable

log = structlog.get_logger("agenteval.collector")


#: A run's row (its compressed document, ~2 KB) fits three to a page of 8 KiB, where a 4 KiB page
#: (SQLite's default) held one, half empty: ~20% less disk a run (bench/store_size.py).
PAGE_SIZE = 8192

#: Seconds between a SQLite store's background WAL checkpoints (see :meth:`SqliteRunStore._checkpoint_forever`).
CHECKPOINT_INTERVAL = 1.0


class SqliteRunStore(RunStore):
    """Thread-safe: one connection behind a lock; writes of a batch share one transaction."""

    def __init__(self, path: Path | str) -> None:
        super().__init__()
        self.path = Path(path)
        self.display = str(self.path)
        self._lock = threading.Lock()
        self._checkpointer: threading.Thread | None = None
        self._db: sqlite3.Connection | None = None

    @property
    def _conn(self) -> sqlite3.Connection:
        """The connection, once opened (callers run after :meth:`_require_open` or :meth:`_connect`)."""
        if self._db is None:
            raise StoreUnavailable(f"{self.display}: not open")
        return self._db

    def _connect(self) -> None:
        parent = self.path.parent
        if self.path.is_dir():
            raise StoreError(f"{self.path}: is a directory: the SQLite store is a file, e.g. {self.path / 'runs.db'}")
        # a typo must not silently start a new, empty store
        if not parent.is_dir() and self.path != data_dir_store():
            raise StoreError(f"{self.path}: directory {parent} does not exist: create it (mkdir -p {parent}) "
                             f"or fix the store path (--store, store.url or ${STORE_ENV})")
        db = None
        try:
            parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            db.row_factory = sqlite3.Row
            # these two first: they take effect on a new file only (an older one: _incremental_vacuum)
            for pragma in (f"page_size={PAGE_SIZE}", "auto_vacuum=INCREMENTAL", "journal_mode=WAL",
                           "synchronous=NORMAL", "foreign_keys=ON", "busy_timeout=5000",
                           "wal_autocheckpoint=0"):  # checkpoints run beside the writer: _checkpoint_forever
                db.execute(f"PRAGMA {pragma}")
            self._migrate(db)
            self._incremental_vacuum(db)
            self._inode = os.stat(self.path).st_ino
        except (sqlite3.Error, OSError, StoreError) as exc:
            if db is not None:
                db.close()
            if isinstance(exc, StoreError):
                raise
            # another process's write transaction holds the file past busy_timeout: it can end
            code = getattr(exc, "sqlite_errorcode", None) or 0
            locked = (code & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
            raise (StoreUnavailable if locked else StoreError)(f"{self.path}: {exc}") from exc
        self._db = db

    def _still_there(self) -> None:
        """A store file deleted or replaced under a running collector would swallow every later write
        unseen: reopen the path (a new, migrated store), and say so."""
        try:
            same = os.stat(self.path).st_ino == self._inode
        except OSError:
            same = False
        if not same:
            log.error("store_replaced", store=self.display,
                      detail="the store file was deleted or replaced while in use; reopened at the same path")
            self._conn.close()
            self._connect()

    def _migrate(self, db: sqlite3.Connection) -> None:
        db.execute("BEGIN IMMEDIATE")
        try:
            self._migrate_from(db.execute("PRAGMA user_version").fetchone()[0], db.execute,
                               lambda number: db.execute(f"PRAGMA user_version={number}"))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _incremental_vacuum(self, db: sqlite3.Connection) -> None:
        """Switch a store made before retention to incremental auto-vacuum, so deleted runs give
        their pages back to the file system, and to :data:`PAGE_SIZE`: that takes a VACUUM (a copy
        of the file: time, and as much free disk again), once, out of WAL mode (the page size
        cannot change in it) when no other process has the store open, else in it, keeping the
        page size. If it cannot run now (another process writes, the disk is full), the store works
        on, deleted runs' pages reused for new runs but not given back, and the next open tries again."""
        if db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2:
            return
        started = time.monotonic()
        try:
            alone = db.execute("PRAGMA journal_mode=DELETE").fetchone()[0] == "delete"
            try:
                db.execute("VACUUM")
            finally:
                db.execute("PRAGMA journal_mode=WAL")
        except sqlite3.Error as exc:
            log.warning("store_vacuum_failed", store=self.display, error=str(exc),
                        detail="deleted runs' space is reused but not given back; retried when the store is next "
                               "opened")
            return
        log.info("store_vacuumed", store=self.display, auto_vacuum="incremental",
                 page_size=db.execute("PRAGMA page_size").fetchone()[0], alone=alone,
                 seconds=round(time.monotonic() - started, 2))

    def _reclaim(self) -> None:
        """Give the free pages back to the file system, as a transaction of its own: the driver
        steps ``execute``'s PRAGMA once (one page), ``executescript`` steps it to the end."""
        with self._lock:
            try:
                self._conn.executescript("PRAGMA incremental_vacuum")
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: {exc}") from exc

    def size_bytes(self) -> int:
        total = 0
        for suffix in ("", "-wal"):
            with contextlib.suppress(OSError):
                total += os.stat(f"{self.path}{suffix}").st_size
        return total

    def _usage(self) -> tuple[int, int]:
        pages, free, size, runs = (self._query(sql, {})[0]["n"] for sql in (
            "SELECT page_count AS n FROM pragma_page_count()",
            "SELECT freelist_count AS n FROM pragma_freelist_count()",
            "SELECT page_size AS n FROM pragma_page_size()", "SELECT COUNT(*) AS n FROM runs"))
        return (pages - free) * size, runs

    def _checkpoint_forever(self) -> None:
        """Copy the WAL into the database file every :data:`CHECKPOINT_INTERVAL`, beside the writer.

        SQLite's automatic checkpoint runs inside the COMMIT that takes the WAL past 1,000 pages, so
        its fsync of the database file stalled the store writer, and every verdict queued behind it
        (bench/latency.py's rare 100+ ms maxima). A passive checkpoint from a connection of its own
        waits for nobody and nobody waits for it; once it has caught up, the next write starts the
        WAL over, so the WAL stays bounded. A fresh connection each time follows a store file that
        was replaced, and ``mode=rw`` never creates one that was deleted.
        """
        uri = f"{self.path.absolute().as_uri()}?mode=rw"
        while not self._closing.wait(CHECKPOINT_INTERVAL):
            if not self.path.exists():  # deleted under us: the writer reopens it on its next write
                continue
            try:
                db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)")
                finally:
                    db.close()
            except sqlite3.Error as exc:
                log.warning("store_checkpoint_failed", store=self.display, error=str(exc))

    @contextmanager
    def _transaction(self) -> Iterator[Callable[[str, Any], Any]]:
        self._require_open()
        with self._lock:
            if self._checkpointer is None:  # started by the first write: a store only read needs none
                self._checkpointer = threading.Thread(target=self._checkpoint_forever, name="store-checkpoint",
                                                      daemon=True)
                self._checkpointer.start()
            self._still_there()
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                yield self._conn.execute
                self._conn.execute("COMMIT")
            except sqlite3.Error as exc:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise StoreError(f"{self.path}: {exc}") from exc
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise

    def _max_params(self) -> int:
        return self._conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)  # 999 by default before SQLite 3.32

    def _query(self, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        self._require_open()
        with self._lock:
            try:
                return [dict(r) for r in self._conn.execute(sql, params).fetchall()]
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: {exc}") from exc

    def close(self) -> None:
        self._stop_opening()
        if self._checkpointer is not None:
            self._checkpointer.join(10)
        with self._lock:
            if self._db is not None:
                self._db.close()  # the last connection: SQLite checkpoints the WAL and removes it
