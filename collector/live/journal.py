"""The crash journal (docs/design.md §3 Durability): accepted span records are on disk before the receiver
answers, and replayed on start, so a kill -9 loses no acknowledged span.

- What is written is the classifier's compact span record (ids, name, start and end, the facts it
  reads of the span's attributes), never the request: prompt and response text never reach the disk.
- Group commit: requests append to a shared buffer; one writer thread writes whatever accumulated
  while the previous fsync ran, fsyncs once, and then releases every request of that group.
- Segments: files of about ``segment_bytes``; a segment is deleted once every trace with spans in it
  has been finalized and its runs stored (the one being written, once it is full). ``max_bytes``
  bounds the spans still needed: past it the pipeline refuses new spans with a retryable status
  until traces complete.
- A clean close leaves the segments of the traces still needed (cut short at shutdown, or a
  failed write) and a manifest naming those traces (:data:`KEPT`): the next start replays only
  them from those segments, not the records there of traces already done. A trace cut short at
  shutdown stays whole in the journal until a complete run of it is stored, at most for
  ``keep_cut_for`` from its first cut, even while incomplete runs of it are stored, so the rest of
  it completes its run however many restarts come in between.
- One collector per journal directory (an exclusive lock); replicas on one machine need their own.
- Its own faults: a write that fails (a full disk) is cut back off the segment, so the next record
  starts whole (failing that, the next record goes to a new segment), and the requests of that
  group are refused, retryably. A segment deleted under the collector (its directory removed) is
  noticed before any request is answered: the directory is made again, every segment still needed
  copied back into it from the open file, and the journal goes on there.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import structlog

from collector.core.facts import EARLIER_FACTS, FACTS, Facts, SpanRecord, span_facts
from collector.core.profiles import Matcher
from collector.core.serialize import from_json, to_json

log = structlog.get_logger("agenteval.collector")


#: The manifest a clean close leaves: ``{"upto": last segment, "traces": [hex trace ids],
#: "first_cut": {hex trace id: Unix time}}`` (when a collector first cut each trace it keeps).
KEPT = "KEPT.json"


class JournalError(Exception):
    """The journal cannot be opened (in use, unwritable) or a write failed."""


#: Values in a journal row (a span record).
ROW = 10
#: How many values rows of journals of earlier versions hold (replayed with the later values unknown:
#: 9, before the span's end time).
EARLIER_ROWS = (9,)


def encode(spans: list[SpanRecord]) -> bytes:
    """A journal line of span records (also what a replica hands over: docs/scale-out.md)."""
    rows = [[s.trace_id.hex(), s.span_id.hex(), s.parent_id.hex(), s.name, s.start_ns, s.facts, s.resource_subject,
             s.status_error, s.sdk_language, s.end_ns] for s in spans]
    return to_json(rows) + b"\n"


def decode(line: bytes, matcher: Matcher) -> list[SpanRecord]:
    """The records of a journal line (or of a part handed over). A line of an older collector holds a
    span's wanted attributes (a dict) where its facts now stand: they are worked out from them."""
    return [SpanRecord(bytes.fromhex(t), bytes.fromhex(s), bytes.fromhex(p), name, start, _facts(facts, name, matcher),
                       subject, error, lang, end)
            for t, s, p, name, start, facts, subject, error, lang, end in map(_row, from_json(line))]


def _row(row: list) -> list:
    if isinstance(row, list) and len(row) in EARLIER_ROWS:  # a journal of an earlier version
        return row + [None] * (ROW - len(row))
    return row


def _facts(value: list | dict, name: str, matcher: Matcher) -> Facts:
    if isinstance(value, dict):
        return span_facts(matcher, name, value)
    if isinstance(value, list) and len(value) in EARLIER_FACTS:  # a journal of an earlier version
        value = value + [None] * (FACTS - len(value))
    if not isinstance(value, list) or len(value) != FACTS:
        raise ValueError(f"span facts: expected a list of {FACTS}")
    return tuple(value)


