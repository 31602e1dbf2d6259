"""What the store's rooms (schema, rules, documents, retention, parts) need of a backend, and the
SQL helpers they share.

Both backends run the same SQL: named ``:params`` as a dict, or the driver's positional mark
(``_mark``) as a sequence where a statement's length varies. :class:`Database` is the part of
:class:`collector.store.base.RunStore` a room may use; each backend implements it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

#: Runs one statement inside a transaction: ``execute(sql, params) -> cursor``.
Execute = Callable[[str, Any], Any]
#: Values one statement lists at most (``IN (...)``, rows of an upsert).
ROWS_PER_STATEMENT = 256

_T = TypeVar("_T")


class Database(Protocol):
    #: Where the store is, safe to print or log (never a password).
    display: str
    #: The driver's positional parameter mark.
    _mark: str

    def _transaction(self) -> AbstractContextManager[Execute]:
        """An ``execute`` inside one transaction, committed when the block ends."""
        ...

    def _query(self, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]: ...

    def _max_params(self) -> int:
        """Parameters one statement may carry."""
        ...

    def _lock_keys(self, execute: Execute, keys: list[str]) -> None:
        """First in a transaction writing these run ids: keeps other writers off them until it commits."""
        ...

    def _written(self, execute: Execute, run_ids: list[str]) -> None:
        """Inside the transaction, with the runs it wrote (PostgreSQL notifies)."""
        ...

    def _reclaim(self) -> None:
        """After a transaction deleted runs: give their space back (SQLite)."""
        ...

    def _usage(self) -> tuple[int, int]:
        """(bytes the stored runs take, how many there are)."""
        ...

    def size_bytes(self) -> int: ...


def marks(mark: str, n: int) -> str:
    return ", ".join([mark] * n)


def chunks(items: list[_T], size: int) -> Iterator[list[_T]]:
    for at in range(0, len(items), size):
        yield items[at:at + size]


def like_prefix(value: str) -> str:
    """A LIKE pattern (``ESCAPE '\\'``) matching what starts with ``value``."""
    return re.sub(r"([\\%_])", r"\\\1", value) + "%"


def rows_in(db: Database, sql: str, values: list[str]) -> Iterator[dict[str, Any]]:
    """The rows of ``sql`` whose ``{ids}`` stands for ``values``, a statement per chunk of them."""
    for part in chunks(values, ROWS_PER_STATEMENT):
        params = {f"v{i}": value for i, value in enumerate(part)}
        yield from db._query(sql.format(ids=", ".join(f":{name}" for name in params)), params)
