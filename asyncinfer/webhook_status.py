"""Webhook deliveries as the gateway and the scheduler both see them: the events, each delivery's
state, and the webhooks KV bucket that holds them.

The bucket (`nats.webhooks_bucket`) holds two kinds of keys:
- `job.<tenant>.<job_id>`: the job's deliveries (one per event and job attempt) and their attempts
  so far, as JSON. The scheduler writes it (compare-and-set); GetJob reads it. Each write carries a
  per-message TTL of the job's retention plus the retry horizon, so it goes away after the job.
- `disabled.<tenant>.<sha256 of the URL>`: the URL answered 410 Gone; nothing more is sent to it
  for that tenant. Kept until an operator deletes the key (`nats kv del <bucket> <key>`).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import structlog
from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue

from asyncinfer.config import NatsConfig

# Named in asyncinfer.contract; re-exported for their callers here.
from asyncinfer.contract import deliveries_key as deliveries_key
from asyncinfer.contract import disabled_url_key
from asyncinfer.errors import Unavailable
from asyncinfer.jetstream import ensure_kv_bucket
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.jobs import JobState

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


def encode_deliveries(value: JobDeliveries) -> bytes:
    obj = {"ttl_s": value.ttl_s, "deliveries": [asdict(d) for d in value.deliveries]}
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_deliveries(data: bytes, revision: int = 0) -> JobDeliveries:
    obj = json.loads(data)
    deliveries = []
    for item in obj.get("deliveries", ()):
        fields: dict[str, Any] = dict(item)
        fields["event"] = CallbackEvent(fields["event"])
        fields["state"] = DeliveryState(fields["state"])
        deliveries.append(DeliveryStatus(**fields))
    return JobDeliveries(deliveries=tuple(deliveries), ttl_s=obj.get("ttl_s", 0.0), revision=revision)


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
