"""A batch's terminal webhook, enqueued by the gateway that won the batch's terminal write
(asyncinfer.batch_webhooks builds it; the scheduler's webhook sender delivers it, signed, with
its retries and status, as it delivers a job's).

Exactly one delivery per batch end, with several gateways and kill -9: the message's
Nats-Msg-Id is the batch's webhook ID, so a second enqueue within the WEBHOOKS stream's
duplicate window is dropped, and one after it is dropped by the sender, which finds the
delivery final in the webhooks bucket. The record's `callback_enqueued`, written after the
enqueue, tells the drivers it is done; a gateway killed between the terminal write and that
write leaves a terminal record without it, which any driver's next adoption pass enqueues again.
"""

from __future__ import annotations

import structlog

from asyncinfer.batch_webhooks import batch_delivery
from asyncinfer.batches import BatchRecord
from asyncinfer.config import Config
from asyncinfer.errors import Unavailable
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.nats import JetStreamContext
from asyncinfer.nats.streams import publish_durably
from asyncinfer.webhook_delivery import encode_delivery

log = structlog.get_logger("asyncinfer.gateway.batches")

PUBLISH_RETRY_FOR_S = 10.0


class BatchCallbacks:
    def __init__(self, js: JetStreamContext, config: Config) -> None:
        self._js = js
        self._config = config

    async def enqueue(self, record: BatchRecord) -> None:
        """Puts the batch's end on the WEBHOOKS stream; Unavailable when NATS fails (the next
        pass tries again)."""
        delivery = batch_delivery(record, retry_horizon_s=self._config.webhooks.retry_horizon_s)
        try:
            await publish_durably(
                self._js,
                delivery.subject,
                encode_delivery(delivery),
                stream=self._config.nats.webhooks_stream,
                msg_id=delivery.webhook_id,
                retry_for_s=PUBLISH_RETRY_FOR_S,
            )
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot enqueue the batch's webhook: {exc}") from exc
        log.info("batch_webhook_enqueued", batch_id=record.batch_id, tenant=record.tenant, state=record.state.value)
