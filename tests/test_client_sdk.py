"""The Python SDK (asyncinfer.client) against the real in-process stack: gateway + scheduler +
batcher serving the demo model y = 2x + 1, on a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest

from asyncinfer.api_keys import hash_key
from asyncinfer.client import (
    NO_RETRY,
    AlreadyExistsError,
    AsyncClient,
    AsyncInferClientError,
    BulkResult,
    Client,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    Job,
    JobFailedError,
    JobRequest,
    JobState,
    ModelInfo,
    ModelVersion,
    NotFoundError,
    Priority,
    RetryPolicy,
    TensorSpec,
    UnauthenticatedError,
    UnavailableError,
    WaitingReason,
    why_not_served,
)
from asyncinfer.client._convert import job_from_proto
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.v1 import batch_service_pb2, batch_service_pb2_grpc, job_pb2, job_service_pb2, job_service_pb2_grpc
from services.batcher.models import demo
from tests.stack import Stack, StartStack, ThreadedStack
from tests.test_gateway import wait_for

X = np.array([[1, 2, 3, 4], [0, 0, 0, -1]], dtype=np.float32)
FAST_RETRY = RetryPolicy(max_attempts=60, initial_backoff_s=0.02, max_backoff_s=0.2)


def expected_y(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return 2 * x + 1


# -- async client ------------------------------------------------------------------------------


async def test_submit_and_wait_return_numpy_outputs(stack: Stack) -> None:
    async with AsyncClient(stack.address) as client:
        job = await client.submit("demo", {"x": X}, labels={"suite": "sdk"}, priority=Priority.HIGH)
        assert isinstance(job, Job)
        assert job.state is JobState.QUEUED
        assert job.priority is Priority.HIGH
        assert job.labels == {"suite": "sdk"}
        assert job.idempotency_key, "the SDK gives every submit an idempotency key, so retries are safe"

        done = await client.wait(job, timeout_s=30)
    assert done.job_id == job.job_id
    assert done.state is JobState.SUCCEEDED
    assert done.succeeded
    assert done.done
    y = done.outputs["y"]
    assert isinstance(y, np.ndarray)
    assert y.dtype == np.float32
    assert y.shape == (2, 4)
    np.testing.assert_array_equal(y, expected_y(X))
    assert done.attempt == 1
    assert done.batch is not None
    assert done.batch.batch_size >= 1
    assert done.create_time is not None
    assert done.end_time is not None
    assert done.end_time >= done.create_time
    assert done.queue_duration_s is not None
    assert done.run_duration_s is not None
    assert done.error is None


async def test_run_returns_outputs_and_get_reads_the_same_job(stack: Stack) -> None:
    async with AsyncClient(stack.address) as client:
        outputs = await client.run("demo", {"x": X[:1]}, timeout_s=30)
        np.testing.assert_array_equal(outputs["y"], expected_y(X[:1]))

        job = await client.submit("demo", {"x": X})
        done = await client.wait(job.job_id, timeout_s=30)
        again = await client.get(job)
    assert again.revision == done.revision
    assert again.state is JobState.SUCCEEDED
    np.testing.assert_array_equal(again.outputs["y"], done.outputs["y"])


def rpcs(stack: Stack, method: str) -> float:
    """The gateway's calls of a JobService method so far, whatever their code (a watch the client
    closes once it has the terminal state may end OK or CANCELLED, whichever comes first)."""
    return sum(
        sample.value
        for metric in stack.gateway.registry.collect()
        if metric.name == "asyncinfer_rpc_server_handled"
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.labels.get("method") == method
    )


async def test_run_of_a_short_job_is_one_call(stack: Stack) -> None:
    """`run` asks SubmitJob to wait for the job's end (the gateway holds its answer): a job that
    ends within the call's deadline costs one call, and no WatchJob."""
    async with AsyncClient(stack.address) as client:
        outputs = await client.run("demo", {"x": X}, timeout_s=30)
    np.testing.assert_array_equal(outputs["y"], expected_y(X))
    assert (rpcs(stack, "SubmitJob"), rpcs(stack, "WatchJob")) == (1, 0)


async def test_run_of_a_job_that_outlasts_its_submit_watches_it_to_its_end(idle_stack: Stack) -> None:
    async with AsyncClient(idle_stack.address, timeout_s=2.0) as client:  # each call's deadline
        running = asyncio.ensure_future(client.run("demo", {"x": X}, timeout_s=30))
        await wait_for(lambda: rpcs(idle_stack, "SubmitJob") == 1)  # answered QUEUED, once its wait passed
        assert not running.done()
        await idle_stack.start_batcher()
        outputs = await asyncio.wait_for(running, 30)
    np.testing.assert_array_equal(outputs["y"], expected_y(X))
    await wait_for(lambda: rpcs(idle_stack, "WatchJob") >= 1)  # counted once the gateway's handler ends


