"""A batch's terminal webhook (docs/BATCHES.md, "The terminal callback"): which ends a callback
asks for, the delivery's ID and its body. Pure; the gateway's batch driver enqueues it and the
scheduler's webhook sender delivers it like a job's (signed, retried, its status recorded).

One delivery per batch: a batch ends once, so its webhook ID (and the WEBHOOKS message's
Nats-Msg-Id) follows from the batch ID alone, and every enqueue of it after the first is
dropped (by the stream's duplicate window, or by the sender, which finds the delivery final).

    {"type": "batch.completed", "timestamp": "2025-01-01T12:00:00.123456Z",
     "data": {"batch_id": ..., "model_name": ..., "model_version": ..., "state": "COMPLETED",
              "request_counts": {"total": 1000, "completed": 998, "failed": 2},
              "output_ref": "batches/<id>/output", "error_ref": "batches/<id>/errors",
              "create_time": ..., "in_progress_time": ..., "finalizing_time": ..., "end_time": ...,
              "expires_at": ..., "labels": {...}, "failure_message": ...,   # FAILED only
              "fetch": {"rpc": "asyncinfer.v1.BatchService/GetBatch", "batch_id": ...}}}
"""

from __future__ import annotations

import json
from typing import Any

from asyncinfer.batches import BatchRecord, BatchState
from asyncinfer.webhook_delivery import Delivery, rfc3339
from asyncinfer.webhook_status import CallbackEvent, wanted_events

# The callback's events filter a batch's ends as they filter a job's: EXPIRED counts as FAILED,
# as a job's EXPIRED does.
EVENT_OF_END = {
    BatchState.COMPLETED: CallbackEvent.COMPLETED,
    BatchState.FAILED: CallbackEvent.FAILED,
    BatchState.EXPIRED: CallbackEvent.FAILED,
    BatchState.CANCELLED: CallbackEvent.CANCELED,
}
EVENT_TYPES = {state: f"batch.{state.value.lower()}" for state in EVENT_OF_END}
OUTPUT_FILE = "output"
ERROR_FILE = "errors"


def output_ref(record: BatchRecord) -> str:
    return f"batches/{record.batch_id}/{OUTPUT_FILE}"


def error_ref(record: BatchRecord) -> str:
    return f"batches/{record.batch_id}/{ERROR_FILE}"


def has_files(record: BatchRecord) -> bool:
    """Whether the output and error files can be read (GetBatch names them only then): once the
    batch has ended (ReadBatchFile refuses before, BATCH_NOT_ENDED), and for a FAILED batch only
    when lines failed validation (its error file lists them; one whose input could not be read has
    none)."""
    return record.state.is_terminal and (record.state is not BatchState.FAILED or record.invalid_lines > 0)


def batch_webhook_id(batch_id: str) -> str:
    return f"msg_batch_{batch_id}_end"


def callback_due(record: BatchRecord) -> bool:
    """Whether the record's end is one its callback asks for and it is not known to be enqueued."""
    if record.callback is None or record.callback_enqueued or record.state not in EVENT_OF_END:
        return False
    return EVENT_OF_END[record.state] in wanted_events(record.callback.events)


def batch_body(record: BatchRecord) -> str:
    counts = record.counts
    data: dict[str, Any] = {
        "batch_id": record.batch_id,
        "model_name": record.model_name,
        "model_version": record.model_version,
        "state": record.state.value,
        "request_counts": {"total": counts.total, "completed": counts.completed, "failed": counts.failed},
    }
    if has_files(record):
        data["output_ref"] = output_ref(record)
        data["error_ref"] = error_ref(record)
    for name in ("create_time", "in_progress_time", "finalizing_time", "end_time", "expires_at"):
        value = getattr(record, name)
        if value is not None:
            data[name] = rfc3339(value)
    if record.labels:
        data["labels"] = dict(record.labels)
    if record.failure_message:
        data["failure_message"] = record.failure_message
    data["fetch"] = {"rpc": "asyncinfer.v1.BatchService/GetBatch", "batch_id": record.batch_id}
    when = record.end_time if record.end_time is not None else record.create_time
    return json.dumps(
        {"type": EVENT_TYPES[record.state], "timestamp": rfc3339(when), "data": data}, separators=(",", ":")
    )


def batch_delivery(record: BatchRecord, *, retry_horizon_s: float) -> Delivery:
    """The WEBHOOKS message for the batch's end (its status kept as long as the batch's files)."""
    assert record.callback is not None
    assert record.state in EVENT_OF_END
    return Delivery(
        webhook_id=batch_webhook_id(record.batch_id),
        tenant=record.tenant,
        job_id=record.batch_id,
        event=EVENT_OF_END[record.state],
        job_attempt=1,
        url=record.callback.url,
        body=batch_body(record),
        ttl_s=max(record.expires_at - (record.end_time or record.create_time), 0.0)
        + record.result_retention_s
        + retry_horizon_s,
    )
