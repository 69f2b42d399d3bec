"""AsyncClient's claim-check calls (asyncinfer.client._async): large inputs uploaded in chunks (upload,
upload_inputs, delete_input) and large results read back (read_result, outputs)."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import BinaryIO

import grpc
import numpy as np
import numpy.typing as npt

from asyncinfer.client._async_channel import ClientChannel, JobLike, _job_id
from asyncinfer.client._convert import duration_to_proto, input_tensors, tensors_to_arrays
from asyncinfer.client._retry import Deadline
from asyncinfer.client.errors import make_error
from asyncinfer.client.types import BlobRef, Inputs, Job
from asyncinfer.tensor_codec import to_input_proto
from asyncinfer.v1 import job_pb2, job_service_pb2, tensor_pb2

UPLOAD_CHUNK_BYTES = 1 << 20


async def _byte_chunks(content: bytes, size: int) -> AsyncIterator[bytes]:
    for offset in range(0, len(content), size):
        yield content[offset : offset + size]


async def _path_chunks(path: Path, size: int) -> AsyncIterator[bytes]:
    stream = await asyncio.to_thread(path.open, "rb")
    try:
        async for chunk in _file_chunks(stream, size):
            yield chunk
    finally:
        stream.close()


async def _file_chunks(stream: BinaryIO, size: int) -> AsyncIterator[bytes]:
    while chunk := await asyncio.to_thread(stream.read, size):
        yield chunk


class BlobCalls(ClientChannel):
    """AsyncClient's uploads and large results, streamed in chunks."""

    async def outputs(self, job: Job, *, timeout_s: float | None = None) -> dict[str, npt.NDArray[np.generic]]:
        """A succeeded job's outputs: inline ones, or the large result read with `read_result`."""
        if job.result_ref is not None and not job.outputs:
            return await self.read_result(job, timeout_s=timeout_s)
        return dict(job.outputs)

    async def upload(
        self,
        data: bytes | str | os.PathLike[str] | BinaryIO,
        *,
        retention_s: float | None = None,
        chunk_bytes: int = UPLOAD_CHUNK_BYTES,
        timeout_s: float | None = None,
    ) -> BlobRef:
        """Streams a serialized `InferInputs` message (bytes, a file path, or a binary file) into
        the claim-check store and returns its reference, for `submit(input_ref=...)`. See
        `upload_inputs` to upload arrays. Bytes, paths and seekable files are uploaded again from
        the start when the stream breaks; other files are not retried."""
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        metadata = job_service_pb2.UploadInputMetadata()
        if retention_s is not None:
            metadata.retention.CopyFrom(duration_to_proto(retention_s))
        if isinstance(data, bytes | bytearray | memoryview):
            content = bytes(data)
            metadata.size_bytes = len(content)
            metadata.sha256 = hashlib.sha256(content).hexdigest()
            make_chunks: Callable[[], AsyncIterator[bytes]] = lambda: _byte_chunks(content, chunk_bytes)  # noqa: E731
            retriable = True
        elif isinstance(data, str | os.PathLike):
            path = Path(data)
            metadata.size_bytes = (await asyncio.to_thread(path.stat)).st_size
            make_chunks = lambda: _path_chunks(path, chunk_bytes)  # noqa: E731
            retriable = True
        else:
            stream = data
            retriable = stream.seekable()
            start = stream.tell() if retriable else 0
            if retriable:
                metadata.size_bytes = stream.seek(0, os.SEEK_END) - start
                stream.seek(start)

            def make_chunks() -> AsyncIterator[bytes]:
                if retriable:
                    stream.seek(start)
                return _file_chunks(stream, chunk_bytes)

        read_errors: list[Exception] = []

        async def requests() -> AsyncIterator[job_service_pb2.UploadInputRequest]:
            yield job_service_pb2.UploadInputRequest(metadata=metadata)
            try:
                async for chunk in make_chunks():
                    yield job_service_pb2.UploadInputRequest(chunk=chunk)
            except Exception as exc:
                read_errors.append(exc)
                raise

        async def invoke(remaining: float | None) -> job_service_pb2.UploadInputResponse:
            try:
                return await self._stub.UploadInput(requests(), timeout=remaining, metadata=self._metadata)
            except (asyncio.CancelledError, grpc.RpcError):
                # grpc.aio cancels the call when reading the data fails: the read's error is the
                # caller's (an OSError of its file), unless this task itself is being cancelled.
                task = asyncio.current_task()
                if read_errors and not (task is not None and task.cancelling()):
                    raise read_errors[-1] from None
                raise

        response = await self._call(invoke, Deadline(timeout_s), retry=retriable)
        return BlobRef(ref=response.ref.ref, size_bytes=response.ref.size_bytes, sha256=response.ref.sha256)

    async def upload_inputs(
        self, inputs: Inputs, *, retention_s: float | None = None, timeout_s: float | None = None
    ) -> BlobRef:
        """Uploads input tensors (name -> array) for a later `submit(model, input_ref=ref)`."""
        content = tensor_pb2.InferInputs(inputs=[to_input_proto(t) for t in input_tensors(inputs)]).SerializeToString()
        return await self.upload(content, retention_s=retention_s, timeout_s=timeout_s)

    async def delete_input(self, ref: str | BlobRef, *, timeout_s: float | None = None) -> BlobRef:
        """Deletes one of your uploads before its retention ends (its bytes stop counting against
        your stored-upload limit at once) and returns what it was. NotFoundError when you have no
        such upload; a queued job that still refers to it fails at dispatch with INPUT_NOT_FOUND.
        A retry after a lost answer may find it gone and raise NotFoundError."""
        request = job_service_pb2.DeleteInputRequest(ref=ref.ref if isinstance(ref, BlobRef) else ref)

        async def invoke(remaining: float | None) -> job_service_pb2.DeleteInputResponse:
            return await self._stub.DeleteInput(request, timeout=remaining, metadata=self._metadata)

        response = await self._call(invoke, Deadline(timeout_s))
        return BlobRef(ref=response.ref.ref, size_bytes=response.ref.size_bytes, sha256=response.ref.sha256)

    async def read_result(self, job: JobLike, *, timeout_s: float | None = None) -> dict[str, npt.NDArray[np.generic]]:
        """A large result (a job with `result_ref`), streamed back in chunks, as name -> array.
        The content is checked against the reference's SHA-256; a broken stream reads again."""
        request = job_service_pb2.ReadResultRequest(job_id=_job_id(job))

        async def invoke(remaining: float | None) -> bytes:
            chunks: list[bytes] = []
            expected: job_pb2.BlobRef | None = None
            call = self._stub.ReadResult(request, timeout=remaining, metadata=self._metadata)
            try:
                async for response in call:
                    if expected is None and response.HasField("ref"):
                        expected = response.ref
                    chunks.append(response.chunk)
            finally:
                call.cancel()
            content = b"".join(chunks)
            if expected is not None and expected.sha256 and hashlib.sha256(content).hexdigest() != expected.sha256:
                raise make_error(grpc.StatusCode.DATA_LOSS, "the result read back does not match its SHA-256")
            return content

        content = await self._call(invoke, Deadline(timeout_s))
        outputs = tensor_pb2.InferOutputs.FromString(content)
        return tensors_to_arrays(outputs.outputs, "outputs")
