"""The PostgreSQL run store: psycopg 3 with a connection pool, shared by every replica.

Writes NOTIFY ``agenteval_runs`` with the run id inside their transaction, so the notification is
delivered exactly when the run is committed; each store with subscribers LISTENs on a connection of
its own and hands the committed documents to them. After a lost connection it reconnects and
catches up on runs updated meanwhile, so a watcher on one replica sees runs the other finalized
without polling every row.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, LiteralString, cast

import psycopg
import structlog
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import DictRow, dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from collector.store.base import RunStore
from collector.store.errors import StoreError, StoreUnavailable

log = structlog.get_logger("agenteval.collector")

#: The channel a store NOTIFYs with the run id of every run it writes.
CHANNEL = "agenteval_runs"
#: Any fixed key: concurrent replicas starting on a fresh database migrate one at a time.
_MIGRATION_LOCK = 0x616765_6E7465
#: Transaction-scoped advisory locks on a batch's run ids, by hash bucket, in ascending order.
_LOCK_KEYS = ("SELECT pg_advisory_xact_lock(bucket) FROM (SELECT DISTINCT mod(hashtextextended(key, 0), 256) AS bucket "
              "FROM unnest(CAST(%s AS text[])) AS key ORDER BY bucket) AS buckets")
#: Catch-up after a lost LISTEN connection looks this far behind the last notification (clock skew).
_CATCH_UP_MARGIN = 30.0
#: Seconds a read waits for a pooled connection, and then for any lock it needs (see ``_query``).
READ_WAIT = 3.0
#: A connection the server refused for what waiting does not mend (libpq gives no SQLSTATE for these).
_REFUSED = re.compile(r"authentication failed|no password supplied|does not exist|no pg_hba\.conf entry")


@lru_cache(maxsize=128)
def _pg(sql: str) -> LiteralString:
    """``:name`` (the shared SQL) -> psycopg's ``%(name)s``. The SQL is the store's own text, never a
    value (values are parameters): a literal string, as psycopg's types ask, once rewritten."""
    return cast("LiteralString", re.sub(r"(?<!:):([a-z_][a-z0-9_]*)", r"%(\1)s", sql))


def safe_url(url: str) -> str:
    """``postgresql://user@host:port/db``: printable, the password left out."""
    parts = conninfo_to_dict(url)
    user = f"{parts['user']}@" if parts.get("user") else ""
    port = f":{parts['port']}" if parts.get("port") else ""
    return f"postgresql://{user}{parts.get('host', '')}{port}/{parts.get('dbname', '')}"


