"""The planned chunks of running batches, per model, for the autoscaling signal
(services.scheduler.queue_stats): a headers-only ordered watch of the batches bucket's records
(`<tenant>.<batch_id>`, last per subject, then every write), reading only the header each write
carries (asyncinfer.batch_plans), never a record. Each message is a few hundred bytes of
headers, one per batch write (a running batch's driver writes when its chunks move on)."""

from __future__ import annotations

import structlog

from asyncinfer.batch_plans import BATCHES_BUCKET_DESCRIPTION, PLANNED_HEADER, PlannedChunks, decode_planned
from asyncinfer.config import NatsConfig
from asyncinfer.nats import JetStreamContext
from asyncinfer.nats.kv_watch import KeyUpdate, KeyWatch
from asyncinfer.nats.streams import ensure_kv_bucket

log = structlog.get_logger("asyncinfer.scheduler.batch_plans")


class BatchPlans:
    def __init__(self, js: JetStreamContext, bucket: str) -> None:
        self._js = js
        self._bucket = bucket
        self._planned: dict[str, PlannedChunks] = {}  # batch key -> its planned chunks (> 0 only)
        # Batch records only (idempotency claims are <tenant>.key.<hash>), their headers only.
        self._watch = KeyWatch(js, bucket, self._on_write, keys="*.*", headers_only=True, name="batch_plans")

    async def start(self, config: NatsConfig) -> None:
        # Declared here too: the scheduler may start before any gateway made it.
        await ensure_kv_bucket(self._js, config, bucket=self._bucket, description=BATCHES_BUCKET_DESCRIPTION)
        await self._watch.start()

    async def stop(self) -> None:
        await self._watch.stop()

    def _on_write(self, update: KeyUpdate) -> None:
        value = update.headers.get(PLANNED_HEADER)
        if update.removed or value is None:  # deleted, or written by a release without it
            self._planned.pop(update.key, None)
            return
        try:
            planned = decode_planned(value)
        except ValueError as exc:
            log.warning("batch_plan_unreadable", key=update.key, error=str(exc))
            self._planned.pop(update.key, None)
            return
        if planned.chunks > 0:
            self._planned[update.key] = planned
        else:
            self._planned.pop(update.key, None)

    def planned(self, model_name: str) -> tuple[int, int]:
        """(chunks planned and not yet queued, batches that hold them) of the model."""
        mine = [p.chunks for p in self._planned.values() if p.model_name == model_name]
        return sum(mine), len(mine)
