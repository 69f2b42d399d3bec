"""What accepting a job writes, built without I/O: the new job's QUEUED record and its work
message (which carries that record: asyncinfer.jobs), headers and Nats-Msg-Id included. The
submitter (submit.py) publishes one at a time or a message's worth at once; both build them here,
so a job is the same job whichever path queued it.
"""

from __future__ import annotations

from asyncinfer.codecs.envelope import deadline_header, encode_envelope
from asyncinfer.config import Config, ModelConfig
from asyncinfer.contract import TRACEPARENT_HEADER, routing_headers
from asyncinfer.errors import FieldViolation, InvalidArgument
from asyncinfer.idempotency_claims import ClaimWritten
from asyncinfer.jobs import JobError, JobRecord, JobState, queued_envelope
from asyncinfer.nats.groups import DurableMessage
from asyncinfer.tracing import trace_fields
from services.gateway.submit_request import SubmitRequest


def queued_record(
    request: SubmitRequest,
    model: ModelConfig,
    config: Config,
    *,
    tenant: str,
    now: float,
    job_id: str,
    claim: ClaimWritten | None = None,
) -> JobRecord:
    """The job as accepted: QUEUED, with the model's and the gateway's defaults filled in, and the
    idempotency claim its submit wrote, if it has a key."""
    return JobRecord(
        job_id=job_id,
        tenant=tenant,
        model_name=model.name,
        # Only what was asked: a job that names no version gets the default at its dispatch.
        model_version=request.model_version,
        state=JobState.QUEUED,
        priority=request.priority,
        create_time=now,
        update_time=now,
        max_attempts=request.max_attempts or model.max_attempts,
        result_retention_s=request.result_retention_s or config.gateway.default_result_retention_s,
        labels=dict(request.labels),
        idempotency_key=request.idempotency_key,
        deadline=request.deadline,
        execution_timeout_s=request.execution_timeout_s or model.default_execution_timeout_s,
        callback=request.callback,
        input_ref=request.input_blob,
        traceparent=request.traceparent,
        claim_revision=claim.revision if claim is not None else 0,
        claim_fingerprint=claim.fingerprint if claim is not None else "",
    )


def withdrawn_record(
    request: SubmitRequest, model: ModelConfig, config: Config, *, tenant: str, now: float, job_id: str, error: JobError
) -> JobRecord:
    """The record that keeps the keyed job `job_id` from ever running (services/gateway/
    idempotency.py): the job as `request` asks for it, ended CANCELED with `error` at `now`, never
    attempted. No callback (nobody was told of it by a webhook) and no input (none is kept for it)."""
    queued = queued_record(request, model, config, tenant=tenant, now=now, job_id=job_id)
    return queued.evolve(state=JobState.CANCELED, end_time=now, error=error, callback=None, input_ref=None)


def work_message(record: JobRecord, request: SubmitRequest) -> DurableMessage:
    """The job's one durable write: its work message, deduplicated by its job ID."""
    envelope = queued_envelope(record, request.inputs)
    headers = routing_headers(
        tenant=record.tenant, job_id=record.job_id, priority=record.priority, model_name=record.model_name
    )
    headers.update(deadline_header(record.deadline))  # read by the scheduler's deadline sweep
    if record.traceparent:  # also readable by NATS tooling without decoding the record
        headers[TRACEPARENT_HEADER] = record.traceparent
    return DurableMessage(envelope.subject, encode_envelope(envelope), msg_id=record.job_id, headers=headers)


def job_about(record: JobRecord) -> dict[str, str]:
    """What the submit's log lines name (not log.bind(): binding costs on every submit, 2% of the
    gateway's CPU in a bulk burst by py-spy, even when nothing is logged)."""
    about = {"job_id": record.job_id, "model": record.model_name, "tenant": record.tenant}
    if record.traceparent:
        about.update(trace_fields(record.traceparent))
    return about


def check_fits(message: DurableMessage, max_payload: int) -> None:
    """Refuses (INVALID_ARGUMENT REQUEST_TOO_LARGE) a work message NATS would refuse: over the
    server's max_payload (1 MB unless its configuration says more). It was published and
    refused, and the caller was told UNAVAILABLE "submit it again", which could never work."""
    headers = sum(len(k) + len(v) + 4 for k, v in (message.headers or {}).items()) + 16
    size = len(message.payload) + headers
    if max_payload > 0 and size > max_payload:
        text = (
            f"the job's work message would be {size} bytes, over the NATS server's max_payload of {max_payload} "
            "(its setting; `asyncinfer up` sets 8 MB); send large inputs with UploadInput and pass its input_ref"
        )
        raise InvalidArgument(text, [FieldViolation("inputs", text)], reason="REQUEST_TOO_LARGE")
