"""Accepting a job: validate the request (submit_request.py), admit it (model queue depth, tenant
quota), publish its work message, which is its QUEUED record, and announce it. Acceptance means
durably queued: one durable write per job.

Through a NATS leader election (a cluster node died) the publish is retried for
`gateway.enqueue_retry_s` under the same job ID, which it carries as Nats-Msg-Id: a publish that
landed before its answer was lost is dropped as a duplicate, and its retry still gets an ack.

No protobuf here: the servicer converts `SubmitJobRequest` into a `SubmitRequest` first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import structlog

from asyncinfer.codecs.envelope import encode_envelope
from asyncinfer.codecs.record import encode_record
from asyncinfer.config import Config, ModelConfig
from asyncinfer.contract import TRACEPARENT_HEADER, routing_headers
from asyncinfer.errors import ResourceExhausted, Unavailable
from asyncinfer.ids import new_job_id
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.jobs import JobRecord, JobState, queued_envelope
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.streams import StoreFullError, publish_durably, store_full
from asyncinfer.queued_notice import announce_queued
from asyncinfer.tracing import trace_fields
from services.gateway.admission import Admission
from services.gateway.blobs import ClaimCheck, check_exclusive_inputs, input_expiry
from services.gateway.callbacks import check_callback
from services.gateway.model_catalog import ModelCatalog
from services.gateway.recent_records import RecentRecords
from services.gateway.store_health import StoreHealth, store_full_error
from services.gateway.submit_request import SubmitRequest, validate_submit

log = structlog.get_logger("asyncinfer.gateway")


class JobSubmitter:
    """Validates, admits and enqueues jobs."""

    def __init__(
        self,
        config: Config,
        nc: NatsClient,
        admission: Admission,
        *,
        clock: Callable[[], float] = time.time,
        claim_check: ClaimCheck | None = None,
        recent: RecentRecords | None = None,
        store_health: StoreHealth | None = None,
        catalog: ModelCatalog | None = None,
    ) -> None:
        # The models and versions accepted: the configuration's, and those registered.
        self.catalog = catalog or ModelCatalog(config)
        self._recent = recent
        self._store_health = store_health
        self._config = config
        self._claim_check = claim_check
        self._nc = nc
        self._js = nc.jetstream()
        self._admission = admission
        self._clock = clock
        self._tasks: set[asyncio.Task[JobRecord]] = set()

    def store_refusal(self, full: StoreFullError) -> ResourceExhausted:
        """A submit's write (its work message, or its idempotency claim) refused for want of space."""
        if self._store_health is not None:
            return self._store_health.refusal(full)
        return store_full_error(full)

    async def submit(self, request: SubmitRequest, *, tenant: str, job_id: str = "") -> JobRecord:
        """The new job's record (QUEUED, with its revision), once it is durably queued. Raises
        ResourceExhausted past a limit (nothing queued), Unavailable when NATS fails.

        Once admitted, a job is seen through even if the caller goes away: a submit cancelled
        between the publish and the record would leave an orphan work message (dropped later by
        the scheduler) for a job its caller may still be waiting on. `drain` awaits those still running."""
        now = self._clock()
        if request.input_ref:
            request = await self._read_input_ref(request, tenant=tenant)
        model = validate_submit(request, self._config, now=now, catalog=self.catalog)
        if request.callback is not None:  # resolves the URL's host: after the cheap checks
            await check_callback(request.callback, self._config.webhooks, tenant=tenant)
        if request.input_blob is not None:
            request = await self._hold_input_ref(request, model, tenant=tenant, now=now)
        task = asyncio.create_task(
            self._admit_and_enqueue(request, model, tenant=tenant, now=now, job_id=job_id or new_job_id())
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def enqueue_prepared(
        self, request: SubmitRequest, model: ModelConfig, *, tenant: str, job_id: str
    ) -> JobRecord:
        """A job whose inputs its caller checked and stored itself (a batch's chunk, whose rows
        pass max_batch_size: services.gateway.batch_driver), admitted and queued as `submit`
        does, under the caller's job ID."""
        return await self._admit_and_enqueue(request, model, tenant=tenant, now=self._clock(), job_id=job_id)

    async def _read_input_ref(self, request: SubmitRequest, *, tenant: str) -> SubmitRequest:
        """The request with the caller's upload decoded into its inputs, validated like inline
        ones next (NotFound for another tenant's, unknown or expired refs)."""
        check_exclusive_inputs(len(request.inputs), request.input_ref)
        if self._claim_check is None:
            return request
        uploaded = await self._claim_check.inputs(tenant, request.input_ref)
        return dataclasses.replace(request, inputs=uploaded.inputs, input_blob=uploaded.ref)

    async def _hold_input_ref(
        self, request: SubmitRequest, model: ModelConfig, *, tenant: str, now: float
    ) -> SubmitRequest:
        """Keeps the upload alive for the job (see services.gateway.blobs); the decoded inputs
        are dropped: the work message carries the reference, the scheduler reads it."""
        assert self._claim_check is not None
        assert request.input_blob is not None
        retention_s = request.result_retention_s or self._config.gateway.default_result_retention_s
        expires_at = input_expiry(
            retention_s,
            model,
            self._config,
            deadline=request.deadline,
            now=now,
            max_attempts=request.max_attempts or model.max_attempts,
            execution_timeout_s=request.execution_timeout_s,
        )
        await self._claim_check.keep_for(tenant, request.input_blob, expires_at)
        return dataclasses.replace(request, inputs=())

    async def drain(self) -> None:
        """Waits for submits whose callers went away (each bounded by enqueue_retry_s)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _admit_and_enqueue(
        self, request: SubmitRequest, model: ModelConfig, *, tenant: str, now: float, job_id: str
    ) -> JobRecord:
        slot = self._admission.reserve_model_slot(model)
        try:
            tenant_slot = await self._admission.reserve_tenant_slot(tenant, model)
        except BaseException:
            self._admission.release_model_slot(model, slot)
            raise
        try:
            return await self._enqueue(request, model, tenant=tenant, now=now, job_id=job_id)
        except BaseException:
            # Not accepted. (A publish whose every answer was lost for enqueue_retry_s may still
            # have landed: its job then runs although its caller was told UNAVAILABLE, the
            # ambiguity of any lost acknowledgement; an idempotency key makes the retry safe.)
            self._admission.release_model_slot(model, slot)
            raise
        finally:
            self._admission.end_tenant_slot(tenant_slot)

    async def _enqueue(
        self, request: SubmitRequest, model: ModelConfig, *, tenant: str, now: float, job_id: str
    ) -> JobRecord:
        record = JobRecord(
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
            result_retention_s=request.result_retention_s or self._config.gateway.default_result_retention_s,
            labels=dict(request.labels),
            idempotency_key=request.idempotency_key,
            deadline=request.deadline,
            execution_timeout_s=request.execution_timeout_s or model.default_execution_timeout_s,
            callback=request.callback,
            input_ref=request.input_blob,
            traceparent=request.traceparent,
        )
        # Not log.bind(): binding costs on every submit (2% of the gateway's CPU in a bulk burst,
        # py-spy) even when nothing is logged; the few lines below name the job themselves.
        about = {"job_id": record.job_id, "model": record.model_name, "tenant": tenant}
        if record.traceparent:
            about.update(trace_fields(record.traceparent))
        # One durable write: the work message is the job's QUEUED record (asyncinfer.jobs); the
        # jobs bucket holds the job from its first transition on.
        envelope = queued_envelope(record, request.inputs)
        if self._recent is not None:
            self._recent.expect(record.key)
        headers = routing_headers(
            tenant=tenant, job_id=record.job_id, priority=record.priority, model_name=record.model_name
        )
        if record.traceparent:  # also readable by NATS tooling without decoding the record
            headers[TRACEPARENT_HEADER] = record.traceparent
        try:
            await publish_durably(
                self._js,
                envelope.subject,
                encode_envelope(envelope),
                stream=self._config.nats.work_stream,
                msg_id=record.job_id,
                retry_for_s=self._config.gateway.enqueue_retry_s,
                headers=headers,
            )
        except BaseException as exc:
            if self._recent is not None:
                self._recent.forget(record.key)
            full = store_full(exc)
            if full is not None:
                log.warning("enqueue_refused_store_full", error=full.description, **about)
                raise self.store_refusal(full) from exc
            if not isinstance(exc, NATS_FAILURES):
                raise
            log.warning("enqueue_failed", error=str(exc), **about)
            raise Unavailable(
                f"the job could not be queued ({exc}); it was not accepted, submit it again",
                reason="ENQUEUE_FAILED",
                metadata={"job_id": record.job_id},
            ) from exc
        if self._store_health is not None:
            self._store_health.wrote()
        if self._recent is not None:
            self._recent.queued(record)
        await announce_queued(self._nc, record, encode_record(record))
        log.info("job_submitted", priority=record.priority.value, **about)
        return record
