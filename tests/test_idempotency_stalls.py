"""A keyed submit whose job could still be made live after its key went to another job, against a
real stack (gateway, scheduler, batcher, nats-server): a claimant that stalls between its claim and
its publish past the claim's bound (a frozen process, a suspended host), while a duplicate takes
the key over; and a submit whose publish lands after it failed and freed its key. Each time one job
of the key runs; the stalled claimant answers with the key's job (services/gateway/idempotency.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import nats.errors
import pytest

from asyncinfer.config import Config
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.jobs import JobRecord, JobState, job_key
from asyncinfer.nats import KeyValue
from asyncinfer.v1 import job_pb2, job_service_pb2
from services.gateway import idempotency, submit
from services.gateway.idempotency import claim_key
from services.gateway.submit import JobSubmitter
from tests.kv_helpers import job_record
from tests.stack import Stack, StartStack
from tests.test_gateway import submit_request

TENANT = "default"
HANG_GUARD_S = 60.0


@pytest.fixture
async def short_bound_stack(
    start_stack: StartStack, config: Config, monkeypatch: pytest.MonkeyPatch
) -> tuple[Stack, KeyValue]:
    """A stack whose gateway's submits write their jobs within 0.5 s (enqueue_retry_s), with no
    takeover margin: a claim goes stale 0.5 s after it was stored; and the claims bucket."""
    monkeypatch.setattr(idempotency, "TAKEOVER_MARGIN_S", 0.0)
    stack = await start_stack(config.replace(gateway={"enqueue_retry_s": 0.5}))
    return stack, await stack.nc.jetstream().key_value(config.nats.idempotency_bucket)


def stall_first_submit(monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, asyncio.Event]:
    """Holds the first submit between its idempotency claim and its job's publish, as a frozen
    claimant is held: (stalled: set once it holds, resume: set it to let it go on)."""
    stalled, resume = asyncio.Event(), asyncio.Event()
    accept = JobSubmitter.submit

    async def stalling(self: JobSubmitter, *args: Any, **kwargs: Any) -> JobRecord:
        if not stalled.is_set():
            stalled.set()
            await resume.wait()
        return await accept(self, *args, **kwargs)

    monkeypatch.setattr(JobSubmitter, "submit", stalling)
    return stalled, resume


async def claimed_job(claims: KeyValue, key: str) -> str:
    entry = await claims.get(claim_key(TENANT, key))
    assert entry.value is not None
    job_id: str = json.loads(entry.value)["job_id"]
    return job_id


async def ended(stack: Stack, job_id: str) -> job_pb2.Job:
    async def watch() -> job_pb2.Job:
        last = None
        async for update in stack.jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=job_id)):
            last = update.job
        assert last is not None
        return last

    return await asyncio.wait_for(watch(), HANG_GUARD_S)


async def until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    """Polls `condition` (a hang guard, not a timing)."""
    try:
        async with asyncio.timeout(HANG_GUARD_S):
            while not await condition():  # noqa: ASYNC110 - a stream's state, no event
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"not within {HANG_GUARD_S:g} s: {what}")


async def work_queue_empty(stack: Stack) -> bool:
    """Whether every work message was taken off the queue (a job's leaves once it ended, or was dropped)."""
    return (await stack.nc.jetstream().stream_info(stack.config.nats.work_stream)).state.messages == 0


async def withdrawn(stack: Stack, job_id: str, reason: str) -> None:
    """The job never ran: its record ended CANCELED with `reason`, with no attempt."""
    record = await job_record(
        stack.nc.jetstream(),
        job_key(TENANT, job_id),
        bucket=stack.config.nats.jobs_bucket,
        work_stream=stack.config.nats.work_stream,
    )
    assert record is not None
    assert (record.state, record.attempt) == (JobState.CANCELED, 0), record
    assert record.error is not None
    assert record.error.reason == reason


async def listed_and_withdrawn(stack: Stack, withdrawn_job: str, reason: str) -> list[str]:
    """The job IDs ListJobs lists, once GetJob by its ID answered the withdrawal saying why."""
    answer = await stack.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=withdrawn_job))
    assert (answer.job.state, answer.job.error.reason) == (job_pb2.JOB_STATE_CANCELED, reason)
    listed = await stack.jobs.ListJobs(job_service_pb2.ListJobsRequest())
    return [job.job_id for job in listed.jobs]


