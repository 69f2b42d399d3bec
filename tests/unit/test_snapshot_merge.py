"""One model's queue as several schedulers report it (asyncinfer.snapshot_merge): each writes
the model's one key with its own batchers, credits, rates and drain, and the gateway answers from
their merge. Before session 29 the key's last write was the answer: one batcher on scheduler A, and
every write of scheduler B (no batcher) made the queued jobs say NO_WORKER."""

from __future__ import annotations

import functools
from dataclasses import replace
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import cast

import pytest

from asyncinfer.contract import kv_subject_prefix
from asyncinfer.jobs import JobRecord, JobState, Priority
from asyncinfer.nats import Client, JetStreamContext, Msg
from asyncinfer.queues import SNAPSHOT_STALE_S, PriorityQueueSnapshot, QueueSnapshot, encode_snapshot
from asyncinfer.snapshot_merge import (
    HeldSnapshot,
    SchedulerSnapshots,
    cluster_queue,
    merge_snapshots,
    stopped_snapshot,
)
from services.gateway import queue_view
from services.gateway.queue_view import QueueView, WaitingReason

pytestmark = pytest.mark.unit

NOW = 1_800_000_000.0  # the writers' wall clock (the same host's here)
MONO = 5_000.0  # the reader's monotonic clock, which freshness is judged on
MODEL = "demo"
# The snapshots read as written now, by the reader's clock too.
waiting_reason = functools.partial(queue_view.waiting_reason, written_wall_time=NOW)


def from_scheduler(
    scheduler: str,
    *,
    age_s: float = 0.0,
    batchers: int = 0,
    free: int = 0,
    in_flight: int = 0,
    rate: float = 0.0,
    draining: bool = False,
    depth: int = 3,
    desired: int = 0,
) -> HeldSnapshot:
    """Written `age_s` ago, by both clocks."""
    return HeldSnapshot(
        written_at=MONO - age_s,
        snapshot=QueueSnapshot(
            model_name=MODEL,
            updated_at=NOW - age_s,
            priorities={Priority.NORMAL.value: PriorityQueueSnapshot(depth, NOW - 10.0 - age_s, NOW - 5.0 - age_s)},
            in_flight=in_flight,
            connected_batchers=batchers,
            free_credits=free,
            completed_per_s=rate,
            desired_batchers=desired,
            draining=draining,
            scheduler=scheduler,
        ),
    )


def stopped(held: HeldSnapshot) -> HeldSnapshot:
    return replace(held, snapshot=replace(held.snapshot, stopped=True))


def arrives(held: SchedulerSnapshots, snapshot: HeldSnapshot, now: float = MONO) -> QueueSnapshot:
    return held.arrived(snapshot.snapshot, written_at=snapshot.written_at, now=now).snapshot


def merged_of(snapshots: list[HeldSnapshot], now: float = MONO) -> QueueSnapshot:
    merged = merge_snapshots(snapshots, now)
    assert merged is not None
    return merged.snapshot


def queued_job() -> JobRecord:
    return JobRecord(
        job_id="j",
        tenant="default",
        model_name=MODEL,
        model_version="1",
        state=JobState.QUEUED,
        priority=Priority.NORMAL,
        create_time=NOW - 7.0,
        update_time=NOW - 7.0,
        max_attempts=3,
        result_retention_s=60,
    )


def test_batchers_credits_in_flight_and_rates_add_up() -> None:
    a = from_scheduler("a", age_s=1.0, batchers=1, free=2, in_flight=4, rate=3.0, depth=3, desired=2)
    b = from_scheduler("b", batchers=2, free=1, in_flight=1, rate=1.5, depth=5, desired=3)
    merged = merged_of([a, b])
    assert (merged.connected_batchers, merged.free_credits, merged.in_flight) == (3, 3, 5)
    assert merged.completed_per_s == 4.5
    assert merged.desired_batchers == 3  # each asks for the whole backlog: the larger
    # Depths and their times are one read of the shared consumers: the newest snapshot's, and its time.
    assert (merged.priorities, merged.updated_at) == (b.snapshot.priorities, b.snapshot.updated_at)
    assert not merged.draining


