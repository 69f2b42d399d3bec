"""The gateway's queued-job estimate (services.gateway.queue_view) when the wall clock steps back,
as a laptop's NTP sync after a resume or a VM's clock being set does, while the monotonic clock
runs on: the jobs this gateway queued are counted until a snapshot or a read counts them, and no
longer than that (before session 28 every job queued after a step back of a minute counted for that
minute on top of the snapshot's depth: QUEUE_FULL for a queue that was not full)."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import cast

import pytest

from asyncinfer.contract import kv_subject_prefix
from asyncinfer.jobs import Priority
from asyncinfer.nats import Msg
from asyncinfer.queues import PriorityQueueSnapshot, QueueSnapshot, encode_snapshot
from services.gateway.queue_view import QueueView
from tests.unit.queue_view_fakes import BUCKET, MODEL, Clocks, Consumers, view_with

pytestmark = pytest.mark.unit

STEP_BACK_S = 60.0


async def snapshot_arrives(view: QueueView, *, depth: int, taken_at: float) -> None:
    """The scheduler's snapshot of the model's queue (its clock: the same host's, as in `up`)."""
    snapshot = QueueSnapshot(
        model_name=MODEL, updated_at=taken_at, priorities={Priority.NORMAL.value: PriorityQueueSnapshot(depth=depth)}
    )
    msg = SimpleNamespace(
        subject=f"{kv_subject_prefix(BUCKET)}{MODEL}",
        headers=None,
        data=encode_snapshot(snapshot),
        metadata=SimpleNamespace(timestamp=datetime.fromtimestamp(taken_at, UTC)),  # nats-server's stamp
    )
    await view._watch.deliver(cast(Msg, msg))


async def test_jobs_queued_across_a_step_back_stop_counting_once_snapshots_count_them() -> None:
    clocks = Clocks()
    view = view_with(clocks)
    await snapshot_arrives(view, depth=0, taken_at=clocks.wall)
    clocks.pass_s(0.5)
    for _ in range(5):
        view.reserve(MODEL)
    assert view.estimated_depth(MODEL) == 5
    clocks.wall -= STEP_BACK_S  # the clock is set back a minute
    clocks.pass_s(0.1)
    for _ in range(5):
        view.reserve(MODEL)
    # Two snapshots, each taken after all ten were queued, count them: nothing more is added.
    for _ in range(2):
        clocks.pass_s(2.0)
        await snapshot_arrives(view, depth=10, taken_at=clocks.wall)
    assert view.estimated_depth(MODEL) == 10
    # Jobs queued after the latest snapshot still count on top of it.
    view.reserve(MODEL)
    assert view.estimated_depth(MODEL) == 11
    clocks.pass_s(2.0)
    await snapshot_arrives(view, depth=11, taken_at=clocks.wall)
    assert view.estimated_depth(MODEL) == 11


async def test_a_read_of_the_queue_after_a_step_back_counts_every_job_queued_before_it() -> None:
    clocks = Clocks()
    consumers = Consumers()
    view = view_with(clocks, consumers)
    await snapshot_arrives(view, depth=0, taken_at=clocks.wall)
    clocks.pass_s(0.5)
    for _ in range(5):
        view.reserve(MODEL)
    clocks.wall -= STEP_BACK_S
    clocks.pass_s(0.1)
    for _ in range(5):
        view.reserve(MODEL)
    consumers.pending = 10
    await view.confirm_depth(MODEL)
    assert view.estimated_depth(MODEL) == 10
    # A token still takes back its own reservation only.
    token = view.reserve(MODEL)
    view.reserve(MODEL)
    view.release(MODEL, token)
    assert view.estimated_depth(MODEL) == 11
