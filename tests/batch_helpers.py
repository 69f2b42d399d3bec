"""What the batch tests share: uploading a file, a BatchService stub on a stack's channel, waiting
for a batch to end, and reading its files back."""

from __future__ import annotations

import asyncio
import io
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from google.protobuf import duration_pb2

from asyncinfer.batches import BatchRecord
from asyncinfer.ids import new_job_id
from asyncinfer.v1 import batch_service_pb2, batch_service_pb2_grpc, job_service_pb2
from services.gateway.batch_store import BatchStore

if TYPE_CHECKING:
    import grpc

    from asyncinfer.v1.batch_service_pb2_grpc import BatchServiceAsyncStub
    from asyncinfer.v1.job_service_pb2_grpc import JobServiceAsyncStub

PIECE = 256 * 1024
TERMINAL = {
    batch_service_pb2.BATCH_STATE_COMPLETED,
    batch_service_pb2.BATCH_STATE_FAILED,
    batch_service_pb2.BATCH_STATE_EXPIRED,
    batch_service_pb2.BATCH_STATE_CANCELLED,
}


def batches_stub(channel: grpc.aio.Channel) -> BatchServiceAsyncStub:
    return batch_service_pb2_grpc.BatchServiceStub(channel)  # type: ignore[no-untyped-call]


async def upload(jobs: JobServiceAsyncStub, data: bytes) -> str:
    async def requests() -> AsyncIterator[job_service_pb2.UploadInputRequest]:
        yield job_service_pb2.UploadInputRequest(metadata=job_service_pb2.UploadInputMetadata(size_bytes=len(data)))
        for start in range(0, len(data), PIECE):
            yield job_service_pb2.UploadInputRequest(chunk=data[start : start + PIECE])

    return (await jobs.UploadInput(requests())).ref.ref


def jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def demo_records(count: int) -> list[dict[str, Any]]:
    return [{"custom_id": f"r{i}", "inputs": {"x": [[i, i + 0.5, -i, 1.0]]}} for i in range(count)]


def create_request(ref: str, **fields: Any) -> batch_service_pb2.CreateBatchRequest:
    window = fields.pop("completion_window_s", None)
    request = batch_service_pb2.CreateBatchRequest(model_name=fields.pop("model_name", "demo"), input_ref=ref, **fields)
    if window is not None:
        request.completion_window.CopyFrom(duration_pb2.Duration(nanos=int(window * 1e9) % 10**9, seconds=int(window)))
    return request


async def wait_until(
    stub: BatchServiceAsyncStub, batch_id: str, done: Callable[[batch_service_pb2.Batch], bool], timeout_s: float = 60.0
) -> batch_service_pb2.Batch:
    """The first state of the batch, read through WatchBatch, for which `done` holds."""
    async with asyncio.timeout(timeout_s):
        async for update in stub.WatchBatch(batch_service_pb2.WatchBatchRequest(batch_id=batch_id)):
            if done(update.batch):
                return update.batch
    raise AssertionError("the watch ended first")


async def wait_ended(stub: BatchServiceAsyncStub, batch_id: str, timeout_s: float = 60.0) -> batch_service_pb2.Batch:
    """The batch once terminal."""
    return await wait_until(stub, batch_id, lambda batch: batch.state in TERMINAL, timeout_s)


async def read_file(stub: BatchServiceAsyncStub, batch_id: str, which: int) -> list[dict[str, Any]]:
    data = bytearray()
    async for piece in stub.ReadBatchFile(batch_service_pb2.ReadBatchFileRequest(batch_id=batch_id, file=which)):
        data += piece.chunk
    return [json.loads(line) for line in data.decode().splitlines() if line]


async def outputs(stub: BatchServiceAsyncStub, batch_id: str) -> list[dict[str, Any]]:
    return await read_file(stub, batch_id, batch_service_pb2.BATCH_FILE_OUTPUT)


async def errors(stub: BatchServiceAsyncStub, batch_id: str) -> list[dict[str, Any]]:
    return await read_file(stub, batch_id, batch_service_pb2.BATCH_FILE_ERRORS)


async def npz_output(stub: BatchServiceAsyncStub, batch_id: str) -> dict[str, Any]:
    """The batch's output as arrays (BATCH_FILE_OUTPUT_NPZ), read with numpy.load."""
    data = bytearray()
    request = batch_service_pb2.ReadBatchFileRequest(batch_id=batch_id, file=batch_service_pb2.BATCH_FILE_OUTPUT_NPZ)
    async for piece in stub.ReadBatchFile(request):
        data += piece.chunk
    with np.load(io.BytesIO(bytes(data)), allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def npy_bytes(array: Any) -> bytes:
    """The array as an NPY file's bytes (an array batch's upload)."""
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def minted_at(unix_s: float) -> str:
    """A batch ID (UUIDv7) minted at `unix_s`: its create started then."""
    fresh = uuid.UUID(new_job_id()).int & ((1 << 80) - 1)
    return str(uuid.UUID(int=int(unix_s * 1000) << 80 | fresh))


class HeldCreate:
    """Holds the first create's record write (between its claim and its record) until released, and
    counts the reads of that batch's record that find nothing (a duplicate looking for it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.batch_id: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.release = asyncio.Event()
        self.looked = 0
        self.looked_enough = asyncio.Event()
        self.enough = 0
        write, get = BatchStore.write, BatchStore.get

        async def held_write(store: BatchStore, record: BatchRecord) -> BatchRecord:
            if record.revision == 0 and not self.batch_id.done():
                self.batch_id.set_result(record.batch_id)
                await self.release.wait()
            return await write(store, record)

        async def counted_get(store: BatchStore, tenant: str, batch_id: str) -> BatchRecord | None:
            found = await get(store, tenant, batch_id)
            if found is None and self.batch_id.done() and batch_id == self.batch_id.result():
                self.looked += 1
                if self.enough and self.looked >= self.enough:
                    self.looked_enough.set()
            return found

        monkeypatch.setattr(BatchStore, "write", held_write)
        monkeypatch.setattr(BatchStore, "get", counted_get)
