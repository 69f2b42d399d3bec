"""What every scheduler reports of each model's queue, for the answers that speak for the cluster.

Behind the Kubernetes Service (2 schedulers) an operator's GetQueueStats (the console, `asyncinfer
stats`) reaches either scheduler, and each answered with its own batchers, jobs in flight and rates
alone: half the cluster, and a drain of the other invisible. So a scheduler watches the queue
snapshot keys as the gateway does (one ordered consumer, each key's latest and every write after)
and answers from the merge of its own snapshot, just taken, with the others' latest
(asyncinfer.snapshot_merge.cluster_queue). As it stops in order it writes each model's last
snapshot, `stopped`, from the same view (asyncinfer.snapshot_merge.stopped_snapshot). The others'
snapshots are fresh by this scheduler's monotonic clock, as a gateway's (asyncinfer.snapshot_freshness):
their hosts' wall clocks may be skewed against its own.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import structlog

from asyncinfer.contract import kv_stream, kv_subject_prefix
from asyncinfer.nats import KV_OP, Client, DeliverPolicy, JetStreamContext, Msg
from asyncinfer.nats.streams import declaration
from asyncinfer.queues import QueueSnapshot, decode_snapshot
from asyncinfer.snapshot_freshness import WriteTimes
from asyncinfer.snapshot_merge import SchedulerSnapshots, cluster_queue, stopped_snapshot
from services.scheduler.queue_stats import ModelQueueSnapshot

log = structlog.get_logger("asyncinfer.scheduler.cluster_queues")


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
        self._js = js
        self._nc = nc
        self._bucket = bucket
        self._subject_prefix = kv_subject_prefix(bucket)
        self._scheduler = scheduler  # this scheduler's instance name, as its snapshots say it
        self._clock = clock  # the wall clock, for the `updated_at` of its last snapshots alone
        self._monotonic = monotonic  # whether a snapshot is fresh
        self._schedulers = SchedulerSnapshots()
        self._write_times = WriteTimes(monotonic)  # of the snapshots the watch delivers
        self._subscription: JetStreamContext.PushSubscription | None = None

    async def start(self) -> None:
        async def watch(_timeout_s: float) -> JetStreamContext.PushSubscription:
            # Before subscribing: the keys' last values the watch delivers first are as old as the
            # server says (asyncinfer.snapshot_freshness).
            await self._write_times.begin(self._nc, self._bucket)
            # `<prefix>*`: the snapshot keys (bare model names), not `paused.*`, `scheduler.*` or
            # the tenant counters of older releases.
            return await self._js.subscribe(
                f"{self._subject_prefix}*",
                stream=kv_stream(self._bucket),
                cb=self._on_update,
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            )

        self._subscription = await declaration(watch, what="watch the queue snapshots")

    async def stop(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is None:
            return
        try:
            await subscription.unsubscribe()
        except Exception as exc:  # the connection may already be gone; nothing is left to free
            log.warning("cluster_queues_unsubscribe_failed", error=str(exc))

    async def _on_update(self, msg: Msg) -> None:
        key = msg.subject.removeprefix(self._subject_prefix)
        if KV_OP in (msg.headers or {}):
            self._schedulers.forget(key)
            return
        try:
            snapshot = decode_snapshot(msg.data)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("queue_snapshot_unreadable", model=key, error=str(exc))
            return
        received_at = self._monotonic()
        written_at = self._write_times.of(msg, received_at)
        self._schedulers.arrived(snapshot, written_at=written_at, now=received_at)

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
