"""What a WEBHOOKS message carries (one delivery: the event, where to send it, the exact body),
and the thin JSON body itself.

The body is built once, when the event is enqueued, and sent unchanged on every attempt (only
`webhook-timestamp` and the signature change), so a receiver that deduplicates by `webhook-id`
sees one event. It is a summary, never the outputs:

    {"type": "job.completed", "timestamp": "2025-01-01T12:00:00.123456Z",
     "data": {"job_id": ..., "model_name": ..., "model_version": ..., "state": "SUCCEEDED",
              "attempt": 1, "labels": {...}, "error": {"code": "INVALID_ARGUMENT", "reason": ...,
              "message": ...},            # failed jobs only
              "fetch": {"rpc": "asyncinfer.v1.JobService/GetJob", "job_id": ...}}}

`fetch.rpc` is ReadResult when the result is large (kept by reference), GetJob otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import grpc
import msgspec

# Named in asyncinfer.contract; re-exported for its callers here.
from asyncinfer.contract import WEBHOOK_SUBJECT_PREFIX as WEBHOOK_SUBJECT_PREFIX
from asyncinfer.contract import webhook_subject
from asyncinfer.jobs import JobRecord, JobState
from asyncinfer.webhook_status import CallbackEvent

EVENT_TYPES = {
    CallbackEvent.RUNNING: "job.running",
    CallbackEvent.COMPLETED: "job.completed",
    CallbackEvent.FAILED: "job.failed",
    CallbackEvent.CANCELED: "job.canceled",
}
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


@dataclass(frozen=True, slots=True)
class Delivery:
    webhook_id: str
    tenant: str
    job_id: str
    event: CallbackEvent
    job_attempt: int
    url: str
    body: str  # the exact JSON text sent
    ttl_s: float  # how long the job's delivery status is kept after each write

    @property
    def subject(self) -> str:
        return webhook_subject(self.tenant)


# --- codec -------------------------------------------------------------------------------------

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


def _rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def event_body(record: JobRecord, event: CallbackEvent) -> str:
    """The body for `event` of the job as `record` stands (a RUNNING event reports RUNNING and its
    start time even when built from a later record)."""
    running = event is CallbackEvent.RUNNING
    state = JobState.RUNNING if running else record.state
    when = (record.start_time if running else record.end_time) or record.update_time
    data: dict[str, Any] = {
        "job_id": record.job_id,
        "model_name": record.model_name,
        "model_version": record.model_version,
        "state": state.value,
        "attempt": record.attempt,
    }
    if record.labels:
        data["labels"] = dict(record.labels)
    if not running and record.error is not None:
        data["error"] = {
            "code": _CODE_NAMES.get(record.error.code, str(record.error.code)),
            "reason": record.error.reason,
            "message": record.error.message,
        }
    if event is CallbackEvent.COMPLETED:
        rpc = "ReadResult" if record.result_ref is not None else "GetJob"
        data["fetch"] = {"rpc": f"asyncinfer.v1.JobService/{rpc}", "job_id": record.job_id}
    else:
        data["fetch"] = {"rpc": "asyncinfer.v1.JobService/GetJob", "job_id": record.job_id}
    body = {"type": EVENT_TYPES[event], "timestamp": _rfc3339(when), "data": data}
    return json.dumps(body, separators=(",", ":"))
