"""Accepting a job: validate the request (submit_request.py), admit it (model queue depth, tenant
quota), publish its work message, which is its QUEUED record, and announce it. Acceptance means
durably queued: one durable write per job. The jobs of one SubmitJobs message are admitted in
order and their writes published as one pipelined group (submit_group.py).

Through a NATS leader election (a cluster node died) the publish is retried for
`gateway.enqueue_retry_s` under the same job ID, which it carries as Nats-Msg-Id: a publish that
landed before its answer was lost is dropped as a duplicate, and its retry still gets an ack.

No protobuf here: the servicer converts `SubmitJobRequest` into a `SubmitRequest` first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import structlog

from asyncinfer.config import Config, ModelConfig
from asyncinfer.errors import ResourceExhausted, Unavailable
from asyncinfer.idempotency_claims import ClaimWritten
from asyncinfer.ids import new_job_id
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.jobs import JobRecord
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.groups import DurableMessage, publish_durably_many
from asyncinfer.nats.streams import StoreFullError, publish_durably, store_full
from asyncinfer.queued_notice import announce_queued
from asyncinfer.supervision import outcome_seen
from asyncinfer.work_summary import WorkSummary
from services.gateway.admission import Admission
from services.gateway.blobs import ClaimCheck, check_exclusive_inputs, input_expiry
from services.gateway.callbacks import check_callback
from services.gateway.model_catalog import ModelCatalog
from services.gateway.recent_records import RecentRecords
from services.gateway.store_health import StoreHealth, store_full_error
from services.gateway.submit_group import admit_and_enqueue_group
from services.gateway.submit_request import SubmitRequest, validate_each, validate_submit
from services.gateway.work_message import check_fits, job_about, queued_record, work_message

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
        summary: WorkSummary | None = None,
    ) -> None:
        # The models and versions accepted: the configuration's, and those registered.
        self.catalog = catalog or ModelCatalog(config)
        self._recent = recent
        self._store_health = store_health
        self._summary = summary
        # job_submitted is at debug (at info it was most of the gateway's log; jobs_summary says
        # how many were accepted instead). Asked once, as logging is configured before a service
        # starts: a filtered-out call still built the line's fields, ~2 us a job.
        self._log_each_job = log.is_enabled_for(logging.DEBUG)
        self._config = config
        self._claim_check = claim_check
        self._nc = nc
        self._js = nc.jetstream()
        self._admission = admission
        self._clock = clock
        self._tasks: set[asyncio.Task[JobRecord]] = set()
        self._group_tasks: set[asyncio.Task[list[JobRecord | Exception]]] = set()
        # A submit refused for NATS trouble or a full store, once per interval per model and kind
        # (the rest at debug): while it lasts, every submit is refused, at the clients' rate.
        self._refusal_lines = RepeatedLines()

    @property
    def clock(self) -> Callable[[], float]:
        """The gateway's wall clock, which stamps create_time (a queue_ttl's deadline reads it too)."""
        return self._clock

    def store_refusal(self, full: StoreFullError) -> ResourceExhausted:
        """A submit's write (its work message, or its idempotency claim) refused for want of space."""
        if self._store_health is not None:
            return self._store_health.refusal(full)
        return store_full_error(full)

    async def submit(
        self, request: SubmitRequest, *, tenant: str, job_id: str = "", claim: ClaimWritten | None = None
    ) -> JobRecord:
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
            self._admit_and_enqueue(request, model, tenant=tenant, now=now, job_id=job_id or new_job_id(), claim=claim)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(outcome_seen)
        return await asyncio.shield(task)

    async def submit_many(self, requests: Sequence[SubmitRequest], *, tenant: str) -> list[JobRecord | Exception]:
        """`submit` for each of a SubmitJobs message's requests, their work messages published as
        one pipelined group (submit_group.py); each one's record or error, in order. For inline
        requests without a callback: what needs a read first (an upload, a callback's host)
        goes through `submit`."""
        now = self._clock()
        checked = validate_each(requests, self._config, now=now, catalog=self.catalog)
        task = asyncio.create_task(
            admit_and_enqueue_group(self, self._admission, requests, checked, tenant=tenant, now=now)
        )
        self._group_tasks.add(task)
        task.add_done_callback(self._group_tasks.discard)
        task.add_done_callback(outcome_seen)
        return await asyncio.shield(task)

    def group_message(
        self, request: SubmitRequest, model: ModelConfig, *, tenant: str, now: float
    ) -> tuple[JobRecord, DurableMessage]:
        """A new job's record and work message, expected by the recent records from now on."""
        record = queued_record(request, model, self._config, tenant=tenant, now=now, job_id=new_job_id())
        message = work_message(record, request)
        check_fits(message, self._nc.max_payload)
        if self._recent is not None:
            self._recent.expect(record.key)
        return record, message

    async def publish_group(self, messages: Sequence[DurableMessage]) -> list[int | Exception]:
        return await publish_durably_many(
            self._js,
            messages,
            stream=self._config.nats.work_stream,
            retry_for_s=self._config.gateway.enqueue_retry_s,
        )

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
        if self._tasks or self._group_tasks:
            await asyncio.gather(*self._tasks, *self._group_tasks, return_exceptions=True)

    async def _admit_and_enqueue(
        self,
        request: SubmitRequest,
        model: ModelConfig,
        *,
        tenant: str,
        now: float,
        job_id: str,
        claim: ClaimWritten | None = None,
    ) -> JobRecord:
        slot = await self._admission.admit_to_model(model)
        try:
            tenant_slot = await self._admission.reserve_tenant_slot(tenant, model)
        except BaseException:
            self._admission.release_model_slot(model, slot)
            raise
        try:
            return await self._enqueue(request, model, tenant=tenant, now=now, job_id=job_id, claim=claim)
        except BaseException:
            # Not accepted. (A publish whose every answer was lost for enqueue_retry_s may still
            # have landed: its job then runs although its caller was told UNAVAILABLE, the
            # ambiguity of any lost acknowledgement; an idempotency key makes the retry safe. One
            # never sent is not sent later: the adapter takes it back out of nats-py's reconnect
            # buffer when its attempt times out, asyncinfer.nats._fastpath.withdraw_unsent.)
            self._admission.release_model_slot(model, slot)
            raise
        finally:
            self._admission.end_tenant_slot(tenant_slot)

    async def _enqueue(
        self,
        request: SubmitRequest,
        model: ModelConfig,
        *,
        tenant: str,
        now: float,
        job_id: str,
        claim: ClaimWritten | None = None,
    ) -> JobRecord:
        record = queued_record(request, model, self._config, tenant=tenant, now=now, job_id=job_id, claim=claim)
        # One durable write: the work message is the job's QUEUED record (asyncinfer.jobs); the
        # jobs bucket holds the job from its first transition on.
        message = work_message(record, request)
        check_fits(message, self._nc.max_payload)
        if self._recent is not None:
            self._recent.expect(record.key)
        try:
            await publish_durably(
                self._js,
                message.subject,
                message.payload,
                stream=self._config.nats.work_stream,
                msg_id=message.msg_id,
                retry_for_s=self._config.gateway.enqueue_retry_s,
                headers=message.headers,
            )
        except BaseException as exc:
            error = self.not_queued(record, exc)
            if error is exc:
                raise
            raise error from exc
        await self.queued(record)
        return record

    def not_queued(self, record: JobRecord, exc: BaseException) -> BaseException:
        """What a submit whose work message failed answers (the error to raise from `exc`)."""
        self.abandon(record)
        full = store_full(exc)
        if full is not None:
            self._refusal_lines.say(
                log,
                "warning",
                "enqueue_refused_store_full",
                kind=(record.model_name, "store_full"),
                error=full.description,
                **job_about(record),
            )
            return self.store_refusal(full)
        if not isinstance(exc, NATS_FAILURES):
            return exc
        self._refusal_lines.say(
            log,
            "warning",
            "enqueue_failed",
            kind=(record.model_name, type(exc).__name__),
            error=str(exc),
            **job_about(record),
        )
        return Unavailable(
            f"the job could not be queued ({exc}); it was not accepted, submit it again",
            reason="ENQUEUE_FAILED",
            metadata={"job_id": record.job_id},
        )

    def abandon(self, record: JobRecord) -> None:
        """A job that will not be queued by this submit: the recent records stop expecting it."""
        if self._recent is not None:
            self._recent.forget(record.key)

    async def queued(self, record: JobRecord) -> None:
        """After a job's work message was acknowledged: noted, and announced to the schedulers."""
        await self.queued_many([record])

    async def queued_many(self, records: Sequence[JobRecord]) -> None:
        """`queued` for each of a group's jobs, the notices sent in one write."""
        for record in records:
            self._noted(record)
        await announce_queued(self._nc, records)

    def _noted(self, record: JobRecord) -> None:
        if self._store_health is not None:
            self._store_health.wrote()
        if self._recent is not None:
            self._recent.queued(record)
        if self._summary is not None:
            self._summary.count(record.model_name, "accepted")
        if self._log_each_job:
            log.debug("job_submitted", priority=record.priority.value, **job_about(record))
