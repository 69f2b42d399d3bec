"""ListJobs against a real nats-server and a real gateway (no scheduler): the caller's jobs newest
first, every job once across pages, filters by state, model and labels, opaque page tokens bound
to their filters, and never another tenant's records."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
import pytest

from asyncinfer.codecs.record import encode_record
from asyncinfer.config import Config
from asyncinfer.contract import job_work_subject, kv_stream
from asyncinfer.ids import new_job_id
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import BATCH_LABEL, CHUNK_LABEL, JobRecord, JobState, Priority
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.kv import open_kv_bucket
from asyncinfer.nats.streams import ensure_kv_bucket
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import job_pb2, job_service_pb2
from services.gateway.job_service import JobService
from services.gateway.list_jobs import (
    DEFAULT_PAGE_SIZE,
    MAX_RECORDS_READ_PER_PAGE,
    READ_CHUNK,
    JobLister,
    ListPage,
    ListQuery,
    newest_first,
    read_size,
)
from services.gateway.tenant_keys import (
    INSERT_AT_MOST,
    SCAN_BATCH,
    SCAN_CONSUMER_INACTIVE_S,
    apply_changes,
    tenant_filter_subject,
)
from services.gateway.transitions import Expiry
from tests.nats_probes import RequestsSeen
from tests.test_gateway import submit_request, violations_of
from tests.test_gateway_auth import ACME_KEY, GLOBEX_KEY, bearer, serve, with_keys

if TYPE_CHECKING:
    from asyncinfer.v1.job_service_pb2_grpc import JobServiceAsyncStub as JobStub


# nats-server's JSMaxSubjectDetails: the most subjects one stream info answer lists.
SERVER_SUBJECTS_PER_ANSWER = 100_000


def two_models(config: Config) -> Config:
    demo = config.models[0]
    return config.replace(models=[demo, demo.model_copy(update={"name": "other"})])


@pytest.fixture
async def stub(config: Config) -> AsyncIterator[JobStub]:
    async for stub in serve(two_models(config)):
        yield stub


async def submit_many(stub: JobStub, requests: list[job_service_pb2.SubmitJobRequest], **kwargs: Any) -> list[str]:
    """Job IDs, through one SubmitJobs stream."""

    async def send() -> AsyncIterator[job_service_pb2.SubmitJobsRequest]:
        for request in requests:
            yield job_service_pb2.SubmitJobsRequest(job=request)

    ids = []
    async for answer in stub.SubmitJobs(send(), **kwargs):
        assert answer.HasField("job"), answer.error
        ids.append(answer.job.job_id)
    return ids


async def list_all(stub: JobStub, request: job_service_pb2.ListJobsRequest, **kwargs: Any) -> list[list[str]]:
    """Every page's job IDs, following the tokens to the end."""
    pages: list[list[str]] = []
    while True:
        page = await stub.ListJobs(request, **kwargs)
        pages.append([job.job_id for job in page.jobs])
        if not page.next_page_token:
            return pages
        assert len(pages) < 100, "the tokens never end"
        following = job_service_pb2.ListJobsRequest()
        following.CopyFrom(request)
        following.page_token = page.next_page_token
        request = following


def listing(page_size: int = 0, **fields: Any) -> job_service_pb2.ListJobsRequest:
    return job_service_pb2.ListJobsRequest(page_size=page_size, **fields)


async def test_jobs_come_newest_first_and_pages_cover_every_job_once(stub: JobStub) -> None:
    ids = await submit_many(stub, [submit_request() for _ in range(23)])
    pages = await list_all(stub, listing(5))
    assert [len(page) for page in pages] == [5, 5, 5, 5, 3]
    listed = [job_id for page in pages for job_id in page]
    assert listed == sorted(ids, reverse=True)  # UUIDv7: newest first
    first = await stub.ListJobs(listing(5))
    times = [job.create_time.ToNanoseconds() for job in first.jobs]
    assert times == sorted(times, reverse=True)
    assert all(job.state == job_pb2.JOB_STATE_QUEUED for job in first.jobs)


