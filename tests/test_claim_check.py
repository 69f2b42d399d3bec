"""The claim check (issue 5, item 3), against a real nats-server and real gRPC: inputs uploaded in
chunks into the Object Store and submitted by reference, large results stored there and read back
with ReadResult, size and digest limits that keep nothing partial, tenant isolation of references,
and expiry with a sweeper."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest
from google.protobuf import duration_pb2
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from structlog.testing import capture_logs

from asyncinfer.api_keys import hash_key
from asyncinfer.blob_meta import new_input_ref
from asyncinfer.codecs.envelope import decode_envelope
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.contract import BYTES_IN_HEADER
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.nats import Client as NatsClient
from asyncinfer.tensor_codec import decode_tensors
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc, tensor_pb2
from services.scheduler import blobs as scheduler_blobs
from tests.stack import Stack, StartStack

if TYPE_CHECKING:
    from asyncinfer.v1.job_service_pb2_grpc import JobServiceAsyncStub as JobStub

ACME = "acme-key"
GLOBEX = "globex-key"
CHUNK = 256 * 1024
ROWS_3MB = 3 * 1024 * 1024 // 16  # FP32 rows of 4: 16 bytes a row


BATCHER_KEY = "claim-check-batcher-key"


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def claim_check_config(config: Config, **gateway: Any) -> Config:
    return config.replace(
        gateway={
            "api_keys": [
                {"tenant": "acme", "sha256": hash_key(ACME)},
                {"tenant": "globex", "sha256": hash_key(GLOBEX)},
                # With keys, the scheduler takes only batchers with a key of role batcher.
                {"role": "batcher", "sha256": hash_key(BATCHER_KEY)},
            ],
            **gateway,
        },
        batcher={"api_key": BATCHER_KEY},
        scheduler={"inline_result_max_bytes": 1024},
        models=[{**DEMO_MODEL.model_dump(), "max_batch_size": 2 * ROWS_3MB}],
    )


def inputs_bytes(rows: np.ndarray[Any, Any]) -> bytes:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=list(rows.shape))
    x.raw_contents = rows.astype("<f4").tobytes()
    return tensor_pb2.InferInputs(inputs=[x]).SerializeToString()


async def upload(
    jobs: JobStub,
    data: bytes,
    *,
    key: str = ACME,
    size: int = 0,
    sha256: str = "",
    retention_s: float | None = None,
) -> job_pb2.BlobRef:
    metadata = job_service_pb2.UploadInputMetadata(size_bytes=size, sha256=sha256)
    if retention_s is not None:
        metadata.retention.CopyFrom(duration_pb2.Duration(nanos=int(retention_s * 1e9)))

    async def requests() -> AsyncIterator[job_service_pb2.UploadInputRequest]:
        yield job_service_pb2.UploadInputRequest(metadata=metadata)
        for start in range(0, len(data), CHUNK):
            yield job_service_pb2.UploadInputRequest(chunk=data[start : start + CHUNK])

    return (await jobs.UploadInput(requests(), metadata=bearer(key))).ref


def by_ref(ref: str) -> job_service_pb2.SubmitJobRequest:
    return job_service_pb2.SubmitJobRequest(model_name="demo", input_ref=ref)


def inline(rows: list[list[float]]) -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[len(rows), 4])
    x.contents.fp32_contents.extend(v for row in rows for v in row)
    return job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[x])


async def rpc_error(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


def reason_of(error: grpc.aio.AioRpcError) -> str:
    status = status_details(error)
    assert status is not None
    return str(unpack_details(status)["ErrorInfo"].reason)


async def objects_stream_state(nc: NatsClient, config: Config) -> tuple[int, int]:
    info = await nc.jetstream().stream_info(f"OBJ_{config.nats.objects_bucket}")
    return info.state.messages, info.state.bytes


async def read_result(jobs: JobStub, job_id: str, key: str = ACME) -> tuple[job_pb2.BlobRef, bytes, int]:
    ref: job_pb2.BlobRef | None = None
    data = bytearray()
    messages = 0
    async for message in jobs.ReadResult(job_service_pb2.ReadResultRequest(job_id=job_id), metadata=bearer(key)):
        if messages == 0:
            assert message.HasField("ref"), "the first message carries the reference"
            ref = message.ref
        data += message.chunk
        messages += 1
    assert ref is not None
    return ref, bytes(data), messages


async def read_to_end(call: Any, sizes: list[int]) -> None:
    """Reads a stream's messages to its end (raising its error), each one's chunk size into `sizes`."""
    while (message := await call.read()) is not grpc.aio.EOF:
        sizes.append(len(message.chunk))


async def finish(jobs: JobStub, job_id: str, key: str = ACME) -> job_pb2.Job:
    last = None
    async for update in jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=job_id), metadata=bearer(key)):
        last = update.job
    assert last is not None
    return last


def objects_directory(config: Config, tmp_path: Path) -> Config:
    """The configuration with the objects' bytes in a directory of the test's (nats.objects_directory)."""
    directory = tmp_path / "objects"
    directory.mkdir(exist_ok=True)
    return config.replace(nats={"objects_directory": str(directory)})


@pytest.fixture(
    params=[(False, False), (True, False), (False, True)],
    ids=["scheduler-moves-bytes", "batcher-claim-check-io", "scheduler-moves-bytes-objects-dir"],
)
async def full(config: Config, start_stack: StartStack, request: pytest.FixtureRequest, tmp_path: Path) -> Stack:
    """The whole stack; its batcher reads inputs and stores results itself (batcher.claim_check_io)
    or leaves that to the scheduler; the objects' bytes in the stream or in a directory."""
    claim_check_io, in_directory = request.param
    stack_config = claim_check_config(objects_directory(config, tmp_path) if in_directory else config)
    return await start_stack(stack_config.replace(batcher={"claim_check_io": claim_check_io}))


