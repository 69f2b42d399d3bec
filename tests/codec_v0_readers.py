"""The readers of the release before the codecs were versioned (f3c5455), copied verbatim: what a
process of that release does with what this one writes, during a rolling upgrade. Only for
tests/test_codecs.py."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any

from asyncinfer.errors import FieldViolation
from asyncinfer.idempotency_claims import Claim
from asyncinfer.jobs import BatchInfo, BlobRef, CallbackSpec, JobError, JobRecord, JobState, Priority, WorkEnvelope
from asyncinfer.queues import CancelNotice, PriorityQueueSnapshot, QueueSnapshot
from asyncinfer.tensors import Tensor
from asyncinfer.webhook_status import CallbackEvent, DeliveryState, DeliveryStatus, JobDeliveries
from services.scheduler.dead_letters import DeadLetter
from services.scheduler.webhooks.deliveries import Delivery


def _tensor_from_json(obj: Mapping[str, Any]) -> Tensor:
    return Tensor(
        name=obj["name"],
        datatype=obj["datatype"],
        shape=tuple(obj["shape"]),
        data=base64.b64decode(obj["data"]),
    )


def error_from_json(obj: Mapping[str, Any] | None) -> JobError | None:
    if obj is None:
        return None
    return JobError(
        code=obj["code"],
        reason=obj["reason"],
        message=obj["message"],
        violations=tuple(FieldViolation(f, d) for f, d in obj.get("violations", ())),
        retriable=obj.get("retriable", False),
    )


def _blob_from_json(obj: Mapping[str, Any] | None) -> BlobRef | None:
    return None if obj is None else BlobRef(obj["ref"], obj["size_bytes"], obj["sha256"])


def decode_record(data: bytes, revision: int = 0) -> JobRecord:
    obj = json.loads(data)
    batch = obj.get("batch")
    callback = obj.get("callback")
    return JobRecord(
        job_id=obj["job_id"],
        tenant=obj["tenant"],
        model_name=obj["model_name"],
        model_version=obj.get("model_version", ""),
        state=JobState(obj["state"]),
        priority=Priority(obj["priority"]),
        create_time=obj["create_time"],
        update_time=obj["update_time"],
        max_attempts=obj["max_attempts"],
        result_retention_s=obj["result_retention_s"],
        attempt=obj.get("attempt", 0),
        labels=obj.get("labels", {}),
        idempotency_key=obj.get("idempotency_key", ""),
        start_time=obj.get("start_time"),
        end_time=obj.get("end_time"),
        queue_duration_s=obj.get("queue_duration_s"),
        run_duration_s=obj.get("run_duration_s"),
        deadline=obj.get("deadline"),
        execution_timeout_s=obj.get("execution_timeout_s"),
        batch=BatchInfo(**batch) if batch else None,
        error=error_from_json(obj.get("error")),
        last_error=error_from_json(obj.get("last_error")),
        outputs=tuple(_tensor_from_json(t) for t in obj.get("outputs", ())),
        result_ref=_blob_from_json(obj.get("result_ref")),
        input_ref=_blob_from_json(obj.get("input_ref")),
        callback=CallbackSpec(callback["url"], tuple(callback.get("events", ()))) if callback else None,
        batcher_id=obj.get("batcher_id", ""),
        revision=revision,
    )


def decode_envelope(data: bytes) -> WorkEnvelope:
    obj = json.loads(data)
    return WorkEnvelope(
        job_id=obj["job_id"],
        tenant=obj["tenant"],
        model_name=obj["model_name"],
        model_version=obj.get("model_version", ""),
        priority=Priority(obj["priority"]),
        create_time=obj["create_time"],
        max_attempts=obj["max_attempts"],
        inputs=tuple(_tensor_from_json(t) for t in obj.get("inputs", ())),
        input_ref=_blob_from_json(obj.get("input_ref")),
        deadline=obj.get("deadline"),
        execution_timeout_s=obj.get("execution_timeout_s"),
    )


def decode_snapshot(data: bytes) -> QueueSnapshot:
    obj = json.loads(data)
    priorities = {name: PriorityQueueSnapshot(**value) for name, value in obj.pop("priorities", {}).items()}
    return QueueSnapshot(priorities=priorities, **obj)


def decode_deliveries(data: bytes, revision: int = 0) -> JobDeliveries:
    obj = json.loads(data)
    deliveries = []
    for item in obj.get("deliveries", ()):
        fields: dict[str, Any] = dict(item)
        fields["event"] = CallbackEvent(fields["event"])
        fields["state"] = DeliveryState(fields["state"])
        deliveries.append(DeliveryStatus(**fields))
    return JobDeliveries(deliveries=tuple(deliveries), ttl_s=obj.get("ttl_s", 0.0), revision=revision)


def decode_dead_letter(data: bytes, sequence: int = 0) -> DeadLetter:
    obj = json.loads(data)
    return DeadLetter(
        job_id=obj["job_id"],
        tenant=obj["tenant"],
        model_name=obj["model_name"],
        reason=obj["reason"],
        attempts=obj["attempts"],
        dead_time=obj["dead_time"],
        original=base64.b64decode(obj["original"]),
        last_error=error_from_json(obj.get("last_error")),
        sequence=sequence,
    )


def decode_delivery(data: bytes) -> Delivery:
    obj: dict[str, Any] = json.loads(data)
    obj["event"] = CallbackEvent(obj["event"])
    return Delivery(**obj)


def decode_cancel_notice(data: bytes) -> CancelNotice:  # CancelNotice.decode
    return CancelNotice(**json.loads(data))


def decode_claim(data: bytes, revision: int) -> Claim:  # Claim.decode
    obj = json.loads(data)
    return Claim(obj["job_id"], obj["fingerprint"], obj["claim_time"], revision)
