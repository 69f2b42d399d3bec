"""The JobService servicer: converts requests at the edge, calls the domain, converts back.
Errors are raised as asyncinfer errors; the server's interceptor turns them into statuses."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from asyncinfer.config import Config
from asyncinfer.errors import AsyncInferError, Unimplemented
from asyncinfer.ids import is_job_id
from asyncinfer.job_store import JobStore, job_not_found
from asyncinfer.jobs import job_key
from asyncinfer.v1 import job_service_pb2, job_service_pb2_grpc
from services.gateway.convert import job_to_proto, submit_request_from_proto
from services.gateway.metrics import GatewayMetrics
from services.gateway.submit import JobSubmitter, check_request_size
from services.gateway.watch_hub import WatchHub

Context = grpc.aio.ServicerContext[Any, Any]


def resolve_tenant(context: Context, config: Config) -> str:
    """The caller's tenant. One tenant until API keys map callers to tenants."""
    del context  # the authorization metadata will be read here
    return config.gateway.default_tenant


class JobService(job_service_pb2_grpc.JobServiceServicer):
    def __init__(
        self,
        config: Config,
        *,
        submitter: JobSubmitter,
        records: JobStore,
        hub: WatchHub,
        metrics: GatewayMetrics,
    ) -> None:
        self._config = config
        self._submitter = submitter
        self._records = records
        self._hub = hub
        self._metrics = metrics

    async def SubmitJob(
        self, request: job_service_pb2.SubmitJobRequest, context: Context
    ) -> job_service_pb2.SubmitJobResponse:
        started = time.perf_counter()
        # Unknown names would otherwise let callers mint label values without bound.
        model_label = request.model_name if self._config.model(request.model_name) else "unknown"
        try:
            check_request_size(request.ByteSize(), self._config.gateway.max_request_bytes)
            submit = submit_request_from_proto(request, now=time.time())
            record = await self._submitter.submit(submit, tenant=resolve_tenant(context, self._config))
        except AsyncInferError as error:
            self._metrics.submit_rejected.labels(model=model_label, code=error.code.name).inc()
            raise
        finally:
            self._metrics.submit_seconds.observe(time.perf_counter() - started)
        self._metrics.jobs_submitted.labels(model=model_label, priority=record.priority.value).inc()
        return job_service_pb2.SubmitJobResponse(job=job_to_proto(record))

    async def GetJob(self, request: job_service_pb2.GetJobRequest, context: Context) -> job_service_pb2.GetJobResponse:
        # Anything but a canonical job ID cannot name a job (and must not reach the KV as a key).
        if not is_job_id(request.job_id):
            raise job_not_found(request.job_id)
        record = await self._records.get(job_key(resolve_tenant(context, self._config), request.job_id))
        if record is None:
            raise job_not_found(request.job_id)
        return job_service_pb2.GetJobResponse(job=job_to_proto(record))

    async def WatchJob(
        self, request: job_service_pb2.WatchJobRequest, context: Context
    ) -> AsyncIterator[job_service_pb2.WatchJobResponse]:
        if not is_job_id(request.job_id):
            raise job_not_found(request.job_id)
        tenant = resolve_tenant(context, self._config)
        # aclosing: a cancelled call closes the watch (and frees its queue) at once, not at GC.
        async with contextlib.aclosing(self._hub.watch(tenant, request.job_id, request.after_revision)) as updates:
            async for record in updates:
                yield job_service_pb2.WatchJobResponse(job=job_to_proto(record))

    async def SubmitJobs(
        self, request_iterator: AsyncIterator[job_service_pb2.SubmitJobsRequest], context: Context
    ) -> AsyncIterator[job_service_pb2.SubmitJobsResponse]:
        raise Unimplemented("SubmitJobs (bulk submission) comes with a later release; use SubmitJob")
        yield  # an async generator, as server-streaming methods must be

    async def CancelJob(
        self, request: job_service_pb2.CancelJobRequest, context: Context
    ) -> job_service_pb2.CancelJobResponse:
        raise Unimplemented("CancelJob comes with a later release")

    async def ListJobs(
        self, request: job_service_pb2.ListJobsRequest, context: Context
    ) -> job_service_pb2.ListJobsResponse:
        raise Unimplemented("ListJobs comes with a later release")

    async def UploadInput(
        self, request_iterator: AsyncIterator[job_service_pb2.UploadInputRequest], context: Context
    ) -> job_service_pb2.UploadInputResponse:
        raise Unimplemented("UploadInput (claim-check uploads) comes with a later release")

    async def ReadResult(
        self, request: job_service_pb2.ReadResultRequest, context: Context
    ) -> AsyncIterator[job_service_pb2.ReadResultResponse]:
        raise Unimplemented("ReadResult (large results) comes with a later release")
        yield  # an async generator, as server-streaming methods must be