@pytest.fixture
async def gateway_only(config: Config, start_stack: StartStack) -> Stack:
    limited = claim_check_config(config, max_upload_bytes=1024 * 1024)
    return await start_stack(limited, scheduler=False, batcher=False)


# --- the whole way: upload, submit by reference, large result, ReadResult ---------------------


async def test_a_3mb_upload_runs_by_reference_and_its_large_result_reads_back(full: Stack) -> None:
    jobs = full.jobs
    rows = np.arange(ROWS_3MB * 4, dtype=np.float32).reshape(ROWS_3MB, 4) / 7
    data = inputs_bytes(rows)
    started = time.perf_counter()
    ref = await upload(jobs, data, size=len(data), sha256=hashlib.sha256(data).hexdigest())
    elapsed = time.perf_counter() - started
    print(f"\nupload of {len(data) / 1e6:.1f} MB in {CHUNK // 1024} KiB chunks: {len(data) / 1e6 / elapsed:.0f} MB/s")
    assert ref.ref.startswith("in/")
    assert ref.size_bytes == len(data)
    assert ref.sha256 == hashlib.sha256(data).hexdigest()
    uploaded = await full.blobs.info("acme", ref.ref)

    submitted = (await jobs.SubmitJob(by_ref(ref.ref), metadata=bearer(ACME))).job
    assert submitted.input_ref.ref == ref.ref
    assert submitted.input_ref.sha256 == ref.sha256
    kept = await full.blobs.info("acme", ref.ref)
    assert kept.expires_at is not None
    assert uploaded.expires_at is not None
    assert kept.expires_at > uploaded.expires_at, "a job that uses the input extends its expiry"

    done = await finish(jobs, submitted.job_id)
    assert done.state == job_pb2.JOB_STATE_SUCCEEDED, done.error
    assert not done.outputs, "a result over inline_result_max_bytes is not inline"
    # The scheduler stores it as the job's; a batcher with claim_check_io as the attempt's.
    by_batcher = full.config.batcher.claim_check_io
    assert done.result_ref.ref == (f"out/{done.job_id}.1" if by_batcher else f"out/{done.job_id}")

    result_ref, result, messages = await read_result(jobs, done.job_id)
    assert messages > 1, "a large result comes back in chunks"
    assert result_ref == done.result_ref
    assert len(result) == result_ref.size_bytes
    assert hashlib.sha256(result).hexdigest() == result_ref.sha256
    (y,) = decode_tensors(tensor_pb2.InferOutputs.FromString(result).outputs, "outputs")
    assert y.name == "y"
    np.testing.assert_allclose(y.to_numpy(), 2 * rows + 1, rtol=1e-6)

    stored = await full.blobs.info("acme", result_ref.ref)
    in_directory = full.config.nats.objects_directory is not None
    for info in (uploaded, stored):  # where the bytes are, as the services were configured
        assert (BYTES_IN_HEADER in info.meta["headers"]) == in_directory
    end = done.end_time.ToNanoseconds() / 1e9
    assert stored.expires_at == pytest.approx(end + done.result_retention.ToSeconds(), abs=1.0)

    # Another tenant can name neither the job nor its result.
    error = await rpc_error(read_result(jobs, done.job_id, key=GLOBEX))
    assert error.code() == grpc.StatusCode.NOT_FOUND