def with_put_back(held: HeldSnapshot, *, pending: int, put_back: int, oldest: float | None) -> HeldSnapshot:
    """`held` whose NORMAL depth is `pending` (the consumer's) plus `put_back` of its own, the oldest
    of those stored at `oldest`."""
    normal = held.snapshot.priorities[Priority.NORMAL.value]
    own = replace(
        normal,
        depth=pending + put_back,
        oldest_create_time=min(t for t in (normal.oldest_create_time, oldest) if t is not None),
        put_back=put_back,
        put_back_oldest_create_time=oldest,
    )
    return replace(held, snapshot=replace(held.snapshot, priorities={Priority.NORMAL.value: own}))


def read_unacknowledged(held: HeldSnapshot, count: int) -> HeldSnapshot:
    """`held` whose writer read `count` unacknowledged deliveries on the consumer with its put-backs."""
    priorities = {key: replace(p, ack_pending=count) for key, p in held.snapshot.priorities.items()}
    return replace(held, snapshot=replace(held.snapshot, priorities=priorities))


def test_the_depth_is_the_newest_pending_plus_every_schedulers_own_put_backs() -> None:
    """A's 2 put-backs counted whichever scheduler wrote last (the newest's depth alone flipped
    between 5 and 3), B's 1 too, the pending once; the oldest time a put-back's of A's where older."""
    a = with_put_back(from_scheduler("a", age_s=1.0), pending=4, put_back=2, oldest=NOW - 60.0)
    b = with_put_back(from_scheduler("b"), pending=3, put_back=1, oldest=None)  # still in its backoff
    merged = merged_of([a, b]).priorities[Priority.NORMAL.value]
    assert (merged.depth, merged.put_back) == (3 + 2 + 1, 3)  # B's pending, the newer read
    assert merged.oldest_create_time == NOW - 60.0
    assert merged.put_back_oldest_create_time == NOW - 60.0
    assert merged.newest_create_time == b.snapshot.priorities[Priority.NORMAL.value].newest_create_time
    # A stale scheduler's put-backs leave with it.
    stale = replace(a, written_at=MONO - SNAPSHOT_STALE_S - 1.0)
    fresh_c = from_scheduler("c", age_s=2.0)
    alone = merged_of([stale, b, fresh_c]).priorities[Priority.NORMAL.value]
    assert (alone.depth, alone.put_back) == (4, 1)


def test_the_merge_counts_no_more_put_backs_than_the_consumers_unacknowledged_deliveries() -> None:
    """One job pulled and put back by both A and B (neither wrote its record): each counts it; the
    consumer holds one unacknowledged delivery, so the merge counts one."""
    a = with_put_back(from_scheduler("a", age_s=1.0), pending=0, put_back=1, oldest=NOW - 30.0)
    b = with_put_back(from_scheduler("b"), pending=0, put_back=1, oldest=NOW - 30.0)
    merged = merged_of([read_unacknowledged(a, 1), read_unacknowledged(b, 1)]).priorities[Priority.NORMAL.value]
    assert (merged.depth, merged.put_back) == (1, 1)
    # Two jobs, one on each: two unacknowledged deliveries, as the newer read says.
    two = merged_of([read_unacknowledged(a, 1), read_unacknowledged(b, 2)]).priorities[Priority.NORMAL.value]
    assert two.depth == 2


def test_a_scheduler_without_batchers_does_not_make_the_model_look_unserved() -> None:
    a = from_scheduler("a", age_s=1.0, batchers=1)
    b = from_scheduler("b", batchers=0)  # written last: the key's value, which the gateway read alone
    merged = merged_of([a, b])
    assert merged.connected_batchers == 1
    assert waiting_reason(queued_job(), merged, paused=False, fresh=True) == WaitingReason.WAITING_FOR_CAPACITY
    # The last write alone:
    assert waiting_reason(queued_job(), b.snapshot, paused=False, fresh=True) == WaitingReason.NO_WORKER


