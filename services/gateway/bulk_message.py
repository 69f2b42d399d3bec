"""The jobs of one many-jobs SubmitJobs message: converted and checked together, the plain ones
(inline inputs, no idempotency key, no callback) queued as one group by
`JobSubmitter.submit_many` (its writes one pipelined publish), the others each through the
single-submit path (`submit_one`, the servicer's own: metrics, tracing, idempotency), started at
once so that their writes leave together too.

A key repeated within the message: its later items wait for the first to finish, then ask the
idempotent submitter like any repeat, so they get the first one's job (deduplicated) or its error,
never a second job, and never wait on the first one's claim by polling the KV.

While the gateway traces jobs, every item goes through `submit_one`: each job's span is its own.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from asyncinfer.config import Config
from asyncinfer.errors import AsyncInferError
from asyncinfer.jobs import JobRecord
from asyncinfer.tracing import Tracing
from asyncinfer.v1 import job_service_pb2
from services.gateway.bulk import ItemOutcome
from services.gateway.convert import submit_request_from_proto
from services.gateway.idempotency import SubmitOutcome
from services.gateway.metrics import GatewayMetrics
from services.gateway.submit import JobSubmitter
from services.gateway.submit_request import SubmitRequest, check_request_size

SubmitOne = Callable[[job_service_pb2.SubmitJobRequest], Coroutine[Any, Any, SubmitOutcome]]
# The most jobs submitted (and writes in flight) at once for one message.
MAX_GROUP = 1000


def needs_own_submit(job: job_service_pb2.SubmitJobRequest) -> bool:
    """What the group does not take: an idempotency key (a claim first), an upload (a read
    first), a callback (its host resolved first)."""
    return bool(job.idempotency_key or job.input_ref or job.HasField("callback"))


class MessageSubmitter:
    def __init__(
        self,
        config: Config,
        submitter: JobSubmitter,
        metrics: GatewayMetrics,
        model_label: Callable[[str], str],
        tracing: Tracing,
    ) -> None:
        self._max_request_bytes = config.gateway.max_request_bytes
        self._submitter = submitter
        self._metrics = metrics
        self._model_label = model_label
        self._tracing = tracing

    async def submit(
        self, jobs: Sequence[job_service_pb2.SubmitJobRequest], tenant: str, submit_one: SubmitOne
    ) -> list[ItemOutcome]:
        """Each job's outcome or error, in order. A message of more than MAX_GROUP jobs is taken
        MAX_GROUP at a time, one group after the other: what is in flight stays bounded whatever
        a message holds."""
        outcomes: list[ItemOutcome] = []
        for start in range(0, len(jobs), MAX_GROUP):
            outcomes += await self._submit_group(jobs[start : start + MAX_GROUP], tenant, submit_one)
        return outcomes

    async def _submit_group(
        self, jobs: Sequence[job_service_pb2.SubmitJobRequest], tenant: str, submit_one: SubmitOne
    ) -> list[ItemOutcome]:
        started = time.perf_counter()
        outcomes: list[ItemOutcome | None] = [None] * len(jobs)
        own: dict[int, asyncio.Task[SubmitOutcome]] = {}
        by_key: dict[str, asyncio.Task[SubmitOutcome]] = {}
        grouped: list[int] = []
        requests: list[SubmitRequest] = []
        now = self._submitter.clock()  # the clock of the jobs' create_time: their deadlines agree with it
        try:
            for index, job in enumerate(jobs):
                if self._tracing.enabled or needs_own_submit(job):
                    first = by_key.get(job.idempotency_key) if job.idempotency_key else None
                    task = asyncio.create_task(_after(first, submit_one, job))
                    own[index] = task
                    if job.idempotency_key:
                        by_key[job.idempotency_key] = task
                    continue
                try:
                    check_request_size(job.ByteSize(), self._max_request_bytes)
                    requests.append(submit_request_from_proto(job, now=now))
                except AsyncInferError as error:
                    outcomes[index] = error
                    continue
                grouped.append(index)
            records = await self._submitter.submit_many(requests, tenant=tenant) if requests else []
            for index, record in zip(grouped, records, strict=True):
                outcomes[index] = SubmitOutcome(record) if isinstance(record, JobRecord) else record
            if own:
                await asyncio.wait(own.values())
        finally:
            for task in own.values():
                task.cancel()  # only those not done: the stream ended (the submits are shielded)
            if own:
                await asyncio.gather(*own.values(), return_exceptions=True)
        for index, task in own.items():
            failure = task.exception()
            outcomes[index] = task.result() if failure is None else _as_exception(failure)
        self._count(jobs, outcomes, own, time.perf_counter() - started)
        return [outcome if outcome is not None else RuntimeError("no outcome") for outcome in outcomes]

    def _count(
        self,
        jobs: Sequence[job_service_pb2.SubmitJobRequest],
        outcomes: Sequence[ItemOutcome | None],
        own: dict[int, asyncio.Task[SubmitOutcome]],
        elapsed_s: float,
    ) -> None:
        """The metrics of the grouped jobs, as a single submit counts them (submit_one counts its
        own), each counter's labels looked up once per message rather than once per job."""
        submitted: Counter[tuple[str, str]] = Counter()
        rejected: Counter[tuple[str, str, str]] = Counter()
        for index, (job, outcome) in enumerate(zip(jobs, outcomes, strict=True)):
            if index in own:
                continue
            self._metrics.submit_seconds.observe(elapsed_s)
            if isinstance(outcome, SubmitOutcome):
                submitted[job.model_name, outcome.record.priority.value] += 1
            elif isinstance(outcome, AsyncInferError):
                rejected[job.model_name, outcome.code.name, outcome.reason] += 1
        for (model_name, priority), count in submitted.items():
            self._metrics.jobs_submitted.labels(model=self._model_label(model_name), priority=priority).inc(count)
        for (model_name, code, reason), count in rejected.items():
            labels = {"model": self._model_label(model_name), "code": code, "reason": reason}
            self._metrics.submit_rejected.labels(**labels).inc(count)


async def _after(
    first: asyncio.Task[SubmitOutcome] | None, submit_one: SubmitOne, job: job_service_pb2.SubmitJobRequest
) -> SubmitOutcome:
    """`submit_one(job)`, once `first` (an earlier item with the same idempotency key) has finished."""
    if first is not None:
        await asyncio.wait((first,))
    return await submit_one(job)


def _as_exception(error: BaseException) -> Exception:
    return error if isinstance(error, Exception) else RuntimeError(repr(error))