async def test_page_size_defaults_and_is_bounded(stub: JobStub) -> None:
    ids = await submit_many(stub, [submit_request() for _ in range(DEFAULT_PAGE_SIZE + 3)])
    default = await stub.ListJobs(listing())
    assert len(default.jobs) == DEFAULT_PAGE_SIZE
    assert default.next_page_token
    everything = await stub.ListJobs(listing(5000))  # clamped to the maximum, which holds them all
    assert [job.job_id for job in everything.jobs] == sorted(ids, reverse=True)
    assert not everything.next_page_token
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ListJobs(listing(-1))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violations_of(info.value)[1][0][0] == "page_size"


async def test_filters_by_state_model_and_labels(stub: JobStub) -> None:
    team_prod = await submit_many(stub, [submit_request(labels={"team": "a", "env": "prod"}) for _ in range(3)])
    team_only = await submit_many(stub, [submit_request(labels={"team": "a"}) for _ in range(2)])
    other = await submit_many(stub, [submit_request(model_name="other") for _ in range(4)])
    for job_id in (team_prod[0], other[1]):
        await stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id))

    async def ids(**fields: Any) -> list[str]:
        return [job_id for page in await list_all(stub, listing(2, **fields)) for job_id in page]

    assert await ids(states=[job_pb2.JOB_STATE_CANCELED]) == sorted([team_prod[0], other[1]], reverse=True)
    queued = await ids(states=[job_pb2.JOB_STATE_QUEUED])
    assert len(queued) == 7
    assert team_prod[0] not in queued
    assert await ids(model_name="other") == sorted(other, reverse=True)
    assert await ids(model_name="other", states=[job_pb2.JOB_STATE_QUEUED]) == sorted(
        set(other) - {other[1]}, reverse=True
    )
    assert await ids(labels={"team": "a"}) == sorted(team_prod + team_only, reverse=True)
    assert await ids(labels={"team": "a", "env": "prod"}) == sorted(team_prod, reverse=True)  # all must match
    assert await ids(labels={"team": "b"}) == []
    assert await ids(model_name="no-such-model") == []


async def test_a_selective_filter_still_pages_through_every_match(stub: JobStub) -> None:
    ids = await submit_many(stub, [submit_request(labels={"parity": str(i % 2)}) for i in range(30)])
    pages = await list_all(stub, listing(4, labels={"parity": "1"}))
    listed = [job_id for page in pages for job_id in page]
    assert listed == sorted(ids[1::2], reverse=True)


