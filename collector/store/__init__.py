"""The run store (docs/design.md §5): where verdicts are kept, read back and watched.

``base`` is the interface both backends implement, a facade over rooms of one job each (``schema``,
``rules``, ``documents``, ``retention``, ``parts``; see its docstring); ``sqlite`` and ``postgres``
import it, never each other nor this package's :func:`open_store`, which picks one by URL. The
PostgreSQL backend is imported only for a ``postgresql://`` URL (psycopg is optional).

May import: ``collector.core``. Imported by the outputs, the live collector and the command line.
"""

from __future__ import annotations

from pathlib import Path

from collector.core.serialize import MAX_ITEMS
from collector.store.base import STORE_ENV, RunStore, data_dir_store, default_store_url, instance_name, is_postgres
from collector.store.codec import pack, unpack
from collector.store.documents import StoredRun
from collector.store.errors import RETRY_READ_AFTER, UNREADABLE, StoreError, StoreUnavailable
from collector.store.parts import Part
from collector.store.retention import Retention
from collector.store.rules import replaces
from collector.store.sqlite import SqliteRunStore

__all__ = ["RETRY_READ_AFTER", "STORE_ENV", "UNREADABLE", "Part", "Retention", "RunStore", "StoreError",
           "StoreUnavailable", "StoredRun", "default_store_url", "instance_name", "is_postgres", "open_store", "pack",
           "replaces", "unpack"]


def open_store(url: str | Path | None = None, password: str | None = None, pool_size: int = 4,
               existing: bool = False, max_items: int = MAX_ITEMS, retry: bool = False) -> RunStore:
    """The store at ``url`` (default: :func:`default_store_url`), migrated to the current schema.
    ``existing``: for reading, a SQLite file named explicitly must be there (a typo must not read as
    an empty store, nor leave one behind); the default store may not exist yet. ``max_items``: what
    each bounded list of the documents it writes keeps (``store.max_span_ids_per_unit``). ``retry``:
    see :meth:`RunStore.open`."""
    url = str(url or default_store_url())
    path = Path(url.removeprefix("sqlite:///"))
    if existing and not is_postgres(url) and path != data_dir_store() and not path.exists():
        raise StoreError(f"{path}: no store there (the collector creates it when it starts): check --store, "
                         f"store.url or ${STORE_ENV}")
    if is_postgres(url):
        try:
            from collector.store.postgres import PostgresRunStore
        except ImportError as exc:
            raise StoreError(f"a postgresql:// store needs psycopg: pip install 'agenteval-collector[postgres]' "
                             f"({exc})") from exc

        store: RunStore = PostgresRunStore(url, password, pool_size)
    else:
        store = SqliteRunStore(path)
    store.max_items = max_items
    store.open(retry)
    return store