@pytest.mark.parametrize(
    ("a_draining", "a_batchers", "b_draining", "b_batchers", "draining"),
    [
        (False, 1, True, 0, False),  # the one without batchers drains: A still dispatches
        (False, 1, True, 1, False),  # one of two serving schedulers drains: the other dispatches
        (True, 1, False, 0, True),  # the only one with a batcher drains: nothing dispatches
        (True, 1, True, 1, True),  # every one drains
        (True, 0, False, 0, False),  # no batcher anywhere, one not draining: NO_WORKER says why
        (True, 0, True, 0, True),  # every one drains (as with one scheduler: DRAINING before NO_WORKER)
    ],
)
def test_draining_when_every_scheduler_that_could_dispatch_drains(
    a_draining: bool, a_batchers: int, b_draining: bool, b_batchers: int, draining: bool
) -> None:
    a = from_scheduler("a", batchers=a_batchers, draining=a_draining)
    b = from_scheduler("b", batchers=b_batchers, draining=b_draining)
    assert merged_of([a, b]).draining is draining


def test_a_draining_schedulers_free_slots_and_rate_take_no_queued_job() -> None:
    a = from_scheduler("a", batchers=1, free=4, rate=8.0, draining=True)
    b = from_scheduler("b", batchers=1, free=1, rate=2.0)
    merged = merged_of([a, b])
    assert (merged.free_credits, merged.completed_per_s, merged.connected_batchers) == (1, 2.0, 2)
    both = merged_of([a, replace(b, snapshot=replace(b.snapshot, draining=True))])  # all drain: all, as with one
    assert (both.free_credits, both.completed_per_s) == (5, 10.0)


def test_stale_snapshots_are_left_out_and_all_stale_is_the_newest() -> None:
    gone = from_scheduler("a", age_s=SNAPSHOT_STALE_S + 1.0, batchers=5, free=5, rate=9.0, draining=True)
    live = from_scheduler("b", batchers=1, free=1, rate=1.0)
    assert merge_snapshots([gone, live], MONO) is live  # one fresh: itself, as it was written
    older = replace(gone, written_at=MONO - SNAPSHOT_STALE_S - 5.0)
    assert merge_snapshots([gone, older], MONO) is gone  # stale: says nobody looks after the model
    assert merge_snapshots([], MONO) is None


def test_freshness_and_newest_are_the_readers_monotonic_clock_not_the_writers_wall_clock() -> None:
    """Scheduler A's host is 60 s behind the reader's, B's 60 s ahead. Judged by `updated_at`
    against the reader's wall clock, A's snapshot just received was stale (NO_WORKER for a served
    model) and B's, 16 s after its last write, fresh for another minute; and B's was the newest,
    whose depths the merge carries, whichever was written last."""
    behind = from_scheduler("a", batchers=1, free=1, depth=4)
    behind = replace(behind, snapshot=replace(behind.snapshot, updated_at=NOW - 60.0))
    ahead = from_scheduler("b", age_s=SNAPSHOT_STALE_S + 1.0, batchers=2, depth=9)
    ahead = replace(ahead, snapshot=replace(ahead.snapshot, updated_at=NOW + 60.0))
    merged = merge_snapshots([behind, ahead], MONO)
    assert merged is behind  # B's gone; A's counts
    assert waiting_reason(queued_job(), merged.snapshot, paused=False, fresh=True) == (
        WaitingReason.WAITING_FOR_CAPACITY
    )
    both = merged_of([behind, replace(ahead, written_at=MONO - 1.0)])
    assert both.connected_batchers == 3
    assert both.total_depth == 4  # A's, written last by the reader's clock


def test_each_schedulers_latest_counts_and_unnamed_ones_count_as_one() -> None:
    held = SchedulerSnapshots()
    assert arrives(held, from_scheduler("a", age_s=2.0, batchers=1)).connected_batchers == 1
    assert arrives(held, from_scheduler("b", age_s=1.0, batchers=0)).connected_batchers == 1
    assert arrives(held, from_scheduler("a", batchers=2)).connected_batchers == 2  # A's latest replaces A's
    # Schedulers of the release before name none: the last write among them wins, as it did.
    assert arrives(held, from_scheduler("", batchers=3)).connected_batchers == 5
    assert arrives(held, from_scheduler("", batchers=1)).connected_batchers == 3
    held.forget(MODEL)
    assert arrives(held, from_scheduler("b", batchers=0)).connected_batchers == 0