async def test_watch_yields_queued_running_succeeded_in_order(config: Config, start_stack: StartStack) -> None:
    # The demo model held at the gate while it runs: a watch that has not read RUNNING yet when the
    # job ends gets the latest (SUCCEEDED), so the job ends only once RUNNING was seen.
    gated = DEMO_MODEL.model_copy(update={"loader": "services.batcher.models.demo:build_gated_model", "warm_up": False})
    idle_stack = await start_stack(config.replace(models=[gated.model_dump()]), batcher=False)
    demo.GATE.clear()
    try:
        async with AsyncClient(idle_stack.address) as client:
            job = await client.submit("demo", {"x": X})
            seen: list[Job] = []
            async for update in client.watch(job, timeout_s=30):
                seen.append(update)
                if len(seen) == 1:
                    assert update.state is JobState.QUEUED
                    assert update.queue is not None, "a queued job says where it stands"
                    await idle_stack.start_batcher()  # only now can it run
                elif update.state is JobState.RUNNING:
                    demo.GATE.set()
    finally:
        demo.GATE.set()
    assert [u.state for u in seen] == [JobState.QUEUED, JobState.RUNNING, JobState.SUCCEEDED]
    # Where it runs, from the moment it starts; and the batch it ran in names the same batcher.
    assert idle_stack.batcher is not None
    assert seen[0].batcher_id == ""
    assert seen[1].batcher_id == seen[2].batcher_id == idle_stack.batcher.batcher_id
    assert seen[2].batch is not None
    assert seen[2].batch.batcher_id == seen[1].batcher_id
    revisions = [u.revision for u in seen]
    assert revisions == sorted(set(revisions)), "each change once, in order"
    np.testing.assert_array_equal(seen[-1].outputs["y"], expected_y(X))


async def test_cancel_a_queued_job(idle_stack: Stack) -> None:
    async with AsyncClient(idle_stack.address) as client:
        job = await client.submit("demo", {"x": X})
        canceled = await client.cancel(job, reason="changed my mind")
        assert canceled.state is JobState.CANCELED
        assert (await client.wait(job, timeout_s=10)).state is JobState.CANCELED
        assert (await client.cancel(job)).state is JobState.CANCELED, "cancelling again is harmless"


async def test_errors_are_typed_with_reasons_and_violations(stack: Stack) -> None:
    async with AsyncClient(stack.address) as client:
        with pytest.raises(NotFoundError) as not_found:
            await client.submit("no-such-model", {"x": X})
        assert not_found.value.code is grpc.StatusCode.NOT_FOUND
        assert not_found.value.reason == "MODEL_NOT_FOUND"

        with pytest.raises(InvalidArgumentError) as invalid:
            await client.submit("demo", {"x": np.ones((1, 3), np.float32)})  # the model takes [-1, 4]
        assert invalid.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert invalid.value.violations, "field violations from google.rpc.BadRequest"
        assert any(v.field.startswith("inputs[0]") for v in invalid.value.violations)
        # The reason is left out where it only repeats the code, as the CLI prints it.
        assert str(invalid.value).startswith("INVALID_ARGUMENT: invalid request: inputs[0].shape")
        assert str(not_found.value).startswith("NOT_FOUND MODEL_NOT_FOUND: unknown model")

        with pytest.raises(NotFoundError) as unknown_job:
            await client.get("0190b8e4-7c1a-7d3e-8f00-000000000000")
        assert unknown_job.value.reason == "JOB_NOT_FOUND"
        assert str(unknown_job.value) == "NOT_FOUND JOB_NOT_FOUND: job '0190b8e4-7c1a-7d3e-8f00-000000000000' not found"
        with pytest.raises(NotFoundError) as malformed:
            await client.wait("not-a-job-id", timeout_s=5)
        # Still NOT_FOUND (an unknown ID is), saying why: a truncated copy reads differently from a gone job.
        assert malformed.value.reason == "JOB_NOT_FOUND"
        assert "'not-a-job-id' not found: not a job ID (job IDs are UUIDv7, like " in malformed.value.message


async def test_run_raises_job_failed_when_the_job_does_not_succeed(idle_stack: Stack) -> None:
    async with AsyncClient(idle_stack.address) as client:
        with pytest.raises(JobFailedError) as info:
            await client.run("demo", {"x": X}, queue_ttl_s=0.2, timeout_s=10)  # no batcher: it expires
    assert info.value.job.state is JobState.EXPIRED
    assert info.value.job.error is not None
    assert info.value.reason == info.value.job.error.reason


async def test_wait_with_a_short_timeout_raises_deadline_exceeded(idle_stack: Stack) -> None:
    async with AsyncClient(idle_stack.address) as client:
        job = await client.submit("demo", {"x": X})
        started = time.monotonic()
        # The client's own timeout ends the wait (DeadlineExceededError, not the hang guard's
        # TimeoutError: the job stays queued, so a wait that ignored it would never end).
        async with asyncio.timeout(30):
            with pytest.raises(DeadlineExceededError) as info:
                await client.wait(job, timeout_s=0.5)
        assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started >= 0.4  # it waited its timeout out
        assert (await client.get(job)).state is JobState.QUEUED, "the job carries on; only the wait ended"


