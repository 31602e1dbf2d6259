"""Offsets as a promise about what was handled (docs/scale-out.md "Kafka, exact").

With the kafka receiver, Kafka is the durable log: :class:`KafkaOffsets` is the pipeline's
:class:`~collector.live.spanlog.SpanLog` in place of the crash journal, and instead of deleting
segments it tells the receiver, per partition, what may be committed:

- the offset: the oldest message holding a trace whose runs are not all stored yet (the
  watermark), else the one after the last message taken;
- the metadata: the traces with messages at or past that offset whose runs are all stored, so the
  replica that next owns the partition, which re-reads from the offset, skips them instead of
  reconciling their tails as runs of their own. A trace is named by the first 8 bytes of its id.

A trace's spans are all in one partition (the exporter partitions by trace id); one message may hold
several traces, and a trace's spans may be in several messages.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from collector.core.facts import SpanRecord

#: Prefix of the commit metadata this receiver writes (its format's version).
METADATA_PREFIX = "agenteval1:"
#: Bytes of a trace id the metadata names a trace by.
KEY_BYTES = 8


def encode_metadata(keys: Iterable[bytes], max_bytes: int) -> tuple[str, int]:
    """The commit metadata naming ``keys`` (each :data:`KEY_BYTES` long), within ``max_bytes``;
    returns it and how many keys did not fit."""
    keys = list(keys)
    room = max(0, (max_bytes - len(METADATA_PREFIX)) // 4 * 3 // KEY_BYTES)
    if not keys:
        return "", 0
    if room == 0:
        return "", len(keys)
    fit = keys[:room]
    return METADATA_PREFIX + base64.b64encode(b"".join(fit)).decode(), len(keys) - len(fit)


def decode_metadata(metadata: str | None) -> set[bytes]:
    """The trace keys a commit's metadata names (none when it is not ours or is damaged)."""
    if not metadata or not metadata.startswith(METADATA_PREFIX):
        return set()
    try:
        raw = base64.b64decode(metadata[len(METADATA_PREFIX):], validate=True)
    except ValueError:
        return set()
    return {raw[i:i + KEY_BYTES] for i in range(0, len(raw) - KEY_BYTES + 1, KEY_BYTES)}


@dataclass(slots=True)
class _Partition:
    #: The offset after the last message taken (handled or skipped); None before the first.
    next: int | None = None
    #: offset -> how many traces of that message are not yet done
    pending: dict[int, int] = field(default_factory=dict)
    #: Traces whose runs are stored (full id), or that the previous owner's commit named (a key):
    #: -> the last offset seen of them here (pruned once the watermark passes it).
    done: dict[bytes, int] = field(default_factory=dict)
    #: Keys the previous owner's commit named: their spans are skipped while this replica owns it.
    inherited: frozenset[bytes] = frozenset()


@dataclass(frozen=True, slots=True)
class CommitPoint:
    offset: int
    metadata: str
    #: Stored traces past ``offset`` the metadata could not name (left to the run store's rule).
    unnamed: int


