"""A batcher that moves claim-checked bytes itself (`batcher.claim_check_io`), against the fake
scheduler of tests/test_batcher_worker.py and a real nats-server: it says so in its hello, reads
an order's input by reference (an upload, or a batch chunk's rows of its NPY upload), stores
outputs over the order's threshold as the object the order names, and answers an input it cannot
read with a clear error. A batcher without the setting refuses such an order. The whole stack's
runs are in tests/test_claim_check.py, tests/test_batches.py and tests/test_batch_crash.py."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import duration_pb2

from asyncinfer import blob_writer, ranged_inputs
from asyncinfer.blob_meta import attempt_result_ref, new_input_ref
from asyncinfer.blob_sweep import list_objects, sweep
from asyncinfer.blobs import BlobStore, ensure_objects_bucket
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.errors import Unavailable
from asyncinfer.nats import Client as NatsClient
from asyncinfer.tensor_codec import decode_tensors, to_input_proto
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import job_pb2, tensor_pb2, worker_service_pb2
from services.batcher.app import BatcherApp
from services.scheduler.blobs import orphan_age_s
from tests.silent_proxy import SilentProxy
from tests.test_batcher_results import HUGE
from tests.test_batcher_worker import FakeScheduler, batcher_under_test, order, serving

TENANT = "acme"


def batcher_config(config: Config, port: int, *, claim_check_io: bool) -> Config:
    return config.replace(
        batcher={**batcher_under_test(port), "claim_check_io": claim_check_io},
        models=[DEMO_MODEL],
    )


@pytest.fixture
async def scheduler() -> AsyncIterator[tuple[FakeScheduler, int]]:
    """test_batcher_worker's fake scheduler (its welcome takes one order per message)."""
    async with serving(FakeScheduler()) as served:
        yield served


@pytest.fixture
async def store(nc: NatsClient, config: Config) -> BlobStore:
    return await ensure_objects_bucket(nc, config.nats)


@pytest.fixture
async def reading_batcher(
    config: Config, store: BlobStore, scheduler: tuple[FakeScheduler, int]
) -> AsyncIterator[BatcherApp]:
    _, port = scheduler
    app = BatcherApp(batcher_config(config, port, claim_check_io=True))
    await app.start()
    try:
        yield app
    finally:
        await app.stop(grace_s=1.0)


def order_by_ref(job_id: str, ref: str, *, store_over: int = 0, attempt: int = 1) -> worker_service_pb2.ConnectResponse:
    work = worker_service_pb2.WorkOrder(
        job_id=job_id, attempt=attempt, model_name="demo", tenant=TENANT, input_ref=ref, priority=job_pb2.PRIORITY_LOW
    )
    if store_over:
        work.store_outputs_over_bytes = store_over
        work.output_name = attempt_result_ref(job_id, attempt)
        work.result_retention.CopyFrom(duration_pb2.Duration(seconds=600))
    return worker_service_pb2.ConnectResponse(order=work)


async def upload(store: BlobStore, x: np.ndarray[Any, Any]) -> str:
    message = tensor_pb2.InferInputs(inputs=[to_input_proto(Tensor.from_numpy("x", x))])
    ref = new_input_ref()
    await store.put_bytes(TENANT, ref, message.SerializeToString(), expires_at=time.time() + 600)
    return ref


async def test_an_upload_is_read_and_large_outputs_are_stored_as_the_object_the_order_names(
    scheduler: tuple[FakeScheduler, int], reading_batcher: BatcherApp, store: BlobStore
) -> None:
    fake, _ = scheduler
    connection = await fake.next_connection(1)
    assert connection.hello.reads_claim_checks
    x = np.arange(40 * 4, dtype=np.float32).reshape(40, 4)  # 640 B of outputs
    ref = await upload(store, x)
    job_id = "01a2b3c4-0000-7000-8000-000000000001"
    connection.send(order_by_ref(job_id, ref, store_over=100))
    result = await connection.result(job_id)
    assert not result.HasField("error"), result.error
    assert not result.outputs, "stored, not sent back"
    assert result.output_ref.ref == f"out/{job_id}.1"
    info = await store.info(TENANT, result.output_ref.ref)
    assert (info.ref.size_bytes, info.ref.sha256) == (result.output_ref.size_bytes, result.output_ref.sha256)
    assert info.expires_at == pytest.approx(time.time() + 600, abs=30)
    _, data = await store.read(TENANT, result.output_ref.ref, max_bytes=1 << 20)
    (y,) = decode_tensors(tensor_pb2.InferOutputs.FromString(bytes(data)).outputs, "outputs")
    np.testing.assert_array_equal(y.to_numpy(), 2 * x + 1)

    # Under the threshold (or with none), the outputs come back in the result as ever.
    small = "01a2b3c4-0000-7000-8000-000000000002"
    connection.send(order_by_ref(small, await upload(store, x[:2]), store_over=100))
    kept_inline = await connection.result(small)
    assert not kept_inline.HasField("output_ref")
    (y,) = decode_tensors(kept_inline.outputs, "outputs")
    np.testing.assert_array_equal(y.to_numpy(), 2 * x[:2] + 1)