@dataclass(frozen=True, kw_only=True)
class ObservedRetry(RetryPolicy):
    """A retry policy that also tells the test each time the client decides to try again."""

    retried: asyncio.Queue[grpc.StatusCode] = field(default_factory=asyncio.Queue)

    def backoff_s(self, attempt: int, error: AsyncInferClientError) -> float:
        self.retried.put_nowait(error.code)
        return RetryPolicy.backoff_s(self, attempt, error)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_submit_retries_unavailable_until_the_gateway_starts(config: Config, start_stack: StartStack) -> None:
    port = free_port()
    retry = ObservedRetry(max_attempts=60, initial_backoff_s=0.02, max_backoff_s=0.2)
    async with AsyncClient(f"127.0.0.1:{port}", retry=retry) as client:
        with pytest.raises(UnavailableError):  # nothing listens there yet
            async with AsyncClient(f"127.0.0.1:{port}", retry=NO_RETRY) as once:
                await once.get("0190b8e4-7c1a-7d3e-8f00-000000000000", timeout_s=5)

        submit = asyncio.create_task(client.submit("demo", {"x": X}, timeout_s=30))
        async with asyncio.timeout(10):  # it failed a few attempts first
            assert [await retry.retried.get() for _ in range(3)] == [grpc.StatusCode.UNAVAILABLE] * 3
        assert not submit.done(), "UNAVAILABLE is retried, not raised"
        await start_stack(config.replace(gateway={"port": port}))
        job = await submit
        assert job.state is JobState.QUEUED
        done = await client.wait(job, timeout_s=30)
        np.testing.assert_array_equal(done.outputs["y"], expected_y(X))


async def test_watch_resumes_across_a_gateway_restart(config: Config, start_stack: StartStack) -> None:
    stack = await start_stack(config.replace(gateway={"port": free_port()}), batcher=False)
    async with AsyncClient(stack.address, retry=FAST_RETRY) as client:
        job = await client.submit("demo", {"x": X})
        updates = client.watch(job, timeout_s=30)
        first = await anext(updates)
        assert first.state is JobState.QUEUED

        await stack.restart_gateway()  # ends the watch with UNAVAILABLE
        await stack.start_batcher()

        rest = [update async for update in updates]
    assert [u.state for u in rest][-1] is JobState.SUCCEEDED
    assert JobState.QUEUED not in [u.state for u in rest], "resumed after the revision seen, not from scratch"
    assert all(u.revision > first.revision for u in rest)


async def test_api_key_is_sent_as_bearer(config: Config, start_stack: StartStack) -> None:
    keyed = config.replace(gateway={"api_keys": [{"tenant": "acme", "sha256": hash_key("k-acme")}]})
    stack = await start_stack(keyed, batcher=False)
    async with AsyncClient(stack.address, api_key="k-acme") as client:
        job = await client.submit("demo", {"x": X})
        assert (await client.get(job)).job_id == job.job_id
    async with AsyncClient(stack.address, api_key="wrong") as intruder:
        with pytest.raises(UnauthenticatedError):
            await intruder.get(job)
    async with AsyncClient(stack.address) as anonymous:
        with pytest.raises(UnauthenticatedError):
            await anonymous.submit("demo", {"x": X})


# -- idempotency, bulk, models, list, the claim check -----------------------------------------


async def test_same_idempotency_key_returns_the_first_job(idle_stack: Stack) -> None:
    async with AsyncClient(idle_stack.address) as client:
        first = await client.submit("demo", {"x": X}, idempotency_key="order-42")
        second = await client.submit("demo", {"x": X}, idempotency_key="order-42")
        other = await client.submit("demo", {"x": X}, idempotency_key="order-43")
        with pytest.raises(AlreadyExistsError) as reused:  # the same key for another request
            await client.submit("demo", {"x": X * 2}, idempotency_key="order-42")
        listed = [job.job_id async for job in client.list(model="demo")]
    assert second.job_id == first.job_id, "a repeated key returns the first job"
    # What happened, the job holding the key, and what to do, in the error's text and metadata.
    assert (reused.value.reason, reused.value.metadata["job_id"]) == ("IDEMPOTENCY_KEY_REUSED", first.job_id)
    assert str(reused.value) == (
        f"ALREADY_EXISTS IDEMPOTENCY_KEY_REUSED: idempotency key 'order-42' was first used for job {first.job_id}, "
        "with a different request: a key can be sent again only with its first request (a retry, answered with "
        "that job). Get that job with GetJob, or use a new key for a different request"
    )
    assert first.idempotency_key == second.idempotency_key == "order-42"
    assert other.job_id != first.job_id
    assert sorted(listed) == sorted([first.job_id, other.job_id]), "the repeat queued nothing"


