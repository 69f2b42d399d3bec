"""Webhook deliveries as the gateway and the scheduler both see them: the events, each delivery's
state, and the webhooks KV bucket that holds them.

The bucket (`nats.webhooks_bucket`) holds two kinds of keys:
- `job.<tenant>.<job_id>`: the job's deliveries (one per event and job attempt) and their attempts
  so far (asyncinfer.codecs.webhook_status). The scheduler writes it (compare-and-set); GetJob reads it. Each write carries a
  per-message TTL of the job's retention plus the retry horizon, so it goes away after the job.
- `disabled.<tenant>.<sha256 of the URL>`: the URL answered 410 Gone; nothing more is sent to it
  for that tenant. Kept for webhooks.disabled_for_s (7 days; 0: until an operator deletes the key,
  `nats kv del <bucket> <key>`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace

import msgspec
import structlog

from asyncinfer.config import NatsConfig

# Named in asyncinfer.contract; re-exported for their callers here.
from asyncinfer.contract import deliveries_key as deliveries_key
from asyncinfer.contract import disabled_url_key
from asyncinfer.errors import Unavailable
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.jobs import JobState
from asyncinfer.nats import JetStreamContext, KeyDeletedError, KeyNotFoundError, KeyValue
from asyncinfer.nats.streams import ensure_kv_bucket

log = structlog.get_logger("asyncinfer.webhooks")
disabled_key = disabled_url_key  # its name here before asyncinfer.contract


class CallbackEvent(enum.StrEnum):
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELED = "CANCELED"


# What a callback without events asks for.
TERMINAL_EVENTS = (CallbackEvent.COMPLETED, CallbackEvent.FAILED, CallbackEvent.CANCELED)

EVENT_OF_STATE: Mapping[JobState, CallbackEvent] = {
    JobState.RUNNING: CallbackEvent.RUNNING,
    JobState.SUCCEEDED: CallbackEvent.COMPLETED,
    JobState.FAILED: CallbackEvent.FAILED,
    JobState.TIMED_OUT: CallbackEvent.FAILED,
    JobState.EXPIRED: CallbackEvent.FAILED,
    JobState.CANCELED: CallbackEvent.CANCELED,
}


def wanted_events(events: tuple[str, ...]) -> frozenset[CallbackEvent]:
    return frozenset(CallbackEvent(e) for e in events) if events else frozenset(TERMINAL_EVENTS)


class DeliveryState(enum.StrEnum):
    PENDING = "PENDING"
    DELIVERED = "DELIVERED"
    FAILED = "FAILED"
    DISABLED = "DISABLED"

    @property
    def is_final(self) -> bool:
        return self is not DeliveryState.PENDING


@dataclass(frozen=True, slots=True)
class DeliveryStatus:
    """One delivery (one event of one job attempt) and its attempts so far. Times are Unix seconds."""

    webhook_id: str
    event: CallbackEvent
    job_attempt: int
    state: DeliveryState = DeliveryState.PENDING
    attempts: int = 0
    create_time: float = 0.0
    first_attempt_time: float | None = None
    last_attempt_time: float | None = None
    last_status_code: int = 0
    last_error: str = ""
    next_attempt_time: float | None = None


@dataclass(frozen=True, slots=True)
class JobDeliveries:
    """The value at `job.<tenant>.<job_id>`; `revision` is the KV revision it was read at (0: none)."""

    deliveries: tuple[DeliveryStatus, ...] = ()
    ttl_s: float = 0.0
    revision: int = 0

    def find(self, webhook_id: str) -> DeliveryStatus | None:
        return next((d for d in self.deliveries if d.webhook_id == webhook_id), None)

    def with_delivery(self, delivery: DeliveryStatus) -> JobDeliveries:
        """A copy with `delivery` replacing the one with its webhook ID (or added)."""
        kept = tuple(d for d in self.deliveries if d.webhook_id != delivery.webhook_id)
        ordered = sorted((*kept, delivery), key=lambda d: (d.create_time, d.webhook_id))
        return replace(self, deliveries=tuple(ordered))


def webhook_id(job_id: str, event: CallbackEvent, job_attempt: int) -> str:
    """The `webhook-id`: the same for every attempt of one delivery, distinct per event and job attempt."""
    return f"msg_{job_id}_{event.value.lower()}_{job_attempt}"


async def ensure_webhooks_bucket(js: JetStreamContext, config: NatsConfig) -> KeyValue:
    """The webhooks KV bucket (declared by the gateway and the scheduler alike)."""
    return await ensure_kv_bucket(
        js,
        config,
        bucket=config.webhooks_bucket,
        description="asyncinfer webhook deliveries per job (job.<tenant>.<job_id>) and disabled URLs",
    )


async def read_deliveries(kv: KeyValue, tenant: str, job_id: str) -> JobDeliveries:
    """The job's deliveries (empty when none was made yet). Raises Unavailable when NATS fails."""
    try:
        entry = await kv.get(deliveries_key(tenant, job_id))
    except (KeyNotFoundError, KeyDeletedError):
        return JobDeliveries()
    except NATS_FAILURES as exc:
        raise Unavailable(f"cannot read the webhook deliveries: {exc}") from exc
    if entry.value is None or entry.revision is None:
        return JobDeliveries()
    return decode_deliveries(entry.value, revision=entry.revision)


