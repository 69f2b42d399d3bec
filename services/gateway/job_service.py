"""The JobService servicer: converts requests at the edge, calls the domain, converts back.
Errors are raised as asyncinfer errors; the server's interceptor turns them into statuses."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import grpc
import structlog

from asyncinfer.config import Config
from asyncinfer.errors import AsyncInferError
from asyncinfer.grpc_headers import WATCH_READY, watch_since
from asyncinfer.ids import is_job_id
from asyncinfer.job_store import JobStore, job_not_found
from asyncinfer.jobs import JobRecord, JobState, job_key
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.nats import Client as NatsClient
from asyncinfer.tracing import Tracing, trace_fields
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc
from services.gateway import transitions
from services.gateway.auth import Authenticator

# MAX_IDS_PER_READ is re-exported: callers (tests among them) read the GetJobs bound here.
from services.gateway.batch_reads import MAX_IDS_PER_READ as MAX_IDS_PER_READ
from services.gateway.batch_reads import get_jobs, watch_jobs_responses, watched_changes
from services.gateway.blobs import ClaimCheck
from services.gateway.bulk import ItemOutcome, submit_stream
from services.gateway.bulk_message import MessageSubmitter
from services.gateway.callbacks import CallbackDeliveries
from services.gateway.convert import job_to_proto, models_to_proto, submit_request_from_proto, submit_wait_s
from services.gateway.idempotency import IdempotentSubmitter, SubmitOutcome
from services.gateway.list_jobs import (
    JobLister,
    ListQuery,
    estimated_bytes,
    list_query_from_proto,
    say_unreadable_skipped,
)
from services.gateway.metrics import GatewayMetrics
from services.gateway.progress_watch import ProgressFeed, progress_to_proto, record_progress, watch_with_progress
from services.gateway.queue_view import QueueView, version_waiting_reason
from services.gateway.shared_runs import SharedRuns
from services.gateway.stream_limits import StreamCounts
from services.gateway.submit import JobSubmitter
from services.gateway.submit_request import check_request_size
from services.gateway.submit_tracing import Submit, caller_trace, traced_submit
from services.gateway.submit_wait import wait_budget_s, wait_for_end
from services.gateway.transitions import Expiry
from services.gateway.watch_hub import WatchHub

log = structlog.get_logger("asyncinfer.gateway")

Context = grpc.aio.ServicerContext[Any, Any]


def resolve_tenant(context: Context, authenticator: Authenticator) -> str:
    """The caller's tenant, from its API key (UNAUTHENTICATED without a valid one), or the default
    tenant when no keys are configured. Every record key is built from it, so another tenant's job
    is simply not there (NOT_FOUND, exactly like an unknown one)."""
    return authenticator.tenant(context.invocation_metadata() or ())


# Watch messages kept for sharing between the watchers of one change: enough for every job changing
# within the moment it takes to fan one change out.
WATCH_RESPONSES_CACHED = 1024
# ... and at most about this many bytes of outputs among them (they outlive the watches).
WATCH_RESPONSES_CACHED_BYTES = 16 * 1024 * 1024


class JobService(job_service_pb2_grpc.JobServiceServicer):
    def __init__(
        self,
        config: Config,
        *,
        submitter: JobSubmitter,
        records: JobStore,
        hub: WatchHub,
        queues: QueueView,
        expiry: Expiry,
        nc: NatsClient,
        metrics: GatewayMetrics,
        claim_check: ClaimCheck,
        callback_deliveries: CallbackDeliveries | None = None,
        idempotent: IdempotentSubmitter,
        tracing: Tracing | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        # What a label watch's headers say it listens since (the clock of its submits' create_time).
        self._wall_clock = wall_clock
        self._tracing = tracing or Tracing.off()
        self._submitter = submitter
        self._records = records
        self._hub = hub
        self._queues = queues
        self._expiry = expiry
        self._nc = nc
        self._metrics = metrics
        self._claim_check = claim_check
        self._callback_deliveries = callback_deliveries
        self._idempotent = idempotent
        # A cancel, once per interval per model and state (the rest at debug): a client cancelling
        # its thousand jobs one by one, or one cancel hammered, wrote a line each.
        self._cancel_lines = RepeatedLines()
        # The lines a plain function says per job for this service (a cancel notice not sent, a
        # submit's wait ended early, a bulk item that failed unexpectedly): once per interval per kind.
        self._repeated_lines = RepeatedLines()
        self.progress_feed = ProgressFeed(nc)
        # Converted watch messages of recent record changes, oldest first (see _watch_response).
        self._watch_responses: dict[tuple[str, int], job_service_pb2.WatchJobResponse] = {}
        self._watch_response_bytes: dict[tuple[str, int], int] = {}
        self._watches = StreamCounts(
            "watch",
            reason="TOO_MANY_WATCHES",
            per_tenant=config.gateway.max_watches_per_tenant,
            per_connection=config.gateway.max_watches_per_connection,
        )
        self._lister = JobLister(
            nc,
            records,
            expiry,
            bucket=config.nats.jobs_bucket,
            work_stream=config.nats.work_stream,
            max_page_bytes=config.gateway.max_request_bytes,  # the server's limit has headroom above it
        )
        self._listings: SharedRuns[tuple[str, str, int, str], job_service_pb2.ListJobsResponse] = SharedRuns()
        self._authenticator = Authenticator(config.gateway.api_keys, config.gateway.default_tenant)
        self._catalog = submitter.catalog
        self._models_listed: tuple[int, job_service_pb2.ListModelsResponse] | None = None  # (catalog generation, it)
        self._message_submitter = MessageSubmitter(config, submitter, metrics, self._model_label, self._tracing)

    def _model_label(self, model_name: str) -> str:
        # Unknown names would otherwise let callers mint label values without bound (names learnt
        # from the registry come from batchers, not callers).
        return model_name if self._catalog.model(model_name) else "unknown"

    def _job(self, record: JobRecord) -> job_pb2.Job:
        standing = self._queues.standing(record)
        if standing is None:
            return job_to_proto(record, standing)
        # The version it waits for: its own, or a default_version the configuration fixes (which
        # keeps unpinned jobs queued while nothing serves it, as after its version was unloaded),
        # else the one it would run on now (a model whose only version failed to load: that one).
        model = self._catalog.model(record.model_name)
        pinned = record.model_version or (model.default_version if model is not None else "")
        version = pinned or (self._catalog.default_version(model) if model is not None else "")
        if not version:
            return job_to_proto(record, standing)
        served = self._catalog.serves(record.model_name, version)
        reason = version_waiting_reason(
            standing.waiting_reason,
            pinned=bool(pinned),
            served=served,
            load_failed=not served and self._catalog.load_failed(record.model_name, version),
        )
        if reason != standing.waiting_reason:
            standing = dataclasses.replace(standing, waiting_reason=reason, estimated_start_time=None)
        return job_to_proto(record, standing)

    async def _read(self, context: Context, job_id: str) -> JobRecord:
        """The caller's job as it stands now (EXPIRED if its queue deadline passed)."""
        tenant = resolve_tenant(context, self._authenticator)  # first: a caller without a key learns nothing
        return await self._record(tenant, job_id)

    async def _record(self, tenant: str, job_id: str) -> JobRecord:
        # Anything but a canonical job ID cannot name a job (and must not reach the KV as a key).
        if not is_job_id(job_id):
            raise job_not_found(job_id)
        key = job_key(tenant, job_id)
        # A job this gateway queued that has ended is answered from the feed's record (recent_records).
        finished = self._hub.recent.finished(key)
        if finished is not None:
            return finished
        record = await self._records.get(key)
        if record is not None:
            record = await self._expiry.settle(record)
        if record is None:
            raise await self._records.not_found(key, job_id)
        return record

    def _submit(self, request: job_service_pb2.SubmitJobRequest, tenant: str, caller: str = "") -> Submit:
        """One item of SubmitJobs, counted in the metrics (and traced: submit_tracing.py)."""
        return traced_submit(self._tracing, self._submit_as, request, tenant, caller)

    def _submit_unary(self, request: job_service_pb2.SubmitJobRequest, tenant: str, caller: str) -> Submit:
        """`_submit` for a SubmitJob, whose request may ask to wait (submit_wait.py)."""
        return traced_submit(self._tracing, self._submit_waitable, request, tenant, caller)

    def _submit_waitable(self, request: job_service_pb2.SubmitJobRequest, tenant: str, trace: str) -> Submit:
        return self._submit_as(request, tenant, trace, wait_allowed=True)

    async def _submit_as(
        self, request: job_service_pb2.SubmitJobRequest, tenant: str, trace: str, *, wait_allowed: bool = False
    ) -> SubmitOutcome:
        started = time.perf_counter()
        model_label = self._model_label(request.model_name)
        try:
            check_request_size(request.ByteSize(), self._config.gateway.max_request_bytes)
            submit = submit_request_from_proto(
                request, now=self._expiry.clock(), traceparent=trace, wait_allowed=wait_allowed
            )
            outcome = await self._idempotent.submit(submit, tenant=tenant)
        except AsyncInferError as error:
            self._metrics.submit_rejected.labels(model=model_label, code=error.code.name, reason=error.reason).inc()
            raise
        finally:
            self._metrics.submit_seconds.observe(time.perf_counter() - started)
        if not outcome.deduplicated:
            self._metrics.jobs_submitted.labels(model=model_label, priority=outcome.record.priority.value).inc()
        return outcome

    async def SubmitJob(
        self, request: job_service_pb2.SubmitJobRequest, context: Context
    ) -> job_service_pb2.SubmitJobResponse:
        tenant = resolve_tenant(context, self._authenticator)
        caller = caller_trace(self._tracing, context)
        budget_s = wait_budget_s(
            submit_wait_s(request), self._config.gateway.max_submit_wait_s, context.time_remaining()
        )
        if budget_s <= 0:
            outcome = await self._submit_unary(request, tenant, caller)
            return job_service_pb2.SubmitJobResponse(job=self._job(outcome.record), deduplicated=outcome.deduplicated)
        # A waiting call holds a watch: counted (and refused past the limits) before the job is accepted.
        with self._watches.hold(tenant, context.peer()):
            await self._hub.ensure_feed_quietly()  # first: the job's changes then come without a read
            outcome = await self._submit_unary(request, tenant, caller)
            record = await wait_for_end(self._hub, outcome.record, budget_s, self._repeated_lines)
        self._metrics.submit_waits.labels(outcome="ended" if record.state.is_terminal else "wait_passed").inc()
        return job_service_pb2.SubmitJobResponse(job=self._job(record), deduplicated=outcome.deduplicated)

    async def GetJob(self, request: job_service_pb2.GetJobRequest, context: Context) -> job_service_pb2.GetJobResponse:
        record = await self._read(context, request.job_id)
        self._hub.note_polls()  # after the caller is known: an unauthenticated call keeps nothing running
        job = self._job(record)
        if self._callback_deliveries is not None:
            job.callback_deliveries.extend(await self._callback_deliveries.for_job(record))
        progress = record_progress(record)
        if progress is None:
            return job_service_pb2.GetJobResponse(job=job)
        return job_service_pb2.GetJobResponse(job=job, progress=progress_to_proto(progress))

    async def GetJobs(
        self, request: job_service_pb2.GetJobsRequest, context: Context
    ) -> job_service_pb2.GetJobsResponse:
        tenant = resolve_tenant(context, self._authenticator)
        self._hub.note_polls()
        return await get_jobs(
            request.job_ids, tenant, self._job_or_error, budget_bytes=self._config.gateway.max_request_bytes
        )

    async def _job_or_error(
        self, tenant: str, job_id: str
    ) -> tuple[job_pb2.Job, job_service_pb2.JobProgress | None] | AsyncInferError:
        try:
            record = await self._record(tenant, job_id)
        except AsyncInferError as error:
            return error
        progress = record_progress(record)
        return self._job(record), None if progress is None else progress_to_proto(progress)

    async def WatchJob(
        self, request: job_service_pb2.WatchJobRequest, context: Context
    ) -> AsyncIterator[job_service_pb2.WatchJobResponse]:
        tenant = resolve_tenant(context, self._authenticator)
        if not is_job_id(request.job_id):
            raise job_not_found(request.job_id)
        # aclosing: a cancelled call closes the watch (and frees its queue) at once, not at GC.
        with self._watches.hold(tenant, context.peer()):
            updates = watch_with_progress(self._hub, self.progress_feed, tenant, request.job_id, request.after_revision)
            async with contextlib.aclosing(updates) as watched:
                async for record, progress in watched:
                    response = self._watch_response(record)
                    if progress is not None:
                        # Not the shared message: that one goes to every watcher of the change.
                        response = job_service_pb2.WatchJobResponse(
                            job=response.job, progress=progress_to_proto(progress)
                        )
                    yield response

    async def WatchJobs(
        self, request: job_service_pb2.WatchJobsRequest, context: Context
    ) -> AsyncIterator[job_service_pb2.WatchJobsResponse]:
        tenant = resolve_tenant(context, self._authenticator)

        async def listening() -> None:
            # The stream's headers, before any change: a client that awaits them before it submits
            # sees its jobs from QUEUED on; and since when, on this gateway's clock, for the SDK's
            # catch-up after a reconnect (asyncinfer.grpc_headers).
            await context.send_initial_metadata((WATCH_READY, watch_since(self._wall_clock())))

        with self._watches.hold(tenant, context.peer()):
            changes = watched_changes(request, tenant, self._hub, self._records, self._expiry, listening=listening)
            async with contextlib.aclosing(changes) as batches:
                budget = self._config.gateway.max_request_bytes
                async for batch in batches:
                    for response in watch_jobs_responses(batch, self._watch_response, budget_bytes=budget):
                        yield response

    def _watch_response(self, record: JobRecord) -> job_service_pb2.WatchJobResponse:
        """The message for one record change. Every watcher of a job gets the same change at
        the same moment, so a record past QUEUED (no queue standing, which changes with time) is
        converted once and the message shared (gRPC only reads it to serialize)."""
        if record.state is JobState.QUEUED:
            return job_service_pb2.WatchJobResponse(job=self._job(record))
        cache_key = (record.key, record.revision)
        response = self._watch_responses.get(cache_key)
        if response is None:
            response = job_service_pb2.WatchJobResponse(job=self._job(record))
            self._watch_responses[cache_key] = response
            self._watch_response_bytes[cache_key] = estimated_bytes(record)
            while len(self._watch_responses) > 1 and (
                len(self._watch_responses) > WATCH_RESPONSES_CACHED
                or sum(self._watch_response_bytes.values()) > WATCH_RESPONSES_CACHED_BYTES
            ):
                oldest = next(iter(self._watch_responses))
                del self._watch_responses[oldest], self._watch_response_bytes[oldest]
        return response

    async def CancelJob(
        self, request: job_service_pb2.CancelJobRequest, context: Context
    ) -> job_service_pb2.CancelJobResponse:
        outcome = "INTERNAL"
        model_label = "unknown"
        try:
            record = await self._read(context, request.job_id)
            model_label = self._model_label(record.model_name)
            record = await transitions.cancel(
                self._records,
                self._nc,
                record,
                reason=request.reason,
                now=self._expiry.clock(),
                lines=self._repeated_lines,
            )
            outcome = record.state.value
            self._metrics.job_timings.observe(record)  # terminal (CANCELED) when the job was queued
        except AsyncInferError as error:
            outcome = error.reason
            raise
        finally:
            self._metrics.cancels.labels(model=model_label, outcome=outcome).inc()
        about = {"job_id": record.job_id, "model": record.model_name, **trace_fields(record.traceparent)}
        self._cancel_lines.say(
            log,
            "info",
            "job_cancel_requested",
            kind=(record.model_name, record.state),
            **about,
            state=record.state.value,
        )
        return job_service_pb2.CancelJobResponse(job=self._job(record))

    async def SubmitJobs(
        self, request_iterator: AsyncIterator[job_service_pb2.SubmitJobsRequest], context: Context
    ) -> AsyncIterator[job_service_pb2.SubmitJobsResponse]:
        tenant = resolve_tenant(context, self._authenticator)  # once, before any request is read
        caller = caller_trace(self._tracing, context)  # the parent of each item's span

        def submit_one(request: job_service_pb2.SubmitJobRequest) -> Submit:
            return self._submit(request, tenant, caller)

        def submit_many(jobs: Sequence[job_service_pb2.SubmitJobRequest]) -> Coroutine[Any, Any, list[ItemOutcome]]:
            return self._message_submitter.submit(jobs, tenant, submit_one)

        responses = submit_stream(request_iterator, submit_one, submit_many, self._job, lines=self._repeated_lines)
        async with contextlib.aclosing(responses) as answers:
            async for answer in answers:
                yield answer

    async def ListJobs(
        self, request: job_service_pb2.ListJobsRequest, context: Context
    ) -> job_service_pb2.ListJobsResponse:
        tenant = resolve_tenant(context, self._authenticator)
        query = list_query_from_proto(request)
        # Identical calls (every label watch of a run reconnecting after a restart) share one
        # listing that starts after each of them came (services/gateway/shared_runs.py).
        key = (tenant, query.fingerprint(tenant), query.page_size, query.page_token)
        return await self._listings.run(key, lambda: self._list_page(tenant, query))

    async def _list_page(self, tenant: str, query: ListQuery) -> job_service_pb2.ListJobsResponse:
        """One listing; its answer may go to several callers (never modified once made)."""
        self._metrics.list_jobs_listings.inc()
        page = await self._lister.page(tenant, query)
        say_unreadable_skipped(self._repeated_lines, log, "ListJobs", tenant, page.unreadable_skipped)
        return job_service_pb2.ListJobsResponse(
            jobs=[self._job(record) for record in page.records],
            next_page_token=page.next_page_token,
            unreadable_skipped=page.unreadable_skipped,
        )

    async def close(self) -> None:
        """After the server stopped: the listings whose callers all left."""
        await self._listings.close()

    async def UploadInput(
        self, request_iterator: AsyncIterator[job_service_pb2.UploadInputRequest], context: Context
    ) -> job_service_pb2.UploadInputResponse:
        tenant = resolve_tenant(context, self._authenticator)  # before any chunk is read
        return await self._claim_check.upload(request_iterator, tenant=tenant)

    async def DeleteInput(
        self, request: job_service_pb2.DeleteInputRequest, context: Context
    ) -> job_service_pb2.DeleteInputResponse:
        return await self._claim_check.delete_input(resolve_tenant(context, self._authenticator), request.ref)

    async def ListModels(
        self, request: job_service_pb2.ListModelsRequest, context: Context
    ) -> job_service_pb2.ListModelsResponse:
        resolve_tenant(context, self._authenticator)  # a caller without a key learns nothing
        # Made again only once the catalog changed (300 models x 12 batchers: ~9 ms a listing,
        # on the event loop). Never modified once made: gRPC only serializes it.
        generation = self._catalog.generation
        if self._models_listed is None or self._models_listed[0] != generation:
            self._models_listed = (generation, models_to_proto(self._catalog.listings()))
        return self._models_listed[1]

    async def ReadResult(
        self, request: job_service_pb2.ReadResultRequest, context: Context
    ) -> AsyncIterator[job_service_pb2.ReadResultResponse]:
        record = await self._read(context, request.job_id)
        async with contextlib.aclosing(self._claim_check.read_result(record)) as chunks:
            async for message in chunks:
                yield message
