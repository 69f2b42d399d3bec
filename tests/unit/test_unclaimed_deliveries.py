"""The deliveries a model's consumers hold unacknowledged that no reporting scheduler accounts for
(services.scheduler.cluster_queues.unclaimed_deliveries): a job put back by a scheduler since gone
waits in its consumer's redelivery queue until a pull comes, counted by nobody. The cluster's view
counts them as waiting; the real-NATS case is test_scheduler_policies'
test_a_job_put_back_by_a_scheduler_since_gone_counts_in_the_depth_and_the_desired_batchers."""

from __future__ import annotations

import pytest

from asyncinfer.jobs import PRIORITIES_BY_RANK, Priority
from asyncinfer.queues import PriorityQueueSnapshot, QueueSnapshot
from services.scheduler import queue_stats
from services.scheduler.cluster_queues import unclaimed_deliveries

pytestmark = pytest.mark.unit


def own(
    ack_pending: dict[Priority, int | None], *, put_back: dict[Priority, int] | None = None
) -> queue_stats.ModelQueueSnapshot:
    """This scheduler's snapshot with each priority's deliveries as read (None: not read)."""
    put_back = put_back or {}
    return queue_stats.ModelQueueSnapshot(
        model_name="demo",
        priorities=tuple(
            queue_stats.PriorityQueueSnapshot(
                priority=p,
                depth=put_back.get(p, 0),
                oldest_age_s=None,
                put_back=put_back.get(p, 0),
                ack_pending=ack_pending.get(p, 0),
            )
            for p in PRIORITIES_BY_RANK
        ),
        in_flight=0,
        connected_batchers=0,
        free_credits=0,
        desired_batchers=0,
    )


def merged(*, in_flight: int = 0, put_back: dict[Priority, int] | None = None) -> QueueSnapshot:
    """The reporting schedulers' merge: their jobs in flight and each priority's put-backs."""
    put_back = put_back or {}
    return QueueSnapshot(
        model_name="demo",
        updated_at=0.0,
        priorities={
            p.value: PriorityQueueSnapshot(depth=put_back.get(p, 0), put_back=put_back.get(p, 0))
            for p in PRIORITIES_BY_RANK
        },
        in_flight=in_flight,
    )


def test_a_delivery_nobody_accounts_for_is_unclaimed() -> None:
    assert unclaimed_deliveries(own({Priority.NORMAL: 1}), merged()) == {Priority.NORMAL: 1}


def test_deliveries_the_schedulers_hold_in_flight_or_put_back_are_claimed() -> None:
    deliveries = own({Priority.HIGH: 2, Priority.LOW: 1})
    assert unclaimed_deliveries(deliveries, merged(in_flight=2, put_back={Priority.LOW: 1})) == {}
    # More accounted for than read (a snapshot older than the read): none, never below zero.
    assert unclaimed_deliveries(deliveries, merged(in_flight=5, put_back={Priority.LOW: 1})) == {}


def test_the_jobs_in_flight_are_by_no_priority_so_the_rest_counts_from_the_lowest_up() -> None:
    deliveries = own({Priority.HIGH: 2, Priority.NORMAL: 1, Priority.LOW: 1})
    assert unclaimed_deliveries(deliveries, merged(in_flight=2)) == {Priority.LOW: 1, Priority.NORMAL: 1}
    assert unclaimed_deliveries(deliveries, merged(in_flight=1)) == {
        Priority.LOW: 1,
        Priority.NORMAL: 1,
        Priority.HIGH: 1,
    }


def test_the_put_backs_are_the_merges_every_schedulers_not_this_ones_alone() -> None:
    deliveries = own({Priority.NORMAL: 2}, put_back={Priority.NORMAL: 1})
    assert unclaimed_deliveries(deliveries, merged(put_back={Priority.NORMAL: 2})) == {}
    assert unclaimed_deliveries(deliveries, merged(put_back={Priority.NORMAL: 1})) == {Priority.NORMAL: 1}


def test_a_priority_not_read_counts_none() -> None:
    """A pull of this scheduler held open on the queue: its deliveries are not read (a job that can
    be delivered comes to that pull at once), and its jobs in flight are still taken from the rest."""
    deliveries = own({Priority.HIGH: None, Priority.LOW: 1})
    assert unclaimed_deliveries(deliveries, merged()) == {Priority.LOW: 1}
    assert unclaimed_deliveries(deliveries, merged(in_flight=1)) == {}


def test_unclaimed_deliveries_count_with_the_oldest_unacknowledged_deliverys_time() -> None:
    """Their oldest time is the oldest unacknowledged delivery's stored time (queue_stats reads it
    where the deliveries are more than this scheduler holds): taken where it is older than the
    queue's own oldest, aged on the clock the own age was read on, else on the wall clock; without
    it, only the depth grows (the real-NATS case: test_scheduler_policies'
    test_jobs_put_back_by_a_scheduler_killed_with_sigkill_count_with_their_oldest_time)."""
    from typing import Any

    from services.scheduler.cluster_queues import ClusterQueues

    none: Any = None
    cluster = ClusterQueues(none, none, bucket="queues", scheduler="a", clock=lambda: 1_000.0)

    def queue(**fields: Any) -> queue_stats.PriorityQueueSnapshot:
        return queue_stats.PriorityQueueSnapshot(priority=Priority.LOW, **{"depth": 0, "oldest_age_s": None, **fields})

    alone = cluster._with_unclaimed(queue(unacked_oldest_create_time=940.0), 2)
    assert (alone.depth, alone.oldest_create_time, alone.oldest_age_s) == (2, 940.0, 60.0)
    behind = cluster._with_unclaimed(
        queue(depth=1, oldest_create_time=990.0, oldest_age_s=12.0, unacked_oldest_create_time=940.0), 1
    )
    assert (behind.depth, behind.oldest_create_time, behind.oldest_age_s) == (2, 940.0, 62.0)
    younger = cluster._with_unclaimed(
        queue(depth=1, oldest_create_time=900.0, oldest_age_s=100.0, unacked_oldest_create_time=940.0), 1
    )
    assert (younger.depth, younger.oldest_create_time, younger.oldest_age_s) == (2, 900.0, 100.0)
    unknown = cluster._with_unclaimed(queue(), 3)
    assert (unknown.depth, unknown.oldest_create_time, unknown.oldest_age_s) == (3, None, None)
