"""One memory budget for every request in flight on both receivers (``receivers.max_inflight_bytes``).

A request holds a :class:`Lease` on the budget for the bytes it keeps while it is received and
decoded: its body as read (compressed), its decompressed form, the joined copy the decoders take, and
an estimate of the decoder's working set (:func:`decode_working_set`). It holds them from before it
reads them until its span records are handed to the assembler, whose own bounds
(``assembly.max_spans_in_flight``, ...) take over from there. Over the budget a request is refused
with a retryable status (:class:`~collector.live.assembler.Backpressure`) before it reads more; a request
that alone needs more than the whole budget can never be accepted (:class:`NeverFits`).

Reading takes bytes at once or is refused (:meth:`Lease.hold`). Decoding, which needs several times
what was read, waits for its bytes in a first-come queue (:meth:`Lease.grow`): requests being read
would otherwise keep taking what the ones already read need, and under a burst none would be
accepted. While anyone waits, no new request is admitted (one being read goes on while there is
room: it ends, bounded by the size limit); a request joins the queue only when everything
queued fits the budget at once (what the waiters hold and want), so the queue always drains as the
requests ahead of it finish, and is refused otherwise.

A gRPC call cannot know its message's size before grpc has read it, so it holds the largest while it
reads (:meth:`Lease.reserve`). It waits for that room, in a queue of its own behind the decodes, for
as long as it may take to send its message (``receivers.grpc.read_timeout``); a read takes
milliseconds once it has begun, so with a large ``max_message_bytes`` (room for two reads) the calls
of many streams take turns instead of being refused. (A wait as long as ``retry_after`` was not
enough on a saturated box: the event loop itself stalled that long, and calls were refused.) A waiting
read holds nothing: it delays no decode and keeps no body out. See docs/design.md §3 (receivers).

Everything here runs on the event loop: no lock.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from collector.live.assembler import Backpressure

#: Decoder working set per serialized byte and per span. Measured with bench/overload.py's dense MAF
#: requests and the worst shapes found (RSS growth while decoding, /proc VmHWM): the compiled decoder
#: takes 3.7x a dense request's size (~1,400 bytes a span), the protobuf fallback 4.9x (5.1x for one
#: attribute holding 900,000 array values); requests of bare spans (33 bytes each) take ~720 bytes a
#: span whichever decoder runs. ``6 x bytes + 768 x spans`` covers each of these.
PROTOBUF_BYTE_FACTOR = 6
SPAN_BYTES = 768
#: ``json.loads`` and the decoder take 7.5x a dense OTLP/JSON document's size, 9.6x one of bare spans;
#: strings of a few characters in an array reach ~12x (a Python str per element).
JSON_BYTE_FACTOR = 16


def decode_working_set(size: int, spans: int | None) -> int:
    """Bytes decoding a request of ``size`` bytes may take: ``spans`` is its span count when it is
    protobuf, None when it is OTLP/JSON (not counted before it is parsed)."""
    if spans is None:
        return JSON_BYTE_FACTOR * size
    return PROTOBUF_BYTE_FACTOR * size + SPAN_BYTES * spans


@dataclass(eq=False)
class _Waiter:
    lease: Lease
    size: int
    queued: int
    granted: asyncio.Future[None]


class NeverFits(Exception):
    """The request alone needs more than the whole budget: retrying it cannot help."""


class MemoryBudget:
    """``limit`` bytes shared by the requests in flight; refusals say to retry after ``retry_after`` s."""

    def __init__(self, limit: int, retry_after: float) -> None:
        self.limit = limit
        self.retry_after = retry_after
        #: Bytes held by leases now.
        self.used = 0
        #: Leases waiting to grow, first come first served: the lease, the bytes it wants, what it
        #: counts in ``_queued`` and the future that grants them.
        self._waiting: deque[_Waiter] = deque()
        #: What the waiters hold and want together.
        self._queued = 0
        #: Reads waiting for room (:meth:`Lease.reserve`), first come first served, after the decodes.
        self._readers: deque[tuple[Lease, int, asyncio.Future[None]]] = deque()

    def lease(self) -> Lease:
        return Lease(self)

    def _refusal(self) -> Backpressure:
        return Backpressure(f"receivers.max_inflight_bytes ({self.limit}) are held by requests in flight",
                            self.retry_after)

    def _admit_waiters(self) -> None:
        """Give the bytes freed to the waiters at the head of the queue that now fit, then (the
        decode queue empty) to the reads waiting."""
        while self._waiting:
            waiter = self._waiting[0]
            if self.used + waiter.size > self.limit:
                return
            self._dequeue(waiter)
            self.used += waiter.size
            waiter.lease.held += waiter.size
            waiter.granted.set_result(None)
        while self._readers:
            lease, size, granted = self._readers[0]
            if granted.cancelled():  # its wait ended (cancelled, out of time): it is leaving
                self._readers.popleft()
                continue
            if self.used + size > self.limit:
                return
            self._readers.popleft()
            self.used += size
            lease.held += size
            granted.set_result(None)

    def _dequeue(self, waiter: _Waiter) -> None:
        self._waiting.remove(waiter)
        self._queued -= waiter.queued


class Lease:
    """What one request holds of the budget; :meth:`close` gives it all back."""

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget
        self.held = 0
        self._closed = False

    def hold(self, size: int, what: str) -> None:
        """Take ``size`` more bytes now (``what`` names them in the refusal), or raise :class:`NeverFits` /
        :class:`Backpressure` holding nothing more. A request holding nothing yet is refused too while
        requests wait in :meth:`grow`."""
        budget = self.budget
        self._check_fits(size, what)
        if (budget._waiting and not self.held) or budget.used + size > budget.limit:
            raise budget._refusal()
        budget.used += size
        self.held += size

    async def grow(self, size: int, what: str) -> None:
        """Take ``size`` more bytes, waiting behind the requests queued before this one; raise
        :class:`NeverFits`, or :class:`Backpressure` at once when the queue could not take this request
        (what it holds and wants) beside the others without exceeding the budget."""
        budget = self.budget
        self._check_fits(size, what)
        if not budget._waiting and budget.used + size <= budget.limit:
            budget.used += size
            self.held += size
            return
        if budget._queued + self.held + size > budget.limit:
            raise budget._refusal()
        waiter = _Waiter(self, size, self.held + size, asyncio.get_running_loop().create_future())
        budget._waiting.append(waiter)
        budget._queued += waiter.queued
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter in budget._waiting:  # not granted (granted, the bytes are held: close() frees them)
                budget._dequeue(waiter)
                budget._admit_waiters()  # those behind it may fit now
            raise

    async def reserve(self, size: int, what: str, wait: float) -> None:
        """Take ``size`` bytes for a read of unknown size (this lease holding nothing yet), waiting
        behind the decodes and the reads queued before it for at most ``wait`` seconds; raise
        :class:`NeverFits`, or :class:`Backpressure` holding nothing when no room came."""
        budget = self.budget
        self._check_fits(size, what)
        if not budget._waiting and not budget._readers and budget.used + size <= budget.limit:
            budget.used += size
            self.held += size
            return
        entry = (self, size, asyncio.get_running_loop().create_future())
        budget._readers.append(entry)
        try:
            async with asyncio.timeout(wait):
                await entry[2]
        except TimeoutError:
            if not self._left(entry):  # granted as the time ran out: the bytes are held, read on
                return
            raise budget._refusal() from None
        except asyncio.CancelledError:
            self._left(entry)  # (granted: close() frees the bytes)
            raise

    def _left(self, entry: tuple[Lease, int, asyncio.Future[None]]) -> bool:
        """Give up a read's place unless it was granted (the wait's cancellation cancels its future);
        those behind it may fit now. Whether it left."""
        granted = entry[2]
        if granted.done() and not granted.cancelled():
            return False
        if entry in self.budget._readers:
            self.budget._readers.remove(entry)
            self.budget._admit_waiters()
        return True

    def _check_fits(self, size: int, what: str) -> None:
        limit = self.budget.limit
        if self.held + size > limit:
            raise NeverFits(f"{what} would take this request to {self.held + size} bytes in memory, more than "
                            f"receivers.max_inflight_bytes ({limit}) allows any request; send smaller batches")

    def free(self, size: int) -> None:
        size = min(size, self.held)
        self.held -= size
        self.budget.used -= size
        if size:
            self.budget._admit_waiters()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.free(self.held)

    def close_when_done(self, work: asyncio.Future) -> None:
        """Close once ``work`` (a decode on a worker thread, which holds the bytes) has finished: for a
        request cancelled while it waits for that work."""
        self._closed = True  # a later close() is a no-op; the callback frees
        work.add_done_callback(lambda _: self.free(self.held))