async def test_a_chunk_named_as_rows_of_an_npy_upload_reads_only_those_rows(
    scheduler: tuple[FakeScheduler, int], reading_batcher: BatcherApp, store: BlobStore
) -> None:
    fake, _ = scheduler
    connection = await fake.next_connection(1)
    x = np.random.default_rng(5).uniform(-1, 1, (500, 4))  # float64: converted to the model's FP32
    buffer = io.BytesIO()
    np.save(buffer, x)
    source = new_input_ref()
    uploaded = await store.put_bytes(TENANT, source, buffer.getvalue(), expires_at=time.time() + 600)
    header_bytes = len(buffer.getvalue()) - x.nbytes
    rows = ranged_inputs.RangedInputs(
        source=source,
        source_sha256=uploaded.sha256,
        offset=header_bytes,
        first=100,
        rows=150,
        row_shape=(4,),
        dtype="<f8",
        name="x",
        datatype="FP32",
    )
    descriptor = new_input_ref()
    await store.put_bytes(TENANT, descriptor, rows.encode(), expires_at=time.time() + 600)
    job_id = "01a2b3c4-0000-7000-8000-000000000003"
    connection.send(order_by_ref(job_id, descriptor))
    result = await connection.result(job_id)
    assert not result.HasField("error"), result.error
    (y,) = decode_tensors(result.outputs, "outputs")
    expected = 2 * x[100:250].astype(np.float32) + 1
    np.testing.assert_allclose(np.asarray(y.to_numpy(), dtype=np.float32), expected, rtol=1e-6)


async def test_an_input_it_cannot_read_is_a_clear_final_error(
    scheduler: tuple[FakeScheduler, int], reading_batcher: BatcherApp, store: BlobStore
) -> None:
    fake, _ = scheduler
    connection = await fake.next_connection(1)
    gone = "01a2b3c4-0000-7000-8000-000000000004"
    connection.send(order_by_ref(gone, new_input_ref()))
    not_inputs = "01a2b3c4-0000-7000-8000-000000000005"
    ref = new_input_ref()
    await store.put_bytes(TENANT, ref, b"\xff\xff not an InferInputs", expires_at=time.time() + 600)
    connection.send(order_by_ref(not_inputs, ref))
    for job_id, code in ((gone, grpc.StatusCode.NOT_FOUND), (not_inputs, grpc.StatusCode.INVALID_ARGUMENT)):
        result = await connection.result(job_id)
        assert result.error.code == code.value[0], result.error
        assert not result.error.retriable
        assert not result.dropped
    # Each answered order gave its credit back.
    max_queue_size = reading_batcher.config.models[0].max_queue_size
    await connection.wait_for(lambda: connection.credits.get("demo") == max_queue_size + 2)


async def test_a_batcher_without_claim_check_io_refuses_an_input_ref(
    config: Config, scheduler: tuple[FakeScheduler, int]
) -> None:
    fake, port = scheduler
    app = BatcherApp(batcher_config(config, port, claim_check_io=False))
    await app.start()
    try:
        connection = await fake.next_connection(1)
        assert not connection.hello.reads_claim_checks
        job_id = "01a2b3c4-0000-7000-8000-000000000006"
        connection.send(order_by_ref(job_id, new_input_ref()))
        result = await connection.result(job_id)
        assert result.error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert result.error.reason == "INPUT_REF_UNSUPPORTED"
        assert "claim_check_io" in result.error.message
    finally:
        await app.stop(grace_s=1.0)


