"""A batcher that moves claim-checked bytes itself (`batcher.claim_check_io`), against the fake
scheduler of tests/test_batcher_worker.py and a real nats-server: it says so in its hello, reads
an order's input by reference (an upload, or a batch chunk's rows of its NPY upload), stores
outputs over the order's threshold as the object the order names, and answers an input it cannot
read with a clear error. A batcher without the setting refuses such an order. The whole stack's
runs are in tests/test_claim_check.py, tests/test_batches.py and tests/test_batch_crash.py."""

from __future__ import annotations

import io
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import duration_pb2

from asyncinfer import ranged_inputs
from asyncinfer.blob_meta import attempt_result_ref, new_input_ref
from asyncinfer.blobs import BlobStore, ensure_objects_bucket
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.nats import Client as NatsClient
from asyncinfer.tensor_codec import decode_tensors, to_input_proto
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import job_pb2, tensor_pb2, worker_service_pb2
from services.batcher.app import BatcherApp
from tests.test_batcher_worker import FakeScheduler, batcher_under_test, serving

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
    return await ensure_objects_bucket(nc.jetstream(), config.nats)


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
