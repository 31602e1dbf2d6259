"""What a request may cost the receivers, and how much of what it carries is echoed back or logged."""

from __future__ import annotations

#: Longest single reason (one rejected span's) echoed to the client and logged.
MAX_REASON_BYTES = 256
#: Longest message (``partial_success.error_message``, an error's status message) echoed to a client.
MAX_MESSAGE_BYTES = 1024
#: Longest error logged.
MAX_LOGGED_BYTES = 300
#: gzip members one body may have. Exporters send one (``cat a.gz b.gz`` makes two); each costs an
#: inflater of its own, and a 4 MiB body of 209,715 empty members was 10-38 s of CPU.
MAX_GZIP_MEMBERS = 64
#: Requests of at least this many bytes are decoded on a worker thread, so the event loop (the
#: receivers, the sweeper) keeps serving meanwhile; smaller ones take at most a few ms in place.
OFFLOAD_BYTES = 256 * 1024


def clip(text: str, limit: int = MAX_MESSAGE_BYTES, tail: int = 0) -> str:
    """``text`` in at most ``limit`` UTF-8 bytes: when longer, its start and its last ``tail`` bytes
    around a "…" (a reason quotes the offending value in the middle and says what is wrong last)."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text
    head = raw[:limit - 3 - tail].decode("utf-8", "ignore")
    return head + "…" + (raw[len(raw) - tail:].decode("utf-8", "ignore") if tail else "")