class KafkaOffsets:
    """What each owned partition's commit may say. ``append`` runs on the event loop, with the
    message being ingested; ``release`` may come from the store writer's thread. Nothing is kept
    across a shutdown here: the receiver drops its open traces before the pipeline closes, and
    Kafka keeps their messages."""

    def __init__(self, max_metadata_bytes: int) -> None:
        self.max_metadata_bytes = max_metadata_bytes
        self._lock = threading.Lock()
        self._partitions: dict[int, _Partition] = {}
        #: trace id -> (append number, partition, offset) of its messages not yet done
        self._traces: dict[bytes, list[tuple[int, int, int]]] = {}
        self._appended = 0

    # --- the receiver's side ----------------------------------------------------------------------
    def assign(self, partition: int, offset: int | None, metadata: str | None) -> None:
        """This replica owns ``partition`` from ``offset`` (its committed offset; None: none yet)."""
        inherited = frozenset(decode_metadata(metadata))
        start = offset if offset is not None and offset >= 0 else 0
        with self._lock:
            self._partitions[partition] = _Partition(inherited=inherited, done=dict.fromkeys(inherited, start))

    def skips(self, partition: int, offset: int, trace_id: bytes) -> bool:
        """Whether a span of ``trace_id`` at ``offset`` belongs to a trace the previous owner stored."""
        part = self._partitions.get(partition)
        key = trace_id[:KEY_BYTES]
        if part is None or key not in part.inherited:
            return False
        with self._lock:
            part.done[key] = max(offset, part.done.get(key, offset))
        return True

    def taken(self, partition: int, offset: int) -> None:
        """The message at ``offset`` was handled (its traces appended) or skipped."""
        part = self._partitions.get(partition)
        if part is not None:
            part.next = offset + 1

    def inherited(self, partition: int) -> frozenset[bytes]:
        part = self._partitions.get(partition)
        return part.inherited if part is not None else frozenset()

    def owned(self) -> list[int]:
        return list(self._partitions)

    def pending_traces(self, partition: int) -> set[bytes]:
        """Traces with messages in ``partition`` whose runs are not all stored."""
        with self._lock:
            return {tid for tid, entries in self._traces.items() if any(p == partition for _, p, _ in entries)}

    def revoke(self, partition: int) -> None:
        """``partition`` is no longer this replica's: forget it (the caller dropped its traces)."""
        with self._lock:
            self._partitions.pop(partition, None)
            for tid in [tid for tid, entries in self._traces.items() if any(p == partition for _, p, _ in entries)]:
                kept = [entry for entry in self._traces[tid] if entry[1] != partition]
                if kept:
                    self._traces[tid] = kept
                else:
                    del self._traces[tid]

    def commit_point(self, partition: int) -> CommitPoint | None:
        """What ``partition``'s commit may say now; None before its first message was taken."""
        with self._lock:
            part = self._partitions.get(partition)
            if part is None or part.next is None:
                return None
            watermark = min(part.pending) if part.pending else part.next
            for key in [key for key, last in part.done.items() if last < watermark]:
                del part.done[key]
            keys = [key[:KEY_BYTES] for key in part.done if key not in self._traces]
        metadata, unnamed = encode_metadata(keys, self.max_metadata_bytes)
        return CommitPoint(watermark, metadata, unnamed)

    # --- the pipeline's side (its SpanLog) -----------------------------------------------------------
    def append(self, spans: list[SpanRecord], line: bytes | None = None, idle: frozenset[bytes] = frozenset(),
               at: tuple[int, int] | None = None) -> None:
        """The traces of ``spans`` (but ``idle`` ones, which nothing will settle) now have a message
        ``at`` (partition, offset) not yet done; spans from no message (``at`` None) are not
        tracked. Nothing to wait for: Kafka holds the message (``line`` is not needed)."""
        if at is None:
            return
        partition, offset = at
        with self._lock:
            self._appended += 1
            part = self._partitions.get(partition)
            if part is None:
                return
            for tid in {span.trace_id for span in spans} - idle:
                entries = self._traces.setdefault(tid, [])
                if entries and entries[-1][1:] == (partition, offset):
                    continue  # a second batch of the same message (never, but harmless)
                entries.append((self._appended, partition, offset))
                part.pending[offset] = part.pending.get(offset, 0) + 1

    def mark(self) -> int:
        return self._appended

    def release(self, done: list[tuple[bytes, int]]) -> None:
        """These traces' runs are stored, as of a :meth:`mark`: their messages up to it are done."""
        with self._lock:
            for tid, upto in done:
                entries = self._traces.get(tid)
                if entries is None:
                    continue
                kept = []
                for entry in entries:
                    number, partition, offset = entry
                    if number > upto:
                        kept.append(entry)
                        continue
                    part = self._partitions.get(partition)
                    if part is None:
                        continue
                    left = part.pending[offset] - 1
                    if left:
                        part.pending[offset] = left
                    else:
                        del part.pending[offset]
                    part.done[tid] = max(offset, part.done.get(tid, offset))
                if kept:
                    self._traces[tid] = kept
                else:
                    del self._traces[tid]
