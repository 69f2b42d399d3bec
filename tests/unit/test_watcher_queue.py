"""The watcher queue keeps the newest update of each job (services.gateway.watcher_queue)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from services.gateway.stream_limits import StreamCounts
from services.gateway.watcher_queue import LatestQueue

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Update:
    key: str
    revision: int


@dataclass(frozen=True)
class Progress:
    key: str
    done: int


async def test_the_newest_update_of_a_key_replaces_the_waiting_one_and_goes_last() -> None:
    queue: LatestQueue[Update | Progress] = LatestQueue()
    for update in (Update("a", 1), Update("b", 2), Progress("a", 10), Update("a", 3)):
        queue.put_nowait(update)
    assert queue.qsize() == 3
    assert [queue.get_nowait() for _ in range(3)] == [Update("b", 2), Progress("a", 10), Update("a", 3)]
    assert queue.empty()
    with pytest.raises(asyncio.QueueEmpty):
        queue.get_nowait()


async def test_a_waiting_reader_wakes_and_the_close_comes_after_what_waits() -> None:
    queue: LatestQueue[Update] = LatestQueue()
    reader = asyncio.create_task(queue.get())
    await asyncio.sleep(0)
    queue.put_nowait(Update("a", 1))
    assert await asyncio.wait_for(reader, 1) == Update("a", 1)
    queue.put_nowait(Update("a", 2))
    queue.put_nowait(None)
    assert await queue.get() == Update("a", 2)
    assert await queue.get() is None
    assert await queue.get() is None  # stays closed


async def test_streams_are_counted_per_tenant_and_per_connection() -> None:
    from asyncinfer.errors import ResourceExhausted

    counts = StreamCounts("watch", reason="TOO_MANY_WATCHES", per_tenant=3, per_connection=2)
    with counts.hold("acme", "c1"), counts.hold("acme", "c1"):
        with pytest.raises(ResourceExhausted) as per_connection:
            counts.hold("acme", "c1").__enter__()
        assert per_connection.value.reason == "TOO_MANY_WATCHES"
        with counts.hold("acme", "c2"):
            with pytest.raises(ResourceExhausted):
                counts.hold("acme", "c3").__enter__()
            with counts.hold("other", "c3"):
                assert counts.open == 4
    assert counts.open == 0
