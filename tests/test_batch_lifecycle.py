"""A batch's lifecycle beyond a plain run (issue 15), against the real stack: cancelling keeps what
finished, a batch past its completion window ends EXPIRED with what was done delivered, a repeated
create with the same idempotency key returns the first batch, and ListBatches pages newest first."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from nats.errors import NoRespondersError
from nats.js.errors import NoStreamResponseError
from structlog.testing import capture_logs

from asyncinfer import batches
from asyncinfer.access import bearer_metadata
from asyncinfer.api_keys import hash_key
from asyncinfer.batches import BatchRecord, BatchState, decode_batch, encode_batch
from asyncinfer.client import AsyncClient, JobState
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.errors import Unavailable
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.ids import new_job_id
from asyncinfer.jobs import Priority
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.kv import KvBucket, kv_latest
from asyncinfer.nats.streams import stream_subjects
from asyncinfer.v1 import batch_service_pb2, job_service_pb2
from services.batcher.models import demo
from services.gateway import batch_service, batch_store, list_batches
from services.gateway.app import GatewayApp
from services.gateway.batch_convert import batch_from_request
from services.gateway.batch_prepare import Preparer
from services.gateway.batch_store import BatchStore, batch_key, ensure_batches_bucket
from tests.batch_helpers import (
    HeldCreate,
    batches_stub,
    create_request,
    demo_records,
    errors,
    jsonl,
    minted_at,
    outputs,
    upload,
    wait_ended,
    wait_until,
)
from tests.stack import StartStack
from tests.test_gateway import wait_for
from tests.test_scheduler import until

SERVER_SUBJECTS_PER_ANSWER = 100_000
# No warm-up: its made-up batch would wait on the closed gate (GATE_TIMEOUT_S) before the model serves.
GATED = {
    **DEMO_MODEL.model_dump(),
    "name": "gated",
    "loader": "services.batcher.models.demo:build_gated_model",
    "warm_up": False,
}


def lifecycle_config(config: Config, **batches: Any) -> Config:
    return config.replace(
        batches={"chunk_records": 50, "chunks_in_flight": 2, "drive_interval_s": 0.05, **batches},
        models=[DEMO_MODEL.model_dump(), GATED],
    )


@pytest.fixture
def gate() -> Iterator[None]:
    """The gated model computes only while the gate is open: closed here, opened at the end."""
    demo.GATE.clear()
    demo.GATE_ENTERED.clear()
    try:
        yield
    finally:
        demo.GATE.set()


def assert_every_record_once(batch: batch_service_pb2.Batch, out: list[Any], bad: list[Any], total: int) -> None:
    """Each record once, in the output or the error file; `failed` counts only the records that
    ran and failed (none here), as OpenAI's Batch API does: those a cancel or the window's end
    skipped are the rest of the total, in the error file."""
    counts = batch.request_counts
    assert counts.total == total
    assert counts.failed == 0
    assert len(out) == counts.completed
    assert len(bad) == total - counts.completed
    ids = [line["custom_id"] for line in out] + [line["custom_id"] for line in bad]
    assert sorted(ids) == sorted(f"r{i}" for i in range(total))


async def test_cancelling_a_batch_stops_its_chunks_and_keeps_what_finished(
    config: Config, start_stack: StartStack, gate: None
) -> None:
    stack = await start_stack(lifecycle_config(config))
    stub = batches_stub(stack.channel)
    created = await stub.CreateBatch(
        create_request(await upload(stack.jobs, jsonl(demo_records(400))), model_name="gated")
    )
    batch_id = created.batch.batch_id

    await wait_until(stub, batch_id, lambda batch: batch.state == batch_service_pb2.BATCH_STATE_IN_PROGRESS)
    # A chunk computes (held at the gate): the batch cannot end before it does. IN_PROGRESS alone
    # did not say so: on a loaded machine every chunk could still be queued, and the cancel ended
    # the batch at once, its files whole.
    await wait_for(demo.GATE_ENTERED.is_set, timeout_s=30)
    cancelled = await stub.CancelBatch(batch_service_pb2.CancelBatchRequest(batch_id=batch_id))
    assert cancelled.batch.state == batch_service_pb2.BATCH_STATE_CANCELLING
    # Its files are whole only once it ends: a download now is refused (it gave part of them).
    with pytest.raises(grpc.aio.AioRpcError) as running:
        await outputs(stub, batch_id)
    assert running.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "BATCH_NOT_ENDED" in str(running.value.trailing_metadata())
    demo.GATE.set()  # the chunk computing finishes; the one queued behind it is cancelled
    batch = await wait_ended(stub, batch_id)
    assert batch.state == batch_service_pb2.BATCH_STATE_CANCELLED
    out, bad = await outputs(stub, batch_id), await errors(stub, batch_id)
    assert_every_record_once(batch, out, bad, 400)
    assert len(bad) >= 300  # at most 2 chunks of 50 were let in before the cancel
    assert {line["code"] for line in bad} == {"CANCELLED"}
    assert [(e.line, e.custom_id, e.code) for e in batch.first_errors] == [
        (line["line"], line["custom_id"], "CANCELLED") for line in bad[:10]
    ], "the first errors are the error file's first lines"


async def test_a_batch_past_its_completion_window_ends_expired_with_what_was_done(
    config: Config, start_stack: StartStack, gate: None
) -> None:
    stack = await start_stack(lifecycle_config(config))
    stub = batches_stub(stack.channel)
    created = await stub.CreateBatch(
        create_request(await upload(stack.jobs, jsonl(demo_records(300))), model_name="gated", completion_window_s=1.5)
    )
    batch_id = created.batch.batch_id
    expires_at = created.batch.expires_at.ToNanoseconds() / 1e9
    await asyncio.sleep(max(expires_at - time.time(), 0.0) + 0.2)  # the window is wall-clock time
    demo.GATE.set()
    batch = await wait_ended(stub, batch_id)
    assert batch.state == batch_service_pb2.BATCH_STATE_EXPIRED
    out, bad = await outputs(stub, batch_id), await errors(stub, batch_id)
    assert_every_record_once(batch, out, bad, 300)
    assert len(bad) >= 200
    assert {line["code"] for line in bad} == {"DEADLINE_EXCEEDED"}
    assert [e.custom_id for e in batch.first_errors] == [line["custom_id"] for line in bad[:10]]


async def test_a_repeated_create_with_the_same_key_returns_the_first_batch(
    config: Config, start_stack: StartStack
) -> None:
    stack = await start_stack(lifecycle_config(config))
    stub = batches_stub(stack.channel)
    ref = await upload(stack.jobs, jsonl(demo_records(10)))
    first, second = await asyncio.gather(
        stub.CreateBatch(create_request(ref, idempotency_key="nightly-1")),
        stub.CreateBatch(create_request(ref, idempotency_key="nightly-1")),
    )
    assert first.batch.batch_id == second.batch.batch_id
    assert sorted([first.deduplicated, second.deduplicated]) == [False, True]
    # A retry that uploaded the same file again (another ref, the same bytes): the same batch.
    again = await stub.CreateBatch(
        create_request(await upload(stack.jobs, jsonl(demo_records(10))), idempotency_key="nightly-1")
    )
    assert (again.batch.batch_id, again.deduplicated) == (first.batch.batch_id, True)
    # The same key for another file, or other labels: refused, not quietly the first batch.
    another_file = await upload(stack.jobs, jsonl(demo_records(3)))
    for unlike, request in [
        ("input_ref", create_request(another_file, idempotency_key="nightly-1")),
        ("labels", create_request(ref, idempotency_key="nightly-1", labels={"run": "other"})),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CreateBatch(request)
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert refused.value.details() == (
            f"idempotency key 'nightly-1' was first used for batch {first.batch.batch_id}, with a different "
            "request: a key can be sent again only with its first request (a retry, answered with that batch). "
            f"Get that batch with GetBatch, or use a new key for a different batch (differing: {unlike})"
        )
        status = status_details(refused.value)
        assert status is not None
        info = unpack_details(status)["ErrorInfo"]
        assert (info.reason, info.metadata["batch_id"], info.metadata["fields"]) == (
            "IDEMPOTENCY_KEY_REUSED",
            first.batch.batch_id,
            unlike,
        )
    other = await stub.CreateBatch(create_request(ref, idempotency_key="nightly-2"))
    assert other.batch.batch_id != first.batch.batch_id
    assert (await wait_ended(stub, first.batch.batch_id)).request_counts.completed == 10
    listed = await stub.ListBatches(batch_service_pb2.ListBatchesRequest(page_size=1))
    assert [b.batch_id for b in listed.batches] == [other.batch.batch_id]
    rest = await stub.ListBatches(batch_service_pb2.ListBatchesRequest(page_token=listed.next_page_token))
    assert [b.batch_id for b in rest.batches] == [first.batch.batch_id]
    assert rest.next_page_token == ""
    with pytest.raises(grpc.aio.AioRpcError) as info:  # it listed the first page again
        await stub.ListBatches(batch_service_pb2.ListBatchesRequest(page_token="garbage"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The ended record and its key's claim are kept as long as the batch's files, then removed by
    # the server (per-message TTLs), so the bucket does not grow with every batch ever run.
    ended = await stub.GetBatch(batch_service_pb2.GetBatchRequest(batch_id=first.batch.batch_id))
    kept_for = ended.batch.expires_at.ToSeconds() + config.gateway.default_result_retention_s - time.time()
    bucket = f"KV_{config.nats.batches_bucket}"
    record = await stack.nc.jetstream().get_last_msg(
        bucket, f"$KV.{config.nats.batches_bucket}.default.{first.batch.batch_id}"
    )
    assert record.headers is not None
    assert abs(int(record.headers["Nats-TTL"]) - kept_for) < 60
    prefix = f"$KV.{config.nats.batches_bucket}.default.key."
    claim_subjects = await stream_subjects(stack.nc.jetstream(), bucket, prefix + "*")
    claims = [await stack.nc.jetstream().get_last_msg(bucket, subject) for subject in claim_subjects]
    claims = [m for m in claims if m.data == first.batch.batch_id.encode()]
    assert len(claims) == 1
    assert claims[0].headers is not None
    assert abs(int(claims[0].headers["Nats-TTL"]) - kept_for) < 60


@pytest.mark.timeout(300)
async def test_batches_past_the_servers_100000_subjects_an_answer_are_listed(
    config: Config, start_stack: StartStack
) -> None:
    """ListBatches takes a tenant's batch IDs from the batches bucket's subjects, which nats-server
    lists at most 100,000 an answer (sorted: the oldest IDs first), the rest behind an offset; it
    read the first answer only, so a tenant's newest batches past 100,000 were never listed. Here
    100,000 older keys (empty: read as no batch) fill the first answer; the two batches follow."""
    # No adoption pass while the test runs: it would read each of the 100,000 keys.
    stack = await start_stack(lifecycle_config(config, adopt_interval_s=3600.0), batcher=False)
    stub = batches_stub(stack.channel)
    bucket = config.nats.batches_bucket
    for _ in range(SERVER_SUBJECTS_PER_ANSWER):
        await stack.nc.publish(f"$KV.{bucket}.default.{new_job_id()}", b"")
    await stack.nc.flush()
    js = stack.nc.jetstream()
    while (await js.stream_info(f"KV_{bucket}")).state.messages < SERVER_SUBJECTS_PER_ANSWER:
        await stack.nc.flush()  # the server stores what it received in order: one more round trip each
    ref = await upload(stack.jobs, jsonl(demo_records(2)))
    created = [(await stub.CreateBatch(create_request(ref))).batch.batch_id for _ in range(2)]
    page = await stub.ListBatches(batch_service_pb2.ListBatchesRequest(page_size=2))
    assert [b.batch_id for b in page.batches] == sorted(created, reverse=True)
    assert page.next_page_token  # the older keys follow (read as no batch)


async def test_a_page_reads_past_many_withdrawals_until_it_holds_a_batch(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ListBatches leaves withdrawals out and read only the newest 2 x page_size IDs below its
    token: past as many withdrawals it answered an empty page with a token, though batches
    followed (a client that stops at an empty page missed them; one that follows the token asked
    again). Now a page reads on until it holds a batch, the listing ends or it read its bound."""
    stack = await start_stack(lifecycle_config(config), batcher=False)
    stub = batches_stub(stack.channel)
    ref = await upload(stack.jobs, jsonl(demo_records(2)))
    created = [(await stub.CreateBatch(create_request(ref))).batch.batch_id for _ in range(2)]
    store = BatchStore(await ensure_batches_bucket(stack.nc.jetstream(), config.nats), stack.nc)
    record = await store.get("default", created[0])
    assert record is not None
    withdrawn = []
    for _ in range(9):  # newer than both batches, as a takeover's would be
        withdrawal = batches.withdrawn_batch(record, batch_id=new_job_id(), now=time.time(), why="a test's")
        assert (await store.create_first(withdrawal))[0] is not None
        withdrawn.append(withdrawal.batch_id)
    for page_size in (1, 2, 4):
        page = await stub.ListBatches(batch_service_pb2.ListBatchesRequest(page_size=page_size))
        assert [b.batch_id for b in page.batches] == sorted(created, reverse=True)[:page_size], page_size
        assert bool(page.next_page_token) == (page_size == 1)
        if page_size == 1:
            following = batch_service_pb2.ListBatchesRequest(page_size=1, page_token=page.next_page_token)
            rest = await stub.ListBatches(following)
            assert ([b.batch_id for b in rest.batches], rest.next_page_token) == ([min(created)], "")
    # The bound: past as many withdrawals (4 here), a page may be empty, its token past what it read.
    monkeypatch.setattr(list_batches, "MAX_BATCHES_READ_PER_PAGE", 4)
    pages = []
    token = ""
    while not pages or token:
        page = await stub.ListBatches(batch_service_pb2.ListBatchesRequest(page_size=1, page_token=token))
        pages.append([b.batch_id for b in page.batches])
        token = page.next_page_token
        assert len(pages) < 20, "the tokens never end"
    assert pages[:3] == [[], [], [max(created)]]
    assert [i for page in pages for i in page] == sorted(created, reverse=True)


