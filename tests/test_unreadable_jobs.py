"""A job record this release cannot decode (a state or field shape a later release wrote during a
rolling upgrade, or a corrupted value) costs that job alone: through the real stack (gateway,
scheduler, batcher on a real nats-server), the values written into the real jobs bucket beside
real jobs."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest
from structlog.testing import capture_logs

from asyncinfer.client import AsyncClient, JobState
from asyncinfer.codecs.envelope import decode_envelope
from asyncinfer.codecs.record import decode_record, encode_record
from asyncinfer.config import Config
from asyncinfer.contract import work_consumer_name
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.ids import new_job_id
from asyncinfer.job_store import JobStore, UnreadableJob, UnreadableOnce
from asyncinfer.jobs import Priority, job_key
from asyncinfer.nats.kv import open_kv_bucket
from asyncinfer.v1 import job_pb2, job_service_pb2
from services.scheduler import job_dispatch, lease_reclaim
from services.scheduler.instances import SchedulerInstance, new_run
from services.scheduler.lease_reclaim import LeaseReclaimer
from tests.stack import Stack, StartStack
from tests.test_deadline_sweep import demo_request, paused_stack
from tests.test_record_codec import MINIMAL

X = np.array([[1, 2, 3, 4]], dtype=np.float32)
WAIT_S = 30.0
LABELS = {"run": "unreadable"}


def later_release(job_id: str) -> bytes:
    """A job record as a later release might write it: a state this one does not know."""
    return json.dumps(json.loads(encode_record(MINIMAL.evolve(job_id=job_id))) | {"state": "PAUSED"}).encode()


def unreadable_values() -> dict[str, bytes]:
    return {(a := new_job_id()): later_release(a), new_job_id(): b"\xff not a job record"}


def assert_unreadable(error: grpc.aio.AioRpcError, job_id: str) -> None:
    assert error.code() == grpc.StatusCode.INTERNAL, error
    status = status_details(error)
    assert status is not None
    info = unpack_details(status)["ErrorInfo"]
    assert (info.reason, dict(info.metadata)) == (
        "JOB_UNREADABLE",
        {"job_id": job_id, "key": job_key("default", job_id)},
    )


def said(logs: list[dict[str, object]], where: str) -> list[object]:
    return sorted(str(e["key"]) for e in logs if e["event"] == "job_unreadable" and e["where"] == where)


def test_decode_record_raises_value_error_for_every_malformed_shape() -> None:
    """One `except ValueError` skips any of them: the contract UnreadableJob rests on (msgspec's
    checks give ValueError already; decode_record turns whatever its conversions raise into it)."""
    valid = json.loads(encode_record(MINIMAL))
    for value in (
        b"\xff",
        b"[]",
        later_release(MINIMAL.job_id),
        json.dumps(valid | {"labels": ["a"]}).encode(),
        json.dumps(valid | {"priority": 7}).encode(),
        json.dumps({k: v for k, v in valid.items() if k != "tenant"}).encode(),
    ):
        with pytest.raises(ValueError, match=r"\S"):
            decode_record(value)
    assert decode_record(encode_record(MINIMAL)) == MINIMAL


async def test_the_gateway_answers_job_unreadable_for_that_job_and_reads_the_others(stack: Stack) -> None:
    """GetJob, CancelJob, WatchJob and ReadResult answered UNKNOWN with a traceback; now INTERNAL
    JOB_UNREADABLE naming the job and its key. GetJobs and WatchJobs by IDs say it in that job's
    own answer beside the others'. ListJobs (no per-job error in its answer; an error for the page
    would stop the listing there for as long as the record stays) leaves it out and says it once per
    key in the log. A label watch's feed meets each value as it is written: one warning per key, and
    it goes on with the jobs after."""
    unreadable = unreadable_values()
    jobs = await open_kv_bucket(stack.nc.jetstream(), stack.config.nats.jobs_bucket)
    stub = stack.jobs
    async with AsyncClient(stack.address) as client:
        before = await client.wait(await client.submit("demo", {"x": X}, labels=LABELS), timeout_s=WAIT_S)
        with capture_logs() as logs:
            watch = stub.WatchJobs(job_service_pb2.WatchJobsRequest(labels=LABELS))
            await asyncio.wait_for(watch.initial_metadata(), WAIT_S)  # it hears every change
            for _ in range(2):  # each key written twice: said once
                for job_id, value in unreadable.items():
                    await jobs.kv.put(job_key("default", job_id), value)
            after = await client.submit("demo", {"x": X + 1}, labels=LABELS)
            async with asyncio.timeout(WAIT_S):
                while True:
                    response = await watch.read()
                    assert isinstance(response, job_service_pb2.WatchJobsResponse)
                    changes = {(c.job_id, c.job.state) for c in response.changes}
                    if (after.job_id, job_pb2.JOB_STATE_SUCCEEDED) in changes:
                        break
            watch.cancel()
            assert said(logs, "watch_feed") == sorted(job_key("default", i) for i in unreadable)

            for job_id in unreadable:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
                assert_unreadable(refused.value, job_id)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id))
                assert_unreadable(refused.value, job_id)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job_id)).read()
                assert_unreadable(refused.value, job_id)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.ReadResult(job_service_pb2.ReadResultRequest(job_id=job_id)).read()
                assert_unreadable(refused.value, job_id)

            asked = [before.job_id, *unreadable, after.job_id]
            got = await stub.GetJobs(job_service_pb2.GetJobsRequest(job_ids=asked))
            assert [r.job.state for r in got.results if r.HasField("job")] == [job_pb2.JOB_STATE_SUCCEEDED] * 2
            assert [(r.job_id, r.error.reason) for r in got.results if r.HasField("error")] == [
                (job_id, "JOB_UNREADABLE") for job_id in unreadable
            ]

            watched = stub.WatchJobs(job_service_pb2.WatchJobsRequest(job_ids=asked))
            first = await asyncio.wait_for(watched.read(), WAIT_S)
            watched.cancel()
            assert isinstance(first, job_service_pb2.WatchJobsResponse)
            assert {c.job_id: c.error.reason or job_pb2.JobState.Name(c.job.state) for c in first.changes} == {
                before.job_id: "JOB_STATE_SUCCEEDED",
                after.job_id: "JOB_STATE_SUCCEEDED",
                **dict.fromkeys(unreadable, "JOB_UNREADABLE"),
            }

            for _ in range(2):  # two listings: said once per key
                page = await stub.ListJobs(job_service_pb2.ListJobsRequest(page_size=10))
                assert [job.job_id for job in page.jobs] == [after.job_id, before.job_id]
            assert said(logs, "list_jobs") == sorted(job_key("default", i) for i in unreadable)
    assert stack.gateway.supervisor.failure is None
    assert stack.scheduler.supervisor.failure is None


async def test_a_watch_hears_when_a_watched_jobs_record_turns_unreadable(idle_stack: Stack) -> None:
    """Queued jobs (no batcher yet) watched by WatchJob, by WatchJobs with their IDs and by a label
    watch, whose records are then written with values this release cannot decode: the feed said it
    and dropped the update, so the watchers heard nothing and waited for ever, and a watch opened
    after started from the record the gateway kept from the job's submit (recent_records) and waited
    too. Now WatchJob ends with INTERNAL JOB_UNREADABLE naming the job, as GetJob answers it;
    WatchJobs by IDs sends that job's entry with the error and goes on watching the other; a watch
    opened after reads the record and answers the same; the label watch skips them (one warning per
    key) and goes on."""
    stack = idle_stack
    jobs = await open_kv_bucket(stack.nc.jetstream(), stack.config.nats.jobs_bucket)
    stub = stack.jobs
    async with AsyncClient(stack.address) as client:
        # First: the feed runs as the jobs are queued, so the gateway keeps their records.
        by_labels = stub.WatchJobs(job_service_pb2.WatchJobsRequest(labels=LABELS))
        await asyncio.wait_for(by_labels.initial_metadata(), WAIT_S)  # it hears every change
        alone, among, other = [(await client.submit("demo", {"x": X + i}, labels=LABELS)).job_id for i in range(3)]
        watch = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=alone))
        first = await asyncio.wait_for(watch.read(), WAIT_S)
        assert isinstance(first, job_service_pb2.WatchJobResponse)
        assert first.job.state == job_pb2.JOB_STATE_QUEUED
        by_ids = stub.WatchJobs(job_service_pb2.WatchJobsRequest(job_ids=[among, other]))
        opening = await asyncio.wait_for(by_ids.read(), WAIT_S)
        assert isinstance(opening, job_service_pb2.WatchJobsResponse)
        assert {(c.job_id, c.job.state) for c in opening.changes} == {
            (among, job_pb2.JOB_STATE_QUEUED),
            (other, job_pb2.JOB_STATE_QUEUED),
        }
        with capture_logs() as logs:
            values = {alone: later_release(alone), among: b"\xff not a job record"}
            for _ in range(2):  # each key written twice: said once
                for job_id, value in values.items():
                    await jobs.kv.put(job_key("default", job_id), value)

            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(watch.read(), WAIT_S)
            assert_unreadable(ended.value, alone)
            told = await asyncio.wait_for(by_ids.read(), WAIT_S)
            assert isinstance(told, job_service_pb2.WatchJobsResponse)
            assert [(c.job_id, c.error.reason, c.HasField("job")) for c in told.changes] == [
                (among, "JOB_UNREADABLE", False)
            ]
            for job_id in values:  # a watch opened now reads the record, not the one kept from its submit
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await asyncio.wait_for(stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job_id)).read(), WAIT_S)
                assert_unreadable(refused.value, job_id)
                again = stub.WatchJobs(job_service_pb2.WatchJobsRequest(job_ids=[job_id]))
                answer = await asyncio.wait_for(again.read(), WAIT_S)
                assert isinstance(answer, job_service_pb2.WatchJobsResponse)
                assert [(c.job_id, c.error.reason) for c in answer.changes] == [(job_id, "JOB_UNREADABLE")]
                assert await again.read() == grpc.aio.EOF

            await stack.start_batcher()  # the other job runs: both watches go on with it
            heard: list[tuple[str, int]] = []
            async with asyncio.timeout(WAIT_S):
                while (other, job_pb2.JOB_STATE_SUCCEEDED) not in heard:
                    response = await by_ids.read()
                    assert isinstance(response, job_service_pb2.WatchJobsResponse), response
                    assert not [c for c in response.changes if c.HasField("error")]
                    heard += [(c.job_id, c.job.state) for c in response.changes]
                assert await by_ids.read() == grpc.aio.EOF  # every job it watched has ended or is told
                labelled: list[tuple[str, int]] = []
                while (other, job_pb2.JOB_STATE_SUCCEEDED) not in labelled:
                    response = await by_labels.read()
                    assert isinstance(response, job_service_pb2.WatchJobsResponse), response
                    labelled += [(c.job_id, c.job.state) for c in response.changes]
            by_labels.cancel()
            assert {c for c in labelled if c[0] != other} == {
                (alone, job_pb2.JOB_STATE_QUEUED),
                (among, job_pb2.JOB_STATE_QUEUED),
            }
        assert said(logs, "watch_feed") == sorted(job_key("default", i) for i in values)
    assert stack.gateway.supervisor.failure is None


class SayCalls:
    """The keys of every UnreadableOnce.say call (the ones it says and the ones it does not)."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.called = asyncio.Event()

    async def at_least(self, times: int, keys: list[str]) -> None:
        while not all(self.keys.count(key) >= times for key in keys):
            self.called.clear()
            await self.called.wait()


