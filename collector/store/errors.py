"""How the run store fails (docs/design.md §5), and what a reader is told when it does."""

from __future__ import annotations


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