async def test_identical_concurrent_listings_share_one_that_starts_after_they_came(
    config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session 30: after a gateway restart every label watch lists its labels' jobs at once, one
    scan of the tenant's records each (bench/system/label_watch_reconnect.py: 200 scans for 4
    labels, watches giving up). Identical calls now share one listing, one that starts after each
    of them came: the calls that come while the first one's listing is under way (and after a job
    was submitted) share the next listing, which has the job; the first does not."""
    callers = 8
    arrived: list[str] = []
    all_arrived = asyncio.Event()
    list_jobs = JobService.ListJobs

    async def counted(
        service: JobService, request: job_service_pb2.ListJobsRequest, context: Any
    ) -> job_service_pb2.ListJobsResponse:
        arrived.append(request.page_token)
        if len(arrived) == callers:
            all_arrived.set()
        return await list_jobs(service, request, context)

    scans: list[str] = []
    first_read, release = asyncio.Event(), asyncio.Event()
    page = JobLister.page

    async def counted_page(lister: JobLister, tenant: str, query: ListQuery) -> ListPage:
        scans.append(tenant)
        listed = await page(lister, tenant, query)
        if len(scans) == 1:  # it has read; it answers once the others came
            first_read.set()
            await release.wait()
        return listed

    monkeypatch.setattr(JobService, "ListJobs", counted)
    monkeypatch.setattr(JobLister, "page", counted_page)
    labels = {"run": "7"}
    async for stub in serve(two_models(config)):
        before = await submit_many(stub, [submit_request(labels=labels) for _ in range(3)])
        await submit_many(stub, [submit_request(labels={"run": "8"})])
        request = listing(50, labels=labels)

        async def list_jobs_call(
            stub: JobStub = stub, request: job_service_pb2.ListJobsRequest = request
        ) -> job_service_pb2.ListJobsResponse:
            return await stub.ListJobs(request)

        first = asyncio.create_task(list_jobs_call())
        await asyncio.wait_for(first_read.wait(), 30)
        late = await submit_many(stub, [submit_request(labels=labels)])
        others = [asyncio.create_task(list_jobs_call()) for _ in range(callers - 1)]
        await asyncio.wait_for(all_arrived.wait(), 30)
        release.set()
        answers = await asyncio.wait_for(asyncio.gather(first, *others), 30)
    assert [job.job_id for job in answers[0].jobs] == sorted(before, reverse=True)
    for answer in answers[1:]:
        assert [job.job_id for job in answer.jobs] == sorted(before + late, reverse=True)
    assert len(scans) == 2, f"{callers} identical calls, two listings (the first, and one for the rest)"


async def test_bad_page_tokens_are_invalid_argument(stub: JobStub) -> None:
    await submit_many(stub, [submit_request() for _ in range(3)])
    page = await stub.ListJobs(listing(1))
    assert page.next_page_token
    bad_tokens = {
        "garbage": listing(1, page_token="not a token!"),
        "other filters": listing(1, page_token=page.next_page_token, model_name="other"),
        "tampered": listing(1, page_token=page.next_page_token[:-4] + "AAAA"),
    }
    for what, request in bad_tokens.items():
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListJobs(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
        assert violations_of(info.value) == ("INVALID_PAGE_TOKEN", [("page_token", info.value.details())]), what
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ListJobs(listing(1, states=[job_pb2.JOB_STATE_UNSPECIFIED, 99]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [field for field, _ in violations_of(info.value)[1]] == ["states", "states"]
    # The same token with the same filters goes on.
    following = await stub.ListJobs(listing(1, page_token=page.next_page_token))
    assert following.jobs[0].job_id < page.jobs[0].job_id


async def store_succeeded(kv: Any, **fields: Any) -> str:
    """A SUCCEEDED record of the default tenant written straight to the bucket; its job ID."""
    now = time.time()
    record = JobRecord(
        job_id=new_job_id(),
        tenant="default",
        model_name="demo",
        model_version="1",
        state=JobState.SUCCEEDED,
        priority=fields.pop("priority", Priority.NORMAL),
        create_time=now,
        update_time=now,
        max_attempts=3,
        result_retention_s=3600.0,
        **fields,
    )
    await kv.create(record.key, encode_record(record))
    return record.job_id


async def test_pages_of_large_results_stay_under_the_message_limit(config: Config, nc: NatsClient) -> None:
    # Inline outputs of 300 kB each (as the scheduler stores results up to its inline limit): with a
    # 700 kB budget two fit a page, whatever page_size asks.
    async for stub in serve(config.replace(gateway={"max_request_bytes": 700_000})):
        kv = await nc.jetstream().key_value(config.nats.jobs_bucket)
        ids = []
        for _ in range(5):
            output = Tensor("y", "UINT8", (1, 300_000), bytes(300_000))
            ids.append(await store_succeeded(kv, outputs=(output,)))
        pages = await list_all(stub, listing(10))
        assert [len(page) for page in pages] == [2, 2, 1]
        assert [job_id for page in pages for job_id in page] == sorted(ids, reverse=True)
        one = await stub.ListJobs(listing(1))
        assert [list(output.shape) for output in one.jobs[0].outputs] == [[1, 300_000]]  # outputs are listed


async def test_a_batchs_chunk_jobs_are_listed_only_when_asked_for_by_its_label(
    stub: JobStub, nc: NatsClient, config: Config
) -> None:
    # Thousands of a large file's chunk jobs would bury the caller's own jobs in `asyncinfer list`
    # and the console; a batch's own tools ask for them by its label.
    mine = await submit_many(stub, [submit_request() for _ in range(3)])
    kv = await nc.jetstream().key_value(config.nats.jobs_bucket)
    chunks = []
    for start in range(0, 5 * 1024, 1024):
        labels = {BATCH_LABEL: "the-batch", CHUNK_LABEL: f"{start}-{start + 1024}"}
        chunks.append(await store_succeeded(kv, priority=Priority.LOW, labels=labels))

    async def ids(**fields: Any) -> list[str]:
        return [job_id for page in await list_all(stub, listing(2, **fields)) for job_id in page]

    assert await ids() == sorted(mine, reverse=True)  # pages of 2 skip the newer chunks
    assert await ids(states=[job_pb2.JOB_STATE_SUCCEEDED]) == []
    assert await ids(labels={BATCH_LABEL: "the-batch"}) == sorted(chunks, reverse=True)
    assert await ids(labels={BATCH_LABEL: "another-batch"}) == []


class ReadRounds(JobStore):
    """Counts the records read and the rounds of reads a page waits for one after another: a read
    that starts while none is in flight opens a round (a page reads a chunk of records at once)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reads = 0
        self.rounds = 0
        self._in_flight = 0

    async def get(self, key: str) -> JobRecord | None:
        self.rounds += self._in_flight == 0
        self.reads += 1
        self._in_flight += 1
        try:
            return await super().get(key)
        finally:
            self._in_flight -= 1