@pytest.fixture
def said_each_time(monkeypatch: pytest.MonkeyPatch) -> SayCalls:
    calls = SayCalls()
    say = UnreadableOnce.say

    def counted(self: UnreadableOnce, exc: UnreadableJob) -> None:
        calls.keys.append(exc.key)
        calls.called.set()
        say(self, exc)

    monkeypatch.setattr(UnreadableOnce, "say", counted)
    return calls


async def test_the_scheduler_leaves_a_queued_job_whose_record_it_cannot_read(
    idle_stack: Stack, monkeypatch: pytest.MonkeyPatch, said_each_time: SayCalls
) -> None:
    """Queued jobs whose records are rewritten with values this release cannot decode: each
    dispatch of them raised, logged a traceback (a bug's) and put them back after a second, for
    as long as the values stayed. Now the dispatch neither runs them nor drops their messages (a
    scheduler of the later release runs them): it puts them back after UNREADABLE_RETRY_DELAY_S,
    one warning per key however many times they come back, and the jobs beside them run."""
    monkeypatch.setattr(job_dispatch, "UNREADABLE_RETRY_DELAY_S", 0.05)  # many passes, quickly
    jobs = await open_kv_bucket(idle_stack.nc.jetstream(), idle_stack.config.nats.jobs_bucket)
    async with AsyncClient(idle_stack.address) as client:
        stuck = [await client.submit("demo", {"x": X + i}) for i in range(2)]
        values = [later_release(stuck[0].job_id), b"\xff not a job record"]
        keys = [job_key("default", job.job_id) for job in stuck]
        for key, value in zip(keys, values, strict=True):
            await jobs.kv.put(key, value)
        with capture_logs() as logs:
            await idle_stack.start_batcher()
            await asyncio.wait_for(said_each_time.at_least(3, keys), WAIT_S)  # three passes each
            ran = await client.wait(await client.submit("demo", {"x": X}), timeout_s=WAIT_S)
        assert ran.state is JobState.SUCCEEDED
        assert said(logs, "dispatch") == sorted(keys)
        assert not [e for e in logs if e["event"] == "dispatch_failed"], "no traceback a pass"
        for key, value in zip(keys, values, strict=True):  # neither run nor written over
            assert (await jobs.kv.get(key)).value == value
    assert idle_stack.scheduler.supervisor.failure is None
    assert idle_stack.gateway.supervisor.failure is None


