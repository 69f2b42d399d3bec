"""A queued job's position with the gateway's wall clock off nats-server's, as on Kubernetes nodes
whose clocks disagree: within a priority a job's time is compared with nats-server's stamps on the
queue's oldest and newest messages, so it must be on the server's clock too. It is the server's own
stamp on the job's work message where the gateway read that message (a GetJob of a queued job reads
it anyway: JobStore.queued), else its create_time (the gateway's clock) moved by the offset the
gateway measured from the server's stamps on the snapshots its watch delivers (no request more).

Before, create_time was compared with the stamps as it was, allowing NEWEST_SLACK_S (50 ms): with
the gateway 15 s ahead of the server every job read "behind all of them" (the depth), and with it
15 s behind every job read 0."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import cast

import pytest

from asyncinfer.contract import kv_subject_prefix
from asyncinfer.jobs import Priority
from asyncinfer.nats import Msg
from asyncinfer.queues import PriorityQueueSnapshot, QueueSnapshot, encode_snapshot
from asyncinfer.server_clock import SAMPLES_KEPT, ServerClockOffset
from services.gateway.queue_view import QueueView, jobs_ahead
from tests.unit.queue_view_fakes import BUCKET, MODEL, Clocks, position, queued_job, view_with

pytestmark = pytest.mark.unit

SKEWS_S = (15.0, -15.0)  # the gateway's clock ahead of nats-server's, then behind it
PUBLISH_S = 0.002  # from a job's create_time to the server's storing its message
DELIVERY_S = 0.001  # from the server's storing a snapshot to its arrival at the gateway


async def snapshot_arrives(view: QueueView, clocks: Clocks, *, depth: int, oldest: float, newest: float | None) -> None:
    """A snapshot written now (the scheduler's clock plays no part: updated_at is not read), stored
    by nats-server at its clock's now and delivered DELIVERY_S later."""
    snapshot = QueueSnapshot(
        model_name=MODEL,
        updated_at=clocks.server,
        priorities={Priority.NORMAL.value: PriorityQueueSnapshot(depth, oldest, newest)},
        connected_batchers=1,
    )
    stored = clocks.server
    clocks.pass_s(DELIVERY_S)
    msg = SimpleNamespace(
        subject=f"{kv_subject_prefix(BUCKET)}{MODEL}",
        headers=None,
        data=encode_snapshot(snapshot),
        metadata=SimpleNamespace(timestamp=datetime.fromtimestamp(stored, UTC)),
    )
    await view._watch.deliver(cast(Msg, msg))


@pytest.mark.parametrize("gateway_ahead_s", SKEWS_S)
async def test_jobs_this_gateway_queued_are_placed_in_order_whatever_the_servers_clock(gateway_ahead_s: float) -> None:
    """Five jobs queued 0.1 s apart through this gateway (their QUEUED records as its submit kept
    them: create_time only), a snapshot a second later: 0..4 (before: 5 each with the gateway ahead,
    0 each behind)."""
    clocks = Clocks(gateway_ahead_s=gateway_ahead_s)
    view = view_with(clocks)
    jobs, stamps = [], []
    for i in range(5):
        jobs.append(queued_job(clocks.wall, job_id=f"j{i}"))
        stamps.append(clocks.server + PUBLISH_S)
        clocks.pass_s(0.1)
    clocks.pass_s(1.0)
    await snapshot_arrives(view, clocks, depth=5, oldest=stamps[0], newest=stamps[-1])
    assert [position(view, job) for job in jobs] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("gateway_ahead_s", SKEWS_S)
async def test_jobs_read_from_their_work_messages_are_placed_by_the_servers_stamps(gateway_ahead_s: float) -> None:
    """Read from their work messages (GetJob of a queued job), the jobs carry the server's stamps:
    placed by them, whatever the create_time of the gateway that queued them said (here one 40 s
    off both)."""
    clocks = Clocks(gateway_ahead_s=gateway_ahead_s)
    view = view_with(clocks)
    stamps = [clocks.server + i / 10 for i in range(5)]
    jobs = [queued_job(stamp + 40.0, work_message_time=stamp, job_id=f"j{i}") for i, stamp in enumerate(stamps)]
    clocks.pass_s(1.5)
    await snapshot_arrives(view, clocks, depth=5, oldest=stamps[0], newest=stamps[-1])
    assert [position(view, job) for job in jobs] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("gateway_ahead_s", SKEWS_S)
async def test_a_job_queued_after_the_snapshot_is_behind_all_of_it_whatever_the_servers_clock(
    gateway_ahead_s: float,
) -> None:
    """Queued after the snapshot was written: behind its three jobs, by its create_time or by its
    message's stamp; and a job the snapshot counts, read from its message, is not (the stamp is
    compared with when the snapshot was written on the server's clock)."""
    clocks = Clocks(gateway_ahead_s=gateway_ahead_s)
    view = view_with(clocks)
    oldest = clocks.server
    clocks.pass_s(1.0)
    newest = clocks.server
    counted = queued_job(clocks.wall, work_message_time=newest)
    clocks.pass_s(0.5)
    await snapshot_arrives(view, clocks, depth=3, oldest=oldest, newest=newest)
    clocks.pass_s(0.5)
    assert position(view, counted) == 2
    assert position(view, queued_job(clocks.wall)) == 3
    assert position(view, queued_job(clocks.wall, work_message_time=clocks.server + PUBLISH_S)) == 3


def test_jobs_ahead_compares_on_the_servers_clock() -> None:
    """The pure rule: a job's stamp where it has one, else its create_time plus the server's offset;
    the snapshot's write time moved by the same offset."""
    burst = QueueSnapshot(
        model_name=MODEL, updated_at=0.0, priorities={Priority.NORMAL.value: PriorityQueueSnapshot(3, 100.0, 100.2)}
    )
    for offset in (15.0, -15.0):  # the server's clock less the gateway's
        gateway = [100.0 + i / 10 - offset for i in range(3)]
        written = 101.0 - offset
        assert [
            jobs_ahead(queued_job(t), burst, written_wall_time=written, server_offset_s=offset) for t in gateway
        ] == [0, 1, 2]
        stamped = [queued_job(0.0, work_message_time=100.0 + i / 10) for i in range(3)]
        assert [jobs_ahead(job, burst, written_wall_time=written, server_offset_s=offset) for job in stamped] == [
            0,
            1,
            2,
        ]
        assert jobs_ahead(queued_job(101.5 - offset), burst, written_wall_time=written, server_offset_s=offset) == 3


def test_the_offset_is_the_least_delayed_of_the_recent_samples() -> None:
    """Each sample is the offset less its message's way: the largest of the last SAMPLES_KEPT; a
    step of the reader's clock back is followed at once, forward after SAMPLES_KEPT samples."""
    offset = ServerClockOffset()
    assert offset.offset_s == 0.0
    for delay in (0.004, 0.001, 0.030):
        offset.sample(1_000.0, 1_015.0 + delay)  # the reader 15 s ahead
    assert offset.offset_s == pytest.approx(-15.001)
    offset.sample(1_000.0, 995.0)  # the reader's clock stepped 20 s back
    assert offset.offset_s == pytest.approx(5.0)
    for _ in range(SAMPLES_KEPT):
        offset.sample(1_000.0, 1_015.001)  # and forward again
    assert offset.offset_s == pytest.approx(-15.001)
