"""The wire form of one webhook delivery, a message of the WEBHOOKS stream: the event, where to
send it and the exact body. Shared because two services enqueue deliveries (the scheduler's
notifier for jobs, the gateway's batch driver for a batch's end) and one sends them (the
scheduler's sender): one definition for both sides.

The body is built once, when the delivery is enqueued, and sent unchanged on every attempt (only
`webhook-timestamp` and the signature change), so a receiver that deduplicates by `webhook-id`
sees one event. `job_id` names the entry of the webhooks bucket that holds the delivery's status
(`job.<tenant>.<job_id>`): a job's ID, or a batch's (batch IDs are job IDs, never the same as one).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec

from asyncinfer.contract import webhook_subject
from asyncinfer.webhook_status import CallbackEvent


@dataclass(frozen=True, slots=True)
class Delivery:
    webhook_id: str
    tenant: str
    job_id: str  # the job's (or the batch's) ID: the key of its delivery status
    event: CallbackEvent
    job_attempt: int
    url: str
    body: str  # the exact JSON text sent
    ttl_s: float  # how long the delivery status is kept after each write

    @property
    def subject(self) -> str:
        return webhook_subject(self.tenant)


# Read with `v` (missing: version 0); still written as version 0 (no `v`): the release before the
# versioned codecs reads a delivery with `Delivery(**fields)`, which refuses a field it does not
# know, and its sender drops (terms) what it cannot read, so a `v` would lose webhooks while
# schedulers of both releases run. Once none of that release is left, a change writes version 1.
CODEC_VERSION = 0


class DeliveryWire(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: int = 0  # missing: version 0
    webhook_id: str
    tenant: str
    job_id: str
    event: CallbackEvent
    job_attempt: int
    url: str
    body: str
    ttl_s: float


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(DeliveryWire)


def encode_delivery(delivery: Delivery) -> bytes:
    d = delivery
    return _encoder.encode(
        DeliveryWire(
            v=CODEC_VERSION,
            webhook_id=d.webhook_id,
            tenant=d.tenant,
            job_id=d.job_id,
            event=d.event,
            job_attempt=d.job_attempt,
            url=d.url,
            body=d.body,
            ttl_s=d.ttl_s,
        )
    )


def decode_delivery(data: bytes) -> Delivery:
    w = _decoder.decode(data)
    return Delivery(
        webhook_id=w.webhook_id,
        tenant=w.tenant,
        job_id=w.job_id,
        event=w.event,
        job_attempt=w.job_attempt,
        url=w.url,
        body=w.body,
        ttl_s=w.ttl_s,
    )


def rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")
