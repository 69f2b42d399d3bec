"""WatchJobs: many jobs on one stream, by IDs or by a label selector — through the real stack
(gateway, scheduler, batcher on a real nats-server), by raw stub and by the SDK."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any

import grpc
import numpy as np
import pytest

from asyncinfer import job_errors
from asyncinfer.client import (
    AsyncClient,
    Client,
    InvalidArgumentError,
    Job,
    JobState,
    NotFoundError,
    Priority,
    ResourceExhaustedError,
    _async_wait,
    _async_watch,
    jobs_watch,
)
from asyncinfer.client._retry import NO_RETRY, RetryPolicy
from asyncinfer.client.errors import MESSAGE_TOO_LARGE, AsyncInferClientError, make_error
from asyncinfer.client.jobs_watch import WatchUpdate
from asyncinfer.config import Config
from asyncinfer.contract import JOBS_BUCKET, WORK_STREAM
from asyncinfer.errors import Unavailable as GatewayUnavailable
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.grpc_headers import WATCH_READY_HEADER, WATCH_SINCE_HEADER
from asyncinfer.ids import new_job_id
from asyncinfer.job_store import JobStore, job_not_found
from asyncinfer.jobs import BATCH_LABEL, CHUNK_LABEL, JobRecord, job_key
from asyncinfer.jobs import JobState as RecordState
from asyncinfer.nats.kv import open_kv_bucket
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc
from services.gateway import batch_reads
from services.gateway.app import GatewayApp
from services.gateway.batch_reads import watch_jobs_responses
from services.gateway.convert import job_to_proto
from services.gateway.list_jobs import JobLister, ListPage, ListQuery
from services.gateway.watch_hub import WatchHub
from services.gateway.watch_many import JobChange, watch_labels
from tests.kv_helpers import job_record
from tests.stack import Stack, StartStack
from tests.test_client_sdk import FAST_RETRY, free_port
from tests.test_gateway import TENANT
from tests.test_record_codec import MINIMAL

X = np.array([[1, 2, 3, 4]], dtype=np.float32)
WAIT_S = 30.0


async def until(condition: Callable[[], bool]) -> None:
    """Waits (bounded) for a condition of the in-process stack that no event announces."""
    for _ in range(int(WAIT_S / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


async def test_ids_watch_sends_each_job_then_its_changes_and_ends_when_all_are_terminal(idle_stack: Stack) -> None:
    async with AsyncClient(idle_stack.address) as client:
        jobs = [await client.submit("demo", {"x": X + i}) for i in range(5)]
    unknown = new_job_id()
    seen: dict[str, list[int]] = {}
    messages: list[job_service_pb2.WatchJobsResponse] = []
    async with grpc.aio.insecure_channel(idle_stack.address) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        call = stub.WatchJobs(job_service_pb2.WatchJobsRequest(job_ids=[*(j.job_id for j in jobs), unknown]))
        first = await asyncio.wait_for(call.read(), WAIT_S)
        assert isinstance(first, job_service_pb2.WatchJobsResponse)
        messages.append(first)
        # The jobs as they stand (all queued: no batcher yet) and the unknown ID, in one message.
        assert {c.job_id for c in first.changes} == {*(j.job_id for j in jobs), unknown}
        assert {c.job.state for c in first.changes if c.HasField("job")} == {job_pb2.JOB_STATE_QUEUED}
        (missing,) = [c for c in first.changes if not c.HasField("job")]
        assert missing.error.code == grpc.StatusCode.NOT_FOUND.value[0]
        await idle_stack.start_batcher()
        async with asyncio.timeout(WAIT_S):
            while (response := await call.read()) is not grpc.aio.EOF:  # ends once every job is terminal
                assert isinstance(response, job_service_pb2.WatchJobsResponse)
                messages.append(response)
        assert await call.code() == grpc.StatusCode.OK
    for message in messages:
        for change in message.changes:
            if change.HasField("job"):
                seen.setdefault(change.job_id, []).append(change.job.state)
    for job in jobs:
        states = seen[job.job_id]
        assert states[0] == job_pb2.JOB_STATE_QUEUED
        assert states[-1] == job_pb2.JOB_STATE_SUCCEEDED
        assert states.count(job_pb2.JOB_STATE_SUCCEEDED) == 1, "each change once"


async def test_a_label_selector_sees_only_matching_jobs(idle_stack: Stack) -> None:
    async with AsyncClient(idle_stack.address) as client:
        watch = client.watch_jobs(labels={"batch": "nightly"}, timeout_s=WAIT_S)
        ready = asyncio.create_task(anext(watch))  # the stream opens before the jobs exist
        hub = idle_stack.gateway.watch_hub
        # Registered, then listening: a job queued between the two shows no QUEUED change (CI, with
        # two workers and other load, submitted in that gap: the watch waited for a change in vain).
        await until(lambda: hub.watcher_count == 1 and hub.hears_notices)
        first = await client.submit("demo", {"x": X}, labels={"batch": "nightly", "owner": "ana"})
        update = await asyncio.wait_for(ready, WAIT_S)
        assert isinstance(update, Job)
        assert update.job_id == first.job_id
        other = await client.submit("demo", {"x": X}, labels={"batch": "adhoc"})
        second = await client.submit("demo", {"x": X}, labels={"batch": "nightly"})
        await idle_stack.start_batcher()
        finished: set[str] = set()
        watched: set[str] = {first.job_id}
        async for update in watch:
            assert isinstance(update, Job)
            watched.add(update.job_id)
            if update.state is JobState.SUCCEEDED:
                finished.add(update.job_id)
            if finished == {first.job_id, second.job_id}:
                break
        await watch.aclose()
        done = await client.wait(other, timeout_s=WAIT_S)
    assert done.state is JobState.SUCCEEDED, "the other job ran too"
    assert other.job_id not in watched, "a job without the labels is not sent"


def hold_notices(hub: WatchHub, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """A label watch's subscription to the queued notices waits until the event is set: the gap
    between registering and listening, held open (CI's load opened it by chance, session 28)."""
    release = asyncio.Event()
    subscribe = hub.ensure_notices

    async def held() -> None:
        await release.wait()
        await subscribe()

    monkeypatch.setattr(hub, "ensure_notices", held)
    return release


async def test_a_label_watch_sends_its_headers_once_it_listens(
    idle_stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session 29: a raw client had no signal that a label watch listens, so a job it submitted
    right after opening the stream could show no QUEUED change. The gateway now sends the stream's
    headers (asyncinfer-watch-ready) once the watch hears the queued notices, not before; a client
    that awaits them and then submits sees every job from QUEUED. Before, the headers came only
    with the first change: awaiting them waited for a change that never came. Session 30: they
    also say since when the watch listens, on the gateway's clock (asyncinfer-watch-since)."""
    hub = idle_stack.gateway.watch_hub
    opened_at = time.time()  # the gateway's clock: its wall clock is this process's
    release = hold_notices(hub, monkeypatch)
    labels = {"run": "raw"}
    async with grpc.aio.insecure_channel(idle_stack.address) as channel, AsyncClient(idle_stack.address) as client:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        call = stub.WatchJobs(job_service_pb2.WatchJobsRequest(labels=labels))
        headers = asyncio.create_task(call.initial_metadata())
        await until(lambda: hub.watcher_count == 1)  # registered; its subscription to notices held
        assert not headers.done(), "no headers before the watch listens"
        release.set()
        ready = await asyncio.wait_for(headers, WAIT_S)
        assert (WATCH_READY_HEADER, "1") in tuple(ready)
        since = float(dict(ready)[WATCH_SINCE_HEADER])
        assert opened_at <= since <= time.time()
        jobs = [await client.submit("demo", {"x": X + i}, labels=labels) for i in range(10)]
        first_states: dict[str, int] = {}
        async with asyncio.timeout(WAIT_S):
            while len(first_states) < len(jobs):
                response = await call.read()
                assert isinstance(response, job_service_pb2.WatchJobsResponse)
                for change in response.changes:
                    first_states.setdefault(change.job_id, change.job.state)
        assert first_states == {job.job_id: job_pb2.JOB_STATE_QUEUED for job in jobs}
        # A status after the headers still carries its details (here: the gateway stops).
        await hub.stop()
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(call.read(), WAIT_S)
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    details = status_details(ended.value)
    assert details is not None
    assert unpack_details(details)["ErrorInfo"].reason == "UNAVAILABLE"


async def test_a_label_watch_shows_the_jobs_a_listing_with_its_labels_shows(idle_stack: Stack) -> None:
    """Session 31: a label watch sent the idempotency fence's withdrawals, and to a selector naming
    only asyncinfer-chunk a batch's chunk jobs, both of which ListJobs with the same labels leaves
    out: the live watch and the listing the SDK catches up with disagreed. Both now follow one rule
    (services.gateway.job_selection). The records are written to the jobs bucket as the fence and
    the batch driver write them; the one both show is written last, so once each watch has sent it
    the feed has passed the others."""
    store = JobStore(await open_kv_bucket(idle_stack.nc.jetstream(), JOBS_BUCKET), work_stream=WORK_STREAM)
    now = time.time()

    def record(labels: dict[str, str], **changes: Any) -> JobRecord:
        return MINIMAL.evolve(job_id=new_job_id(), create_time=now, update_time=now, labels=labels, **changes)

    chunk_label = {CHUNK_LABEL: "0-9"}
    selectors = {"user": {"run": "selected"}, "chunk": chunk_label}
    withdrawal = record(
        selectors["user"], state=RecordState.CANCELED, end_time=now, error=job_errors.superseded(new_job_id(), 60.0)
    )
    chunk_job = record({BATCH_LABEL: "b-1", **chunk_label})
    shown = record({**selectors["user"], **chunk_label})
    seen: dict[str, list[str]] = {}
    async with grpc.aio.insecure_channel(idle_stack.address) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        calls = {
            name: stub.WatchJobs(job_service_pb2.WatchJobsRequest(labels=labels)) for name, labels in selectors.items()
        }
        for call in calls.values():
            assert (WATCH_READY_HEADER, "1") in tuple(await asyncio.wait_for(call.initial_metadata(), WAIT_S))
        for written in (withdrawal, chunk_job, shown):
            await store.create(written)
        for name, call in calls.items():
            seen[name] = []
            async with asyncio.timeout(WAIT_S):
                while shown.job_id not in seen[name]:
                    response = await call.read()
                    assert isinstance(response, job_service_pb2.WatchJobsResponse)
                    seen[name] += [change.job_id for change in response.changes]
            call.cancel()
        listed = {
            name: [job.job_id for job in (await stub.ListJobs(job_service_pb2.ListJobsRequest(labels=labels))).jobs]
            for name, labels in selectors.items()
        }
    assert listed == {"user": [shown.job_id], "chunk": [shown.job_id]}
    assert seen == listed, "the watches show what the listings show"


@pytest.mark.parametrize("sdk", ["blocking", "asyncio"])
async def test_the_sdk_label_watch_is_ready_before_the_jobs_it_submits_next(
    idle_stack: Stack, monkeypatch: pytest.MonkeyPatch, sdk: str
) -> None:
    """Session 29: `watch = client.watch_jobs(labels=...)` then `client.submit(...)` lost the
    jobs' QUEUED (the blocking client opened the stream only at the first `next`; the gateway
    listened a moment after it opened). The blocking client's watch_jobs now returns once the
    gateway listens, as `await watch.ready()` does: 20 jobs submitted at once each show QUEUED
    (no batcher: it is their only change, so a job whose QUEUED was lost never shows)."""
    hub = idle_stack.gateway.watch_hub
    release = hold_notices(hub, monkeypatch)
    labels = {"run": sdk}

    def watch_then_submit() -> dict[str, JobState]:
        with Client(idle_stack.address) as client:
            watch = client.watch_jobs(labels=labels, timeout_s=WAIT_S)
            submitted = [client.submit("demo", {"x": X + i}, labels=labels) for i in range(20)]
            first_states: dict[str, JobState] = {}
            for update in watch:
                assert isinstance(update, Job)
                first_states.setdefault(update.job_id, update.state)
                if len(first_states) == len(submitted):
                    break
            return first_states

    async def watch_then_submit_async() -> dict[str, JobState]:
        async with AsyncClient(idle_stack.address) as client:
            watch = client.watch_jobs(labels=labels, timeout_s=WAIT_S)
            await watch.ready()
            submitted = [await client.submit("demo", {"x": X + i}, labels=labels) for i in range(20)]
            first_states: dict[str, JobState] = {}
            async for update in watch:
                assert isinstance(update, Job)
                first_states.setdefault(update.job_id, update.state)
                if len(first_states) == len(submitted):
                    break
            await watch.aclose()
            return first_states

    watching = asyncio.ensure_future(
        asyncio.to_thread(watch_then_submit) if sdk == "blocking" else watch_then_submit_async()
    )
    await until(lambda: hub.watcher_count == 1 or watching.done())  # registered; its notices held
    release.set()
    first_states = await asyncio.wait_for(watching, 2 * WAIT_S)
    assert len(first_states) == 20
    assert set(first_states.values()) == {JobState.QUEUED}


async def test_a_label_watch_keeps_nothing_of_the_jobs_that_ended(idle_stack: Stack) -> None:
    """A label watch lives as long as its caller (a service following a team's jobs for days): what
    it keeps of the jobs it saw is bounded (jobs_watch.DeliveredRevisions, REVISIONS_KEPT). Before,
    its generator also put every job that ended into the set a watch of IDs ends by, which a label
    watch never reads: one entry more per job for as long as the watch lived. 30 jobs cancelled
    under a watch: each comes CANCELED, and the watch holds no set of them."""
    labels = {"run": "ended"}
    async with AsyncClient(idle_stack.address) as client:
        watch = client.watch_jobs(labels=labels, timeout_s=WAIT_S)
        await watch.ready()
        jobs = [await client.submit("demo", {"x": X + i}, labels=labels) for i in range(30)]
        for job in jobs:
            await client.cancel(job)
        ended: set[str] = set()
        async for update in watch:
            assert isinstance(update, Job)
            if update.state is JobState.CANCELED:
                ended.add(update.job_id)
            if len(ended) == len(jobs):
                break
        kept = watch._updates.ag_frame.f_locals  # type: ignore[attr-defined]  # suspended at its yield
        assert kept["done"] == set()
        assert len(kept["delivered"]) == len(jobs)  # the bounded record of what it delivered
        await watch.aclose()


async def test_a_label_watch_refused_still_says_why_through_the_sdk(idle_stack: Stack) -> None:
    """The wait for the headers does not hide a refusal: INVALID_ARGUMENT with its field comes
    from `ready()`, and from the blocking client's watch_jobs itself (before: only at its first
    `next`)."""
    bad = {"": "x"}
    async with AsyncClient(idle_stack.address) as client:
        watch = client.watch_jobs(labels=bad, timeout_s=WAIT_S)
        with pytest.raises(InvalidArgumentError) as refused:
            await watch.ready()
        await watch.aclose()
    assert [v.field for v in refused.value.violations] == ["labels['']"]

    def open_blocking() -> None:
        with Client(idle_stack.address) as client:
            client.watch_jobs(labels=bad, timeout_s=WAIT_S)

    with pytest.raises(InvalidArgumentError) as refused_blocking:
        await asyncio.to_thread(open_blocking)
    assert [v.field for v in refused_blocking.value.violations] == ["labels['']"]


async def test_a_blocking_label_watch_refused_at_ready_leaves_nothing_open(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blocking client's watch_jobs(labels=...) waits for ready(); refused there (the tenant's
    watches full: RESOURCE_EXHAUSTED TOO_MANY_WATCHES) it raises, and the watch it made is closed:
    its generator ended, no task left on the client's loop, the gateway holding only the watch
    that filled the limit."""
    stack = await start_stack(config.replace(gateway={"max_watches_per_tenant": 1}), batcher=False)
    hub = stack.gateway.watch_hub
    made: list[jobs_watch.JobsWatch] = []

    class Recorded(jobs_watch.JobsWatch):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(_async_watch, "JobsWatch", Recorded)

    def refused_watch() -> tuple[ResourceExhaustedError, int]:
        with Client(stack.address, retry=NO_RETRY) as client:
            with pytest.raises(ResourceExhaustedError) as refused:
                client.watch_jobs(labels={"run": "second"}, timeout_s=WAIT_S)
            pending = len([task for task in asyncio.all_tasks(client._loop) if not task.done()])
            return refused.value, pending

    async with AsyncClient(stack.address) as client:
        held = client.watch_jobs(labels={"run": "first"}, timeout_s=WAIT_S)
        await held.ready()
        error, pending = await asyncio.to_thread(refused_watch)
        assert hub.watcher_count == 1
        await held.aclose()
    assert error.reason == "TOO_MANY_WATCHES"
    assert pending == 0
    assert len(made) == 2
    assert made[1]._updates.ag_frame is None  # type: ignore[attr-defined]  # closed: nothing can resume it


async def test_a_blocking_watch_closed_or_left_part_way_ends_its_stream_at_once(
    idle_stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blocking client's watches are closed as files are: by close(), iterated or not, and at
    the end of a `with` block, part-way; the gateway sees the stream end (its watcher gone) when
    they return. They were generators: close() of one never started did nothing (a label watch's
    stream, open once watch_jobs returned, stayed open until its objects were collected; here the
    JobsWatch is held, as a traceback or a debugger's frame holds it), and `with` was a TypeError.
    One dropped unclosed is closed when collected, without waiting there. (No timeout_s: a watch
    that waits for its stream's deadline is not closed.)"""
    hub = idle_stack.gateway.watch_hub
    made: list[jobs_watch.JobsWatch] = []

    class Recorded(jobs_watch.JobsWatch):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(_async_watch, "JobsWatch", Recorded)
    async with AsyncClient(idle_stack.address) as submitter:
        job = await submitter.submit("demo", {"x": X})  # no batcher: QUEUED, its watch never ends
    client = await asyncio.to_thread(Client, idle_stack.address)
    try:
        # A label watch, its stream open (the gateway listens), closed before any `next`.
        watch = await asyncio.to_thread(client.watch_jobs, labels={"run": "closed"})
        assert hub.watcher_count == 1
        await asyncio.to_thread(watch.close)
        await until(lambda: hub.watcher_count == 0)
        assert made[0]._updates.ag_frame is None  # type: ignore[attr-defined]  # closed: nothing resumes it
        with pytest.raises(StopIteration):
            next(watch)  # closed: it ends, as a closed generator does

        # A job's watch left part-way by the end of a `with` block.
        seen, checked = threading.Event(), threading.Event()

        def left_part_way() -> Job:
            with client.watch(job.job_id) as updates:
                first = next(updates)
                seen.set()
                assert checked.wait(WAIT_S)
            return first

        leaving = asyncio.ensure_future(asyncio.to_thread(left_part_way))
        assert await asyncio.to_thread(seen.wait, WAIT_S)
        await until(lambda: hub.watcher_count == 1)
        checked.set()
        assert (await leaving).state is JobState.QUEUED
        await until(lambda: hub.watcher_count == 0)

        # A watch of IDs in a `with` block, never iterated, and one dropped after one `next`.
        def never_iterated() -> None:
            with client.watch_jobs([job.job_id]):
                pass

        await asyncio.to_thread(never_iterated)
        assert await asyncio.to_thread(lambda: next(client.watch(job.job_id)).job_id) == job.job_id
        await until(lambda: hub.watcher_count == 0)
    finally:
        await asyncio.to_thread(client.close)


async def test_an_async_watch_left_by_async_with_ends_its_stream_at_once(idle_stack: Stack) -> None:
    """AsyncClient.watch_jobs returns a JobsWatch, which took only `aclose()`: `async with` was a
    TypeError, and a label watch left part-way by an error kept its stream open, and the gateway
    its watcher, until the watch was collected or its timeout_s passed (none here). The end of an
    `async with` block closes it: part-way, by an error, or never iterated."""
    hub = idle_stack.gateway.watch_hub
    labels = {"run": "async-with"}
    async with AsyncClient(idle_stack.address) as client:
        # A label watch left after its first change.
        async with client.watch_jobs(labels=labels) as watch:
            await watch.ready()
            assert hub.watcher_count == 1
            job = await client.submit("demo", {"x": X}, labels=labels)  # no batcher: QUEUED for good
            first = await anext(watch)
            assert isinstance(first, Job)
            assert (first.job_id, first.state) == (job.job_id, JobState.QUEUED)
        assert watch._updates.ag_frame is None  # type: ignore[attr-defined]  # closed: nothing resumes it
        await until(lambda: hub.watcher_count == 0)
        with pytest.raises(StopAsyncIteration):
            await anext(watch)  # closed: it ends, as a closed generator does
        await watch.aclose()  # again: nothing

        # A watch of IDs left by an error (the job never ends: no batcher), and one never iterated.
        async def left_by_an_error() -> None:
            async with client.watch_jobs([job.job_id]) as ids_watch:
                assert (await anext(ids_watch)).job_id == job.job_id  # type: ignore[union-attr]
                assert hub.watcher_count == 1
                raise LookupError("the caller's own error goes through")

        with pytest.raises(LookupError):
            await left_by_an_error()
        await until(lambda: hub.watcher_count == 0)
        async with client.watch_jobs([job.job_id]):
            pass
        assert hub.watcher_count == 0


async def test_the_sdk_does_not_wait_for_ever_on_a_gateway_without_the_ready_header(
    idle_stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway before session 29 sends its headers only with the first change, which may never
    come: `ready()` gives up its wait after READY_WAIT_S and the watch carries on."""

    def without_headers(hub: WatchHub, tenant: str, labels: dict[str, str], listening: object = None) -> object:
        return watch_labels(hub, tenant, labels)  # as before: no `listening`

    monkeypatch.setattr(batch_reads, "watch_labels", without_headers)
    monkeypatch.setattr(jobs_watch, "READY_WAIT_S", 0.2)
    labels = {"run": "old-gateway"}
    async with AsyncClient(idle_stack.address) as client:
        watch = client.watch_jobs(labels=labels, timeout_s=WAIT_S)
        await asyncio.wait_for(watch.ready(), WAIT_S)
        await until(lambda: idle_stack.gateway.watch_hub.hears_notices)
        job = await client.submit("demo", {"x": X}, labels=labels)
        update = await asyncio.wait_for(anext(watch), WAIT_S)
        await watch.aclose()
    assert isinstance(update, Job)
    assert (update.job_id, update.state) == (job.job_id, JobState.QUEUED)


class _SkewedClock(datetime):
    """The SDK's clock (what the label watch module reads as `datetime`) `ahead_s` off the hosts'."""

    ahead_s = 0.0

    @classmethod
    def now(cls, tz: tzinfo | None = None) -> datetime:
        return datetime.now(tz) + timedelta(seconds=cls.ahead_s)


@pytest.mark.parametrize(
    ("sdk", "client_ahead_s", "late_headers"),
    [
        ("blocking", 0.0, False),
        ("asyncio", 0.0, False),
        ("asyncio", 60.0, False),
        ("asyncio", -60.0, False),
        ("asyncio", 60.0, True),
    ],
)
async def test_a_reopened_label_watch_reports_what_changed_while_it_was_broken(
    config: Config,
    start_stack: StartStack,
    monkeypatch: pytest.MonkeyPatch,
    sdk: str,
    client_ahead_s: float,
    late_headers: bool,
) -> None:
    """Session 29: the SDK reopened a label watch broken by a gateway restart, and what changed
    meanwhile was lost: jobs that finished while the gateway was down were never reported (a client
    collecting results by label waited for ever). The reopened watch now lists the jobs with its
    labels once the new stream listens and yields each it has not yielded the latest state of:
    here every job that finished in the gap, once, at its terminal state (one queued before the
    watch started among them), and not the job that ended before the watch started.

    Session 30: whatever the client's clock says. The catch-up compared the jobs' times (the
    services') with the client's clock at the watch's start: 60 s ahead, the job queued before the
    watch and ended in the gap was never reported (the watch ran to its timeout); 60 s behind, the
    job that ended before the watch started was. It now compares them with the gateway's clock,
    which the watch's headers say; also when they came after the SDK stopped waiting for them
    (`late_headers`: a loaded gateway past READY_WAIT_S, as under CI's load in session 30)."""
    _SkewedClock.ahead_s = client_ahead_s
    monkeypatch.setattr(_async_watch, "datetime", _SkewedClock)
    stack = await start_stack(config.replace(gateway={"port": free_port()}), batcher=False)
    labels = {"run": f"gap-{sdk}-{client_ahead_s:+.0f}-{late_headers}"}
    release = subscribed = None
    if late_headers:  # the first stream's headers come after the SDK's wait for them ended
        monkeypatch.setattr(jobs_watch, "READY_WAIT_S", 0.05)
        release = hold_notices(stack.gateway.watch_hub, monkeypatch)
        subscribed, held = asyncio.Event(), stack.gateway.watch_hub.ensure_notices

        async def subscribe_then_say() -> None:
            await held()
            subscribed.set()

        monkeypatch.setattr(stack.gateway.watch_hub, "ensure_notices", subscribe_then_say)
    async with AsyncClient(stack.address) as client:
        ended_before = await client.cancel(await client.submit("demo", {"x": X}, labels=labels))
        queued_before = await client.submit("demo", {"x": X}, labels=labels)
    assert ended_before.state is JobState.CANCELED

    async def run_while_away(job_ids: list[str]) -> None:
        async def finish() -> None:
            await stack.start_batcher()
            js = stack.nc.jetstream()
            async with asyncio.timeout(WAIT_S):  # no watch announces it: the gateway is down
                while True:
                    records = [await job_record(js, job_key(TENANT, job_id)) for job_id in job_ids]
                    if all(record is not None and record.state.is_terminal for record in records):
                        return
                    await asyncio.sleep(0.01)

        await stack.restart_gateway(0.2, while_away=finish)

    loop = asyncio.get_running_loop()
    # What the watch yielded, and the marker once submitted: kept here, so that a watch that ends
    # short (CI: DEADLINE_EXCEEDED after the marker had SUCCEEDED) says how far it came.
    seen: list[Job] = []
    markers: list[str] = []
    started = time.monotonic()
    heard: list[tuple[float, str, str, int]] = []  # when (s after the watch began), what

    def note(update: Job) -> None:
        seen.append(update)
        heard.append((round(time.monotonic() - started, 2), update.job_id[-6:], update.state.name, update.revision))

    def watch_blocking() -> tuple[list[str], str]:
        with Client(stack.address, retry=FAST_RETRY) as client:
            updates = client.watch_jobs(labels=labels, timeout_s=2 * WAIT_S)
            gap = [client.submit("demo", {"x": X + i}, labels=labels).job_id for i in range(3)]
            for update in updates:  # each gap job's QUEUED (no batcher yet)
                assert isinstance(update, Job)
                note(update)
                if len(seen) == len(gap):
                    break
            asyncio.run_coroutine_threadsafe(run_while_away([*gap, queued_before.job_id]), loop).result()
            marker = ""
            for update in updates:
                assert isinstance(update, Job)
                note(update)
                if not marker and {*gap, queued_before.job_id} <= {j.job_id for j in seen if j.done}:
                    # Caught up: anything repeated would come before the next job's changes.
                    marker = client.submit("demo", {"x": X}, labels=labels).job_id
                    markers.append(marker)
                    heard.append((round(time.monotonic() - started, 2), marker[-6:], "submitted", 0))
                if update.job_id == marker and update.done:
                    break
            return gap, marker

    async def watch_async() -> tuple[list[str], str]:
        async with AsyncClient(stack.address, retry=FAST_RETRY) as client:
            updates = client.watch_jobs(labels=labels, timeout_s=2 * WAIT_S)
            await updates.ready()
            if release is not None and subscribed is not None:  # now the gateway listens, and says since when
                release.set()
                await asyncio.wait_for(subscribed.wait(), WAIT_S)
            gap = [(await client.submit("demo", {"x": X + i}, labels=labels)).job_id for i in range(3)]
            async for update in updates:
                assert isinstance(update, Job)
                note(update)
                if len(seen) == len(gap):
                    break
            await run_while_away([*gap, queued_before.job_id])
            marker = ""
            async for update in updates:
                assert isinstance(update, Job)
                note(update)
                if not marker and {*gap, queued_before.job_id} <= {j.job_id for j in seen if j.done}:
                    marker = (await client.submit("demo", {"x": X}, labels=labels)).job_id
                    markers.append(marker)
                    heard.append((round(time.monotonic() - started, 2), marker[-6:], "submitted", 0))
                if update.job_id == marker and update.done:
                    break
            await updates.aclose()
            return gap, marker

    try:
        gap, marker = await (asyncio.to_thread(watch_blocking) if sdk == "blocking" else watch_async())
    except AsyncInferClientError as error:
        hub = stack.gateway.watch_hub
        ended = [await job_record(stack.nc.jetstream(), job_key(TENANT, job_id)) for job_id in markers]
        raise AssertionError(
            f"the watch ended ({error!r}) after {time.monotonic() - started:.1f} s having heard {heard}; "
            f"the marker {markers} stands {[(r.state, r.revision) if r else None for r in ended]}; the "
            f"gateway's hub: feeding={hub.feeding} hears_notices={hub.hears_notices} watchers={hub.watcher_count}"
        ) from error
    states: dict[str, list[JobState]] = {}
    for update in seen:
        states.setdefault(update.job_id, []).append(update.state)
    for job_id in gap:
        assert states[job_id] == [JobState.QUEUED, JobState.SUCCEEDED], "QUEUED live, then once as it ended"
    assert states[queued_before.job_id] == [JobState.SUCCEEDED], "queued before the watch, ended in the gap"
    assert states[marker][-1] is JobState.SUCCEEDED
    assert ended_before.job_id not in states, "a job that ended before the watch started is not news"


async def test_a_reopened_label_watch_lists_again_once_a_late_gateway_says_it_listens(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session 32's CI4: a label watch reopened on a gateway just restarted and loaded took its
    stream as listening once its wait for the headers ended (READY_WAIT_S) and listed what it had
    missed; a job that changed after that listing and before the new gateway's feed started came
    neither way, and the watch waited for it to its timeout. It now lists again once the gateway
    says it listens. Here the new gateway's feed is held until the job has ended."""
    stack = await start_stack(config.replace(gateway={"port": free_port()}))
    labels = {"run": "late-listening"}
    monkeypatch.setattr(jobs_watch, "READY_WAIT_S", 0.05)
    feed_held = asyncio.Event()
    ensure_feed = WatchHub.ensure_feed
    listed = asyncio.Event()
    list_page = JobLister.page

    async def counted(lister: JobLister, tenant: str, query: ListQuery) -> ListPage:
        page = await list_page(lister, tenant, query)
        listed.set()
        return page

    async with AsyncClient(stack.address, retry=FAST_RETRY) as client:
        updates = client.watch_jobs(labels=labels, timeout_s=WAIT_S)
        await updates.ready()
        seen: list[Job] = []
        marker: list[str] = []
        marker_done = asyncio.Event()

        async def collect() -> None:
            async for update in updates:
                assert isinstance(update, Job)
                seen.append(update)
                if update.job_id in marker and update.done:
                    marker_done.set()

        async def held_feed(hub: WatchHub) -> None:
            await feed_held.wait()
            await ensure_feed(hub)

        async def while_away() -> None:  # the old gateway is gone: what follows is the new one's
            monkeypatch.setattr(WatchHub, "ensure_feed", held_feed)
            monkeypatch.setattr(JobLister, "page", counted)

        collecting = asyncio.create_task(collect())
        try:
            await stack.restart_gateway(0.2, while_away=while_away)
            await asyncio.wait_for(listed.wait(), WAIT_S)  # the reopened watch's catch-up, feed held
            job = await client.submit("demo", {"x": X}, labels=labels)
            marker.append(job.job_id)
            js = stack.nc.jetstream()
            async with asyncio.timeout(WAIT_S):  # no watch says it: the feed is held
                while True:
                    record = await job_record(js, job_key(TENANT, job.job_id))
                    if record is not None and record.state.is_terminal:
                        break
                    await asyncio.sleep(0.01)
            feed_held.set()
            await asyncio.wait_for(marker_done.wait(), WAIT_S)
        finally:
            feed_held.set()
            collecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collecting
            await updates.aclose()
    assert [u.state for u in seen if u.job_id == job.job_id][-1] is JobState.SUCCEEDED


async def test_a_label_watch_outlasts_a_catch_up_listing_past_its_call_deadline(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session 30: after a gateway restart every label watch lists at once, and a catch-up's
    ListJobs that ran past the client's call deadline (DEADLINE_EXCEEDED, not retried) ended its
    watch with DeadlineExceededError (136 of 200 in bench/system/label_watch_reconnect.py). The
    catch-up now tries its listing again for as long as the watch may live: here the new gateway's
    first listing is held past the watching client's 2-s call timeout, and the job that finished
    while the gateway was down still comes."""
    stack = await start_stack(config.replace(gateway={"port": free_port()}), batcher=False)
    labels = {"run": "catch-up-past-its-deadline"}
    listings: list[str] = []
    held = asyncio.Event()  # set at the end: the held listing's handler then ends too
    list_page = JobLister.page

    async def first_held(lister: JobLister, tenant: str, query: ListQuery) -> ListPage:
        listings.append(tenant)
        if len(listings) == 1:
            await held.wait()
        return await list_page(lister, tenant, query)

    async def finish(job_id: str) -> None:
        await stack.start_batcher()
        async with asyncio.timeout(WAIT_S):  # no watch announces it: the gateway is down
            while True:
                record = await job_record(stack.nc.jetstream(), job_key(TENANT, job_id))
                if record is not None and record.state.is_terminal:
                    return
                await asyncio.sleep(0.01)

    try:
        async with AsyncClient(stack.address, retry=FAST_RETRY, timeout_s=2.0) as client:
            watch = client.watch_jobs(labels=labels, timeout_s=4 * WAIT_S)
            await watch.ready()
            job = await client.submit("demo", {"x": X}, labels=labels)
            queued = await anext(watch)
            assert (queued.job_id, queued.state) == (job.job_id, JobState.QUEUED)
            monkeypatch.setattr(JobLister, "page", first_held)
            await stack.restart_gateway(0.2, while_away=lambda: finish(job.job_id))
            async with asyncio.timeout(2 * WAIT_S):
                caught_up = await anext(watch)
            await watch.aclose()
    finally:
        held.set()
    assert (caught_up.job_id, caught_up.state) == (job.job_id, JobState.SUCCEEDED)
    assert len(listings) >= 2, "the held listing was tried again"


@pytest.mark.parametrize("later_tries", ["refused", "hung"])
async def test_a_catch_up_listing_that_fails_to_the_end_says_what_it_met_and_its_hint(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch, later_tries: str
) -> None:
    """A reopened label watch's catch-up (ListJobs) raised its own errors, not through the client's
    `_hinted` as every other call does: a listing refused until the watch's deadline ended it with
    "the label watch (its catch-up after a reconnect) did not complete within 5 s", without what
    the listing met or its hint (tests/test_tls_hints.py: a closed socket's names tls_ca_file= to a
    plaintext client). Here the first listing of the new gateway answers UNAVAILABLE "Socket
    closed" while the reopened stream listens, and the watch ends with that error and its hint.
    `hung`: the tries after it hang, so the last is cut short by the watch's deadline, as a loaded
    machine's last try was (CI under load: DEADLINE_EXCEEDED with no hint at all); its error
    keeps the hint of what the try before it met ("earlier tries: ...")."""
    stack = await start_stack(config.replace(gateway={"port": free_port()}), batcher=False)
    labels = {"run": "catch-up-hinted"}
    tries = 0

    async def refused(lister: JobLister, tenant: str, query: ListQuery) -> ListPage:
        nonlocal tries
        tries += 1
        if later_tries == "hung" and tries > 1:
            await asyncio.Event().wait()
        raise GatewayUnavailable("Socket closed")

    async with (
        AsyncClient(stack.address, retry=FAST_RETRY, timeout_s=2.0) as client,
        client.watch_jobs(labels=labels, timeout_s=5.0) as watch,
    ):
        await watch.ready()
        monkeypatch.setattr(JobLister, "page", refused)
        await stack.restart_gateway(0.2)
        with pytest.raises(AsyncInferClientError) as ended:
            await anext(watch)
    assert tries >= 1, "a listing was tried before the deadline"
    hint = "if the server is on TLS, give tls_ca_file="
    if ended.value.code is grpc.StatusCode.DEADLINE_EXCEEDED:
        # The last try cut short by the deadline (always so when the later tries hang; on a
        # loaded machine it may be so when they are refused): the earlier tries' hint.
        assert (ended.value.hint or "").startswith(f"earlier tries: {hint}"), str(ended.value)
    else:
        assert later_tries == "refused", str(ended.value)
        assert ended.value.code is grpc.StatusCode.UNAVAILABLE, str(ended.value)
        assert "Socket closed" in ended.value.message, str(ended.value)
        assert hint in (ended.value.hint or ""), str(ended.value)
    if later_tries == "hung":
        assert ended.value.code is grpc.StatusCode.DEADLINE_EXCEEDED, str(ended.value)


async def test_a_catch_up_cut_short_after_a_reopen_keeps_the_hint_of_the_catch_up_before(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session 39 (CI of session 38): a catch-up whose listings were refused ("Socket closed") ended
    when the watch's deadline left no room for another wait; the stream reopened and answered, and
    the next catch-up's first try was cut short by the deadline: "Deadline Exceeded" with no hint,
    for each catch-up kept what it met for itself and the reopened stream's answer forgot the rest.
    Here the first catch-up is refused until its stream ends (the gateway restarts again), and every
    listing of the next gateway hangs: the watch ends DEADLINE_EXCEEDED with the hint of the
    refusals before ("earlier tries: ...")."""
    stack = await start_stack(config.replace(gateway={"port": free_port()}), batcher=False)
    labels = {"run": "catch-up-hinted-after-a-reopen"}
    refusing: GatewayApp | None = None
    refusals = 0
    refused_twice = asyncio.Event()
    hung = 0

    async def refused_then_hung(lister: JobLister, tenant: str, query: ListQuery) -> ListPage:
        nonlocal refusals, hung
        if stack.gateway is not refusing:
            hung += 1
            await asyncio.Event().wait()
        refusals += 1
        if refusals >= 2:
            refused_twice.set()
        raise GatewayUnavailable("Socket closed")

    async with (
        AsyncClient(stack.address, retry=FAST_RETRY, timeout_s=2.0) as client,
        client.watch_jobs(labels=labels, timeout_s=8.0) as watch,
    ):
        await watch.ready()
        monkeypatch.setattr(JobLister, "page", refused_then_hung)
        await stack.restart_gateway(0.2)
        refusing = stack.gateway
        ending = asyncio.ensure_future(anext(watch))
        await asyncio.wait_for(refused_twice.wait(), WAIT_S)
        await stack.restart_gateway(0.2)
        with pytest.raises(AsyncInferClientError) as ended:
            await ending
    assert hung >= 1, "the next gateway's catch-up listed"
    assert ended.value.code is grpc.StatusCode.DEADLINE_EXCEEDED, str(ended.value)
    assert (ended.value.hint or "").startswith("earlier tries: if the server is on TLS, give tls_ca_file="), str(
        ended.value
    )


async def test_label_watches_ended_by_a_gateway_stop_reopen_on_the_next_gateway(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session 31: a gateway's stop ended its watches before its server stopped intake, so each
    client reopened its watch at once, on the same connection, on the gateway that was stopping; the
    calls its loop had not picked up by the time the server stopped ended CANCELLED ("CANCELLED":
    gRPC core's answer to a call it drops at shutdown), which the SDK retries for no call, and the
    watch ended (1 to 114 of 200 label watches in bench/system/label_watch_reconnect.py). Here the
    stopping gateway's loop is kept busy while 20 watches reopen, as 200 watches ending and reopening
    kept it. The gateway now ends its watches once its server has sent GOAWAY: every watch reopens on
    the next gateway, and hears the job submitted there."""
    stack = await start_stack(config.replace(gateway={"port": free_port()}), batcher=False)
    labels = {"run": "reopened-during-a-stop"}
    watches = 20
    retried_on: list[str] = []
    all_retried = threading.Event()

    def on_retry(error: AsyncInferClientError, delay_s: float) -> None:  # on the client's loop
        retried_on.append(error.code.name)
        if len(retried_on) >= watches:
            all_retried.set()

    hub_stop = stack.gateway.watch_hub.stop

    async def stop_then_busy() -> None:
        await hub_stop()
        # The client (its own loop, in a thread) heard its watches end and reopens them now...
        assert await asyncio.to_thread(all_retried.wait, WAIT_S)
        # ...while this gateway's loop is busy (blocked on purpose): the calls that reach its
        # server meanwhile wait in gRPC core, not yet picked up.
        time.sleep(0.5)  # noqa: ASYNC251 - the busy loop is the scenario

    monkeypatch.setattr(stack.gateway.watch_hub, "stop", stop_then_busy)
    ready = threading.Event()

    async def watch_first_jobs() -> list[WatchUpdate]:
        async with AsyncClient(stack.address, retry=replace(FAST_RETRY, on_retry=on_retry)) as client:
            label_watches = [client.watch_jobs(labels=labels, timeout_s=2 * WAIT_S) for _ in range(watches)]
            await asyncio.gather(*(watch.ready() for watch in label_watches))
            ready.set()
            try:
                return list(await asyncio.gather(*(anext(watch) for watch in label_watches)))
            finally:
                await asyncio.gather(*(watch.aclose() for watch in label_watches))

    watching = asyncio.ensure_future(asyncio.to_thread(lambda: asyncio.run(watch_first_jobs())))
    assert await asyncio.to_thread(ready.wait, WAIT_S)
    await stack.restart_gateway(0.2)
    async with AsyncClient(stack.address) as client:
        job = await client.submit("demo", {"x": X}, labels=labels)
    async with asyncio.timeout(2 * WAIT_S):
        heard = await watching
    assert [(update.job_id, update.state) for update in heard if isinstance(update, Job)] == [
        (job.job_id, JobState.QUEUED)
    ] * watches
    assert set(retried_on) == {"UNAVAILABLE"}, "the stopping gateway, then nothing listening: UNAVAILABLE"


async def test_wait_jobs_returns_every_job_terminal_or_its_error(stack: Stack) -> None:
    async with AsyncClient(stack.address) as client:
        jobs = [await client.submit("demo", {"x": X * i}) for i in range(4)]
        unknown = new_job_id()
        done = await client.wait_jobs([*jobs, unknown], timeout_s=WAIT_S)
    assert list(done) == [*(j.job_id for j in jobs), unknown]
    for i, job in enumerate(jobs):
        final = done[job.job_id]
        assert isinstance(final, Job)
        assert final.state is JobState.SUCCEEDED
        np.testing.assert_array_equal(final.outputs["y"], 2 * (X * i) + 1)
    assert isinstance(done[unknown], NotFoundError)


async def test_wait_jobs_closes_its_other_streams_when_one_fails(
    idle_stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past WATCH_JOBS_MAX_IDS jobs (here 2) wait_jobs opens a stream per chunk. One refused (the
    gateway's limit lowered to 1 ID per watch: the 2-ID chunk is) raised from asyncio.gather while
    the other chunk's stream watched on with nothing awaiting it, until the client closed. Now the
    others are cancelled and awaited first, and the error is the refused stream's own."""
    monkeypatch.setattr(_async_wait, "WATCH_JOBS_MAX_IDS", 2)
    monkeypatch.setattr(batch_reads, "MAX_IDS_PER_WATCH", 1)
    hub = idle_stack.gateway.watch_hub
    async with AsyncClient(idle_stack.address) as client:
        queued = await client.submit("demo", {"x": X})  # no batcher: it stays queued
        with pytest.raises(InvalidArgumentError) as refused:
            await client.wait_jobs([new_job_id(), new_job_id(), queued], timeout_s=WAIT_S)
        unowned = [
            task
            for task in asyncio.all_tasks()
            if not task.done() and getattr(task.get_coro(), "__qualname__", "").endswith("wait_jobs.<locals>.watch")
        ]
        assert unowned == []
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        await until(lambda: hub.watcher_count == 0)
        assert (await client.get(queued)).state is JobState.QUEUED
    assert [v.field for v in refused.value.violations] == ["job_ids"]


async def test_a_watched_queued_job_expires_at_its_deadline(idle_stack: Stack) -> None:
    async with AsyncClient(idle_stack.address) as client:
        lasting = await client.submit("demo", {"x": X})
        short = await client.submit("demo", {"x": X}, queue_ttl_s=0.5)
        updates: list[Job] = []
        async with asyncio.timeout(WAIT_S):
            async for update in client.watch_jobs([short, lasting]):
                assert isinstance(update, Job)
                updates.append(update)
                if update.job_id == short.job_id and update.done:
                    break
    assert updates[-1].state is JobState.EXPIRED
    assert [u.state for u in updates if u.job_id == lasting.job_id] == [JobState.QUEUED]


@pytest.mark.parametrize(
    "request_",
    [job_service_pb2.WatchJobsRequest(), job_service_pb2.WatchJobsRequest(job_ids=["x"], labels={"a": "b"})],
    ids=["neither", "both"],
)
async def test_ids_or_labels_one_of_the_two(idle_stack: Stack, request_: job_service_pb2.WatchJobsRequest) -> None:
    async with grpc.aio.insecure_channel(idle_stack.address) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in stub.WatchJobs(request_):
                pass
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.unit
def test_a_batch_of_changes_is_cut_into_messages_within_the_budget() -> None:
    """A helper's limits pass, session 24: a WatchJobs message was bounded by its count of changes
    alone, so 40 finished jobs with 240-KB outputs made a 9.6-MB message, over the gateway's send
    limit, and the watch failed RESOURCE_EXHAUSTED on every retry. Cut by bytes, as GetJobs is."""
    output = Tensor.from_numpy("y", np.zeros((1, 25_000), np.float32))  # 100 KB
    done = MINIMAL.evolve(state=RecordState.SUCCEEDED, outputs=(output,), revision=3)
    changes = [JobChange(new_job_id(), done.evolve(job_id=f"j{i}")) for i in range(7)]
    changes.insert(3, JobChange("gone", error=job_not_found("gone")))

    def convert(record: JobRecord) -> job_service_pb2.WatchJobResponse:
        return job_service_pb2.WatchJobResponse(job=job_to_proto(record))

    responses = watch_jobs_responses(changes, convert, budget_bytes=250_000)
    # Two 100-KB jobs a message (a third would pass 250 KB); the small error fits beside two.
    assert [len(r.changes) for r in responses] == [2, 3, 2, 1]
    assert [c.job_id for r in responses for c in r.changes] == [c.job_id for c in changes]
    assert all(r.ByteSize() <= 250_000 for r in responses)
    assert [len(r.changes) for r in watch_jobs_responses(changes[:1], convert, budget_bytes=10)] == [1]


@pytest.mark.unit
def test_a_label_watchs_catch_up_takes_only_the_news() -> None:
    """What a reopened label watch yields of the jobs it lists (jobs_watch.missed): a job it
    delivered, when newer; one it did not (or forgot: the memory is bounded), when it changed
    since the watch started (a terminal one: when it ended)."""
    since = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
    before, after = since - timedelta(seconds=1), since + timedelta(seconds=1)

    def job(job_id: str, state: JobState, revision: int, *, update: datetime, end: datetime | None = None) -> Job:
        return Job(
            job_id=job_id,
            model_name="demo",
            model_version="",
            state=state,
            priority=Priority.NORMAL,
            attempt=1,
            max_attempts=3,
            revision=revision,
            update_time=update,
            end_time=end,
        )

    delivered = jobs_watch.DeliveredRevisions(kept=2)
    delivered.delivered(job("queued", JobState.QUEUED, 0, update=after))
    delivered.delivered(job("ran", JobState.SUCCEEDED, 7, update=after, end=after))
    assert not jobs_watch.missed(job("queued", JobState.QUEUED, 0, update=after), delivered, since)
    assert jobs_watch.missed(job("queued", JobState.RUNNING, 3, update=after), delivered, since)
    assert not jobs_watch.missed(job("ran", JobState.SUCCEEDED, 7, update=after, end=after), delivered, since)
    # Unseen: changed since the watch started (queued before it, among them), or not.
    assert jobs_watch.missed(job("new", JobState.SUCCEEDED, 9, update=after, end=after), delivered, since)
    assert jobs_watch.missed(job("old-running", JobState.RUNNING, 4, update=after), delivered, since)
    assert not jobs_watch.missed(job("old", JobState.CANCELED, 2, update=after, end=before), delivered, since)
    assert not jobs_watch.missed(job("idle", JobState.QUEUED, 0, update=before), delivered, since)
    # A third job forgets the one delivered least recently: at least once, never lost.
    delivered.delivered(job("third", JobState.QUEUED, 0, update=after))
    assert len(delivered) == 2
    assert not delivered.knows("queued")
    assert jobs_watch.missed(job("queued", JobState.QUEUED, 0, update=after), delivered, since)


@pytest.mark.unit
def test_a_catch_up_listing_is_tried_again_on_what_a_loaded_or_restarting_gateway_answers() -> None:
    """What a reopened label watch's catch-up outlasts (jobs_watch.catch_up_retries): a call past
    its deadline, an unavailable or exhausted gateway; not a bad request, a message over the size
    limit, or any failure when the policy turns stream resumes off."""
    policy = RetryPolicy()
    for code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
        assert jobs_watch.catch_up_retries(make_error(code, "busy"), policy), code
        assert not jobs_watch.catch_up_retries(make_error(code, "busy"), NO_RETRY), code
    assert not jobs_watch.catch_up_retries(make_error(grpc.StatusCode.INVALID_ARGUMENT, "bad"), policy)
    too_large = make_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "too large", reason=MESSAGE_TOO_LARGE)
    assert not jobs_watch.catch_up_retries(too_large, policy)
    no_exhausted = RetryPolicy(retry_resource_exhausted=False)
    assert not jobs_watch.catch_up_retries(make_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy"), no_exhausted)


@pytest.mark.unit
def test_a_since_header_past_any_date_is_no_time_rather_than_an_error() -> None:
    """The gateway's `asyncinfer-watch-since` is Unix seconds: one that is a number but no date
    (a proxy's or another server's header; 1e300 seconds) is read as not said, the client's clock
    used, as for one that is not a number. It raised OverflowError or ValueError ("year 3170843 is
    out of range") out of the label watch."""
    for value in ("1e300", "-1e300", "99999999999999", "nan", "inf", "soon"):
        assert jobs_watch._gateway_time([(WATCH_SINCE_HEADER, value)]) is None, value
    said = jobs_watch._gateway_time([(WATCH_SINCE_HEADER, "1765101600.250000")])
    assert said == datetime(2025, 12, 7, 10, 0, 0, 250000, tzinfo=UTC)