async def test_the_chunks_of_a_result_whose_put_died_midway_are_swept_once_past_the_bound(
    config: Config, nc: NatsClient, scheduler: tuple[FakeScheduler, int], store: BlobStore
) -> None:
    """A batcher (or scheduler) that dies or loses NATS in the middle of storing a result leaves
    chunks that no meta names: its purge of them never arrives. The sweep purged only uploads'
    such chunks, so these stayed for ever (counted against no tenant, filling the store)."""
    fake, port = scheduler
    proxy = SilentProxy(int(config.nats.url.rsplit(":", 1)[1]))
    await proxy.start()
    app = BatcherApp(
        batcher_config(config, port, claim_check_io=True).replace(
            nats={"url": f"nats://127.0.0.1:{proxy.port}"}, models=[HUGE]
        )
    )
    await app.start()
    bucket = config.nats.objects_bucket
    # Hears each result chunk as it is stored (headers only: they are 512 KiB each).
    stored = await nc.jetstream().subscribe(
        f"$O.{bucket}.C.*", stream=f"OBJ_{bucket}", ordered_consumer=True, headers_only=True
    )
    try:
        connection = await fake.next_connection(1)
        job_id = "01a2b3c4-0000-7000-8000-000000000007"
        work = order(job_id, np.ones((1, 4), np.float32), model="huge")  # 68 MB of outputs: 136 chunks
        work.order.tenant = TENANT
        work.order.store_outputs_over_bytes = 1024
        work.order.output_name = attempt_result_ref(job_id, 1)
        work.order.result_retention.CopyFrom(duration_pb2.Duration(seconds=600))
        connection.send(work)
        first = await stored.next_msg(timeout=60)
        proxy.silence()  # the batcher's link to NATS goes dead mid-put: no more chunks, nor the purge
        async with connection.changed:
            await asyncio.wait_for(connection.changed.wait_for(lambda: (job_id, 1) in connection.results), 60)
        assert connection.results[(job_id, 1)].error.reason == "NATS_UNAVAILABLE"
        await proxy.cut()
    finally:
        await stored.unsubscribe()
        await app.stop(grace_s=1.0)
        await proxy.stop()

    left = await nc.jetstream().stream_info(f"OBJ_{bucket}", subjects_filter=first.subject)
    assert (left.state.subjects or {}).get(first.subject, 0) >= 1, "the put's purge must not have landed"
    assert [info.name for info in await list_objects(store)] == []  # no meta names them
    bound = orphan_age_s(config)
    assert await sweep(store, orphans_after_s=bound) == 0  # stored just now: maybe a put still going
    assert await sweep(store, time.time() + bound + 1, orphans_after_s=bound) == 1
    left = await nc.jetstream().stream_info(f"OBJ_{bucket}", subjects_filter=f"$O.{bucket}.C.>")
    assert not left.state.subjects


async def test_a_result_put_whose_chunks_were_swept_under_it_is_refused_not_stored_cut(
    config: Config, store: BlobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put paused past the sweep's bound (a process stopped, a VM frozen: its own timeouts do not
    run) finds its first chunks purged as a dead put's: it reads its first chunk back before its
    meta when it took SLOW_PUT_CHECKED_AFTER_S (here 0: the clock of a long pause)."""
    monkeypatch.setattr(blob_writer, "SLOW_PUT_CHECKED_AFTER_S", 0.0)
    swept = asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"\x01" * 1000
        await swept.wait()
        yield b"\x02" * 1000

    stored = await store.js.subscribe(f"$O.{store.bucket}.C.*", stream=store.stream, ordered_consumer=True)
    ref = attempt_result_ref("01a2b3c4-0000-7000-8000-000000000008", 1)
    put = asyncio.ensure_future(
        store.put(TENANT, ref, chunks(), expires_at=time.time() + 600, max_bytes=1 << 20, chunk_bytes=1000)
    )
    try:
        await stored.next_msg(timeout=30)  # its first chunk is stored
    finally:
        await stored.unsubscribe()
    bound = orphan_age_s(config)
    assert await sweep(store, time.time() + bound + 1, orphans_after_s=bound) == 1
    swept.set()
    with pytest.raises(Unavailable) as refused:
        await put
    assert refused.value.reason == "RESULT_CHUNKS_LOST"
    assert [info.name for info in await list_objects(store)] == []
    assert await _chunk_subjects_of(store) == []


async def _chunk_subjects_of(store: BlobStore) -> list[str]:
    info = await store.js.stream_info(store.stream, subjects_filter=f"$O.{store.bucket}.C.>")
    return list(info.state.subjects or {})