@pytest.mark.parametrize("items_per_message", [1, 8])
async def test_bulk_answers_every_request_in_order(stack: Stack, items_per_message: int) -> None:
    requests = [JobRequest(model="demo", inputs={"x": X * i}, correlation_id=f"row-{i}") for i in range(20)]
    requests.insert(7, JobRequest(model="no-such-model", inputs={"x": X}, correlation_id="bad"))
    async with AsyncClient(stack.address) as client:

        async def collect() -> list[BulkResult]:
            bulk = client.bulk(requests, window=16, items_per_message=items_per_message, timeout_s=30)
            return [result async for result in bulk]

        results = await collect()
        assert [r.index for r in results] == list(range(len(requests)))
        assert [r.correlation_id for r in results] == [r.correlation_id for r in requests]
        refused = results[7]
        assert refused.job is None
        assert refused.error is not None
        assert refused.error.reason == "MODEL_NOT_FOUND"
        accepted = [r for r in results if r.accepted]
        assert len(accepted) == 20
        done = await asyncio.gather(*(client.wait(r.job.job_id, timeout_s=30) for r in accepted if r.job))
    for i, job in enumerate(done):
        np.testing.assert_array_equal(job.outputs["y"], expected_y(X * i))


class CountingGateway(job_service_pb2_grpc.JobServiceServicer):
    """A SubmitJobs that accepts everything and records how many jobs each message carried."""

    def __init__(self) -> None:
        self.jobs_per_message: list[int] = []

    async def SubmitJobs(self, request_iterator: Any, context: Any) -> Any:
        index = 0
        async for request in request_iterator:
            items = list(request.items)
            self.jobs_per_message.append(len(items) or 1)
            response = job_service_pb2.SubmitJobsResponse()
            for item in items:
                answer = response.answers.add(correlation_id=item.correlation_id, index=index)
                answer.job.job_id = f"job-{index}"
                answer.job.state = job_pb2.JOB_STATE_QUEUED
                index += 1
            yield response


