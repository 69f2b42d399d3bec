"""The jobs of one SubmitJobs message, accepted together: admitted one by one in the message's
order (model queue depth, tenant quota: exactly as that many single submits arriving in that
order would be), then every admitted job's work message published as one pipelined group: all
written to the NATS connection before any acknowledgement is awaited, so a message of 100 jobs is
one flush and one batch of acks rather than 100 round trips each with its own socket write.

Each job keeps what a single submit guarantees: its own Nats-Msg-Id (its job ID, so a retried
publish is deduplicated), its own answer (a record only once its own write was acknowledged, else
its own error: QUEUE_FULL past the model's limit, TENANT_QUOTA_EXCEEDED, a full store,
ENQUEUE_FAILED), and its queued notice after the ack. A job whose admission or write fails frees
what it reserved; the others are not affected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from asyncinfer.config import ModelConfig
from asyncinfer.errors import AsyncInferError
from asyncinfer.jobs import JobRecord
from asyncinfer.nats.groups import DurableMessage
from services.gateway.admission import Admission
from services.gateway.submit_request import SubmitRequest
from services.gateway.tenant_quota import TenantSlot


class GroupWriter(Protocol):
    """What the group needs of the submitter (services.gateway.submit.JobSubmitter)."""

    def group_message(
        self, request: SubmitRequest, model: ModelConfig, *, tenant: str, now: float
    ) -> tuple[JobRecord, DurableMessage]: ...

    async def publish_group(self, messages: Sequence[DurableMessage]) -> list[int | Exception]: ...

    def not_queued(self, record: JobRecord, exc: BaseException) -> BaseException: ...

    def abandon(self, record: JobRecord) -> None: ...

    async def queued_many(self, records: Sequence[JobRecord]) -> None: ...


async def admit_and_enqueue_group(
    submitter: GroupWriter,
    admission: Admission,
    requests: Sequence[SubmitRequest],
    checked: Sequence[ModelConfig | AsyncInferError],
    *,
    tenant: str,
    now: float,
) -> list[JobRecord | Exception]:
    """Each request's record (durably queued) or error, in order; `checked` is each one's
    validation (submit_request.validate_each)."""
    results: list[JobRecord | Exception] = []
    # (index in results, model, its queue slot) of each admitted job, and its record and message.
    admitted: list[tuple[int, ModelConfig, float]] = []
    records: list[JobRecord] = []
    messages: list[DurableMessage] = []
    tenant_slots: list[TenantSlot | None] = []
    unsettled = True  # until every admitted job's outcome is known (or its slot released)
    try:
        for request, model in zip(requests, checked, strict=True):
            if isinstance(model, AsyncInferError):
                results.append(model)
                continue
            try:
                slot = await admission.admit_to_model(model)  # one at a time: in this message's order
            except AsyncInferError as error:
                results.append(error)
                continue
            try:
                tenant_slots.append(await admission.reserve_tenant_slot(tenant, model))
            except BaseException as error:
                admission.release_model_slot(model, slot)
                if not isinstance(error, AsyncInferError):
                    raise
                results.append(error)
                continue
            try:
                record, message = submitter.group_message(request, model, tenant=tenant, now=now)
            except AsyncInferError as error:  # over NATS's max_payload: this one alone
                admission.release_model_slot(model, slot)
                admission.end_tenant_slot(tenant_slots.pop())
                results.append(error)
                continue
            admitted.append((len(results), model, slot))
            records.append(record)
            messages.append(message)
            results.append(record)
        outcomes = await submitter.publish_group(messages) if messages else []
        unsettled = False
        for (index, model, slot), record, outcome in zip(admitted, records, outcomes, strict=True):
            if isinstance(outcome, Exception):
                # Not accepted (as a single submit: a write whose every answer was lost may still
                # have landed; an idempotency key makes the retry safe).
                admission.release_model_slot(model, slot)
                answer = submitter.not_queued(record, outcome)
                results[index] = answer if isinstance(answer, Exception) else outcome
        queued = [done for index, _, _ in admitted if isinstance(done := results[index], JobRecord)]
        if queued:
            await submitter.queued_many(queued)  # the notices go out together too: one write
    finally:
        if unsettled:  # cancelled or failed before the acks came: nothing is answered accepted
            for (_, model, slot), record in zip(admitted, records, strict=True):
                admission.release_model_slot(model, slot)
                submitter.abandon(record)
        for tenant_slot in tenant_slots:
            admission.end_tenant_slot(tenant_slot)
    return results
