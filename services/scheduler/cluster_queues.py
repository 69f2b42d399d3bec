"""What every scheduler reports of each model's queue, for the answers that speak for the cluster.

Behind the Kubernetes Service (2 schedulers) an operator's GetQueueStats (the console, `asyncinfer
stats`) reaches either scheduler, and each answered with its own batchers, jobs in flight and rates
alone: half the cluster, and a drain of the other invisible. So a scheduler watches the queue
snapshot keys as the gateway does (asyncinfer.snapshot_watch: each key's latest and every write
after) and answers from the merge of its own snapshot, just taken, with the others' latest
(asyncinfer.snapshot_merge.cluster_queue). As it stops in order it writes each model's last
snapshot, `stopped`, from the same view (asyncinfer.snapshot_merge.stopped_snapshot). The others'
snapshots are fresh by this scheduler's monotonic clock, as a gateway's (asyncinfer.snapshot_freshness):
their hosts' wall clocks may be skewed against its own.

A job put back (nak'ed) waits in its consumer's redelivery queue, delivered and unacknowledged,
until a pull comes for it, and a scheduler pulls only for a batcher with a free credit; only its
putter counted it. Once that scheduler is gone (restarted, or stopped or killed while another
runs) nobody did, for as long as no batcher came: depth 0, desired batchers 0, and an autoscaler on
that signal never started the batcher that would pull it. So the cluster's view also counts as
waiting the consumers' unacknowledged deliveries (as this scheduler just read them) beyond what the
reporting schedulers account for, their jobs in flight and put back (`unclaimed_deliveries`): a
queue's backlog is its pending plus the larger of its unacknowledged deliveries and the jobs in
flight and put back, the count the gateway's admission already makes of the consumers
(services.gateway.queue_view). A job another scheduler pulled since its last snapshot counts so
for a round (waiting rather than in flight: the backlog the same). Such a job's oldest time is the
oldest unacknowledged delivery's stored time (services.scheduler.queue_stats reads it where the
deliveries are more than this scheduler holds), so its queue's oldest age and aging count it too.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from asyncinfer.jobs import PRIORITIES_BY_RANK, Priority
from asyncinfer.nats import Client, JetStreamContext
from asyncinfer.queues import QueueSnapshot
from asyncinfer.snapshot_merge import ClusterQueue, cluster_queue, stopped_snapshot
from asyncinfer.snapshot_watch import SnapshotWatch
from services.scheduler.queue_stats import ModelQueueSnapshot, PriorityQueueSnapshot


class ClusterQueues:
    def __init__(
        self,
        js: JetStreamContext,
        nc: Client,
        *,
        bucket: str,
        scheduler: str,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._scheduler = scheduler  # this scheduler's instance name, as its snapshots say it
        self._clock = clock  # the wall clock, for the `updated_at` of its last snapshots alone
        self._monotonic = monotonic  # whether a snapshot is fresh
        self._watch = SnapshotWatch(js, nc, bucket=bucket, monotonic=monotonic)
        self._schedulers = self._watch.schedulers
        # QueueStatsReader.desired, set once the reader is made: the batchers a queue asks for.
        self.desire: Callable[..., int] | None = None

    async def start(self) -> None:
        await self._watch.start()

    async def stop(self) -> None:
        await self._watch.stop()

    def cluster_wide(self, own: ModelQueueSnapshot) -> ModelQueueSnapshot:
        """`own` (this scheduler's, just taken) with the cluster's depths (the consumers' pending,
        as this scheduler just read it, plus every scheduler's own put-backs) and oldest times,
        batchers, jobs in flight, free credits, completion rate (every scheduler's, a draining
        one's too: it still finishes what it dispatched) and desired batchers (`cluster_desired`).
        Its pause, drain, submission rate (every scheduler hears every queued notice) and batch
        sizes stay its own."""
        cluster = self._cluster(own)
        merged = cluster.merged
        return dataclasses.replace(
            own,
            priorities=self._cluster_priorities(own, merged),
            in_flight=merged.in_flight,
            connected_batchers=merged.connected_batchers,
            free_credits=merged.free_credits,
            completed_per_s=cluster.completed_per_s,
            desired_batchers=self._desired(own, cluster),
            schedulers=cluster.schedulers,
            draining_schedulers=cluster.draining_schedulers,
        )

    def cluster_desired(self, own: ModelQueueSnapshot) -> int:
        """The batchers the whole cluster's queue asks for (`desire` over the cluster's depths, jobs
        in flight, batchers and completion rate), with `own` this scheduler's just taken: what its
        gauge asyncinfer_desired_batchers and its snapshots say, so KEDA's max() over the
        schedulers' gauges is the cluster's ask. Each asked for its own view before (the shared
        pending plus its own put-backs and jobs in flight, its batchers' rate): the others' put-back
        jobs and jobs in flight were missing from every one."""
        return self._desired(own, self._cluster(own))

    def with_cluster_depths(self, own: ModelQueueSnapshot) -> ModelQueueSnapshot:
        """`own` with the cluster's depths and oldest times, the rest its own: its gauges
        (asyncinfer_queue_depth and _oldest_age_seconds, read as the max over schedulers)."""
        merged = self._cluster(own).merged
        return dataclasses.replace(own, priorities=self._cluster_priorities(own, merged))

    def _cluster(self, own: ModelQueueSnapshot) -> ClusterQueue:
        return cluster_queue(own.to_shared(self._scheduler), self._schedulers.latest(own.model_name), self._monotonic())

    def _desired(self, own: ModelQueueSnapshot, cluster: ClusterQueue) -> int:
        merged = cluster.merged
        if self.desire is None:
            return merged.desired_batchers
        return self.desire(
            own.model_name,
            waiting=merged.total_depth + sum(unclaimed_deliveries(own, merged).values()),
            in_flight=merged.in_flight,
            connected=merged.connected_batchers,
            completed_per_s=cluster.completed_per_s,  # every scheduler's: a batcher's throughput
            held=merged.paused or merged.draining,  # draining: every scheduler that could dispatch drains
        )

    def _cluster_priorities(self, own: ModelQueueSnapshot, merged: QueueSnapshot) -> tuple[PriorityQueueSnapshot, ...]:
        unclaimed = unclaimed_deliveries(own, merged)
        return tuple(
            self._with_unclaimed(queue, unclaimed[queue.priority]) if unclaimed.get(queue.priority) else queue
            for queue in self._merged_priorities(own, merged)
        )

    def _with_unclaimed(self, queue: PriorityQueueSnapshot, count: int) -> PriorityQueueSnapshot:
        """`queue` with `count` unclaimed deliveries waiting, and their oldest time where it is older
        than the queue's: the oldest unacknowledged delivery's stored time, as this scheduler read
        it (`unacked_oldest_create_time`), so the age gauge, GetQueueStats and aging see a job put
        back by a scheduler since gone. Aged on the clock the queue's own age was read on (the
        server's) where it has one, else on this scheduler's wall clock."""
        stored_at = queue.unacked_oldest_create_time
        if stored_at is None or (queue.oldest_create_time is not None and queue.oldest_create_time <= stored_at):
            return dataclasses.replace(queue, depth=queue.depth + count)
        if queue.oldest_create_time is not None and queue.oldest_age_s is not None:
            oldest_age_s = queue.oldest_age_s + (queue.oldest_create_time - stored_at)
        else:
            oldest_age_s = max(self._clock() - stored_at, 0.0)
        return dataclasses.replace(
            queue, depth=queue.depth + count, oldest_create_time=stored_at, oldest_age_s=oldest_age_s
        )

    def _merged_priorities(self, own: ModelQueueSnapshot, merged: QueueSnapshot) -> tuple[PriorityQueueSnapshot, ...]:
        priorities = []
        for queue in own.priorities:
            cluster = merged.priorities.get(queue.priority.value)
            if cluster is None or (
                cluster.depth == queue.depth and cluster.oldest_create_time == queue.oldest_create_time
            ):
                priorities.append(queue)
                continue
            oldest_age_s = None
            if cluster.oldest_create_time is not None:
                if queue.oldest_create_time is not None and queue.oldest_age_s is not None:
                    # On the clock the own age was read on (the server's, as a rule).
                    oldest_age_s = queue.oldest_age_s + max(queue.oldest_create_time - cluster.oldest_create_time, 0.0)
                else:
                    oldest_age_s = max(self._clock() - cluster.oldest_create_time, 0.0)
            priorities.append(
                dataclasses.replace(
                    queue,
                    depth=cluster.depth,
                    oldest_age_s=oldest_age_s,
                    oldest_create_time=cluster.oldest_create_time,
                    newest_create_time=cluster.newest_create_time,
                    put_back=cluster.put_back,
                    put_back_oldest_create_time=cluster.put_back_oldest_create_time,
                )
            )
        return tuple(priorities)

    def reporting(self) -> list[str]:
        """The schedulers whose snapshot of some model is fresh (not stopped), by name: those
        GetQueueStats' `schedulers` counts, which a drain order to every one expects to answer."""
        now = self._monotonic()
        names = {
            name for model_name in self._schedulers.models() for name in self._schedulers.reporting(model_name, now)
        }
        return sorted(names)

    def last_words(self) -> list[QueueSnapshot]:
        """Each model's `stopped` snapshot, for the models this scheduler's writes reached the
        bucket (a model it never wrote leaves nothing to take back)."""
        now, wall_time = self._monotonic(), self._clock()
        last = []
        for model_name in self._schedulers.models():
            latest = self._schedulers.latest(model_name)
            own = latest.get(self._scheduler)
            if own is not None and not own.snapshot.stopped:
                last.append(stopped_snapshot(own.snapshot, latest, now=now, wall_time=wall_time))
        return last


def unclaimed_deliveries(own: ModelQueueSnapshot, merged: QueueSnapshot) -> dict[Priority, int]:
    """The deliveries the model's consumers hold unacknowledged (`own`'s `ack_pending`, as this
    scheduler just read them) beyond what the reporting schedulers account for (`merged`: their
    put-backs, each priority's, and their jobs in flight, the model's): jobs put back by a scheduler
    since gone, waiting until a pull comes. By priority, where a priority's deliveries exceed its
    put-backs; the jobs in flight (the model's, by no priority) are taken from those first, so the
    rest is counted from the lowest priority up (jobs in flight were more likely the higher ones').
    A priority not read (a pull of this scheduler held open there: a job that can be delivered
    comes to it at once) counts none. Never below what is known: better a batcher asked for a
    round too long than a job nobody counts."""
    excess: dict[Priority, int] = {}
    for queue in own.priorities:
        if queue.ack_pending is None:
            continue
        cluster = merged.priorities.get(queue.priority.value)
        put_back = cluster.put_back if cluster is not None else queue.put_back
        excess[queue.priority] = max(queue.ack_pending - put_back, 0)
    left = sum(excess.values()) - merged.in_flight
    unclaimed: dict[Priority, int] = {}
    for priority in reversed(PRIORITIES_BY_RANK):
        if left <= 0:
            break
        counted = min(excess.get(priority, 0), left)
        if counted:
            unclaimed[priority] = counted
            left -= counted
    return unclaimed