@contextlib.asynccontextmanager
async def counting_gateway() -> AsyncIterator[tuple[CountingGateway, str]]:
    """A JobService that answers SubmitJobs and counts the jobs of each message, and its address."""
    gateway = CountingGateway()
    server = grpc.aio.server()
    job_service_pb2_grpc.add_JobServiceServicer_to_server(gateway, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield gateway, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def test_bulk_sends_the_requests_ready_together_in_one_message() -> None:
    async with counting_gateway() as (gateway, address), AsyncClient(address) as client:
        requests = [JobRequest(model="demo", inputs={"x": X}, correlation_id=f"row-{i}") for i in range(300)]
        results = [r async for r in client.bulk(requests, window=128, items_per_message=50, timeout_s=30)]
    assert [r.correlation_id for r in results] == [f"row-{i}" for i in range(300)]
    assert sum(gateway.jobs_per_message) == 300
    assert max(gateway.jobs_per_message) == 50, "a list is always ready: its requests go 50 to a message"
    assert len(gateway.jobs_per_message) < 300 / 10


async def test_bulk_sends_at_most_the_gateways_limit_of_items_in_a_message() -> None:
    """The gateway refuses a message of more than 1,000 items (its answer must fit one message):
    a larger `items_per_message` is taken as 1,000."""
    async with counting_gateway() as (gateway, address), AsyncClient(address) as client:
        requests = [JobRequest(model="demo", inputs={"x": X}) for _ in range(2500)]
        results = [r async for r in client.bulk(requests, window=5000, items_per_message=5000, timeout_s=60)]
    assert len(results) == 2500
    assert max(gateway.jobs_per_message) == 1000


NEWER_ID = "0190b8e4-7c1a-7d3e-8f00-000000000099"
DONE_ID = "0190b8e4-7c1a-7d3e-8f00-000000000100"
NEWER_BATCH_ID = "0190b8e4-7c1a-7d3e-8f00-0000000000b9"
# A real gateway answers a reopened watch with the job (or batch) as it stands and ends it again, for
# ever; the stand-in does so this many times, then refuses, so that a reopening SDK fails at once.
ANSWERS_BEFORE_REFUSING = 3


class NewerStatesGateway(job_service_pb2_grpc.JobServiceServicer, batch_service_pb2_grpc.BatchServiceServicer):
    """A gateway newer than this SDK that ended a job and a batch in a state numbered 99, which it
    takes for terminal: it ends their watches after sending it, as a gateway ends the watch of a
    terminal job. Counts the watches opened."""

    def __init__(self) -> None:
        self.opened: list[str] = []

    def _opened(self, what: str) -> bool:
        self.opened.append(what)
        return self.opened.count(what) <= ANSWERS_BEFORE_REFUSING

    async def WatchJobs(self, request: Any, context: Any) -> AsyncIterator[job_service_pb2.WatchJobsResponse]:
        if not self._opened("jobs"):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the watch of ended jobs was opened again")
        response = job_service_pb2.WatchJobsResponse()
        for job_id in request.job_ids:
            state = 99 if job_id == NEWER_ID else job_pb2.JOB_STATE_SUCCEEDED
            response.changes.add(
                job_id=job_id, job=job_pb2.Job(job_id=job_id, model_name="demo", state=state, revision=4)
            )  # type: ignore[arg-type]
        yield response

    async def WatchBatch(self, request: Any, context: Any) -> AsyncIterator[batch_service_pb2.WatchBatchResponse]:
        if not self._opened("batch"):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the watch of an ended batch was opened again")
        batch = batch_service_pb2.Batch(batch_id=request.batch_id, model_name="demo", state=99, revision=6)  # type: ignore[arg-type]
        yield batch_service_pb2.WatchBatchResponse(batch=batch)


@contextlib.asynccontextmanager
async def newer_states_gateway() -> AsyncIterator[tuple[NewerStatesGateway, str]]:
    gateway = NewerStatesGateway()
    server = grpc.aio.server()
    job_service_pb2_grpc.add_JobServiceServicer_to_server(gateway, server)
    batch_service_pb2_grpc.add_BatchServiceServicer_to_server(gateway, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield gateway, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


NEWER_ENDED = r"ended at state UNKNOWN_99 \(newer than this SDK: upgrade it\)"


async def test_jobs_the_gateway_ended_in_a_state_newer_than_the_sdk_end_wait_jobs_naming_it() -> None:
    """README: `wait` on a job the gateway ended in a state the SDK has no member for raises
    InternalError naming it. `wait_jobs` and `watch_jobs` took the end of the WatchJobs stream for a
    break, as no job of theirs was done: they opened it again, the gateway sent the job again and
    ended it again, for ever (each answer started the backoff afresh), until `timeout_s`. Now the
    stream's end ends such a job: `wait_jobs` maps it to that InternalError, the other jobs to
    their Job, and `watch_jobs` yields the job as it ended, then (job_id, InternalError)."""
    async with newer_states_gateway() as (gateway, address), AsyncClient(address, retry=FAST_RETRY) as client:
        found = await client.wait_jobs([NEWER_ID, DONE_ID], timeout_s=60)
        assert gateway.opened == ["jobs"]
        newer, done = found[NEWER_ID], found[DONE_ID]
        assert isinstance(done, Job)
        assert done.state is JobState.SUCCEEDED
        assert isinstance(newer, InternalError)
        assert re.search(f"job {NEWER_ID} {NEWER_ENDED}", str(newer)), str(newer)

        updates = [u async for u in client.watch_jobs([NEWER_ID, DONE_ID], timeout_s=60)]
        assert gateway.opened == ["jobs", "jobs"]
        assert [(u.job_id, u.state) if isinstance(u, Job) else (u[0], type(u[1])) for u in updates] == [
            (NEWER_ID, "UNKNOWN_99"),
            (DONE_ID, JobState.SUCCEEDED),
            (NEWER_ID, InternalError),
        ]


async def test_a_batch_the_gateway_ended_in_a_state_newer_than_the_sdk_ends_its_watch_and_wait() -> None:
    """`watch_batch` took the end of the WatchBatch stream after a state it cannot call terminal for
    a break: it opened the stream again and yielded the batch again, for ever, and `wait_batch`
    never returned (until `timeout_s`). Now the watch ends there, and `wait_batch` raises
    InternalError naming the state, as a job's `wait` does."""
    async with newer_states_gateway() as (gateway, address), AsyncClient(address, retry=FAST_RETRY) as client:
        seen = [batch.state async for batch in client.watch_batch(NEWER_BATCH_ID, timeout_s=60)]
        assert seen == ["UNKNOWN_99"]
        with pytest.raises(InternalError, match=f"batch {NEWER_BATCH_ID} {NEWER_ENDED}"):
            await client.wait_batch(NEWER_BATCH_ID, timeout_s=60)
        assert gateway.opened == ["batch", "batch"]


async def test_bulk_carries_on_across_a_gateway_restart(config: Config, start_stack: StartStack) -> None:
    stack = await start_stack(config.replace(gateway={"port": free_port()}), batcher=False)
    restarted = asyncio.Event()

    async def requests() -> AsyncIterator[JobRequest]:
        for i in range(10):
            if i == 5:
                await restarted.wait()  # the first stream breaks while this waits
            yield JobRequest(model="demo", inputs={"x": X * i}, correlation_id=f"row-{i}")

    results: list[BulkResult] = []
    async with AsyncClient(stack.address, retry=FAST_RETRY) as client:
        async for result in client.bulk(requests(), timeout_s=60):
            results.append(result)
            if len(results) == 5:
                await stack.restart_gateway(0.2)
                restarted.set()
        listed = [job async for job in client.list(model="demo")]
    assert [r.index for r in results] == list(range(10))
    assert [r.correlation_id for r in results] == [f"row-{i}" for i in range(10)]
    assert all(r.accepted for r in results)
    assert len({r.job.job_id for r in results if r.job}) == 10
    assert len(listed) == 10, "nothing was queued twice"


@pytest.mark.unit
def test_the_default_policy_waits_out_a_restart_but_not_forever() -> None:
    """An operations pass (session 24): with full jitter, 6 attempts waited 1.55 s on average and a
    gateway restart of 1.5 s failed half the calls made during it. Equal jitter: never under half."""
    policy = RetryPolicy()
    error = UnavailableError("gone", code=grpc.StatusCode.UNAVAILABLE)
    waits = [[policy.backoff_s(n, error) for n in range(1, policy.max_attempts)] for _ in range(200)]
    assert min(sum(w) for w in waits) >= 3.15
    assert max(sum(w) for w in waits) <= 6.3


@pytest.mark.unit
def test_a_waiting_reason_the_sdk_does_not_know_reads_as_its_number() -> None:
    """MODEL_LOAD_FAILED reads as itself; a value newer than this SDK (a later gateway's) reads as
    UNKNOWN_<number>, not an error that loses the whole job (nor as no reason given)."""

    def queued(reason: int) -> job_pb2.Job:
        job = job_pb2.Job(job_id="j", model_name="demo", state=job_pb2.JOB_STATE_QUEUED)
        job.queue.waiting_reason = job_pb2.WaitingReason.ValueType(reason)  # the wire's int, known or not
        return job

    failed = job_from_proto(queued(job_pb2.WAITING_REASON_MODEL_LOAD_FAILED))
    assert failed.queue is not None
    assert failed.queue.waiting_reason is WaitingReason.MODEL_LOAD_FAILED
    assert failed.queue.waiting_reason.not_served
    newer = job_from_proto(queued(99))
    assert newer.queue is not None
    assert newer.queue.waiting_reason == "UNKNOWN_99"
    assert not newer.queue.waiting_reason.not_served
    assert newer.state is JobState.QUEUED
    # Why, from ListModels: the job's version's reason (every version's for a job that names none).
    spec = (TensorSpec(name="x", datatype="FP32", shape=(-1, 4)),)
    broken = ModelInfo(
        name="demo",
        version="2",
        inputs=spec,
        outputs=spec,
        max_batch_size=8,
        default_max_attempts=3,
        max_attempts_limit=10,
        default_execution_timeout_s=None,
        versions=(
            ModelVersion(version="1", state="UNAVAILABLE", reason="batcher b1 could not load it: no module"),
            ModelVersion(version="2", state="UNAVAILABLE", reason="no batcher serves it"),
        ),
    )
    assert why_not_served(failed, [broken]) == "batcher b1 could not load it: no module; no batcher serves it"
    pinned = dataclasses.replace(failed, model_version="1")
    assert why_not_served(pinned, [broken]) == "batcher b1 could not load it: no module"
    assert why_not_served(dataclasses.replace(failed, model_name="other"), [broken]) == ""


@pytest.mark.unit
def test_an_async_client_made_outside_a_running_loop_says_where_to_make_it() -> None:
    """grpc.aio binds a channel to the loop current at creation: a client made at import time
    failed only at its first call under asyncio.run(), with "attached to a different loop"."""
    with pytest.raises(RuntimeError, match="inside a coroutine"):
        AsyncClient("127.0.0.1:1")


async def test_a_submit_outlasts_a_gateway_restart(config: Config, start_stack: StartStack) -> None:
    """Unary calls during a restart (the old gateway gone, the new one 1.5 s later) succeed with the
    default policy, which the README promised."""
    stack = await start_stack(config.replace(gateway={"port": free_port()}), batcher=False)
    async with AsyncClient(stack.address) as client:
        await client.models()  # connected
        restart = asyncio.create_task(stack.restart_gateway(0.2, away_s=1.5))
        await asyncio.sleep(0.3)  # the old one is gone
        job = await client.submit("demo", {"x": X})
        await restart
    assert job.state is JobState.QUEUED


async def test_a_bulk_and_a_watch_outlast_a_gateway_away_for_seconds(config: Config, start_stack: StartStack) -> None:
    # The default policy's 7 attempts give up within 3-6 s; a stream that was answering is reopened
    # for RetryPolicy.stream_resume_s (30 s) after it broke: a restart or a one-replica rollout.
    stack = await start_stack(config.replace(gateway={"port": free_port()}), batcher=False)
    away = asyncio.Event()
    back = asyncio.Event()

    async def requests() -> AsyncIterator[JobRequest]:
        for i in range(6):
            if i == 3:
                await back.wait()
            yield JobRequest(model="demo", inputs={"x": X * i}, correlation_id=f"row-{i}")

    async def outage() -> None:
        await away.wait()
        await stack.restart_gateway(0.2, away_s=4.0)
        back.set()

    async with AsyncClient(stack.address) as client:
        watched = await client.submit("demo", {"x": X})
        updates = client.watch(watched, timeout_s=60)
        assert (await anext(updates)).state is JobState.QUEUED
        restart = asyncio.create_task(outage())
        results: list[BulkResult] = []
        async for result in client.bulk(requests(), timeout_s=60):
            results.append(result)
            if len(results) == 3:
                away.set()
        await restart
        await stack.start_batcher()
        states = [update.state async for update in updates]
        listed = [job async for job in client.list(model="demo")]
    assert [r.correlation_id for r in results] == [f"row-{i}" for i in range(6)]
    assert all(r.accepted for r in results)
    assert len(listed) == 7, "every request queued once"
    assert states[-1] is JobState.SUCCEEDED


async def test_a_watch_that_gives_up_on_a_gateway_away_says_how_to_resume_it(
    config: Config, start_stack: StartStack
) -> None:
    """A gateway away for longer than the watch is resumed for (a frozen process or VM, a laptop's
    suspend behind a remote client): the watch ends UNAVAILABLE, with a note that the job goes on
    and the call that resumes the watch after the last change it saw; that call does."""
    stack = await start_stack(config.replace(gateway={"port": free_port()}), batcher=False)
    policy = RetryPolicy(max_attempts=2, initial_backoff_s=0.05, max_backoff_s=0.2, stream_resume_s=1.0)
    async with AsyncClient(stack.address, retry=policy) as client:
        job = await client.submit("demo", {"x": X})
        updates = client.watch(job, timeout_s=60)
        first = await anext(updates)
        assert first.state is JobState.QUEUED
        await stack.gateway.stop(0.2)
        with pytest.raises(UnavailableError) as given_up:
            await anext(updates)
        resume = f"client.watch({job.job_id!r})"
        assert any(resume in note for note in getattr(given_up.value, "__notes__", ())), given_up.value
    await stack.restart_gateway(0.2)
    await stack.start_batcher()
    async with AsyncClient(stack.address) as client:  # the default policy: outlasts the channel's reconnect
        states = [update.state async for update in client.watch(job.job_id, after_revision=first.revision)]
    assert states[-1] is JobState.SUCCEEDED


@pytest.mark.parametrize("stream", ["watch", "watch_jobs", "bulk"])
async def test_a_broken_stream_climbs_the_backoff_from_its_first_rung(
    stream: str, config: Config, start_stack: StartStack
) -> None:
    """A job's watch, watch_jobs and bulk, once answering, then broken by a gateway gone for good:
    each wait lies in [c / 2, c] of the policy's ceiling c for its attempt (1 for the break, then
    2, 3, ...), as a batch watch's. They waited at the first rung twice: an answer set the attempt
    to 0, the break waited max(0, 1) = 1 and the next failed open 1 again."""
    stack = await start_stack(config.replace(gateway={"port": free_port()}), batcher=False)
    waits: list[float] = []
    answered_after: list[int] = []  # the waits heard before each answer: its next break starts at attempt 1

    def on_retry(error: Any, delay_s: float) -> None:
        assert error.code is grpc.StatusCode.UNAVAILABLE
        waits.append(delay_s)

    policy = RetryPolicy(initial_backoff_s=0.02, max_backoff_s=0.32, stream_resume_s=2.0, on_retry=on_retry)
    stopped = asyncio.Event()

    async def requests() -> AsyncIterator[JobRequest]:
        yield JobRequest(model="demo", inputs={"x": X})
        await asyncio.Event().wait()  # the iterator goes on: the stream is reopened, not ended

    async with AsyncClient(stack.address, retry=policy) as client:
        job = await client.submit("demo", {"x": X})  # no batcher: it stays queued
        updates: AsyncIterator[Any] = {
            "watch": lambda: client.watch(job),
            "watch_jobs": lambda: client.watch_jobs([job]),
            "bulk": lambda: client.bulk(requests()),
        }[stream]()

        async def read_on() -> None:
            async for _ in updates:
                answered_after.append(len(waits))
                if not stopped.is_set():
                    stopped.set()
                    await stack.gateway.stop(0)  # a stopping gateway may still answer a reopened stream once

        with pytest.raises(UnavailableError):
            await asyncio.wait_for(read_on(), 30)
    assert stopped.is_set()
    bounds = [*answered_after, len(waits)]
    breaks = [waits[start:end] for start, end in itertools.pairwise(bounds)]
    assert len(breaks[-1]) >= 5  # the ceilings 0.02 to 0.32 s, then 0.32 s each, for 2 s
    for heard in breaks:
        for attempt, delay_s in enumerate(heard, 1):
            ceiling = min(0.32, 0.02 * 2 ** (attempt - 1))
            assert ceiling / 2 <= delay_s <= ceiling, (stream, attempt, delay_s, waits)


async def test_models_describe_what_the_gateway_serves(idle_stack: Stack) -> None:
    async with AsyncClient(idle_stack.address) as client:
        models = await client.models()
    demo = idle_stack.config.models[0]
    assert [m.name for m in models] == [m.name for m in idle_stack.config.models]
    assert models[0] == ModelInfo(
        name=demo.name,
        version=demo.version,
        inputs=demo.signature.inputs,
        outputs=demo.signature.outputs,
        max_batch_size=demo.max_batch_size,
        default_max_attempts=demo.max_attempts,
        max_attempts_limit=demo.max_attempts_limit,
        default_execution_timeout_s=demo.default_execution_timeout_s,
        versions=(
            ModelVersion(
                version=demo.version,
                state="UNAVAILABLE",  # this stack has no batcher
                reason="no batcher serves it",
                inputs=demo.signature.inputs,
                outputs=demo.signature.outputs,
                max_batch_size=demo.max_batch_size,
            ),
        ),
    )
    assert models[0].input("x") == TensorSpec("x", "FP32", (-1, 4))
    assert models[0].input("nope") is None


async def test_list_pages_through_the_callers_jobs(idle_stack: Stack) -> None:
    async with AsyncClient(idle_stack.address) as client:
        submitted = [await client.submit("demo", {"x": X}, labels={"batch": "b1"}) for _ in range(5)]
        await client.submit("demo", {"x": X}, labels={"batch": "other"})

        async def collect() -> list[Job]:
            return [job async for job in client.list(labels={"batch": "b1"}, page_size=2)]

        listed = await collect()
        assert [j.job_id for j in listed] == [j.job_id for j in reversed(submitted)], "newest first, filtered"
        queued = [job async for job in client.list(states=[JobState.QUEUED], limit=3)]
        assert len(queued) == 3


async def test_upload_then_submit_by_reference(stack: Stack) -> None:
    async with AsyncClient(stack.address) as client:
        ref = await client.upload_inputs({"x": X})
        assert ref.ref
        assert ref.size_bytes > 0
        assert len(ref.sha256) == 64
        job = await client.submit("demo", input_ref=ref)
        done = await client.wait(job, timeout_s=30)
        assert done.input_ref is not None
        assert done.input_ref.ref == ref.ref
        np.testing.assert_array_equal((await client.outputs(done))["y"], expected_y(X))


async def test_read_result_of_a_large_result(config: Config, start_stack: StartStack) -> None:
    # Every result counts as large: it goes to the claim-check store, and ReadResult brings it back.
    stack = await start_stack(config.replace(scheduler={"inline_result_max_bytes": 1}))
    async with AsyncClient(stack.address) as client:
        job = await client.submit("demo", {"x": X})
        done = await client.wait(job, timeout_s=30)
        assert done.state is JobState.SUCCEEDED, done.error
        assert done.result_ref is not None, "a result over inline_result_max_bytes is stored by reference"
        assert done.result_ref.ref == f"out/{done.job_id}"
        assert done.result_ref.size_bytes > 0
        assert not done.outputs, "and is not inline"
        np.testing.assert_array_equal((await client.read_result(done))["y"], expected_y(X))
        np.testing.assert_array_equal((await client.outputs(done))["y"], expected_y(X))


# -- the synchronous client, from plain (non-async) tests ---------------------------------------


@pytest.fixture
def threaded_stack(config: Config) -> Iterator[ThreadedStack]:
    """The stack without a batcher, on its own loop in a thread: the test itself is synchronous.
    Its demo model computes only while demo.GATE is set (set, as tests leave it, unless a test
    clears it)."""
    gated = DEMO_MODEL.model_copy(update={"loader": "services.batcher.models.demo:build_gated_model", "warm_up": False})
    with ThreadedStack(config.replace(models=[gated.model_dump()]), batcher=False) as running:
        yield running


def test_sync_client_submits_watches_and_waits(threaded_stack: ThreadedStack) -> None:
    with Client(threaded_stack.stack.address) as client:
        job = client.submit("demo", {"x": X})
        assert job.state is JobState.QUEUED
        with pytest.raises(DeadlineExceededError):
            client.wait(job, timeout_s=0.3)  # no batcher yet

        watch = client.watch(job, timeout_s=30)
        assert next(watch).state is JobState.QUEUED
        # Held at the gate while it runs: the jobs bucket keeps one write a key, so a watch that
        # has not read RUNNING yet when the job ends gets SUCCEEDED alone (a loaded machine).
        demo.GATE.clear()
        try:
            threaded_stack.run(threaded_stack.stack.start_batcher)
            states = []
            for update in watch:
                states.append(update.state)
                demo.GATE.set()
        finally:
            demo.GATE.set()
        assert states == [JobState.RUNNING, JobState.SUCCEEDED]

        done = client.wait(job, timeout_s=30)
        np.testing.assert_array_equal(done.outputs["y"], expected_y(X))
        np.testing.assert_array_equal(client.run("demo", {"x": X[1:]}, timeout_s=30)["y"], expected_y(X[1:]))

        with pytest.raises(NotFoundError) as info:
            client.submit("no-such-model", {"x": X})
        assert info.value.reason == "MODEL_NOT_FOUND"
    with pytest.raises(RuntimeError):
        client.get(job)  # closed


def test_sync_client_cancel_and_break_out_of_a_watch(threaded_stack: ThreadedStack) -> None:
    client = Client(threaded_stack.stack.address)
    try:
        job = client.submit("demo", {"x": X})
        for update in client.watch(job):
            assert update.state is JobState.QUEUED
            break  # leaving a watch early closes its stream
        assert client.cancel(job).state is JobState.CANCELED
        assert client.wait(job, timeout_s=10).state is JobState.CANCELED
    finally:
        client.close()
        client.close()  # idempotent
