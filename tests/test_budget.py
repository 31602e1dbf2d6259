"""The memory budget's queue (collector/live/budget.py): decoding waits for bytes in arrival order
while no new read is admitted, and is refused when the queue could not drain."""

from __future__ import annotations

import asyncio

import pytest

from collector.live.assembler import Backpressure
from collector.live.budget import MemoryBudget, NeverFits


def test_a_decode_waits_for_bytes_a_finished_request_frees_while_new_reads_are_refused():
    async def scenario() -> None:
        budget = MemoryBudget(100, retry_after=1.0)
        first, second, newcomer = budget.lease(), budget.lease(), budget.lease()
        first.hold(60, "the body")
        second.hold(10, "the body")
        waiting = asyncio.ensure_future(second.grow(50, "decoding it"))
        await asyncio.sleep(0)
        assert not waiting.done() and budget.used == 70
        with pytest.raises(Backpressure):  # room for it, but the queue's decode comes first
            newcomer.hold(10, "the body")
        first.close()
        await waiting
        assert second.held == 60 and budget.used == 60
        newcomer.hold(10, "the body")  # queue empty: reads are admitted again
        assert budget.used == 70

    asyncio.run(scenario())


def test_a_decode_that_could_not_fit_beside_the_queue_is_refused_at_once():
    async def scenario() -> None:
        budget = MemoryBudget(100, retry_after=2.0)
        reader, first, second = budget.lease(), budget.lease(), budget.lease()
        reader.hold(40, "the body")
        first.hold(20, "the body")
        second.hold(20, "the body")
        waiting = asyncio.ensure_future(first.grow(50, "decoding it"))  # queued: 20 + 50 <= 100
        await asyncio.sleep(0)
        with pytest.raises(Backpressure) as refused:  # 70 queued + 20 + 50 > 100: it would never drain
            await second.grow(50, "decoding it")
        assert refused.value.retry_after == 2.0 and second.held == 20
        second.close()
        reader.close()
        await waiting
        assert budget.used == 70

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_queue_and_those_behind_it_move_up():
    async def scenario() -> None:
        budget = MemoryBudget(100, retry_after=1.0)
        reader, big, small = budget.lease(), budget.lease(), budget.lease()
        reader.hold(50, "the body")
        big.hold(10, "the body")
        small.hold(10, "the body")
        first = asyncio.ensure_future(big.grow(45, "decoding it"))  # 70 + 45 > 100: waits
        second = asyncio.ensure_future(small.grow(20, "decoding it"))  # behind it, though it would fit
        await asyncio.sleep(0)
        assert not first.done() and not second.done()
        first.cancel()
        await asyncio.wait_for(second, 5)  # granted once the cancelled waiter left
        assert first.cancelled() and small.held == 30 and budget.used == 90
        big.close()
        assert budget.used == 80

    asyncio.run(scenario())


def test_a_request_over_the_whole_budget_never_fits():
    async def scenario() -> None:
        lease = MemoryBudget(100, retry_after=1.0).lease()
        lease.hold(40, "the body")
        with pytest.raises(NeverFits, match="decoding it would take this request to 101 bytes"):
            await lease.grow(61, "decoding it")
        assert lease.held == 40

    asyncio.run(scenario())


def test_a_body_being_read_goes_on_while_decodes_wait_but_no_new_one_starts():
    """A chunked or gzip body takes its bytes as they arrive: refusing it half-read while a decode
    waits would waste what it has read; a request not yet started waits its turn."""
    async def scenario() -> None:
        budget = MemoryBudget(100, retry_after=1.0)
        reading, decoding, newcomer = budget.lease(), budget.lease(), budget.lease()
        reading.hold(10, "the body")
        decoding.hold(30, "the body")
        waiting = asyncio.ensure_future(decoding.grow(65, "decoding it"))  # 40 + 65 > 100: waits
        await asyncio.sleep(0)
        assert not waiting.done()
        reading.hold(5, "the body")  # there is room, and it has begun
        with pytest.raises(Backpressure):
            newcomer.hold(5, "the body")
        reading.close()
        await asyncio.wait_for(waiting, 5)
        assert budget.used == decoding.held == 95

    asyncio.run(scenario())


def test_a_read_of_unknown_size_waits_for_room_instead_of_being_refused():
    """A gRPC call holds the largest message while it reads (its size is not known before): when
    the budget holds two such reads, a third waits for one to finish rather than being refused (the
    reads take milliseconds; 16 streams of a 64 MiB limit were refused so), in arrival order."""
    async def scenario() -> None:
        budget = MemoryBudget(100, retry_after=1.0)
        first, second, third, fourth = (budget.lease() for _ in range(4))
        await first.reserve(40, "the request message", 5.0)
        await second.reserve(40, "the request message", 5.0)
        waiting = asyncio.ensure_future(third.reserve(40, "the request message", 5.0))
        behind = asyncio.ensure_future(fourth.reserve(40, "the request message", 5.0))
        await asyncio.sleep(0)
        assert not waiting.done() and not behind.done() and budget.used == 80
        first.free(30)  # its message was 10 bytes: the rest goes back, and the first waiter reads
        await asyncio.wait_for(waiting, 5)
        assert third.held == 40 and budget.used == 90 and not behind.done()
        second.close()
        await asyncio.wait_for(behind, 5)
        assert fourth.held == 40 and budget.used == 90

    asyncio.run(scenario())


def test_a_read_waits_behind_the_decodes_and_no_longer_than_it_may():
    """Decodes hold bytes already: they are served first. A read that found no room within its
    wait is refused (retryable) holding nothing; a waiting read does not keep a new body out."""
    async def scenario() -> None:
        budget = MemoryBudget(100, retry_after=1.0)
        holder, decoding, reader, body = (budget.lease() for _ in range(4))
        holder.hold(50, "the body")
        decoding.hold(10, "the body")
        grown = asyncio.ensure_future(decoding.grow(45, "decoding it"))  # 60 + 45 > 100: waits
        read = asyncio.ensure_future(reader.reserve(30, "the request message", 5.0))
        await asyncio.sleep(0)
        assert not grown.done() and not read.done()
        holder.close()  # 10 used: the decode first (55), then the read (85)
        await asyncio.wait_for(grown, 5)
        await asyncio.wait_for(read, 5)
        assert budget.used == 85
        with pytest.raises(Backpressure):  # 85 + 30 > 100, and nothing is freed within its wait
            await budget.lease().reserve(30, "the request message", 0.05)
        body.hold(10, "the body")  # no decode waits: a new body is read beside the reads
        assert budget.used == 95 and not budget._readers
        with pytest.raises(NeverFits):
            await budget.lease().reserve(101, "the request message", 5.0)

    asyncio.run(scenario())