async def test_a_claimant_that_stalls_past_its_bound_answers_with_the_job_that_took_its_key_over(
    short_bound_stack: tuple[Stack, KeyValue], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Session 29's hole: A claims the key and freezes before publishing; B, a duplicate, finds the
    # claim stale (by both clocks) and makes its own job; A wakes and publishes: two jobs ran for
    # one key. Now B's takeover first withdraws A's job (a CANCELED record under its ID), and A,
    # which took longer than half the bound, creates its job's record and loses to it.
    stack, claims = short_bound_stack
    stalled, resume = stall_first_submit(monkeypatch)
    request = submit_request(idempotency_key="stalled")
    first = asyncio.ensure_future(stack.jobs.SubmitJob(request, timeout=HANG_GUARD_S))
    await asyncio.wait_for(stalled.wait(), HANG_GUARD_S)
    stalled_job = await claimed_job(claims, "stalled")
    second = await stack.jobs.SubmitJob(request, timeout=HANG_GUARD_S)  # takes the stale claim over
    assert not second.deduplicated
    assert second.job.job_id != stalled_job
    resume.set()
    first_answer = await first
    assert first_answer.job.job_id == second.job.job_id, "the stalled claimant answers with the key's job"
    assert first_answer.deduplicated
    assert (await ended(stack, second.job.job_id)).state == job_pb2.JOB_STATE_SUCCEEDED
    await until(lambda: work_queue_empty(stack), "the work queue emptied")
    await withdrawn(stack, stalled_job, "IDEMPOTENCY_SUPERSEDED")
    assert await claimed_job(claims, "stalled") == second.job.job_id
    # Both submits were answered with B's job: the withdrawal is no job of the caller's.
    assert await listed_and_withdrawn(stack, stalled_job, "IDEMPOTENCY_SUPERSEDED") == [second.job.job_id]


async def test_a_stalled_claimant_whose_clocks_missed_the_stall_has_its_job_withdrawn_unrun(
    short_bound_stack: tuple[Stack, KeyValue], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A's clocks did not see the stall (a paused VM whose clocks had not caught up): it publishes
    # and answers its own job. The scheduler's dispatch creates that job's record and loses to the
    # takeover's withdrawal: it never runs, and says why.
    stack, claims = short_bound_stack
    monkeypatch.setattr(idempotency, "FENCE_AFTER_SHARE", float("inf"), raising=False)
    stalled, resume = stall_first_submit(monkeypatch)
    request = submit_request(idempotency_key="unseen-stall")
    first = asyncio.ensure_future(stack.jobs.SubmitJob(request, timeout=HANG_GUARD_S))
    await asyncio.wait_for(stalled.wait(), HANG_GUARD_S)
    stalled_job = await claimed_job(claims, "unseen-stall")
    second = await stack.jobs.SubmitJob(request, timeout=HANG_GUARD_S)
    resume.set()
    assert (await first).job.job_id == stalled_job
    assert (await ended(stack, second.job.job_id)).state == job_pb2.JOB_STATE_SUCCEEDED
    await until(lambda: work_queue_empty(stack), "the stalled job's message was taken off the queue")
    await withdrawn(stack, stalled_job, "IDEMPOTENCY_SUPERSEDED")
    answer = await stack.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=stalled_job))
    assert second.job.job_id in answer.job.error.message  # it names the job that took its key


async def test_a_failed_submit_whose_publish_lands_after_it_freed_its_key_never_runs(
    short_bound_stack: tuple[Stack, KeyValue], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The publish's answer never came (NATS silent), the submit answered UNAVAILABLE and freed the
    # key; the publish landed later. Before, the release checked that the job had no record and
    # freed the key: the late job ran, and so did the retry's.
    stack, _ = short_bound_stack
    publish = submit.publish_durably
    land = asyncio.Event()
    late: list[asyncio.Task[Any]] = []

    async def unanswered(*args: Any, **kwargs: Any) -> Any:
        if late:
            return await publish(*args, **kwargs)

        async def after_release() -> None:
            await land.wait()
            await publish(*args, **kwargs)

        late.append(asyncio.create_task(after_release()))
        raise nats.errors.TimeoutError

    monkeypatch.setattr(submit, "publish_durably", unanswered)
    request = submit_request(idempotency_key="late-publish")
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await stack.jobs.SubmitJob(request, timeout=HANG_GUARD_S)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    status = status_details(failed.value)
    assert status is not None
    lost_job = unpack_details(status)["ErrorInfo"].metadata["job_id"]
    land.set()
    await asyncio.wait_for(late[0], HANG_GUARD_S)
    retry = await stack.jobs.SubmitJob(request, timeout=HANG_GUARD_S)
    assert not retry.deduplicated
    assert (await ended(stack, retry.job.job_id)).state == job_pb2.JOB_STATE_SUCCEEDED
    await until(lambda: work_queue_empty(stack), "the late job's message was taken off the queue")
    await withdrawn(stack, lost_job, "NOT_ACCEPTED")
    # Its submit was answered UNAVAILABLE: the withdrawal is no job of the caller's.
    assert await listed_and_withdrawn(stack, lost_job, "NOT_ACCEPTED") == [retry.job.job_id]
