"""What every scheduler reports of each model's queue, as this scheduler hears it: it watches the
queue snapshot keys as the gateway does (one ordered consumer, each key's latest and every write
after). As it stops in order it writes each model's last snapshot, `stopped`, saying what the other
schedulers report without it (asyncinfer.snapshot_merge.stopped_snapshot).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from asyncinfer.contract import kv_stream, kv_subject_prefix
from asyncinfer.nats import KV_OP, DeliverPolicy, JetStreamContext, Msg
from asyncinfer.nats.streams import declaration
from asyncinfer.queues import QueueSnapshot, decode_snapshot
from asyncinfer.snapshot_merge import SchedulerSnapshots, stopped_snapshot

log = structlog.get_logger("asyncinfer.scheduler.cluster_queues")


class ClusterQueues:
    def __init__(
        self, js: JetStreamContext, *, bucket: str, scheduler: str, clock: Callable[[], float] = time.time
    ) -> None:
        self._js = js
        self._bucket = bucket
        self._subject_prefix = kv_subject_prefix(bucket)
        self._scheduler = scheduler  # this scheduler's instance name, as its snapshots say it
        self._clock = clock
        self._schedulers = SchedulerSnapshots()
        self._subscription: JetStreamContext.PushSubscription | None = None

    async def start(self) -> None:
        async def watch(_timeout_s: float) -> JetStreamContext.PushSubscription:
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
        self._schedulers.arrived(snapshot, self._clock())

    def last_words(self) -> list[QueueSnapshot]:
        """Each model's `stopped` snapshot, for the models this scheduler's writes reached the
        bucket (a model it never wrote leaves nothing to take back)."""
        now = self._clock()
        last = []
        for model_name in self._schedulers.models():
            latest = self._schedulers.latest(model_name)
            own = latest.get(self._scheduler)
            if own is not None and not own.stopped:
                last.append(stopped_snapshot(own, latest, now))
        return last
