"""Whether a queue snapshot is fresh, on its reader's monotonic clock (asyncinfer.snapshot_freshness).
Before, a reader compared the snapshot's `updated_at` (its scheduler's wall clock) with its own wall
clock: a gateway 15 s ahead of a scheduler's host said NO_WORKER for every queued job of a served
model, and one 15 s behind kept a dead scheduler's batchers for 30 s."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest

from asyncinfer.contract import kv_subject_prefix
from asyncinfer.jobs import Priority
from asyncinfer.nats import Client, JetStreamContext, Msg
from asyncinfer.queues import SNAPSHOT_STALE_S, PriorityQueueSnapshot, QueueSnapshot, encode_snapshot
from asyncinfer.snapshot_freshness import WatchStart, is_fresh, written_at
from services.gateway.queue_view import QueueView, WaitingReason
from tests.unit.queue_view_fakes import queued_job

pytestmark = pytest.mark.unit

SERVER_NOW = 1_800_000_000.0  # nats-server's clock as the watch began
READ_AT = 700.0  # the reader's monotonic clock then
START = WatchStart(last_seq=10, server_time=SERVER_NOW, read_at=READ_AT)
BUCKET = "queues"
MODEL = "demo"


def test_a_write_the_watch_delivers_as_it_happens_was_written_as_it_arrived() -> None:
    assert written_at(START, seq=11, stored_time=SERVER_NOW - 100.0, received_at=750.0) == 750.0
    assert written_at(None, seq=3, stored_time=SERVER_NOW - 100.0, received_at=750.0) == 750.0


def test_a_keys_last_value_at_the_watchs_start_is_as_old_as_the_server_says() -> None:
    # Stored 10 s before the server's time at the start: 10 s before the start, whenever it arrives.
    assert written_at(START, seq=10, stored_time=SERVER_NOW - 10.0, received_at=700.2) == READ_AT - 10.0
    assert written_at(START, seq=4, stored_time=SERVER_NOW - 10.0, received_at=701.0) == READ_AT - 10.0
    # A stamp past the server's time (it cannot be): written as the watch began, not in the future.
    assert written_at(START, seq=10, stored_time=SERVER_NOW + 3.0, received_at=700.1) == READ_AT
    # The server's times unknown (older than 2.10, or no stamp): as it arrived.
    no_time = WatchStart(last_seq=10, server_time=None, read_at=READ_AT)
    assert written_at(no_time, seq=10, stored_time=SERVER_NOW - 10.0, received_at=700.2) == 700.2
    assert written_at(START, seq=10, stored_time=None, received_at=700.2) == 700.2


def test_fresh_while_written_within_snapshot_stale_s_by_the_readers_clock() -> None:
    assert is_fresh(100.0, 100.0)
    assert is_fresh(100.0, 100.0 + SNAPSHOT_STALE_S)
    assert not is_fresh(100.0, 100.0 + SNAPSHOT_STALE_S + 0.01)


# --- the gateway's view, its watch faked ---------------------------------------------------------


@dataclass
class Clocks:
    wall: float = SERVER_NOW + 3_600.0  # the gateway's wall clock: an hour ahead of everyone's
    mono: float = READ_AT


class Bucket:
    """The queues bucket as the view's start sees it: a stream info (the raw request) and the
    watch's subscriptions, whose callbacks the test calls with what the watch would deliver."""

    def __init__(self, last_seq: int) -> None:
        self.last_seq = last_seq
        self.callbacks: dict[str, Callable[[Msg], Awaitable[None]]] = {}

    async def request(self, _subject: str, _payload: bytes, **_options: Any) -> Any:
        ts = datetime.fromtimestamp(SERVER_NOW, UTC).isoformat().replace("+00:00", "Z")
        return SimpleNamespace(data=msgspec.json.encode({"state": {"last_seq": self.last_seq}, "ts": ts}))

    async def subscribe(self, subject: str, *, cb: Callable[[Msg], Awaitable[None]], **_options: Any) -> Any:
        self.callbacks[subject] = cb
        return SimpleNamespace()

    async def deliver(self, snapshot: QueueSnapshot, *, seq: int, stored_time: float) -> None:
        msg = SimpleNamespace(
            subject=f"{kv_subject_prefix(BUCKET)}{MODEL}",
            headers=None,
            data=encode_snapshot(snapshot),
            metadata=SimpleNamespace(
                sequence=SimpleNamespace(stream=seq), timestamp=datetime.fromtimestamp(stored_time, UTC)
            ),
        )
        await self.callbacks[f"{kv_subject_prefix(BUCKET)}*"](cast(Msg, msg))


