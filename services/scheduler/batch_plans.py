"""The planned chunks of running batches, per model, for the autoscaling signal
(services.scheduler.queue_stats): a headers-only ordered watch of the batches bucket's records
(`<tenant>.<batch_id>`, last per subject, then every write), reading only the header each write
carries (asyncinfer.batch_plans), never a record. Each message is a few hundred bytes of
headers, one per batch write (a running batch's driver writes when its chunks move on)."""

from __future__ import annotations

import structlog

from asyncinfer.batch_plans import BATCHES_BUCKET_DESCRIPTION, PLANNED_HEADER, PlannedChunks, decode_planned
from asyncinfer.config import NatsConfig
from asyncinfer.contract import kv_stream, kv_subject_prefix
from asyncinfer.nats import KV_OP, DeliverPolicy, JetStreamContext, Msg
from asyncinfer.nats.streams import ensure_kv_bucket

log = structlog.get_logger("asyncinfer.scheduler.batch_plans")


class BatchPlans:
    def __init__(self, js: JetStreamContext, bucket: str) -> None:
        self._js = js
        self._bucket = bucket
        self._subject_prefix = kv_subject_prefix(bucket)
        self._planned: dict[str, PlannedChunks] = {}  # batch key -> its planned chunks (> 0 only)
        self._subscription: JetStreamContext.PushSubscription | None = None

    async def start(self, config: NatsConfig) -> None:
        # Declared here too: the scheduler may start before any gateway made it.
        await ensure_kv_bucket(self._js, config, bucket=self._bucket, description=BATCHES_BUCKET_DESCRIPTION)
        self._subscription = await self._js.subscribe(
            f"{self._subject_prefix}*.*",  # batch records only: idempotency claims are <tenant>.key.<hash>
            stream=kv_stream(self._bucket),
            cb=self._on_write,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            headers_only=True,
        )

    async def stop(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            try:
                await subscription.unsubscribe()
            except Exception as exc:  # the connection may already be gone
                log.warning("batch_plans_unsubscribe_failed", error=str(exc))

    async def _on_write(self, msg: Msg) -> None:
        key = msg.subject.removeprefix(self._subject_prefix)
        headers = msg.headers or {}
        value = headers.get(PLANNED_HEADER)
        if KV_OP in headers or value is None:  # deleted, or written by a release without it
            self._planned.pop(key, None)
            return
        try:
            planned = decode_planned(value)
        except ValueError as exc:
            log.warning("batch_plan_unreadable", key=key, error=str(exc))
            self._planned.pop(key, None)
            return
        if planned.chunks > 0:
            self._planned[key] = planned
        else:
            self._planned.pop(key, None)

    def planned(self, model_name: str) -> tuple[int, int]:
        """(chunks planned and not yet queued, batches that hold them) of the model."""
        mine = [p.chunks for p in self._planned.values() if p.model_name == model_name]
        return sum(mine), len(mine)