async def test_a_small_result_stays_inline_and_read_result_serves_it_too(full: Stack) -> None:
    jobs = full.jobs
    submitted = (await jobs.SubmitJob(inline([[1, 2, 3, 4]]), metadata=bearer(ACME))).job
    done = await finish(jobs, submitted.job_id)
    assert done.state == job_pb2.JOB_STATE_SUCCEEDED
    assert done.outputs
    assert not done.HasField("result_ref")
    ref, data, _ = await read_result(jobs, done.job_id)
    assert ref.ref == ""
    assert ref.size_bytes == len(data)
    assert ref.sha256 == hashlib.sha256(data).hexdigest()
    (y,) = decode_tensors(tensor_pb2.InferOutputs.FromString(data).outputs, "outputs")
    np.testing.assert_allclose(y.to_numpy(), [[3, 5, 7, 9]])


@pytest.mark.parametrize("in_directory", [False, True], ids=["chunks", "objects-dir"])
async def test_a_result_deleted_while_it_is_read_ends_the_read_not_found(
    config: Config, start_stack: StartStack, tmp_path: Path, in_directory: bool
) -> None:
    """A result deleted between two of its chunks (its retention passed and the sweep took it, or
    the job's record went) is NOT_FOUND RESULT_NOT_FOUND, as a read that starts after the delete:
    not DATA_LOSS "incomplete or corrupt", which says the store lost bytes it still holds. Its file,
    where the bytes are in the objects' directory, likewise."""
    stack = await start_stack(claim_check_config(objects_directory(config, tmp_path) if in_directory else config))
    rows = np.ones((ROWS_3MB, 4), dtype=np.float32)
    ref = await upload(stack.jobs, inputs_bytes(rows))
    done = await finish(stack.jobs, (await stack.jobs.SubmitJob(by_ref(ref.ref), metadata=bearer(ACME))).job.job_id)
    assert done.state == job_pb2.JOB_STATE_SUCCEEDED, done.error
    # Flow control without BDP probing (a 64 KiB window): the gateway reads a chunk or two ahead of
    # this reader, not the whole 3 MB result.
    async with grpc.aio.insecure_channel(stack.address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        call = job_service_pb2_grpc.JobServiceStub(channel).ReadResult(
            job_service_pb2.ReadResultRequest(job_id=done.job_id), metadata=bearer(ACME)
        )
        first = await call.read()
        assert first is not grpc.aio.EOF
        assert first.ref == done.result_ref
        await stack.blobs.delete("acme", done.result_ref.ref)
        received = [len(first.chunk)]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await read_to_end(call, received)
    assert sum(received) < done.result_ref.size_bytes, "the delete came before the read's end"
    assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()
    assert reason_of(info.value) == "RESULT_NOT_FOUND"
    assert "deleted while it was read" in (info.value.details() or "")


async def test_the_sweeper_deletes_expired_objects_and_keeps_live_ones(config: Config, start_stack: StartStack) -> None:
    stack = await start_stack(claim_check_config(config), blob_sweep_interval_s=0.05)
    live = await upload(stack.jobs, inputs_bytes(np.ones((4, 4))))
    before = await objects_stream_state(stack.nc, stack.config)
    short = await upload(stack.jobs, inputs_bytes(np.ones((20_000, 4))), retention_s=0.3)
    assert (await objects_stream_state(stack.nc, stack.config))[0] > before[0]
    for _ in range(200):  # the sweeper runs every 50 ms; the object expires after 300 ms
        if await objects_stream_state(stack.nc, stack.config) == before:
            break
        await asyncio.sleep(0.05)
    assert await objects_stream_state(stack.nc, stack.config) == before, "the expired object is gone, all of it"
    error = await rpc_error(stack.jobs.SubmitJob(by_ref(short.ref), metadata=bearer(ACME)))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert (await stack.blobs.info("acme", live.ref)).ref.size_bytes == live.size_bytes


async def test_a_sweep_failing_while_nats_is_out_of_reach_is_said_in_a_line_once_per_interval(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep fails every interval while NATS is out of reach (here 50 ms; 60 s by default), and
    each failure logged an error with its traceback. NATS out of reach is a warning with its error,
    a bug keeps its traceback, each at most once per 5 s; the sweeps go on after."""
    failures: list[Exception] = [NoRespondersError() for _ in range(5)] + [NatsTimeoutError() for _ in range(5)]
    failures += [RuntimeError("a bug") for _ in range(5)]
    real_sweep = scheduler_blobs.sweep

    async def failing_sweep(store: Any, **options: Any) -> int:
        if failures:
            raise failures.pop(0)
        return await real_sweep(store, **options)

    monkeypatch.setattr(scheduler_blobs, "sweep", failing_sweep)
    with capture_logs() as logs:
        stack = await start_stack(claim_check_config(config), blob_sweep_interval_s=0.05)
        before = await objects_stream_state(stack.nc, stack.config)
        await upload(stack.jobs, inputs_bytes(np.ones((4, 4))), retention_s=0.3)
        for _ in range(200):  # swept once the failures are over and the object expired
            if not failures and await objects_stream_state(stack.nc, stack.config) == before:
                break
            await asyncio.sleep(0.05)
        assert await objects_stream_state(stack.nc, stack.config) == before, "the sweeps went on"
    lines = [e for e in logs if e["event"] == "blob_sweep_failed"]
    assert [(e["log_level"], "exc_info" in e) for e in lines] == [
        ("warning", False),
        ("warning", False),
        ("error", True),
    ], lines
    assert [e["error"] for e in lines[:2]] == [
        "NoRespondersError: nats: no responders available for request",
        "TimeoutError: nats: timeout",
    ]
    assert isinstance(lines[2]["exc_info"], RuntimeError), lines[2]


# --- refusals that keep nothing -------------------------------------------------------------


async def test_an_upload_declared_over_the_limit_is_refused_at_once(gateway_only: Stack) -> None:
    never = asyncio.Event()

    async def requests() -> AsyncIterator[job_service_pb2.UploadInputRequest]:
        metadata = job_service_pb2.UploadInputMetadata(size_bytes=2 * 1024 * 1024)
        yield job_service_pb2.UploadInputRequest(metadata=metadata)
        await never.wait()  # the answer must not wait for chunks
        yield job_service_pb2.UploadInputRequest()

    error = await rpc_error(gateway_only.jobs.UploadInput(requests(), metadata=bearer(ACME), timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason_of(error) == "UPLOAD_TOO_LARGE"
    assert "max_upload_bytes" in (error.details() or "")
    assert await objects_stream_state(gateway_only.nc, gateway_only.config) == (0, 0)


async def test_an_upload_streaming_past_the_limit_is_refused_and_nothing_is_left(gateway_only: Stack) -> None:
    never = asyncio.Event()
    limit = gateway_only.config.gateway.max_upload_bytes

    async def requests() -> AsyncIterator[job_service_pb2.UploadInputRequest]:
        yield job_service_pb2.UploadInputRequest(metadata=job_service_pb2.UploadInputMetadata())
        for _ in range(limit // CHUNK + 1):
            yield job_service_pb2.UploadInputRequest(chunk=b"\x01" * CHUNK)
        await never.wait()  # past the limit: refused before the stream ends
        yield job_service_pb2.UploadInputRequest()

    error = await rpc_error(gateway_only.jobs.UploadInput(requests(), metadata=bearer(ACME), timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason_of(error) == "UPLOAD_TOO_LARGE"
    assert await objects_stream_state(gateway_only.nc, gateway_only.config) == (0, 0), "no partial chunks"


async def test_a_sha256_mismatch_is_refused_and_nothing_is_kept(gateway_only: Stack) -> None:
    data = inputs_bytes(np.ones((30_000, 4)))  # ~480 KB: several chunks were written before the check
    wrong = hashlib.sha256(b"something else").hexdigest()
    error = await rpc_error(upload(gateway_only.jobs, data, sha256=wrong))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason_of(error) == "SHA256_MISMATCH"
    assert await objects_stream_state(gateway_only.nc, gateway_only.config) == (0, 0)


# --- submitting by reference ----------------------------------------------------------------


async def test_a_ref_submit_queues_the_reference_not_the_tensors(gateway_only: Stack) -> None:
    ref = await upload(gateway_only.jobs, inputs_bytes(np.ones((1000, 4))))
    job = (await gateway_only.jobs.SubmitJob(by_ref(ref.ref), metadata=bearer(ACME))).job
    assert job.state == job_pb2.JOB_STATE_QUEUED
    msg = await gateway_only.nc.jetstream().get_msg(gateway_only.config.nats.work_stream, seq=1)
    envelope = decode_envelope(msg.data or b"")
    assert envelope.job_id == job.job_id
    assert envelope.inputs == ()
    assert envelope.input_ref is not None
    assert envelope.input_ref.ref == ref.ref
    assert envelope.input_ref.sha256 == ref.sha256


async def test_another_tenants_ref_is_not_found_like_an_unknown_one(gateway_only: Stack) -> None:
    jobs = gateway_only.jobs
    ref = await upload(jobs, inputs_bytes(np.ones((2, 4))), key=ACME)
    answers = []
    done = (await jobs.SubmitJob(by_ref(ref.ref), metadata=bearer(ACME))).job
    candidates = (ref.ref, new_input_ref(), "../acme/in/x", f"acme/{ref.ref}", f"out/{done.job_id}")
    for candidate in candidates:
        error = await rpc_error(jobs.SubmitJob(by_ref(candidate), metadata=bearer(GLOBEX)))
        answers.append((error.code(), reason_of(error)))
    assert answers == [(grpc.StatusCode.NOT_FOUND, "INPUT_NOT_FOUND")] * len(candidates)
    # The owner still can.
    assert (await jobs.SubmitJob(by_ref(ref.ref), metadata=bearer(ACME))).job.input_ref.ref == ref.ref


async def test_inline_inputs_and_a_ref_together_are_refused(gateway_only: Stack) -> None:
    ref = await upload(gateway_only.jobs, inputs_bytes(np.ones((2, 4))))
    request = inline([[1, 2, 3, 4]])
    request.input_ref = ref.ref
    error = await rpc_error(gateway_only.jobs.SubmitJob(request, metadata=bearer(ACME)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not both" in (error.details() or "")
    neither = await rpc_error(gateway_only.jobs.SubmitJob(by_ref(""), metadata=bearer(ACME)))
    assert neither.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe not a protobuf \x00\x01",
        tensor_pb2.InferInputs(
            inputs=[tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[2, 3], raw_contents=b"\0" * 24)]
        ).SerializeToString(),
        tensor_pb2.InferInputs(
            inputs=[tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[2, 4], raw_contents=b"\0" * 8)]
        ).SerializeToString(),
    ],
    ids=["not-inferinputs", "wrong-shape", "data-size-mismatch"],
)
async def test_a_ref_to_invalid_inputs_is_refused_and_queues_nothing(gateway_only: Stack, content: bytes) -> None:
    ref = await upload(gateway_only.jobs, content)
    error = await rpc_error(gateway_only.jobs.SubmitJob(by_ref(ref.ref), metadata=bearer(ACME)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    stream = await gateway_only.nc.jetstream().stream_info(gateway_only.config.nats.work_stream)
    assert stream.state.messages == 0
    kv = await gateway_only.nc.jetstream().key_value(gateway_only.config.nats.jobs_bucket)
    assert (await kv.status()).values == 0


async def test_an_expired_input_is_not_found_with_its_own_reason(gateway_only: Stack) -> None:
    ref = await upload(gateway_only.jobs, inputs_bytes(np.ones((2, 4))), retention_s=0.05)
    # Waiting out a 50 ms retention is waiting on the clock itself. No sweeper runs here, so the
    # object is still stored: the answer comes from its expiry, not its absence.
    await asyncio.sleep(0.06)
    assert await gateway_only.blobs.info("acme", ref.ref, now=0.0)
    error = await rpc_error(gateway_only.jobs.SubmitJob(by_ref(ref.ref), metadata=bearer(ACME)))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert reason_of(error) == "INPUT_EXPIRED"


async def test_read_result_of_an_unfinished_job_names_its_state(gateway_only: Stack) -> None:
    job = (await gateway_only.jobs.SubmitJob(inline([[1, 2, 3, 4]]), metadata=bearer(ACME))).job
    error = await rpc_error(read_result(gateway_only.jobs, job.job_id))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "QUEUED" in (error.details() or "")
    other = await rpc_error(read_result(gateway_only.jobs, job.job_id, key=GLOBEX))
    assert other.code() == grpc.StatusCode.NOT_FOUND