async def test_the_deadline_sweep_leaves_a_queued_job_whose_record_it_cannot_read(
    config: Config, start_stack: StartStack, said_each_time: SayCalls
) -> None:
    """Overdue jobs in a paused queue, two of them with records this release cannot decode: the
    ValueError ended the sweep's pass with a traceback (deadline_sweep_failed), the models after it
    unswept that pass. Now each is said once and left (its message and value as they were), and
    the job beside them expires."""
    stack, channel = await paused_stack(config, start_stack)
    try:
        with capture_logs() as logs:
            ids = [(await stack.jobs.SubmitJob(demo_request(url="", queue_ttl_s=0.3))).job.job_id for _ in range(3)]
            jobs = await open_kv_bucket(stack.nc.jetstream(), stack.config.nats.jobs_bucket)
            keys = [job_key("default", job_id) for job_id in ids[:2]]
            values = [later_release(ids[0]), b"\xff not a job record"]
            for key, value in zip(keys, values, strict=True):
                await jobs.kv.put(key, value)
            await asyncio.wait_for(said_each_time.at_least(1, keys), WAIT_S)
            watcher = await jobs.kv.watch(job_key("default", ids[2]))  # its key alone: the others do not decode
            try:
                async with asyncio.timeout(WAIT_S):
                    async for entry in watcher:
                        if entry is not None and entry.value and decode_record(entry.value).state.name == "EXPIRED":
                            break
            finally:
                await watcher.stop()  # type: ignore[no-untyped-call]
        assert said(logs, "deadline_sweep") == sorted(keys)
        assert not [e for e in logs if e["event"] == "deadline_sweep_failed"]
        for key, value in zip(keys, values, strict=True):
            assert (await jobs.kv.get(key)).value == value
        assert stack.scheduler.supervisor.failure is None
    finally:
        await channel.close()