async def test_a_key_claimed_by_a_create_that_died_before_its_batch_was_written_is_taken_over(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bound a claim's readers apply (1 s here): past it, by the wall clocks and by the server's,
    # its create can no longer write its batch.
    monkeypatch.setattr(batches, "CREATE_RECORD_WITHIN_S", 1.0)
    monkeypatch.setattr(batches, "CREATE_WRITE_MARGIN_S", 0.0)
    stack = await start_stack(lifecycle_config(config))
    stub = batches_stub(stack.channel)
    store = BatchStore(await ensure_batches_bucket(stack.nc.jetstream(), config.nats), stack.nc)
    ghost = new_job_id()
    # As if its gateway died right here:
    assert await store.claim("default", "nightly-3", ghost, until=time.time() + 3600) == ghost
    created = await stub.CreateBatch(
        create_request(await upload(stack.jobs, jsonl(demo_records(5))), idempotency_key="nightly-3")
    )
    assert not created.deduplicated
    assert created.batch.batch_id != ghost
    claim = await store.holder("default", "nightly-3")  # the key names the new batch
    assert claim is not None
    assert claim[0] == created.batch.batch_id
    assert (await wait_ended(stub, created.batch.batch_id)).request_counts.completed == 5


async def test_a_claim_the_wall_clocks_call_stale_is_kept_while_the_server_stored_it_lately(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim whose batch ID says an hour old (its gateway's clock behind, or ours stepped forward)
    but that the server stored a moment ago is live: a duplicate waits for its batch, and gets it."""
    monkeypatch.setattr(batch_service, "CLAIM_WAIT_STEP_S", 0.001)  # the duplicate looks often
    stack = await start_stack(lifecycle_config(config), batcher=False)
    stub = batches_stub(stack.channel)
    store = BatchStore(await ensure_batches_bucket(stack.nc.jetstream(), config.nats), stack.nc)
    request = create_request(await upload(stack.jobs, jsonl(demo_records(5))), idempotency_key="nightly-5")
    ghost = minted_at(time.time() - 3600)
    first = batch_from_request(request, stack.config, tenant="default", batch_id=ghost, now=time.time())
    assert await store.claim("default", "nightly-5", ghost, until=first.kept_until) == ghost
    held = HeldCreate(monkeypatch)
    held.batch_id.set_result(ghost)  # count the looks for its record
    held.enough = 300  # far more than the 50 after which a duplicate took the claim over

    async def create() -> batch_service_pb2.CreateBatchResponse:
        return await stub.CreateBatch(request)

    duplicate = asyncio.create_task(create())
    looked = asyncio.create_task(held.looked_enough.wait())
    await asyncio.wait([looked, duplicate], return_when=asyncio.FIRST_COMPLETED)
    assert not duplicate.done(), f"the duplicate answered {duplicate.result().batch.batch_id}"
    await store.write(first)  # its create, slow, writes it now
    answer = await duplicate
    assert (answer.batch.batch_id, answer.deduplicated) == (ghost, True)


async def test_a_tenant_sees_only_its_own_batches_and_uploads(config: Config, start_stack: StartStack) -> None:
    keys = [{"tenant": "acme", "sha256": hash_key("acme-key")}, {"tenant": "globex", "sha256": hash_key("globex-key")}]
    secured = lifecycle_config(config).replace(
        gateway={"api_keys": [*keys, {"role": "batcher", "sha256": hash_key("batcher-key")}]},
        batcher={"api_key": "batcher-key"},
    )
    stack = await start_stack(secured)
    stub = batches_stub(stack.channel)
    acme, globex = bearer_metadata("acme-key"), bearer_metadata("globex-key")
    data = jsonl(demo_records(5))

    async def acme_upload() -> AsyncIterator[job_service_pb2.UploadInputRequest]:
        yield job_service_pb2.UploadInputRequest(metadata=job_service_pb2.UploadInputMetadata(), chunk=data)

    ref = (await stack.jobs.UploadInput(acme_upload(), metadata=acme)).ref.ref
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.CreateBatch(create_request(ref), metadata=globex)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    created = await stub.CreateBatch(create_request(ref), metadata=acme)
    batch_id = created.batch.batch_id
    for call in (
        stub.GetBatch(batch_service_pb2.GetBatchRequest(batch_id=batch_id), metadata=globex),
        stub.CancelBatch(batch_service_pb2.CancelBatchRequest(batch_id=batch_id), metadata=globex),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as hidden:
            await call
        assert hidden.value.code() == grpc.StatusCode.NOT_FOUND
    listed = await stub.ListBatches(batch_service_pb2.ListBatchesRequest(), metadata=globex)
    assert list(listed.batches) == []
    with pytest.raises(grpc.aio.AioRpcError) as anonymous:
        await stub.GetBatch(batch_service_pb2.GetBatchRequest(batch_id=batch_id))
    assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
    got = await stub.GetBatch(batch_service_pb2.GetBatchRequest(batch_id=batch_id), metadata=acme)
    assert got.batch.batch_id == batch_id


async def test_plain_jobs_sent_while_a_chunk_overfills_the_batcher_still_run(
    config: Config, start_stack: StartStack, gate: None
) -> None:
    """A helper's operations pass, session 24: a chunk's parts may pass the model's queue limit (one
    credit bought them all), and the batcher then refused the plain orders the scheduler sent on the
    credits it had granted before (BATCHER_QUEUE_FULL): each spent an attempt, and with none left the
    job FAILED and was dead-lettered, though it never ran. A credited order is a promised slot."""
    small_queue = {**GATED, "max_queue_size": 4, "max_batch_size": 8}
    stack = await start_stack(
        config.replace(
            batches={"chunk_records": 50, "chunks_in_flight": 1, "drive_interval_s": 0.05},
            models=[DEMO_MODEL.model_dump(), small_queue],
        )
    )
    assert stack.batcher is not None
    stub = batches_stub(stack.channel)
    created = await stub.CreateBatch(
        create_request(await upload(stack.jobs, jsonl(demo_records(50))), model_name="gated")
    )
    engine = stack.batcher.engine
    await wait_for(lambda: engine.free_slots("gated") == 0, timeout_s=30)  # the chunk's 7 parts: past the limit of 4
    async with AsyncClient(stack.address) as client:
        x = {"x": np.ones((1, 4), np.float32)}
        jobs = [await client.submit("gated", x, max_attempts=1) for _ in range(3)]
        # The credits granted before the chunk came are spent on them.
        await wait_for(lambda: stack.scheduler.batchers.sessions[0].credits.get("gated", 0) == 0, timeout_s=30)
        demo.GATE.set()
        finished = await wait_ended(stub, created.batch.batch_id)
        assert finished.request_counts.completed == 50
        for job in jobs:
            ended = await client.wait(job, timeout_s=30)
            assert ended.state is JobState.SUCCEEDED, ended.error


async def test_a_preparation_that_keeps_failing_is_tried_again_with_backoff(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A helper's batch pass, session 24: a preparation that failed (a full store, a line that broke
    the parser) was started again at once, some 400 times a second, rereading the whole upload."""
    tries: list[float] = []

    async def store_full(self: Preparer, record: Any, model: Any, *, now: float, **_: Any) -> Any:
        tries.append(time.monotonic())
        raise Unavailable("the job store is full")

    monkeypatch.setattr(Preparer, "prepare", store_full)
    stack = await start_stack(lifecycle_config(config))
    stub = batches_stub(stack.channel)
    await stub.CreateBatch(create_request(await upload(stack.jobs, jsonl(demo_records(10)))))
    await asyncio.sleep(2.0)
    assert 2 <= len(tries) <= 4, len(tries)  # at 0, 0.5, 1.5 s (doubling waits)
    assert all(b - a >= 0.45 for a, b in itertools.pairwise(tries))


async def test_duplicates_of_a_create_held_between_its_claim_and_its_record_all_get_its_batch(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A duplicate CreateBatch that found the key claimed by a batch with no record yet looked for it
    50 times (5 s) and then took the claim over at once: a first create slower than that between its
    claim and its record (NATS slow to answer) and the key had two batches. A duplicate now waits
    while the claim is live (younger than a create's bound, by the wall clocks or the server's)."""
    monkeypatch.setattr(batch_service, "CLAIM_WAIT_STEP_S", 0.001)  # the duplicates look often
    stack = await start_stack(lifecycle_config(config), batcher=False)
    stub = batches_stub(stack.channel)
    ref = await upload(stack.jobs, jsonl(demo_records(5)))
    held = HeldCreate(monkeypatch)
    request = create_request(ref, idempotency_key="nightly-4")

    async def create() -> batch_service_pb2.CreateBatchResponse:
        return await stub.CreateBatch(request)

    first = asyncio.create_task(create())
    batch_id = await held.batch_id  # claimed, named on the upload, its record not written
    # Far more looks than the 50 after which a duplicate took the claim over.
    held.enough = 300
    duplicates = [asyncio.create_task(create()) for _ in range(2)]
    looked = asyncio.create_task(held.looked_enough.wait())
    await asyncio.wait([looked, *duplicates], return_when=asyncio.FIRST_COMPLETED)
    assert not [d.result().batch.batch_id for d in duplicates if d.done()], "a duplicate answered while held"
    held.release.set()
    answers = await asyncio.gather(first, *duplicates)
    assert [a.batch.batch_id for a in answers] == [batch_id] * 3
    assert [a.deduplicated for a in answers] == [False, True, True]
    listed = await stub.ListBatches(batch_service_pb2.ListBatchesRequest())
    assert [b.batch_id for b in listed.batches] == [batch_id]


async def test_a_tick_failing_on_a_raw_nats_error_is_said_in_a_line_once_per_interval(
    config: Config, start_stack: StartStack
) -> None:
    """A raw NATS error fails every batch's tick, each tick (here every 50 ms), and each logged an
    error with its traceback. It is a warning with its error, at most once per 5 s for all batches;
    the batches end once NATS answers again."""
    stack = await start_stack(lifecycle_config(config))
    driver = stack.gateway.batch_driver
    assert driver is not None
    stub = batches_stub(stack.channel)
    real_tick = driver.tick
    failed: dict[str, int] = {}

    async def tick_in_an_outage(tenant: str, batch_id: str, *, full: bool = True) -> bool:
        # The outage lasts until both batches' ticks failed 5 times each.
        if len(failed) < 2 or min(failed.values()) < 5:
            failed[batch_id] = failed.get(batch_id, 0) + 1
            raise NoRespondersError()
        return await real_tick(tenant, batch_id, full=full)

    driver.tick = tick_in_an_outage  # type: ignore[method-assign]
    with capture_logs() as logs:
        created = [
            await stub.CreateBatch(create_request(await upload(stack.jobs, jsonl(demo_records(60))))) for _ in range(2)
        ]
        for batch in created:
            assert (await wait_ended(stub, batch.batch.batch_id)).state == batch_service_pb2.BATCH_STATE_COMPLETED
    assert len(failed) == 2
    lines = [e for e in logs if e["event"] == "batch_tick_failed"]
    assert [(e["log_level"], "exc_info" in e) for e in lines] == [("warning", False)], lines
    assert lines[0]["error"] == "NoRespondersError: nats: no responders available for request"


def past_its_window() -> BatchRecord:
    """A running batch (VALIDATING) past its completion window: the tick of the driver that adopts
    it expires it (no model runs)."""
    now = time.time()
    return BatchRecord(
        batch_id=new_job_id(),
        tenant="default",
        model_name=DEMO_MODEL.name,
        model_version="",
        input_ref="in/x",
        input_format=None,
        state=BatchState.VALIDATING,
        priority=Priority.LOW,
        max_attempts=1,
        create_time=now - 60.0,
        expires_at=now - 1.0,
        result_retention_s=60.0,
    )


async def test_a_gateway_started_while_the_batches_bucket_elects_a_leader_adopts_its_running_batch(
    config: Config, nc: NatsClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway's batch driver reads each running batch's record as it adopts it, at its first
    pass as the gateway starts. A read that failed ended the driver, and the gateway exited with
    it: one started while the batches bucket elected a leader (a node lost), with a batch running,
    died at once. The pass now ends and the next reads the record again. The election is the one
    part played here: the first read answers as a leaderless stream does."""
    store = BatchStore(await ensure_batches_bucket(nc.jetstream(), config.nats), nc)
    running = await store.write(past_its_window())
    key = batch_key(running.tenant, running.batch_id)
    failed: list[str] = []

    async def latest_after_an_election(bucket: KvBucket, read: str) -> tuple[bytes, int] | None:
        if not failed:
            failed.append(read)
            raise NoStreamResponseError
        return await kv_latest(bucket, read)

    monkeypatch.setattr(batch_store, "kv_latest", latest_after_an_election)
    gateway = GatewayApp(lifecycle_config(config, adopt_interval_s=0.1))
    with capture_logs() as logs:
        await gateway.start()
        try:

            async def expired() -> bool:
                latest = await kv_latest(store.bucket, key)  # the test's reads are not played
                return latest is not None and decode_batch(*latest).state is BatchState.EXPIRED

            await until(expired)
            assert gateway.supervisor.failure is None
        finally:
            await gateway.stop(grace_s=1.0)
    assert failed == [key]
    said = [e for e in logs if e["event"] == "batch_adopt_failed"]
    assert [(e["log_level"], e["batch_id"]) for e in said] == [("warning", running.batch_id)], said


async def test_a_batch_record_this_release_cannot_read_costs_that_record_alone(
    config: Config, nc: NatsClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch record the decoder refuses (a state written by a later release during a rolling
    upgrade, or a corrupted value) raised ValueError out of the driver's adoption pass: the driver
    ended, the gateway with it, and a restarted one ended again at its first pass. Now that record
    alone is left, with one warning naming its key however many passes read it; the batch beside it
    is adopted and driven, GetBatch answers INTERNAL BATCH_UNREADABLE (it was UNKNOWN), and
    ListBatches shows the batch beside them, leaving them out (one warning each)."""
    store = BatchStore(await ensure_batches_bucket(nc.jetstream(), config.nats), nc)
    running = await store.write(past_its_window())
    later_release = json.loads(encode_batch(past_its_window())) | {"state": "PAUSED"}
    unreadable = {new_job_id(): json.dumps(later_release).encode(), new_job_id(): b"\x00 not a batch record"}
    for batch_id, value in unreadable.items():
        await store.bucket.kv.put(batch_key("default", batch_id), value)
    listings = 0
    real_pages = BatchStore.key_pages

    def counted_pages(self: BatchStore, tenant: str | None = None) -> AsyncGenerator[list[tuple[str, str]], None]:
        nonlocal listings
        listings += 1  # one per adoption pass
        return real_pages(self, tenant)

    monkeypatch.setattr(BatchStore, "key_pages", counted_pages)
    gateway = GatewayApp(lifecycle_config(config, adopt_interval_s=0.05))
    with capture_logs() as logs:
        await gateway.start()
        try:

            async def expired() -> bool:
                latest = await kv_latest(store.bucket, batch_key(running.tenant, running.batch_id))
                return latest is not None and decode_batch(*latest).state is BatchState.EXPIRED

            await until(expired)
            passes = listings

            async def two_more_passes() -> bool:
                return listings >= passes + 2

            await until(two_more_passes)
            assert gateway.supervisor.failure is None
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
                for batch_id in unreadable:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await batches_stub(channel).GetBatch(batch_service_pb2.GetBatchRequest(batch_id=batch_id))
                    assert refused.value.code() == grpc.StatusCode.INTERNAL
                    status = status_details(refused.value)
                    assert status is not None
                    info = unpack_details(status)["ErrorInfo"]
                    assert (info.reason, info.metadata["batch_id"]) == ("BATCH_UNREADABLE", batch_id)
                # A listing leaves them out and shows the others, page after page (an error for
                # the page stopped the listing there), and the log says each once.
                for _ in range(2):
                    listed = await batches_stub(channel).ListBatches(batch_service_pb2.ListBatchesRequest(page_size=10))
                    assert [b.batch_id for b in listed.batches] == [running.batch_id]
            # One it drives that a later release rewrites: let go, not a failed tick every tick.
            driver = gateway.batch_driver
            assert driver is not None
            rounds = driver.rounds
            driver.drive("default", next(iter(unreadable)))

            async def ticked() -> bool:
                return driver.rounds >= rounds + 2

            await until(ticked)
        finally:
            await gateway.stop(grace_s=1.0)
    said = [e for e in logs if e["event"] == "batch_unreadable"]
    for where in ("batch_driver", "list_batches"):
        assert sorted((e["log_level"], e["key"]) for e in said if e["where"] == where) == sorted(
            ("warning", batch_key("default", b)) for b in unreadable
        ), said
    assert not [e for e in logs if e["event"] == "batch_tick_failed"]
    told = {e["batch_id"]: e["error"] for e in said if e["where"] == "batch_driver"}
    assert "'PAUSED' is not a valid BatchState" in told[next(iter(unreadable))]


async def test_a_batch_record_read_readable_again_is_said_again_when_it_turns_unreadable_again(
    config: Config, nc: NatsClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's adoption pass says an unreadable batch record once however many passes meet it,
    and once more after a pass has read it readable between (a record that a later release wrote,
    was written back, then was written so again): it forgets a key it reads readable."""
    store = BatchStore(await ensure_batches_bucket(nc.jetstream(), config.nats), nc)
    batch_id = new_job_id()
    key = batch_key("default", batch_id)
    garbage = b"\x00 not a batch record"
    ended = past_its_window().evolve(batch_id=batch_id, state=BatchState.EXPIRED)  # read, not driven
    await store.bucket.kv.put(key, garbage)
    listings = 0
    real_pages = BatchStore.key_pages

    def counted_pages(self: BatchStore, tenant: str | None = None) -> AsyncGenerator[list[tuple[str, str]], None]:
        nonlocal listings
        listings += 1  # one per adoption pass
        return real_pages(self, tenant)

    monkeypatch.setattr(BatchStore, "key_pages", counted_pages)

    async def two_more_passes() -> None:
        passes = listings

        async def passed() -> bool:
            return listings >= passes + 2

        await until(passed)

    gateway = GatewayApp(lifecycle_config(config, adopt_interval_s=0.05))
    with capture_logs() as logs:
        await gateway.start()
        try:
            await two_more_passes()
            await store.bucket.kv.put(key, encode_batch(ended))
            await two_more_passes()
            await store.bucket.kv.put(key, garbage)
            await two_more_passes()
            assert gateway.supervisor.failure is None
        finally:
            await gateway.stop(grace_s=1.0)
    said = [e for e in logs if e["event"] == "batch_unreadable" and e["where"] == "batch_driver"]
    assert [(e["key"], e["batch_id"], e["tenant"]) for e in said] == [(key, batch_id, "default")] * 2, said
