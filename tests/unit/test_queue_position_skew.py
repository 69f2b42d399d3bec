"""A queued job's position and admission's count of the jobs a gateway queued since a snapshot, with
the scheduler's wall clock (a snapshot's `updated_at`) off the gateway's, as on Kubernetes nodes whose
clocks disagree. The gateway's `create_time` is compared only with times of its own clock (when the
snapshot was written, on the gateway's monotonic clock, read as its wall time) and, for the place
within a priority, with nats-server's stamps on the queued messages (the server here on the gateway's
clock, as in the tests' stacks); its reservations end on its monotonic clock alone.

Before (session 29), `updated_at` stood for "now" on the gateway's clock: with the gateway 15 s ahead,
a burst queued within 15 s of a snapshot read "behind all of them" (each job's position the depth), a
job alone in its queue read 1, and a job this gateway queued stayed counted on top of the snapshot that
counted it (counted twice for a snapshot interval), as did a read of the queue older than the snapshot;
with the gateway 15 s behind, a job queued after a snapshot of one job read 0, and a scheduler of the
release before (no newest time) spread the jobs to its clock's "now", 15 s off."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import cast

import pytest

from asyncinfer.contract import kv_subject_prefix
from asyncinfer.jobs import Priority
from asyncinfer.nats import Msg
from asyncinfer.queues import PriorityQueueSnapshot, QueueSnapshot, encode_snapshot
from services.gateway.queue_view import QueueView, jobs_ahead
from tests.unit.queue_view_fakes import BUCKET, MODEL, Clocks, Consumers, position, queued_job, view_with

pytestmark = pytest.mark.unit

SKEWS_S = (15.0, -15.0)  # the gateway's clock ahead of the scheduler's, then behind it


async def snapshot_arrives(
    view: QueueView,
    clocks: Clocks,
    *,
    gateway_ahead_s: float,
    depth: int,
    oldest: float | None = None,
    newest: float | None = None,
) -> None:
    """The scheduler's snapshot, taken now and delivered at once: its `updated_at` is the scheduler's
    clock, `gateway_ahead_s` behind the gateway's; its oldest and newest times nats-server's."""
    snapshot = QueueSnapshot(
        model_name=MODEL,
        updated_at=clocks.wall - gateway_ahead_s,
        priorities={Priority.NORMAL.value: PriorityQueueSnapshot(depth, oldest, newest)},
        connected_batchers=1,
    )
    msg = SimpleNamespace(
        subject=f"{kv_subject_prefix(BUCKET)}{MODEL}",
        headers=None,
        data=encode_snapshot(snapshot),
        metadata=SimpleNamespace(timestamp=datetime.fromtimestamp(clocks.wall, UTC)),  # the server's stamp
    )
    await view._watch.deliver(cast(Msg, msg))


# --- positions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("gateway_ahead_s", SKEWS_S)
async def test_a_burst_read_a_second_later_is_placed_in_order_whatever_the_skew(gateway_ahead_s: float) -> None:
    """Five jobs queued within 0.4 s, the snapshot taken a second later: 0..4 (with the gateway 15 s
    ahead, each read 5 before: created "after" the scheduler's updated_at)."""
    clocks = Clocks()
    view = view_with(clocks)
    jobs = [queued_job(clocks.wall + i / 10) for i in range(5)]
    clocks.pass_s(1.4)
    await snapshot_arrives(
        view,
        clocks,
        gateway_ahead_s=gateway_ahead_s,
        depth=5,
        oldest=jobs[0].create_time,
        newest=jobs[-1].create_time,
    )
    assert [position(view, job) for job in jobs] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("gateway_ahead_s", SKEWS_S)
async def test_a_job_alone_in_its_queue_is_first_whatever_the_skew(gateway_ahead_s: float) -> None:
    """A snapshot of one job has no newest time (the scheduler reads it only for two or more): the job
    itself is first (it read 1 with the gateway ahead)."""
    clocks = Clocks()
    view = view_with(clocks)
    job = queued_job(clocks.wall)
    clocks.pass_s(1.0)
    await snapshot_arrives(view, clocks, gateway_ahead_s=gateway_ahead_s, depth=1, oldest=job.create_time)
    assert position(view, job) == 0


@pytest.mark.parametrize("gateway_ahead_s", SKEWS_S)
async def test_a_job_queued_after_the_snapshot_is_behind_all_of_them_whatever_the_skew(
    gateway_ahead_s: float,
) -> None:
    """Queued after the snapshot arrived: behind every job it counts, one (it read 0 with the gateway
    behind: before the scheduler's updated_at) or several."""
    for depth in (1, 3):
        clocks = Clocks()
        view = view_with(clocks)
        first = clocks.wall
        clocks.pass_s(1.0)
        newest = clocks.wall if depth > 1 else None
        await snapshot_arrives(view, clocks, gateway_ahead_s=gateway_ahead_s, depth=depth, oldest=first, newest=newest)
        clocks.pass_s(0.5)
        assert position(view, queued_job(clocks.wall)) == depth


@pytest.mark.parametrize("gateway_ahead_s", SKEWS_S)
async def test_a_snapshot_without_a_newest_time_spreads_its_jobs_up_to_when_it_was_written(
    gateway_ahead_s: float,
) -> None:
    """A scheduler of the release before says only the oldest: its ten jobs, one a second, are spread
    from the oldest to when the snapshot was written on the gateway's clock (to the scheduler's
    updated_at before: the sixth read 2 with the gateway 15 s behind, 10 with it ahead)."""
    clocks = Clocks()
    view = view_with(clocks)
    jobs = [queued_job(clocks.wall + i) for i in range(10)]
    clocks.pass_s(10.0)
    await snapshot_arrives(view, clocks, gateway_ahead_s=gateway_ahead_s, depth=10, oldest=jobs[0].create_time)
    assert position(view, jobs[5]) == 5


def test_jobs_ahead_dates_the_snapshot_by_when_it_was_written_on_the_readers_clock() -> None:
    """The pure rule: `written_wall_time` (the gateway's clock) says what was queued after the
    snapshot, whatever the scheduler's `updated_at` says."""
    burst = PriorityQueueSnapshot(3, 100.0, 100.2)
    for updated_at in (85.0, 115.0):  # the scheduler's clock 15 s behind, then ahead
        snap = QueueSnapshot(model_name=MODEL, updated_at=updated_at, priorities={Priority.NORMAL.value: burst})
        assert [jobs_ahead(queued_job(100.0 + i / 10), snap, written_wall_time=101.0) for i in range(3)] == [0, 1, 2]
        assert jobs_ahead(queued_job(101.5), snap, written_wall_time=101.0) == 3
        alone = QueueSnapshot(
            model_name=MODEL, updated_at=updated_at, priorities={Priority.NORMAL.value: PriorityQueueSnapshot(1, 100.0)}
        )
        assert jobs_ahead(queued_job(100.0), alone, written_wall_time=101.0) == 0
        assert jobs_ahead(queued_job(101.5), alone, written_wall_time=101.0) == 1


# --- admission's count --------------------------------------------------------------------------


@pytest.mark.parametrize("gateway_ahead_s", SKEWS_S)
async def test_jobs_this_gateway_queued_count_until_a_snapshot_written_after_them(gateway_ahead_s: float) -> None:
    """Three jobs queued, then a snapshot counting them: 3, not 6 (with the gateway ahead they counted
    on top of it until the next snapshot); a job queued after it counts on top of it, until the next."""
    clocks = Clocks()
    view = view_with(clocks)
    await snapshot_arrives(view, clocks, gateway_ahead_s=gateway_ahead_s, depth=0)
    clocks.pass_s(0.5)
    for _ in range(3):
        view.reserve(MODEL)
    assert view.estimated_depth(MODEL) == 3
    clocks.pass_s(1.5)
    await snapshot_arrives(view, clocks, gateway_ahead_s=gateway_ahead_s, depth=3)
    assert view.estimated_depth(MODEL) == 3
    clocks.pass_s(0.1)
    view.reserve(MODEL)
    assert view.estimated_depth(MODEL) == 4
    clocks.pass_s(2.0)
    await snapshot_arrives(view, clocks, gateway_ahead_s=gateway_ahead_s, depth=4)
    assert view.estimated_depth(MODEL) == 4


@pytest.mark.parametrize("gateway_ahead_s", SKEWS_S)
async def test_a_read_of_the_queue_stands_until_a_snapshot_written_after_it(gateway_ahead_s: float) -> None:
    """A read of the work consumers (before a refusal) says 5; two are dispatched and a snapshot
    written after the read says 3: 3 (with the gateway ahead, the read's 5 stood until the next
    snapshot). A read after a snapshot stands over it."""
    clocks = Clocks()
    consumers = Consumers()
    view = view_with(clocks, consumers)
    await snapshot_arrives(view, clocks, gateway_ahead_s=gateway_ahead_s, depth=0)
    clocks.pass_s(0.5)
    consumers.pending = 5
    await view.confirm_depth(MODEL)
    assert view.estimated_depth(MODEL) == 5
    clocks.pass_s(1.5)
    await snapshot_arrives(view, clocks, gateway_ahead_s=gateway_ahead_s, depth=3)
    assert view.estimated_depth(MODEL) == 3
    clocks.pass_s(0.5)
    consumers.pending = 2
    await view.confirm_depth(MODEL)
    assert view.estimated_depth(MODEL) == 2