def served_by(scheduler: str, *, updated_at: float) -> QueueSnapshot:
    return QueueSnapshot(
        model_name=MODEL,
        updated_at=updated_at,
        priorities={Priority.NORMAL.value: PriorityQueueSnapshot(2, updated_at - 5.0, updated_at - 1.0)},
        connected_batchers=1,
        scheduler=scheduler,
    )


async def started_view(clocks: Clocks, bucket: Bucket) -> QueueView:
    view = QueueView(
        cast(JetStreamContext, bucket),
        cast(Client, bucket),
        bucket=BUCKET,
        clock=lambda: clocks.wall,
        monotonic=lambda: clocks.mono,
    )
    await view.start()
    return view


async def test_the_gateways_view_judges_a_skewed_schedulers_snapshots_by_its_own_clock() -> None:
    """The gateway's wall clock is an hour ahead of the scheduler's: its snapshot, delivered as it
    is written, is fresh for SNAPSHOT_STALE_S by the gateway's monotonic clock (it was stale on
    arrival), then not (NO_WORKER)."""
    clocks = Clocks()
    bucket = Bucket(last_seq=0)
    view = await started_view(clocks, bucket)
    await bucket.deliver(served_by("a", updated_at=SERVER_NOW), seq=1, stored_time=SERVER_NOW)
    job = queued_job(clocks.wall)
    assert view.is_fresh(MODEL)
    assert view.reporting(MODEL) == ["a"]
    standing = view.standing(job)
    assert standing is not None
    assert standing.waiting_reason == WaitingReason.WAITING_FOR_CAPACITY
    clocks.mono += SNAPSHOT_STALE_S
    assert view.is_fresh(MODEL)
    clocks.mono += 0.1  # no write since: its scheduler is gone
    assert not view.is_fresh(MODEL)
    assert view.reporting(MODEL) == []
    standing = view.standing(job)
    assert standing is not None
    assert standing.waiting_reason == WaitingReason.NO_WORKER


async def test_the_last_value_at_the_gateways_start_is_fresh_for_what_is_left_of_its_age() -> None:
    """The watch's first delivery is the key's last value, stored 10 s before the gateway started
    (by the server's clock; the writer's `updated_at` says an hour ago, the gateway's wall clock two):
    fresh for 5 s more, whatever the wall clocks say; a write after the start, as it arrives."""
    clocks = Clocks()
    bucket = Bucket(last_seq=7)
    view = await started_view(clocks, bucket)
    clocks.mono += 0.5
    await bucket.deliver(served_by("a", updated_at=SERVER_NOW - 3_600.0), seq=7, stored_time=SERVER_NOW - 10.0)
    assert view.reporting(MODEL) == ["a"]
    clocks.mono = READ_AT + SNAPSHOT_STALE_S - 10.0  # 15 s after it was stored
    assert view.is_fresh(MODEL)
    clocks.mono += 0.1
    assert not view.is_fresh(MODEL)
    # B writes after the start (its stamp is older than the start's, by a skewed server clock even):
    # fresh from its arrival.
    await bucket.deliver(served_by("b", updated_at=SERVER_NOW), seq=8, stored_time=SERVER_NOW - 30.0)
    assert view.reporting(MODEL) == ["b"]
    clocks.mono += SNAPSHOT_STALE_S
    assert view.reporting(MODEL) == ["b"]
