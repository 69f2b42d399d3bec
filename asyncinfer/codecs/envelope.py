"""The work envelope's codec (the WORK stream, `asyncinfer.work.<model>.<priority>.<tenant>.<job_id>`):
what the gateway publishes for a job and the scheduler decodes to dispatch it.

Routing does not need the payload: the message's headers carry the tenant, job ID, priority and
model (`asyncinfer.contract.routing_headers`). `tenant_of_envelope` is the fallback for a message
from a gateway that predates those headers: it reads the one field and skips the rest (inline
tensors may be megabytes of base64) without decoding it.

Version 1: version 0's fields with `v` first and every default left out.
Version 2: version 1's, and the QUEUED record's own fields (`is_record`, `result_retention_s`,
`labels`, `idempotency_key`, `callback`): a submit's message is the job's QUEUED record. A version 1
message is read with is_record false (its record was written to the jobs bucket). Added since, with
a default: `traceparent` (the record's, when tracing is on); `claim_revision` and `claim_fingerprint`
(the record's: a keyed job's idempotency claim)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec

from asyncinfer.codecs.parts import (
    BlobRefWire,
    TensorWire,
    blob_from_wire,
    blob_to_wire,
    tensors_from_wire,
    tensors_to_wire,
)
from asyncinfer.codecs.record import CallbackWire
from asyncinfer.contract import DEADLINE_HEADER
from asyncinfer.jobs import CallbackSpec, Priority, WorkEnvelope

VERSION = 2


class EnvelopeWire(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: int = 0  # missing: version 0
    job_id: str
    tenant: str
    model_name: str
    model_version: str = ""
    priority: Priority
    create_time: float
    max_attempts: int
    inputs: tuple[TensorWire, ...] = ()
    input_ref: BlobRefWire | None = None
    deadline: float | None = None
    execution_timeout_s: float | None = None
    is_record: bool = False
    result_retention_s: float | None = None
    labels: dict[str, str] = {}
    idempotency_key: str = ""
    callback: CallbackWire | None = None
    traceparent: str = ""
    claim_revision: int = 0
    claim_fingerprint: str = ""


class _EnvelopeTenant(msgspec.Struct):
    tenant: str = ""


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(EnvelopeWire)
_tenant_decoder = msgspec.json.Decoder(_EnvelopeTenant)


def encode_envelope(envelope: WorkEnvelope) -> bytes:
    e = envelope
    return _encoder.encode(
        EnvelopeWire(
            v=VERSION,
            job_id=e.job_id,
            tenant=e.tenant,
            model_name=e.model_name,
            model_version=e.model_version,
            priority=e.priority,
            create_time=e.create_time,
            max_attempts=e.max_attempts,
            inputs=tensors_to_wire(e.inputs),
            input_ref=blob_to_wire(e.input_ref),
            deadline=e.deadline,
            execution_timeout_s=e.execution_timeout_s,
            is_record=e.is_record,
            result_retention_s=e.result_retention_s if e.is_record else None,
            labels=dict(e.labels),
            idempotency_key=e.idempotency_key,
            callback=None if e.callback is None else CallbackWire(e.callback.url, e.callback.events),
            traceparent=e.traceparent,
            claim_revision=e.claim_revision,
            claim_fingerprint=e.claim_fingerprint,
        )
    )


def decode_envelope(data: bytes) -> WorkEnvelope:
    """The envelope in `data` (any version)."""
    w = _decoder.decode(data)
    return WorkEnvelope(
        job_id=w.job_id,
        tenant=w.tenant,
        model_name=w.model_name,
        model_version=w.model_version,
        priority=w.priority,
        create_time=w.create_time,
        max_attempts=w.max_attempts,
        inputs=tensors_from_wire(w.inputs),
        input_ref=blob_from_wire(w.input_ref),
        deadline=w.deadline,
        execution_timeout_s=w.execution_timeout_s,
        is_record=w.is_record,
        result_retention_s=w.result_retention_s or 0.0,
        labels=w.labels,
        idempotency_key=w.idempotency_key,
        callback=None if w.callback is None else CallbackSpec(w.callback.url, w.callback.events),
        traceparent=w.traceparent,
        claim_revision=w.claim_revision,
        claim_fingerprint=w.claim_fingerprint,
    )


def tenant_of_envelope(data: bytes) -> str:
    """The envelope's tenant ("" when `data` is no envelope), without decoding the rest."""
    try:
        return _tenant_decoder.decode(data).tenant
    except msgspec.DecodeError:
        return ""


def deadline_header(deadline: float | None) -> dict[str, str]:
    """The DEADLINE_HEADER of a job's work message (none for a job without a deadline): the
    deadline's Unix seconds as `repr` writes the float, which reads back to the same float."""
    return {} if deadline is None else {DEADLINE_HEADER: repr(deadline)}


def deadline_of_headers(headers: Mapping[str, str] | None) -> float | None:
    """The deadline a work message's headers carry; None without one, or one that is no number
    (never written so: the message is left to its dispatch)."""
    value = (headers or {}).get(DEADLINE_HEADER)
    if value is None:
        return None
    try:
        deadline = float(value)
    except ValueError:
        return None
    return deadline if math.isfinite(deadline) else None