async def test_a_page_reads_past_a_batchs_chunk_jobs_a_chunk_at_a_time(
    stub: JobStub, nc: NatsClient, config: Config
) -> None:
    """A page without filters leaves a batch's chunk jobs out, and it read what it still needed at
    a time: a page of 1 read 1,000 newer chunk jobs in 1,000 round trips, one after another."""
    jobs = await open_kv_bucket(nc.jetstream(), config.nats.jobs_bucket)
    now = time.time()

    def record(tenant: str, labels: dict[str, str]) -> JobRecord:
        return JobRecord(
            job_id=new_job_id(),
            tenant=tenant,
            model_name="demo",
            model_version="1",
            state=JobState.SUCCEEDED,
            priority=Priority.NORMAL,
            create_time=now,
            update_time=now,
            max_attempts=3,
            result_retention_s=3600.0,
            labels=labels,
        )

    plain = [record("batchy", {}) for _ in range(2)] + [record("plain", {}) for _ in range(5)]
    chunk_jobs = [record("batchy", {BATCH_LABEL: "the-batch", CHUNK_LABEL: f"{i}-{i + 1}"}) for i in range(1000)]
    for first in range(0, len(plain + chunk_jobs), 250):  # the chunk jobs after: newer
        await asyncio.gather(*(jobs.kv.create(r.key, encode_record(r)) for r in (plain + chunk_jobs)[first:][:250]))
    store = ReadRounds(jobs, work_stream=config.nats.work_stream)
    lister = JobLister(
        nc,
        store,
        Expiry(store),
        bucket=config.nats.jobs_bucket,
        work_stream=config.nats.work_stream,
        max_page_bytes=1 << 20,
    )
    page = await lister.page("batchy", ListQuery(page_size=1))
    assert [r.job_id for r in page.records] == [plain[1].job_id]
    assert page.next_page_token
    # 1 read, then the 999 other chunk jobs and the plain job READ_CHUNK at a time (the old code: 1,001).
    assert store.rounds == 1 + -(-1000 // READ_CHUNK), store.reads
    # A tenant whose page skips nothing reads no record it does not return, as before.
    for page_size in (1, 3):
        store.reads = store.rounds = 0
        page = await lister.page("plain", ListQuery(page_size=page_size))
        assert [r.job_id for r in page.records] == [r.job_id for r in reversed(plain[2:])][:page_size]
        assert (store.reads, store.rounds) == (page_size, 1)


@pytest.mark.unit
def test_a_page_without_filters_reads_what_it_needs_until_it_skips_one() -> None:
    assert read_size(1, filtered=False, skipped=False) == 1
    assert read_size(7, filtered=False, skipped=False) == 7
    assert read_size(1000, filtered=False, skipped=False) == READ_CHUNK
    for needed in (1, 7, 1000):
        assert read_size(needed, filtered=False, skipped=True) == READ_CHUNK
        assert read_size(needed, filtered=True, skipped=False) == READ_CHUNK


async def test_label_keys_of_the_system_are_refused_on_submit(stub: JobStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SubmitJob(submit_request(labels={BATCH_LABEL: "mine"}))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    field, description = violations_of(info.value)[1][0]
    assert field == "labels['asyncinfer-batch']"
    assert "reserved" in description
    assert await ids_listed(stub) == []  # nothing was queued


async def test_a_label_selector_no_label_can_match_is_refused_by_listjobs_and_watchjobs(stub: JobStub) -> None:
    """A hostile-input pass (session 25): an empty key, a 5,000-byte key or 100 labels were taken;
    WatchJobs then held a watch (of the tenant's) for ever on a selector nothing could match. The
    reserved keys stay allowed in a selector (a batch's chunk jobs are found by theirs)."""
    for labels, field in (
        ({"": "x"}, "labels['']"),
        ({"k" * 5_000: "x"}, "labels['" + "k" * 64 + "']"),
        ({f"k{i}": "v" for i in range(100)}, "labels"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as listed:
            await stub.ListJobs(listing(labels=labels))
        assert listed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert violations_of(listed.value)[1][0][0] == field
        with pytest.raises(grpc.aio.AioRpcError) as watched:
            async for _ in stub.WatchJobs(job_service_pb2.WatchJobsRequest(labels=labels)):
                pass
        assert watched.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert violations_of(watched.value)[1][0][0] == field
    assert (await stub.ListJobs(listing(labels={BATCH_LABEL: "b"}))).jobs == []


async def ids_listed(stub: JobStub) -> list[str]:
    return [job.job_id for job in (await stub.ListJobs(listing())).jobs]


async def test_deleted_records_are_not_listed(stub: JobStub, nc: NatsClient, config: Config) -> None:
    ids = await submit_many(stub, [submit_request() for _ in range(3)])
    kv = await nc.jetstream().key_value(config.nats.jobs_bucket)
    await kv.delete(f"default.{ids[1]}")
    await kv.put("default.not-a-job-id", b"{}")  # a stray key under the tenant is no job either
    listed = [job.job_id for job in (await stub.ListJobs(listing())).jobs]
    assert listed == sorted([ids[0], ids[2]], reverse=True)


async def test_queued_jobs_past_the_servers_100000_subjects_an_answer_are_listed(
    stub: JobStub, nc: NatsClient, config: Config
) -> None:
    """A tenant's queued jobs are found from the work stream's subjects, which nats-server lists at
    most 100,000 an answer, sorted (model, priority, tenant, job ID), the rest behind an offset.
    Here 100,000 older messages of model "aaa" fill the first answer: "demo"'s newer jobs follow."""
    js = nc.jetstream()
    for _ in range(SERVER_SUBJECTS_PER_ANSWER):
        await nc.publish(job_work_subject("aaa", Priority.NORMAL, "default", new_job_id()), b"not a record")
    await nc.flush()
    while (await js.stream_info(config.nats.work_stream)).state.messages < SERVER_SUBJECTS_PER_ANSWER:
        await nc.flush()  # the server stores what it received in order: one more round trip each
    newest = await submit_many(stub, [submit_request() for _ in range(3)])
    page = await stub.ListJobs(listing(3))
    assert [job.job_id for job in page.jobs] == sorted(newest, reverse=True)
    assert page.next_page_token  # the older messages follow (read as no job: not records)


async def test_another_tenants_jobs_are_never_listed_nor_read(config: Config, nc: NatsClient) -> None:
    keyed = with_keys(config)
    async for stub in serve(keyed):
        acme = await submit_many(stub, [submit_request() for _ in range(4)], metadata=bearer(ACME_KEY))
        globex = await submit_many(stub, [submit_request() for _ in range(3)], metadata=bearer(GLOBEX_KEY))
        # A record under acme that would fail to decode if globex's listing ever read it.
        jobs = await open_kv_bucket(nc.jetstream(), config.nats.jobs_bucket)
        await jobs.kv.put(f"acme.{new_job_id()}", b"\xff not a record")
        listed = await list_all(stub, listing(2), metadata=bearer(GLOBEX_KEY))
        assert [job_id for page in listed for job_id in page] == sorted(globex, reverse=True)
        # The scan itself consumes only the tenant's subjects: the server filters, not the client.
        assert tenant_filter_subject(config.nats.jobs_bucket, "globex") == f"$KV.{config.nats.jobs_bucket}.globex.>"
        lister = JobLister(
            nc,
            JobStore(jobs, work_stream=config.nats.work_stream),
            Expiry(JobStore(jobs, work_stream=config.nats.work_stream)),
            bucket=config.nats.jobs_bucket,
            work_stream=config.nats.work_stream,
            max_page_bytes=1 << 20,
        )
        assert await lister.tenant_job_ids("globex") == sorted(globex, reverse=True)
        assert set(await lister.tenant_job_ids("acme")) >= set(acme)
        assert await lister.tenant_job_ids("nobody") == []
        # A token is bound to its tenant too.
        first = await stub.ListJobs(listing(1), metadata=bearer(GLOBEX_KEY))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListJobs(listing(1, page_token=first.next_page_token), metadata=bearer(ACME_KEY))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListJobs(listing())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_the_key_scan_waits_for_every_key_the_server_already_pushed(
    stub: JobStub, config: Config, nc: NatsClient
) -> None:
    # Regression (a CI run listed 100 of 190 jobs): the server can push every key before the scan
    # asks for its consumer's info, which then says nothing is pending; the scan must still wait
    # for the callbacks of what was pushed, not take "nothing pending" for "no keys".
    ids = sorted((new_job_id() for _ in range(3000)), reverse=True)
    js = nc.jetstream()
    for start in range(0, len(ids), 500):
        subjects = [f"$KV.{config.nats.jobs_bucket}.scan.{job_id}" for job_id in ids[start : start + 500]]
        acks = [await js.publish_async(subject, b"{}") for subject in subjects]
        for ack in acks:
            await ack
    assert (await stub.ListJobs(listing())).jobs == []  # the gateway made the bucket; tenant "default" has none
    jobs = await open_kv_bucket(js, config.nats.jobs_bucket)
    lister = JobLister(
        nc,
        JobStore(jobs, work_stream=config.nats.work_stream),
        Expiry(JobStore(jobs, work_stream=config.nats.work_stream)),
        bucket=config.nats.jobs_bucket,
        work_stream=config.nats.work_stream,
        max_page_bytes=1 << 20,
    )
    for _ in range(20):
        assert await lister.tenant_job_ids("scan") == ids


async def test_a_key_scan_pulls_the_keys_a_bounded_batch_at_a_time(
    stub: JobStub, config: Config, nc: NatsClient
) -> None:
    """A measurement pass (20,000 keys in one tenant): the first listing held the gateway's event
    loop 75-112 ms at a time, as the push consumer filled the socket and nats-py parsed all a read
    held before anything else ran. The scan pulls SCAN_BATCH keys at a time, so no more than that
    is ever on its way (and parsed at once), and still reads every key."""
    js = nc.jetstream()
    bucket = config.nats.jobs_bucket
    ids = sorted((new_job_id() for _ in range(3 * SCAN_BATCH + 5)), reverse=True)
    await publish_keys(js, bucket, "scan", ids)
    asked: list[int] = []

    def pull(_subject: str, payload: bytes) -> bool:
        asked.append(json.loads(payload)["batch"])
        return True

    pulls = await RequestsSeen.on(nc, f"$JS.API.CONSUMER.MSG.NEXT.{kv_stream(bucket)}.>", pull)
    lister = lister_of(nc, config, await open_kv_bucket(js, bucket))
    assert await lister.tenant_job_ids("scan") == ids
    await pulls.wait_for(4)
    await nc.flush()
    assert asked == [SCAN_BATCH] * 4


async def test_a_listings_consumer_is_gone_soon_after_the_call(stub: JobStub, nc: NatsClient, config: Config) -> None:
    """Each ListJobs scans the keys through an ephemeral consumer: the gateway deletes it at the
    end of the call, and it is made to be deleted by the server SCAN_CONSUMER_INACTIVE_S after its
    last pull should that delete fail, not the server's default 5 s, so a client paging fast does
    not keep a crowd of them alive. (What the two asked of the server is asserted, not how soon the
    consumers were gone: a loaded machine's to decide.)"""
    await submit_many(stub, [submit_request() for _ in range(3)])
    js = nc.jetstream()
    stream = kv_stream(config.nats.jobs_bucket)
    before = (await js.stream_info(stream)).state.consumer_count
    thresholds_s: list[float] = []

    def created(_subject: str, payload: bytes) -> bool:
        thresholds_s.append(json.loads(payload)["config"].get("inactive_threshold", 0) / 1e9)
        return True

    creates = await RequestsSeen.on(nc, f"$JS.API.CONSUMER.CREATE.{stream}", created)
    deletes = await RequestsSeen.on(nc, f"$JS.API.CONSUMER.DELETE.{stream}.*", lambda _subject, _data: True)
    try:
        for _ in range(4):
            await stub.ListJobs(listing(2))
        await creates.wait_for(1)  # the tenant's first listing scans its keys (the others, fewer)
        assert set(thresholds_s) == {SCAN_CONSUMER_INACTIVE_S}
        await deletes.wait_for(len(thresholds_s))  # each deleted by the gateway, not left to the threshold
    finally:
        await creates.close()
        await deletes.close()
    ended = time.monotonic()
    while (await js.stream_info(stream)).state.consumer_count > before:
        assert time.monotonic() - ended < 30.0, "the listings' consumers outlived the call"  # a hang guard
        await asyncio.sleep(0.1)


def lister_of(nc: NatsClient, config: Config, jobs: Any) -> JobLister:
    records = JobStore(jobs, work_stream=config.nats.work_stream)
    return JobLister(
        nc,
        records,
        Expiry(records),
        bucket=config.nats.jobs_bucket,
        work_stream=config.nats.work_stream,
        max_page_bytes=1 << 20,
    )


async def key_scans(nc: NatsClient, config: Config, tenant: str) -> tuple[RequestsSeen, RequestsSeen]:
    """Counts of the scans of every key of `tenant` (each key's last message), and of the listings
    (at least one request each, whatever the code: the jobs bucket's stream info or a full scan),
    which a test waits for before it counts the scans."""
    stream = kv_stream(config.nats.jobs_bucket)
    filter_subject = tenant_filter_subject(config.nats.jobs_bucket, tenant)

    def full_scan(subject: str, payload: bytes) -> bool:
        if not subject.startswith(f"$JS.API.CONSUMER.CREATE.{stream}"):
            return False
        asked = json.loads(payload)
        consumer = asked.get("config", {})
        return bool(
            filter_subject in (consumer.get("filter_subject"), *consumer.get("filter_subjects", ()))
            and consumer.get("deliver_policy") == "last_per_subject"
        )

    full = await RequestsSeen.on(nc, "$JS.API.CONSUMER.CREATE.>", full_scan)
    listings = await RequestsSeen.on(
        nc,
        "$JS.API.>",
        lambda subject, payload: subject == f"$JS.API.STREAM.INFO.{stream}" or full_scan(subject, payload),
    )
    return full, listings


async def test_listings_after_the_first_read_only_the_keys_written_since(
    stub: JobStub, config: Config, nc: NatsClient
) -> None:
    """A measurement pass: with 20,000 jobs retained in a tenant every ListJobs scanned all their
    keys (0.41-0.54 s a call, the gateway's loop held 40-106 ms at a time), and the console's Jobs
    page asks every few seconds. The gateway keeps a tenant's job IDs: the pages after the first,
    and the refreshes, read only what was written since, and list the same jobs."""
    full, listings = await key_scans(nc, config, "default")
    kv = await nc.jetstream().key_value(config.nats.jobs_bucket)
    stored = [await store_succeeded(kv) for _ in range(12)]
    queued = await submit_many(stub, [submit_request() for _ in range(3)])
    everything = sorted(stored + queued, reverse=True)
    assert [job_id for page in await list_all(stub, listing(5)) for job_id in page] == everything
    assert await ids_listed(stub) == everything  # the console's refresh
    assert await ids_listed(stub) == everything
    more = [await store_succeeded(kv) for _ in range(2)]
    await kv.delete(f"default.{stored[0]}")
    expected = sorted(set(everything) - {stored[0]} | set(more), reverse=True)
    assert [job_id for page in await list_all(stub, listing(4)) for job_id in page] == expected
    await listings.wait_for(3 + 2 + 4)  # every listing's request has been seen, so every scan's too
    assert full.count == 1


async def publish_keys(js: Any, bucket: str, tenant: str, ids: list[str]) -> None:
    for start in range(0, len(ids), 500):
        acks = [await js.publish_async(f"$KV.{bucket}.{tenant}.{job_id}", b"{}") for job_id in ids[start : start + 500]]
        for ack in acks:
            await ack


async def test_the_kept_job_ids_follow_writes_deletes_purges_and_expiries(
    stub: JobStub, config: Config, nc: NatsClient
) -> None:
    """What a listing knows of a tenant's keys is brought up to date from the stream: new keys, our
    deletes and purges, and the marker the server leaves when a record's TTL ends; it lists what a
    full scan would, without scanning again."""
    js = nc.jetstream()
    bucket = config.nats.jobs_bucket
    ids = sorted((new_job_id() for _ in range(600)), reverse=True)
    await publish_keys(js, bucket, "scan", ids)
    full, listings = await key_scans(nc, config, "scan")
    jobs = await open_kv_bucket(js, bucket)
    lister = lister_of(nc, config, jobs)
    for _ in range(3):
        assert await lister.tenant_job_ids("scan") == ids
    kv = jobs.kv
    added = [new_job_id() for _ in range(5)]
    for job_id in added:
        await kv.put(f"scan.{job_id}", b"{}")
    await kv.delete(f"scan.{ids[0]}")
    await kv.purge(f"scan.{ids[1]}")
    await kv.put(f"scan.{ids[2]}", b"{}")  # rewritten: still there
    await kv.put("scan.not-a-job-id", b"{}")
    expiring = new_job_id()
    await kv.create(f"scan.{expiring}", b"{}", msg_ttl=1.0)
    expected = sorted(set(ids) - {ids[0], ids[1]} | set(added), reverse=True)
    assert await lister.tenant_job_ids("scan") == sorted([*expected, expiring], reverse=True)
    # Until the server has removed the expiring record (a fresh lister scans every key).
    fresh_scans = 0
    async with asyncio.timeout(10):
        while expiring in await lister_of(nc, config, jobs).tenant_job_ids("scan"):
            fresh_scans += 1
            await asyncio.sleep(0.1)
    fresh_scans += 1
    assert await lister.tenant_job_ids("scan") == expected
    await listings.wait_for(3 + 1 + fresh_scans + 1)
    assert full.count == 1 + fresh_scans
    # More than are inserted one at a time.
    many = [new_job_id() for _ in range(INSERT_AT_MOST + 10)]
    await publish_keys(js, bucket, "scan", many)
    assert await lister.tenant_job_ids("scan") == sorted(expected + many, reverse=True)
    await listings.wait_for(3 + 1 + fresh_scans + 2)
    assert full.count == 1 + fresh_scans


async def test_a_bucket_made_anew_is_scanned_anew(stub: JobStub, config: Config, nc: NatsClient) -> None:
    js = nc.jetstream()
    bucket = config.nats.jobs_bucket
    before = sorted((new_job_id() for _ in range(50)), reverse=True)
    await publish_keys(js, bucket, "scan", before)
    jobs = await open_kv_bucket(js, bucket)
    lister = lister_of(nc, config, jobs)
    assert await lister.tenant_job_ids("scan") == before
    await js.delete_key_value(bucket)
    await ensure_kv_bucket(
        js, config.nats, bucket=bucket, description="jobs", limit_marker_ttl_s=config.nats.expired_job_marker_ttl_s
    )
    # More writes than before, so its sequences pass the ones the lister knew.
    after = sorted((new_job_id() for _ in range(80)), reverse=True)
    await publish_keys(js, bucket, "scan", after)
    assert await lister.tenant_job_ids("scan") == after


@pytest.mark.unit
def test_changes_applied_to_the_kept_ids_are_what_a_set_would_hold() -> None:
    rng = random.Random(7)
    ids = sorted(new_job_id() for _ in range(400))
    for size in (0, 1, 10, INSERT_AT_MOST, INSERT_AT_MOST + 1, 1000):
        kept = list(ids)
        candidates = ids + [new_job_id() for _ in range(size)]
        changes = {job_id: rng.random() < 0.6 for job_id in rng.sample(candidates, min(size, len(candidates)))}
        expected = set(ids)
        for job_id, live in changes.items():
            (expected.add if live else expected.discard)(job_id)
        apply_changes(kept, changes)
        assert kept == sorted(expected), size


@pytest.mark.unit
def test_the_ids_a_page_reads_are_the_head_of_the_whole_list() -> None:
    rng = random.Random(11)
    recorded = sorted(new_job_id() for _ in range(300))
    queued = set(rng.sample(recorded, 20)) | {new_job_id() for _ in range(30)}
    whole = sorted(set(recorded) | queued, reverse=True)
    for after in (None, whole[0], whole[7], whole[150], whole[-1], "0", "z"):
        older = [job_id for job_id in whole if after is None or job_id < after]
        for most in (1, 5, 64, 400, MAX_RECORDS_READ_PER_PAGE):
            assert newest_first(recorded, queued, after, most) == older[:most], (after, most)
