"""ListJobs and ListBatches leave out a record this release cannot decode (a later release's, during a
rolling upgrade, or a corrupted value) and now say how many they left out: the response's
unreadable_skipped, the SDK's listing and page, the CLI's one line on stderr, the gateway's throttled
log line. Through the real stack (gateway, scheduler, batcher on a real nats-server), the values
written into the real buckets beside real jobs and batches."""

from __future__ import annotations

import asyncio
import sys

from structlog.testing import capture_logs

from asyncinfer.client import AsyncClient, Client
from asyncinfer.jobs import job_key
from asyncinfer.nats.kv import open_kv_bucket
from asyncinfer.v1 import batch_service_pb2, job_service_pb2
from services.gateway.batch_store import batch_key
from tests.batch_helpers import batches_stub, create_request, demo_records, jsonl, upload
from tests.stack import Stack
from tests.test_unreadable_jobs import WAIT_S, X, unreadable_values

CLI_S = 90.0


async def cli(*argv: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "asyncinfer",
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), CLI_S)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def skipped_lines(logs: list[dict[str, object]]) -> list[tuple[object, ...]]:
    return [
        (e["log_level"], e["listing"], e["tenant"], e["unreadable_skipped"])
        for e in logs
        if e["event"] == "list_unreadable_skipped"
    ]


def listed_with_the_blocking_client(address: str) -> tuple[list[str], int]:
    with Client(address) as client, client.list(page_size=1) as listing:
        return [job.job_id for job in listing], listing.unreadable_skipped


async def test_a_job_listing_says_how_many_unreadable_records_it_left_out(stack: Stack) -> None:
    """ListJobs left such a record out and only the gateway's log said so: a caller could not tell
    a listing short of jobs from a whole one. Now each page counts those it read past (summed over
    pages, each counted once), the SDK's listing adds them up, `asyncinfer list` warns on stderr,
    and the gateway logs a line per page, throttled."""
    async with AsyncClient(stack.address) as client:
        older = await client.wait(await client.submit("demo", {"x": X}), timeout_s=WAIT_S)
        newer = await client.wait(await client.submit("demo", {"x": X + 1}), timeout_s=WAIT_S)
        jobs = await open_kv_bucket(stack.nc.jetstream(), stack.config.nats.jobs_bucket)
        for job_id, value in unreadable_values().items():  # newer IDs: read first
            await jobs.kv.put(job_key("default", job_id), value)

        with capture_logs() as logs:
            whole = await stack.jobs.ListJobs(job_service_pb2.ListJobsRequest(page_size=10))
        assert [job.job_id for job in whole.jobs] == [newer.job_id, older.job_id]
        assert (whole.unreadable_skipped, whole.next_page_token) == (2, "")
        assert skipped_lines(logs)[0] == ("warning", "ListJobs", "default", 2)

        counted, token, listed = 0, "", []
        while True:  # one job a page: the two unreadable ones are read on the first page alone
            page = await stack.jobs.ListJobs(job_service_pb2.ListJobsRequest(page_size=1, page_token=token))
            listed += [job.job_id for job in page.jobs]
            counted += page.unreadable_skipped
            token = page.next_page_token
            if not token:
                break
        assert (listed, counted) == ([newer.job_id, older.job_id], 2)

        listing = client.list(page_size=1)
        assert [job.job_id async for job in listing] == [newer.job_id, older.job_id]
        assert listing.unreadable_skipped == 2
    assert await asyncio.to_thread(listed_with_the_blocking_client, stack.address) == (
        [newer.job_id, older.job_id],
        2,
    )

    code, out, err = await cli("list", "--gateway", stack.address, "--timeout", "20")
    assert code == 0, err
    assert [newer.job_id in out, older.job_id in out] == [True, True], out
    assert err.splitlines() == [
        "asyncinfer: warning: the gateway left out 2 job(s) it cannot read (a newer release's record, or a "
        "corrupted one): its log names each (job_unreadable)"
    ], err
    assert stack.gateway.supervisor.failure is None


async def test_a_batch_listing_says_how_many_unreadable_records_it_left_out(stack: Stack) -> None:
    """ListBatches, likewise: the page's unreadable_skipped, the SDK's BatchPage, `asyncinfer batch
    list`'s warning on stderr, and the gateway's throttled line."""
    stub = batches_stub(stack.channel)
    created = await stub.CreateBatch(create_request(await upload(stack.jobs, jsonl(demo_records(3)))))
    batches = await open_kv_bucket(stack.nc.jetstream(), stack.config.nats.batches_bucket)
    for batch_id, value in unreadable_values().items():  # newer IDs: read first
        await batches.kv.put(batch_key("default", batch_id), value)

    with capture_logs() as logs:
        listed = await stub.ListBatches(batch_service_pb2.ListBatchesRequest(page_size=10))
    assert [b.batch_id for b in listed.batches] == [created.batch.batch_id]
    assert listed.unreadable_skipped == 2
    assert skipped_lines(logs)[0] == ("warning", "ListBatches", "default", 2)

    async with AsyncClient(stack.address) as client:
        page = await client.list_batches_page(page_size=10)
        assert ([b.batch_id for b in page.batches], page.next_page_token) == ([created.batch.batch_id], "")
        assert page.unreadable_skipped == 2
        again, token = await client.list_batches(page_size=10)  # the tuple it was: the batches and the token
        assert ([b.batch_id for b in again], token) == ([created.batch.batch_id], "")

    code, out, err = await cli("batch", "list", "--gateway", stack.address, "--timeout", "20")
    assert code == 0, err
    assert created.batch.batch_id in out
    assert err.splitlines() == [
        "asyncinfer: warning: the gateway left out 2 batch(es) it cannot read (a newer release's record, or a "
        "corrupted one): its log names each (batch_unreadable)"
    ], err
    assert stack.gateway.supervisor.failure is None
