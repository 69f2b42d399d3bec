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
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from asyncinfer.nats import Client, JetStreamContext
from asyncinfer.queues import QueueSnapshot
from asyncinfer.snapshot_merge import cluster_queue, stopped_snapshot
from asyncinfer.snapshot_watch import SnapshotWatch
from services.scheduler.queue_stats import ModelQueueSnapshot


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

    async def start(self) -> None:
        await self._watch.start()

    async def stop(self) -> None:
        await self._watch.stop()

    def cluster_wide(self, own: ModelQueueSnapshot) -> ModelQueueSnapshot:
        """`own` (this scheduler's, just taken) with the cluster's batchers, jobs in flight, free
        credits, completion rate (every scheduler's, a draining one's too: it still finishes what
        it dispatched) and desired batchers (the most any scheduler asks for, as KEDA's max() over
        the schedulers' gauges). Its depths, pause, drain, submission rate (every
        scheduler hears every queued notice) and batch sizes stay its own."""
        now = self._monotonic()
        cluster = cluster_queue(own.to_shared(self._scheduler), self._schedulers.latest(own.model_name), now)
        merged = cluster.merged
        return dataclasses.replace(
            own,
            in_flight=merged.in_flight,
            connected_batchers=merged.connected_batchers,
            free_credits=merged.free_credits,
            completed_per_s=cluster.completed_per_s,
            desired_batchers=merged.desired_batchers,
            schedulers=cluster.schedulers,
            draining_schedulers=cluster.draining_schedulers,
        )

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