def test_a_stale_schedulers_snapshot_is_dropped_at_the_next_arrival() -> None:
    held = SchedulerSnapshots()
    arrives(held, from_scheduler("a", batchers=1, draining=True))
    arrives(held, from_scheduler("b", batchers=1))
    later = MONO + SNAPSHOT_STALE_S + 1.0  # A stopped writing; B's heartbeat comes
    merged = arrives(held, replace(from_scheduler("b", batchers=1), written_at=later), later)
    assert (merged.connected_batchers, merged.draining) == (1, False)
    assert held._by_model[MODEL].keys() == {"b"}  # not kept for ever (a scheduler per restart)


async def test_the_queue_view_answers_from_the_merge_whichever_scheduler_wrote_last() -> None:
    """The watch's callback merges on arrival: a write of B (no batchers, draining) after A's leaves
    A's batcher counted and the job waiting for capacity, not NO_WORKER or DRAINING."""
    view = QueueView(cast(JetStreamContext, None), cast(Client, None), bucket="queues", clock=lambda: NOW)

    async def arrives(snapshot: QueueSnapshot) -> None:
        msg = SimpleNamespace(
            subject=f"{kv_subject_prefix('queues')}{MODEL}",
            headers=None,
            data=encode_snapshot(snapshot),
            metadata=SimpleNamespace(timestamp=datetime.fromtimestamp(NOW, UTC)),  # nats-server's stamp
        )
        await view._watch.deliver(cast(Msg, msg))

    await arrives(from_scheduler("a", age_s=0.5, batchers=1, rate=2.0).snapshot)
    await arrives(from_scheduler("b", batchers=0, draining=True).snapshot)
    standing = view.standing(queued_job())
    assert standing is not None
    assert standing.waiting_reason == WaitingReason.WAITING_FOR_CAPACITY
    assert standing.estimated_start_time is not None  # A's rate: B, draining, completes nothing queued
    assert view.estimated_depth(MODEL) == 3


def test_a_stopped_schedulers_last_snapshot_leaves_the_merge_as_it_arrives() -> None:
    """B stops in order (its last snapshot says `stopped`): the merge is A's at once, not after
    SNAPSHOT_STALE_S; meanwhile B's batchers, reconnected to A, counted twice."""
    held = SchedulerSnapshots()
    arrives(held, from_scheduler("a", age_s=1.0, batchers=1, in_flight=1))
    arrives(held, from_scheduler("b", batchers=2, in_flight=2, draining=True))
    assert held.reporting(MODEL, MONO) == ["a", "b"]
    last = stopped_snapshot(from_scheduler("b").snapshot, held.latest(MODEL), now=MONO, wall_time=NOW)
    merged = held.arrived(last, written_at=MONO, now=MONO).snapshot
    assert (merged.connected_batchers, merged.in_flight, merged.draining) == (1, 1, False)
    assert held.reporting(MODEL, MONO) == ["a"]
    # A's next write (B's batchers reconnected to it) drops B's entry for good.
    arrives(held, from_scheduler("a", batchers=3))
    assert held.latest(MODEL).keys() == {"a"}


