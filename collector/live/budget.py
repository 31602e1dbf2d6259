"""One memory budget for every request in flight on both receivers (``receivers.max_inflight_bytes``).

A request holds a :class:`Lease` on the budget for the bytes it keeps while it is received and
decoded: its body as read (compressed), its decompressed form, the joined copy the decoders take, and
an estimate of the decoder's working set (:func:`decode_working_set`). It holds them from before it
reads them until its span records are handed to the assembler, whose own bounds
(``assembly.max_spans_in_flight``, ...) take over from there. Over the budget a request is refused
with a retryable status (:class:`~collector.live.assembler.Backpressure`) before it reads more; a request
that alone needs more than the whole budget can never be accepted (:class:`NeverFits`).

Everything here runs on the event loop: no lock.
"""

from __future__ import annotations

import asyncio

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


class NeverFits(Exception):
    """The request alone needs more than the whole budget: retrying it cannot help."""


class MemoryBudget:
    """``limit`` bytes shared by the requests in flight; refusals say to retry after ``retry_after`` s."""

    def __init__(self, limit: int, retry_after: float) -> None:
        self.limit = limit
        self.retry_after = retry_after
        #: Bytes held by leases now.
        self.used = 0

    def lease(self) -> Lease:
        return Lease(self)


class Lease:
    """What one request holds of the budget; :meth:`close` gives it all back."""

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget
        self.held = 0
        self._closed = False

    def hold(self, size: int, what: str) -> None:
        """Take ``size`` more bytes (``what`` names them in the refusal), or raise :class:`NeverFits` /
        :class:`Backpressure` holding nothing more."""
        budget = self.budget
        if self.held + size > budget.limit:
            raise NeverFits(f"{what} would take this request to {self.held + size} bytes in memory, more than "
                            f"receivers.max_inflight_bytes ({budget.limit}) allows any request; send smaller batches")
        if budget.used + size > budget.limit:
            raise Backpressure(f"receivers.max_inflight_bytes ({budget.limit}) are held by requests in flight",
                               budget.retry_after)
        budget.used += size
        self.held += size

    def free(self, size: int) -> None:
        size = min(size, self.held)
        self.held -= size
        self.budget.used -= size

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.free(self.held)

    def close_when_done(self, work: asyncio.Future) -> None:
        """Close once ``work`` (a decode on a worker thread, which holds the bytes) has finished: for a
        request cancelled while it waits for that work."""
        self._closed = True  # a later close() is a no-op; the callback frees
        work.add_done_callback(lambda _: self.free(self.held))