class SeenRuns:
    """A bounded memory of (run id, revision) pairs, to drop notifications already delivered."""

    def __init__(self, size: int = 10_000) -> None:
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._size = size

    def fresh(self, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for doc in docs:
            key = (doc["run_id"], doc["revision"])
            if key in self._seen:
                continue
            self._seen[key] = None
            if len(self._seen) > self._size:
                self._seen.popitem(last=False)
            out.append(doc)
        return out


class PostgresRunStore(RunStore):
    notifies_all_writers = True
    _mark = "%s"
    _blob = "BYTEA"

    def __init__(self, url: str, password: str | None = None, pool_size: int = 4,
                 connect_timeout: float = 10.0) -> None:
        super().__init__()
        self.display = safe_url(url)
        self._url = url
        self._password = password or None  # None: the URL's own, or libpq's (PGPASSWORD, .pgpass)
        self._pool_size = pool_size
        self._connect_timeout = connect_timeout
        #: Its connections make dict rows (``row_factory``).
        self._pool: ConnectionPool[Any] | None = None
        self._listener: threading.Thread | None = None

    def _connect(self) -> None:
        """Migrate over a connection of its own (so a refused or failed connection says why at
        once, where the pool would retry it until its timeout), then open the pool."""
        try:
            with psycopg.Connection[DictRow].connect(self._url, connect_timeout=max(1, round(self._connect_timeout)),
                                                     autocommit=True, row_factory=dict_row,
                                                     password=self._password) as conn:
                self._migrate(conn)
            pool: ConnectionPool[Any] = ConnectionPool(
                self._url, min_size=1, max_size=self._pool_size, open=False, timeout=self._connect_timeout,
                kwargs={"password": self._password, "row_factory": dict_row},
                check=ConnectionPool.check_connection, name="agenteval-store")
            try:
                pool.open(wait=True, timeout=self._connect_timeout)
            except BaseException:
                pool.close()
                raise
        except (psycopg.OperationalError, PoolTimeout) as exc:  # down, starting, unreachable, too many clients
            message = f"{self.display}: {str(exc).strip() or type(exc).__name__}"
            raise (StoreError if _REFUSED.search(message) else StoreUnavailable)(message) from exc
        except psycopg.Error as exc:
            raise StoreError(f"{self.display}: {str(exc).strip() or type(exc).__name__}") from exc
        self._pool = pool

    def _migrate(self, conn: psycopg.Connection[DictRow]) -> None:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS agenteval_schema (version INTEGER NOT NULL)")
            row = conn.execute("SELECT COALESCE(MAX(version), 0) AS v FROM agenteval_schema").fetchone()
            version = row["v"] if row is not None else 0
            self._migrate_from(version, conn.execute,
                               lambda number: conn.execute("INSERT INTO agenteval_schema (version) VALUES (%s)",
                                                           (number,)))

    @contextmanager
    def _transaction(self) -> Iterator[Callable[[str, Any], Any]]:
        self._require_open()
        assert self._pool is not None
        try:
            with self._pool.connection() as conn, conn.transaction():
                yield lambda sql, params: conn.execute(_pg(sql), params)
        except (psycopg.Error, PoolTimeout) as exc:
            raise StoreError(f"{self.display}: {str(exc).strip() or type(exc).__name__}") from exc

    def _max_params(self) -> int:
        return 65_535

    def _lock_keys(self, execute: Callable[[str, Any], Any], keys: list[str]) -> None:
        """Advisory locks on the keys' hash buckets, taken in one order by every writer: replicas
        writing the same runs wait for each other (so a batch's plan stays exact) and never deadlock."""
        execute(_LOCK_KEYS, [keys])

    def _written(self, execute: Callable[[str, Any], Any], run_ids: list[str]) -> None:
        execute("SELECT pg_notify(:channel, run_id) FROM unnest(CAST(:run_ids AS text[])) AS run_id",
                {"channel": CHANNEL, "run_ids": run_ids})

    def size_bytes(self) -> int:
        """The runs table with its indexes and TOAST: what it takes on disk, including the space of
        deleted runs that (auto)vacuum has made reusable but PostgreSQL does not give back."""
        return self._query("SELECT pg_total_relation_size('runs') AS n", {})[0]["n"]

    def _usage(self) -> tuple[int, int]:
        """The stored runs' bytes, estimated: their count times the newest runs' average size, the
        row and its entries in the five indexes (key, updated_at, a 16-byte entry header, btree
        pages 90% full). Unlike the size on disk, it falls as runs are deleted, so a cap over it
        deletes what is needed and no more (the disk then holds about that, once vacuum lets new
        runs reuse the space)."""
        row = self._query(
            "SELECT (SELECT COUNT(*) FROM runs) AS runs, (SELECT AVG(pg_column_size(newest.*) + (2 * pg_column_size("
            "run_id) + COALESCE(pg_column_size(status), 0) + COALESCE(pg_column_size(subject), 0) + COALESCE("
            "pg_column_size(maf_release), 0) + 4 * 8 + 5 * 16) / 0.9) FROM (SELECT * FROM runs ORDER BY updated_at "
            "DESC LIMIT 500) AS newest) AS run_bytes", {})[0]
        runs = row["runs"]
        return (int(runs * float(row["run_bytes"])) if runs else 0), runs

    def _query(self, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        """A read waits at most :data:`READ_WAIT` for a connection, and as long for a lock (the lock
        timeout, for its transaction only): a reader (run page, API client, the replay check on
        the event loop) is answered "retry later" soon in an outage or while another session locks
        the table (a migration, VACUUM FULL), while the writer keeps the pool's longer wait,
        retried, and waits for locks. A read that is merely slow (a large ``runs list``) runs on."""
        self._require_open()
        assert self._pool is not None
        try:
            with self._pool.connection(timeout=READ_WAIT) as conn:
                conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{READ_WAIT:g}s",))
                return conn.execute(_pg(sql), params).fetchall()
        except (psycopg.Error, PoolTimeout) as exc:
            raise StoreError(f"{self.display}: {str(exc).strip() or type(exc).__name__}") from exc

    def subscribe(self, subscriber: Callable[[list[dict[str, Any]]], None],
                  listening: Callable[[], bool] = lambda: True) -> None:
        super().subscribe(subscriber, listening)
        if self._listener is None:
            self._listener = threading.Thread(target=self._listen_forever, name="store-listener", daemon=True)
            self._listener.start()

    def _listen_forever(self) -> None:
        seen = SeenRuns()
        last: float | None = None  # updated_at of the newest run heard of
        delay = 0.5
        while not self.wait_open(0.5):  # not reachable at start: its opener logs that, not this thread
            if self._closing.is_set():
                return
        while not self._closing.is_set():
            try:
                with psycopg.connect(self._url, autocommit=True, password=self._password) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    if last is not None:  # reconnected: catch up on what was committed meanwhile
                        self._deliver(seen, self.updated_since(last - _CATCH_UP_MARGIN))
                    delay = 0.5
                    while not self._closing.is_set():
                        ids = {n.payload for n in conn.notifies(timeout=0.5, stop_after=256)}
                        if ids and not self._listening():  # nobody to tell: fetch nothing
                            last = time.time()
                        elif ids:
                            docs = self.docs(ids)
                            last = max([last or 0.0, *(d["updated_at"] for d in docs)])
                            self._deliver(seen, docs)
            except (psycopg.Error, StoreError) as exc:
                if self._closing.is_set():
                    return
                log.warning("store_listen_failed", store=self.display, error=str(exc).strip(), retry_in=delay)
                if last is None:
                    last = time.time()
                self._closing.wait(delay)
                delay = min(delay * 2, 10.0)

    def _deliver(self, seen: SeenRuns, docs: list[dict[str, Any]]) -> None:
        fresh = seen.fresh(docs)
        if fresh:
            self._notify(fresh)

    def close(self) -> None:
        self._stop_opening()
        if self._listener is not None:
            self._listener.join(5)
        if self._pool is not None:
            self._pool.close()