def test_a_stopped_snapshot_says_what_the_others_report_without_it() -> None:
    """A gateway of the release before reads the key's last write as the whole queue: the last
    word says A's batcher, not "no batcher" (NO_WORKER until A's next write)."""
    a = from_scheduler("a", age_s=1.0, batchers=1, free=2, in_flight=1, rate=3.0, depth=4)
    b = from_scheduler("b", batchers=2, free=1, in_flight=2, rate=1.0, depth=5)
    stale = from_scheduler("c", age_s=SNAPSHOT_STALE_S + 1.0, batchers=7)  # killed: not counted again
    last = stopped_snapshot(b.snapshot, {"a": a, "b": b, "c": stale}, now=MONO, wall_time=NOW + 0.5)
    assert (last.scheduler, last.stopped, last.updated_at) == ("b", True, NOW + 0.5)
    assert (last.connected_batchers, last.free_credits, last.in_flight, last.completed_per_s) == (1, 2, 1, 3.0)
    assert last.priorities == a.snapshot.priorities
    assert waiting_reason(queued_job(), last, paused=False, fresh=True) == WaitingReason.WAITING_FOR_CAPACITY
    # The last scheduler standing: its own depths, nothing serving (NO_WORKER, which is so).
    alone = stopped_snapshot(replace(b.snapshot, draining=True), {"b": b, "c": stale}, now=MONO, wall_time=NOW)
    assert (alone.connected_batchers, alone.free_credits, alone.in_flight, alone.draining) == (0, 0, 0, False)
    assert (alone.priorities, alone.stopped) == (b.snapshot.priorities, True)
    assert waiting_reason(queued_job(), alone, paused=False, fresh=True) == WaitingReason.NO_WORKER
    # Read alone (a gateway that starts reads the key's last value), it is the merge.
    held = SchedulerSnapshots()
    assert held.arrived(last, written_at=MONO, now=MONO).snapshot is last
    assert held.reporting(MODEL, MONO) == []


def test_a_restarted_scheduler_replaces_its_previous_runs_entry() -> None:
    held = SchedulerSnapshots()
    arrives(held, from_scheduler("a", batchers=1))
    arrives(held, from_scheduler("b", age_s=1.0, batchers=2, draining=True))
    merged = arrives(held, from_scheduler("b", batchers=0))  # B restarted in place: same name
    assert (merged.connected_batchers, merged.draining) == (1, False)
    assert held.reporting(MODEL, MONO) == ["a", "b"]


def test_the_cluster_queue_merges_this_schedulers_own_with_the_others_latest() -> None:
    own = from_scheduler("b", batchers=0, in_flight=0, depth=6).snapshot  # taken now: its depths are the freshest
    latest = {
        "a": from_scheduler("a", age_s=1.0, batchers=1, free=1, in_flight=1, rate=2.0, depth=3, desired=2),
        "b": from_scheduler("b", age_s=1.5, batchers=4, in_flight=4),  # its own previous write: replaced by own
        "c": from_scheduler("c", age_s=SNAPSHOT_STALE_S + 1.0, batchers=5),  # gone
        "d": stopped(from_scheduler("d", batchers=6)),
        "e": from_scheduler("e", age_s=0.5, batchers=1, free=3, rate=5.0, draining=True),
    }
    cluster = cluster_queue(own, latest, MONO)
    assert (cluster.schedulers, cluster.draining_schedulers) == (3, 1)
    merged = cluster.merged
    assert (merged.connected_batchers, merged.in_flight, merged.free_credits) == (2, 1, 1)
    assert (merged.completed_per_s, merged.desired_batchers) == (2.0, 2)
    assert merged.priorities == own.priorities
    alone = cluster_queue(own, {}, MONO)
    assert (alone.merged, alone.schedulers, alone.draining_schedulers) == (own, 1, 0)


def test_the_cluster_queues_completion_rate_counts_a_draining_schedulers_completions() -> None:
    """GetQueueStats' completed_per_second: a draining scheduler still finishes the jobs it
    dispatched, and they complete; it counted only the schedulers not draining (2.0 here, 0 with
    the only batcher's scheduler draining). Estimated starts keep the merge's rate: a draining
    scheduler's completions start no queued job."""
    own = from_scheduler("b", batchers=0).snapshot  # answering: no batcher, not draining
    latest = {"a": from_scheduler("a", age_s=1.0, batchers=1, in_flight=2, rate=3.0, draining=True)}
    cluster = cluster_queue(own, latest, MONO)
    assert (cluster.completed_per_s, cluster.merged.completed_per_s) == (3.0, 0.0)
    both = {**latest, "c": from_scheduler("c", age_s=0.5, batchers=1, rate=2.0)}
    cluster = cluster_queue(own, both, MONO)
    assert (cluster.completed_per_s, cluster.merged.completed_per_s) == (5.0, 2.0)
    # Every one draining: the same sum, as with one scheduler.
    draining_own = replace(own, draining=True, completed_per_s=1.0)
    assert cluster_queue(draining_own, latest, MONO).completed_per_s == 4.0