async def test_the_lease_reclaim_leaves_a_held_job_whose_record_it_cannot_read(
    config: Config, start_stack: StartStack, said_each_time: SayCalls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler that died holding three jobs of a paused queue (pulled, their deliveries unacked),
    two of whose records are then values this release cannot decode, the third RUNNING naming that
    scheduler and its delivery. The lease sweep, both of its passes: the real job's delivery is
    returned (nakked: it comes back), each unreadable record is said once (where=lease_reclaim) and
    left as it was (its value, its delivery held), and the sweep ends its passes without a failure."""
    stack, channel = await paused_stack(config, start_stack)
    # This sweep's second pass a second after its first (the scheduler's own sweep, begun at its
    # start before these jobs existed, waits out the real TTL: after the test).
    monkeypatch.setattr(lease_reclaim, "HEARTBEAT_TTL_S", 0.0)
    try:
        ids = [(await stack.jobs.SubmitJob(demo_request(url="", queue_ttl_s=None))).job.job_id for _ in range(3)]
        js = stack.nc.jetstream()
        work_stream = stack.config.nats.work_stream
        dead = await js.pull_subscribe_bind(work_consumer_name("demo", Priority.NORMAL), stream=work_stream)
        pulled = {decode_envelope(m.data).job_id: m for m in await dead.fetch(3, timeout=WAIT_S)}
        assert sorted(pulled) == sorted(ids)
        jobs = await open_kv_bucket(js, stack.config.nats.jobs_bucket)
        held, *unreadable = ids
        queued = decode_envelope(pulled[held].data).queued_record()
        running = queued.evolve(
            state=JobState.RUNNING, attempt=1, dispatched_by="gone-host:1/gone-run", lease_subject=pulled[held].reply
        )
        await jobs.kv.put(job_key("default", held), encode_record(running))
        keys = [job_key("default", job_id) for job_id in unreadable]
        values = [later_release(unreadable[0]), b"\xff not a job record"]
        for key, value in zip(keys, values, strict=True):
            await jobs.kv.put(key, value)

        queues = await open_kv_bucket(js, stack.config.nats.queues_bucket)
        instance = SchedulerInstance("sweeping-host:1", new_run(), queues)
        store = JobStore(jobs, work_stream=work_stream)
        with capture_logs() as logs:
            await asyncio.wait_for(LeaseReclaimer(stack.nc, js, store, stack.config, instance).run(), WAIT_S)
        assert {e["job_id"] for e in logs if e["event"] == "lease_returned"} == {held}
        assert all(said_each_time.keys.count(key) >= 2 for key in keys)  # met on both passes
        assert said(logs, "lease_reclaim") == sorted(keys)  # said once each
        assert not [e for e in logs if e["event"] == "lease_reclaim_failed"]
        [back] = await dead.fetch(3, timeout=WAIT_S)  # the real job's delivery, returned
        assert (decode_envelope(back.data).job_id, back.metadata.num_delivered) == (held, 2)
        for key, value in zip(keys, values, strict=True):
            assert (await jobs.kv.get(key)).value == value
        info = await js.consumer_info(work_stream, work_consumer_name("demo", Priority.NORMAL))
        assert info.num_ack_pending == 3  # the unreadable two still held as they were, the real one again
        assert stack.scheduler.supervisor.failure is None
    finally:
        await channel.close()