class Journal:
    """The :class:`~collector.live.spanlog.SpanLog` of the OTLP receivers; also keeps traces cut
    short at shutdown for the next start (:meth:`cut`, :meth:`replay`)."""

    def __init__(self, directory: Path, segment_bytes: int, max_bytes: int, keep_cut_for: float = 0.0) -> None:
        self.directory = directory
        #: Seconds from its first cut that a trace cut short at shutdown stays whole here.
        self.keep_cut_for = keep_cut_for
        self.segment_bytes = segment_bytes
        self.max_bytes = max_bytes
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._lock_file = self._lock()
        except OSError as exc:  # named by its key: the default directory (null) is under the user's home
            problem = "is not writable" if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else "cannot be opened"
            raise JournalError(f"journal.path: {directory} {problem} ({exc.strerror or exc}): set journal.path to a "
                               "directory this collector's user can write, e.g. on a volume") from exc
        self._mutex = threading.Lock()
        self._wakeup = threading.Condition(self._mutex)
        #: Requests waiting for the next group commit.
        self._buffer: list[_Request] = []
        #: Requests appended so far: a release covers those appended before the trace was settled.
        self._appended = 0
        #: segment number -> trace ids with spans in it that are not yet done
        self._open: dict[int, set[bytes]] = {}
        self._sizes: dict[int, int] = {}
        #: segment number -> its file, open while the segment is (to copy it back if it is deleted)
        self._handles: dict[int, IO[bytes]] = {}
        #: The segment being written ends in a record cut short that could not be cut off.
        self._torn = False
        #: trace id -> segment number -> the last request with spans of it there
        self._trace_segments: dict[bytes, dict[int, int]] = {}
        existing = self._segments()
        #: From the last clean close: segments up to ``upto`` hold records only the ``kept`` traces
        #: need. ``first_cut``: traces a shutdown cut short, whole here since, with when it first
        #: did (Unix time); a trace leaves it when it is let go, or by :meth:`unpin`.
        self._kept_upto, self.kept, self.first_cut = self._read_kept()
        #: Traces of ``first_cut`` done before ``keep_cut_for`` passed, with the mark their release
        #: covers: let go once it has passed.
        self._pinned: dict[bytes, int] = {}
        # Numbered past the manifest too: what this start writes is never read through it.
        self._number = max([*existing, -1 if self._kept_upto is None else self._kept_upto]) + 1
        self._drop_kept_if_spent()  # its segments may be gone (let go after the close, or deleted by hand)
        self._file = self._start_segment(self._number)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="journal", daemon=True)

    def start(self) -> None:
        """Start the group commits (the writer thread)."""
        self._thread.start()

    # --- files ---------------------------------------------------------------------------------
    def _path(self, number: int) -> Path:
        return self.directory / f"{number:012d}.jsonl"

    def _segments(self) -> list[int]:
        return sorted(int(p.stem) for p in self.directory.glob("*.jsonl") if p.stem.isdigit())

    def _lock(self) -> IO[str]:
        """The directory's lock, taken (held for the journal's life)."""
        handle = open(self.directory / "LOCK", "w")  # held open for the journal's life
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise JournalError(f"{self.directory}: journal in use by another collector "
                               "(give each its own journal.path)") from None
        return handle

    def _start_segment(self, number: int) -> IO[bytes]:
        """Segment ``number``, open for appending (unbuffered: what a failed write left is known)
        and counted; nothing changes if it cannot be."""
        handle = open(self._path(number), "a+b", buffering=0)
        try:
            _fsync_dir(self.directory)
        except OSError:
            handle.close()
            raise
        self._open[number] = set()
        self._sizes[number] = 0
        self._handles[number] = handle
        return handle

    def _lost(self, number: int) -> bool:
        """Whether the file of segment ``number`` is no longer at its path (deleted, or its
        directory removed or moved)."""
        try:
            there = os.stat(self._path(number))
        except FileNotFoundError:
            return True
        here = os.fstat(self._handles[number].fileno())
        return (there.st_dev, there.st_ino) != (here.st_dev, here.st_ino)

    def _restore(self) -> None:
        """If the segment being written was deleted, make the directory again and copy back every
        segment still needed (each from its open file) and the manifest; then write there (the mutex
        is held). An acknowledged record is only ever in a file that is at its path."""
        if not self._lost(self._number):
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        lock = self._lock()  # another collector may have taken the directory since
        self._lock_file.close()
        self._lock_file = lock
        restored = [number for number in sorted(self._handles) if self._lost(number)]
        for number in restored:
            path = self._path(number)
            tmp = path.with_suffix(".tmp")
            source = self._handles[number]
            with open(tmp, "wb") as out:
                _copy(source.fileno(), out.fileno())
                os.fsync(out.fileno())
            os.replace(tmp, path)
            handle = open(path, "a+b" if number == self._number else "rb", buffering=0)
            source.close()
            self._handles[number] = handle
            if number == self._number:
                self._file = handle
        if self._kept_upto is not None:
            self._write_manifest(self._kept_upto, sorted(self.kept), self.first_cut)  # also fsyncs the directory
        else:
            _fsync_dir(self.directory)
        log.warning("journal_directory_recreated", directory=str(self.directory), segments=len(restored))

    def _read_kept(self) -> tuple[int | None, set[bytes], dict[bytes, float]]:
        """The manifest's ``upto``, traces and first cuts (a manifest of the previous version, or
        first cuts that cannot be read: none, its traces are then not known to be whole)."""
        try:
            manifest = from_json((self.directory / KEPT).read_bytes())
            upto, kept = int(manifest["upto"]), {bytes.fromhex(t) for t in manifest["traces"]}
        except FileNotFoundError:
            return None, set(), {}
        except (ValueError, TypeError, KeyError) as exc:  # unreadable: every record replays, as after a crash
            log.warning("journal_manifest_skipped", reason=str(exc)[:200])
            return None, set(), {}
        try:
            first_cut = {bytes.fromhex(t): float(at) for t, at in manifest.get("first_cut", {}).items()}
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("journal_manifest_first_cuts_skipped", reason=str(exc)[:200])
            first_cut = {}
        now = time.time()  # a time ahead (a clock stepped back, or nonsense) counts as now: pins end
        return upto, kept, {t: min(at, now) for t, at in first_cut.items() if t in kept and math.isfinite(at)}

    def _drop_kept_if_spent(self) -> None:
        """Delete the manifest once no segment it speaks for is left."""
        if self._kept_upto is not None and not any(n <= self._kept_upto for n in self._segments()):
            (self.directory / KEPT).unlink(missing_ok=True)
            self._kept_upto, self.kept, self.first_cut, self._pinned = None, set(), {}, {}

    def _write_kept(self) -> None:
        """Name the traces still needed, for the segments left (the mutex is held); none: no manifest."""
        path = self.directory / KEPT
        if not self._trace_segments:
            path.unlink(missing_ok=True)
            return
        # the last segment left: the next start writes to higher numbers, never under the manifest
        self._write_manifest(max(self._segments(), default=self._number), sorted(self._trace_segments), self.first_cut)

    def _write_manifest(self, upto: int, traces: list[bytes], first_cut: Mapping[bytes, float]) -> None:
        path = self.directory / KEPT
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            fh.write(to_json({"upto": upto, "traces": [t.hex() for t in traces],
                              "first_cut": {t.hex(): first_cut[t] for t in traces if t in first_cut}}))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(self.directory)

    @property
    def size(self) -> int:
        return sum(self._sizes.values())

    def full(self) -> bool:
        """Whether the spans that may still be needed fill ``max_bytes``: every segment holding a
        trace not yet done. The segment being written stops counting once all its traces are done
        (it stays on disk until it is full or the journal closes, so a late span's trace keeps its
        earlier records); counted, one request over ``max_bytes`` refused every later one for good.
        Nor does a segment of pinned traces only: done, kept in case the rest of them comes (counted,
        they refused that rest)."""
        with self._mutex:
            needed = sum(size for number, size in self._sizes.items()
                         if (traces := self._open.get(number)) and not traces.issubset(self._pinned))
        return needed >= self.max_bytes

    # --- replay ---------------------------------------------------------------------------------
    def replay(self, matcher: Matcher) -> Iterator[list[SpanRecord]]:
        """The span records of every earlier segment, oldest first (of segments a clean close left,
        only those of the traces it named); they stay journaled (and counted) until their traces are
        done again. A torn last line (a crash mid-write) is skipped."""
        kept_upto, kept = self._kept_upto, self.kept
        for number in self._segments():
            if number == self._number:
                continue
            path = self._path(number)
            handle = self._handles[number] = open(path, "rb", buffering=0)  # closed by _collect
            self._open.setdefault(number, set())
            self._sizes[number] = os.fstat(handle.fileno()).st_size
            named = kept_upto is not None and number <= kept_upto
            with open(handle.fileno(), "rb", closefd=False) as fh:
                for line in fh:
                    try:
                        spans = decode(line, matcher)
                    except (ValueError, TypeError):
                        log.warning("journal_record_skipped", segment=path.name, reason="torn or unreadable line")
                        continue
                    if named:
                        spans = [s for s in spans if s.trace_id in kept]
                        if not spans:
                            continue
                    self._track(number, {s.trace_id for s in spans}, 0)
                    yield spans
            self._collect(number)

    # --- append / commit ------------------------------------------------------------------------
    def append(self, spans: list[SpanRecord], line: bytes | None = None, idle: frozenset[bytes] = frozenset(),
               at: tuple[int, int] | None = None) -> asyncio.Future | None:
        """Queue ``spans`` for the next group commit; the future resolves once they are on disk (or
        fails with :class:`JournalError`). Call from the event loop, or off it once it appends no
        more (the pipeline's close, before :meth:`close` writes them): then nothing waits (None).
        ``line``: the spans already encoded (by the compiled decoder, sparing the event loop
        :func:`encode`). ``idle``: traces of these spans that nothing will release
        (:attr:`collector.live.assembler.Offer.idle`): not waited for, or they would keep the
        segment needed for good. ``at`` is not needed: the journal keeps the spans themselves."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        future = loop.create_future() if loop is not None else None
        if line is None:
            line = encode(spans)
        traces = {s.trace_id for s in spans}
        traces -= idle
        with self._wakeup:
            self._appended += 1
            self._buffer.append(_Request(line, traces, self._appended, future, loop))
            self._wakeup.notify()
        return future

    def mark(self) -> int:
        """The requests appended so far: what a release of traces settled now covers (see
        :meth:`release`). Call from the event loop, where requests are appended."""
        return self._appended

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not self._buffer and not self._closing:
                    self._wakeup.wait()
                group, self._buffer = self._buffer, []
                if not group and self._closing:
                    return
                placed: tuple[int, int, bytes] | Exception
                try:
                    self._restore()
                    # Placed as the group leaves the buffer, under the same lock: a trace released
                    # in between would be tracked after its release, and stay needed for good.
                    placed = self._place(group)
                except (OSError, JournalError) as exc:  # no directory, or no new segment
                    placed = exc
            error: Exception | None = None
            try:
                if isinstance(placed, Exception):
                    raise placed
                number, start, data = placed
                handle = self._file
                try:
                    _write(handle, data)
                    os.fsync(handle.fileno())
                    with self._mutex:  # deleted meanwhile: copied back before any request is answered
                        self._restore()
                except Exception:
                    self._cut(number, handle, start, len(data))
                    raise
            except Exception as exc:  # the group fails; left unsettled, its requests would hang
                error = JournalError(f"{self.directory}: journal write failed: "
                                     f"{getattr(exc, 'strerror', None) or exc}")
                log.error("journal_write_failed", error=str(error), requests=len(group))
            for request in group:
                if request.loop is not None and request.future is not None:
                    request.loop.call_soon_threadsafe(_settle, request.future, error)

    def _place(self, group: list[_Request]) -> tuple[int, int, bytes]:
        """The segment the group's records go to (a new one when the current one would outgrow
        ``segment_bytes``, or ends in a torn record), where they start there, and the records,
        counted there with their traces tracked (the mutex is held)."""
        data = b"".join(request.line for request in group)
        size = self._sizes[self._number]
        if self._torn or (size and size + len(data) > self.segment_bytes):
            handle = self._start_segment(self._number + 1)  # first: a failure leaves the current one
            previous, self._number, self._file, self._torn = self._number, self._number + 1, handle, False
            self._collect(previous)
        for request in group:
            self._track(self._number, request.traces, request.number)
        start = self._sizes[self._number]
        self._sizes[self._number] += len(data)
        return self._number, start, data

    def _cut(self, number: int, handle: IO[bytes], start: int, length: int) -> None:
        """A write of ``length`` bytes at ``start`` failed: cut off whatever of it reached the
        segment, so the next record starts whole; failing that, the next one starts a segment."""
        with self._mutex:
            if number in self._sizes:
                self._sizes[number] -= length
            try:
                handle.truncate(start)
            except OSError as exc:
                self._torn = handle is self._file
                log.warning("journal_tail_torn", segment=self._path(number).name, error=str(exc))

    def _track(self, number: int, traces: set[bytes], request: int) -> None:
        self._open[number].update(traces)
        for tid in traces:
            self._trace_segments.setdefault(tid, {})[number] = request

    # --- release --------------------------------------------------------------------------------
    def release(self, done: list[tuple[bytes, int]]) -> None:
        """These traces' runs are stored, each as of a :meth:`mark` (taken when it was settled):
        its records appended up to then are done; segments holding only done records go. Records
        appended later (late spans re-opening the trace for a new revision) stay until that one is.
        A trace of :attr:`first_cut` stays until ``keep_cut_for`` has passed (checked at each call)."""
        with self._mutex:
            touched = set()
            now = time.time()
            for tid, upto in done:
                if tid in self.first_cut:
                    self._pinned[tid] = max(upto, self._pinned.get(tid, upto))
            done = [item for item in done if item[0] not in self._pinned]
            expired = [(tid, upto) for tid, upto in self._pinned.items()
                       if now - self.first_cut[tid] >= self.keep_cut_for]
            for tid, _ in expired:
                del self._pinned[tid], self.first_cut[tid]
            if expired:
                self._forget_first_cuts()
                done.extend(expired)
            for tid, upto in done:
                for request in self._buffer:  # appended, not yet placed
                    if request.number <= upto:
                        request.traces.discard(tid)
                segments = self._trace_segments.get(tid)
                if segments is None:
                    continue
                for number, last in list(segments.items()):
                    if last <= upto:
                        del segments[number]
                        self._open[number].discard(tid)
                        touched.add(number)
                if not segments:
                    del self._trace_segments[tid]
            for number in touched:
                self._collect(number)

    def _collect(self, number: int) -> None:
        """Delete a finished segment whose traces are all done (the mutex is held or not needed),
        then the manifest if it spoke for no other."""
        if number != self._number and not self._open.get(number):
            self._open.pop(number, None)
            self._sizes.pop(number, None)
            if (handle := self._handles.pop(number, None)) is not None:
                handle.close()
            with contextlib.suppress(FileNotFoundError):
                self._path(number).unlink()
            self._drop_kept_if_spent()

    def cut(self, first_cut: Mapping[bytes, float]) -> None:
        """These traces were cut short at shutdown (first, at these Unix times): whole here, kept."""
        with self._mutex:
            self.first_cut.update(first_cut)

    def unpin(self, traces: list[bytes]) -> None:
        """A complete run of these traces is published, or they made none: they are kept no longer
        than any other trace (the release that follows covers what a pin held back)."""
        with self._mutex:
            unpinned = [tid for tid in traces if self.first_cut.pop(tid, None) is not None]
            for tid in unpinned:
                self._pinned.pop(tid, None)
            if unpinned:
                self._forget_first_cuts()

    def _forget_first_cuts(self) -> None:
        """The manifest stops calling whole the traces that left :attr:`first_cut`, before any of
        their records go: after a kill -9, the part left of one would be taken for all of it (the
        mutex is held)."""
        if self._kept_upto is None:
            return
        try:
            self._write_manifest(self._kept_upto, sorted(self.kept), self.first_cut)
        except OSError as exc:  # its first cuts then stand: the next start may take a part for the whole
            log.warning("journal_manifest_failed", error=str(exc))

    def close(self) -> int:
        """Stop; returns how many traces the journal keeps for the next start (named in :data:`KEPT`,
        with when each was first cut)."""
        with self._wakeup:
            self._closing = True
            self._wakeup.notify()
        if self._thread.is_alive():
            self._thread.join(30)
        with self._mutex:
            ours = True
            try:
                self._restore()  # the directory deleted since the last write: what it keeps is put back
            except (OSError, JournalError) as exc:
                ours = not isinstance(exc, JournalError)  # made again by another collector: left to it
                log.warning("journal_restore_failed", error=str(exc))
            for handle in self._handles.values():
                handle.close()
            if ours and not self._open.get(self._number):  # nothing of the current segment is still needed
                self._path(self._number).unlink(missing_ok=True)
                self._sizes.pop(self._number, None)
            try:
                if ours:
                    self._write_kept()
            except OSError as exc:  # an older manifest, if any, still names a superset of what is needed
                log.warning("journal_manifest_failed", error=str(exc))
            kept = len(self._trace_segments)
        self._lock_file.close()
        return kept


@dataclass(slots=True)
class _Request:
    """One appended request, waiting for the next group commit."""

    line: bytes
    traces: set[bytes]
    number: int
    #: None: appended off the event loop, nothing waits.
    future: asyncio.Future | None
    loop: asyncio.AbstractEventLoop | None


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _write(handle: IO[bytes], data: bytes) -> None:
    """All of ``data`` (an unbuffered file's write may take part of it)."""
    view = memoryview(data)
    while view:
        view = view[handle.write(view):]


def _copy(source: int, target: int) -> None:
    """The whole file ``source`` into ``target`` (file descriptors)."""
    offset = 0
    while sent := os.sendfile(target, source, offset, 1 << 24):
        offset += sent


def _fsync_dir(directory: Path) -> None:
    """Make a new segment's directory entry durable too."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

