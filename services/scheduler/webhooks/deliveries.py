"""The thin JSON body of a job's webhook (the WEBHOOKS message that carries it, Delivery and its
codec, is shared with the gateway's batch callbacks: asyncinfer.webhook_delivery). It is a
summary, never the outputs:

    {"type": "job.completed", "timestamp": "2025-01-01T12:00:00.123456Z",
     "data": {"job_id": ..., "model_name": ..., "model_version": ..., "state": "SUCCEEDED",
              "attempt": 1, "given_back_attempts": 0, "labels": {...},
              "error": {"code": "INVALID_ARGUMENT", "reason": ..., "message": ...},  # failed jobs only
              "fetch": {"rpc": "asyncinfer.v1.JobService/GetJob", "job_id": ...}}}

`fetch.rpc` is ReadResult when the result is large (kept by reference), GetJob otherwise.
`attempt` is the job's attempt number (GetJob's), which counts the attempts given back (shed by a
batcher, put back by a scheduler's stop, ...) too; `given_back_attempts` says how many of them were
given back, so `attempt - given_back_attempts` are the attempts that counted against max_attempts,
as GetJob's Job and a dead letter say them.
"""

from __future__ import annotations

import json
from typing import Any

import grpc

# Named in asyncinfer.contract and asyncinfer.webhook_delivery; re-exported for their callers here.
from asyncinfer.contract import WEBHOOK_SUBJECT_PREFIX as WEBHOOK_SUBJECT_PREFIX
from asyncinfer.jobs import JobRecord, JobState
from asyncinfer.webhook_delivery import CODEC_VERSION as CODEC_VERSION
from asyncinfer.webhook_delivery import Delivery as Delivery
from asyncinfer.webhook_delivery import DeliveryWire as DeliveryWire
from asyncinfer.webhook_delivery import decode_delivery as decode_delivery
from asyncinfer.webhook_delivery import encode_delivery as encode_delivery
from asyncinfer.webhook_delivery import rfc3339 as _rfc3339
from asyncinfer.webhook_status import CallbackEvent

EVENT_TYPES = {
    CallbackEvent.RUNNING: "job.running",
    CallbackEvent.COMPLETED: "job.completed",
    CallbackEvent.FAILED: "job.failed",
    CallbackEvent.CANCELED: "job.canceled",
}
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


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
        "given_back_attempts": record.given_back_attempts,
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