# --- codec --------------------------------------------------------------------------------------
# The codec of a job's webhook delivery status (the webhooks bucket, `job.<tenant>.<job_id>`).
#
# Version 1: version 0's fields with `v` first (the deliveries keep every field: see below).

CODEC_VERSION = 1


class DeliveryStatusWire(msgspec.Struct, kw_only=True):
    # Every field written, defaults too: the release before the versioned codecs reads each with
    # `DeliveryStatus(**fields)` and needs `state`.

    webhook_id: str
    event: CallbackEvent
    job_attempt: int
    state: DeliveryState = DeliveryState.PENDING
    attempts: int = 0
    create_time: float = 0.0
    first_attempt_time: float | None = None
    last_attempt_time: float | None = None
    last_status_code: int = 0
    last_error: str = ""
    next_attempt_time: float | None = None


class JobDeliveriesWire(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: int = 0  # missing: version 0
    ttl_s: float = 0.0
    deliveries: tuple[DeliveryStatusWire, ...] = ()


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(JobDeliveriesWire)


def encode_deliveries(value: JobDeliveries) -> bytes:
    deliveries = tuple(
        DeliveryStatusWire(
            webhook_id=d.webhook_id,
            event=d.event,
            job_attempt=d.job_attempt,
            state=d.state,
            attempts=d.attempts,
            create_time=d.create_time,
            first_attempt_time=d.first_attempt_time,
            last_attempt_time=d.last_attempt_time,
            last_status_code=d.last_status_code,
            last_error=d.last_error,
            next_attempt_time=d.next_attempt_time,
        )
        for d in value.deliveries
    )
    return _encoder.encode(JobDeliveriesWire(v=CODEC_VERSION, ttl_s=value.ttl_s, deliveries=deliveries))


def decode_deliveries(data: bytes, revision: int = 0) -> JobDeliveries:
    w = _decoder.decode(data)
    deliveries = tuple(
        DeliveryStatus(
            webhook_id=d.webhook_id,
            event=d.event,
            job_attempt=d.job_attempt,
            state=d.state,
            attempts=d.attempts,
            create_time=d.create_time,
            first_attempt_time=d.first_attempt_time,
            last_attempt_time=d.last_attempt_time,
            last_status_code=d.last_status_code,
            last_error=d.last_error,
            next_attempt_time=d.next_attempt_time,
        )
        for d in w.deliveries
    )
    return JobDeliveries(deliveries=deliveries, ttl_s=w.ttl_s, revision=revision)
