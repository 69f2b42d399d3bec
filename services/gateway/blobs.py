"""The gateway's side of the claim check: UploadInput streams a client's chunks into the object
store, SubmitJob's `input_ref` is checked and decoded like inline inputs, and ReadResult streams a
finished job's result back (from the store, or from the record when it was small enough to be
inline, so a client has one way to read every result).

Input expiry. An upload lives for its own retention (metadata.retention, else
gateway.default_upload_retention_s). A job that uses it extends it, at submit, to a generous bound
on when that job can have ended plus the job's result retention: the time it may wait (its
deadline, or else the upload default) plus every attempt's execution timeout and longest retry
backoff. The expiry never moves earlier, so several jobs may share one upload. A job that still
waits past that bound fails at dispatch with INPUT_EXPIRED rather than running on missing data.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from asyncinfer.batches import create_settles_in_s
from asyncinfer.blob_meta import INPUT_KIND, BlobInfo, blob_not_found, is_sha256_hex, new_input_ref, upload_too_large
from asyncinfer.blobs import BlobStore, parse_inputs
from asyncinfer.config import Config, ModelConfig
from asyncinfer.errors import DeadlineExceeded, FailedPrecondition, FieldViolation, InvalidArgument
from asyncinfer.jobs import BlobRef, JobRecord, JobState
from asyncinfer.nats.streams import StoreFullError
from asyncinfer.proto_durations import checked_duration
from asyncinfer.tensor_codec import decode_tensors, to_output_proto
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import job_pb2, job_service_pb2, tensor_pb2
from services.gateway.batch_store import BatchStore
from services.gateway.store_health import StoreHealth, store_full_error
from services.gateway.stream_limits import StreamCounts
from services.gateway.upload_storage import UploadStorage

# ReadResult sends inline results in pieces of this size, like stored ones (the store's chunks).
INLINE_CHUNK_BYTES = 128 * 1024


@dataclass(frozen=True, slots=True)
class InputsByRef:
    """A SubmitJob input_ref, resolved: the stored object and its decoded tensors."""

    ref: BlobRef
    inputs: tuple[Tensor, ...]


def check_exclusive_inputs(inline_count: int, input_ref: str) -> None:
    if inline_count and input_ref:
        message = "give inputs inline or an input_ref from UploadInput, not both"
        raise InvalidArgument(message, [FieldViolation("input_ref", message)])


def input_expiry(
    record_retention_s: float,
    model: ModelConfig,
    config: Config,
    *,
    deadline: float | None,
    now: float,
    max_attempts: int,
    execution_timeout_s: float | None,
) -> float:
    """The generous bound on a job's end plus its retention (see the module's docstring)."""
    wait_s = (deadline - now) if deadline is not None else config.gateway.default_upload_retention_s
    run_s = max_attempts * ((execution_timeout_s or model.default_execution_timeout_s) + model.retry_backoff_max_s)
    return now + max(wait_s, 0.0) + run_s + record_retention_s


class ClaimCheck:
    def __init__(
        self,
        store: BlobStore,
        config: Config,
        *,
        storage: UploadStorage | None = None,
        store_health: StoreHealth | None = None,
        batches: BatchStore | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._batches = batches
        self._config = config
        self._storage = storage
        self._store_health = store_health
        self._clock = clock
        self._idle_s = config.gateway.upload_idle_timeout_s
        self._uploads = StreamCounts(
            "upload", reason="TOO_MANY_UPLOADS", per_tenant=config.gateway.max_open_uploads_per_tenant
        )

    # --- UploadInput ------------------------------------------------------------------------

    async def upload(
        self, requests: AsyncIterator[job_service_pb2.UploadInputRequest], *, tenant: str
    ) -> job_service_pb2.UploadInputResponse:
        """Counted against the tenant's open uploads; a stream idle for upload_idle_timeout_s ends
        DEADLINE_EXCEEDED (UPLOAD_IDLE), and what it had sent is purged (BlobStore.put)."""
        with self._uploads.hold(tenant, ""):
            try:
                return await self._upload(requests, tenant=tenant)
            except StoreFullError as full:
                what = "nothing of the upload was kept"
                if self._store_health is not None:
                    raise self._store_health.refusal(full, what=what) from None
                raise store_full_error(full, what=what) from None

    async def _next(
        self, requests: AsyncIterator[job_service_pb2.UploadInputRequest]
    ) -> job_service_pb2.UploadInputRequest | None:
        try:
            async with asyncio.timeout(self._idle_s):
                return await anext(requests, None)
        except TimeoutError:
            raise DeadlineExceeded(
                f"the upload sent nothing for {self._idle_s:g} s (gateway.upload_idle_timeout_s); nothing was kept",
                reason="UPLOAD_IDLE",
            ) from None

    async def _upload(
        self, requests: AsyncIterator[job_service_pb2.UploadInputRequest], *, tenant: str
    ) -> job_service_pb2.UploadInputResponse:
        limit = self._config.gateway.max_upload_bytes
        first = await self._next(requests)
        if first is None or not first.HasField("metadata"):
            message = "the first message must carry metadata (size_bytes, sha256, retention); chunks follow"
            raise InvalidArgument(message, [FieldViolation("metadata", message)])
        metadata = first.metadata
        violations: list[FieldViolation] = []
        if metadata.size_bytes < 0:
            violations.append(FieldViolation("metadata.size_bytes", "must not be negative"))
        elif metadata.size_bytes > limit:
            raise upload_too_large(limit, metadata.size_bytes, declared=True)
        sha256 = metadata.sha256.lower()
        if sha256 and not is_sha256_hex(sha256):
            violations.append(FieldViolation("metadata.sha256", "must be 64 hex digits (the content's SHA-256)"))
        retention_s = self._config.gateway.default_upload_retention_s
        if metadata.HasField("retention"):
            retention = checked_duration(metadata.retention, "metadata.retention", violations)
            retention_s = retention if retention is not None else retention_s
            longest = self._config.gateway.max_result_retention_s
            if retention is not None and not 0 < retention <= longest:
                violations.append(FieldViolation("metadata.retention", f"must be positive and at most {longest:.0f} s"))
        if violations:
            raise InvalidArgument(f"invalid upload: {violations[0].field}: {violations[0].description}", violations)

        storage = self._storage if self._storage is not None and self._storage.enabled else None
        stored_at_start = 0
        if storage is not None:
            stored_at_start = await storage.stored_bytes(tenant)
            storage.check(tenant, stored_at_start, metadata.size_bytes)

        async def chunks() -> AsyncIterator[bytes]:
            sent = len(first.chunk)
            yield first.chunk
            while (request := await self._next(requests)) is not None:
                if request.HasField("metadata"):
                    message = "only the first message carries metadata"
                    raise InvalidArgument(message, [FieldViolation("metadata", message)])
                sent += len(request.chunk)
                if storage is not None:  # refused as it passes the limit, not once it is stored
                    storage.check(tenant, stored_at_start, sent)
                yield request.chunk

        ref = await self._store.put(
            tenant,
            new_input_ref(),
            chunks(),
            expires_at=self._clock() + retention_s,
            max_bytes=limit,
            expected_sha256=sha256,
            expected_size=metadata.size_bytes or None,
            before_commit=(lambda: storage.check_committed(tenant)) if storage is not None else None,
        )
        return job_service_pb2.UploadInputResponse(
            ref=job_pb2.BlobRef(ref=ref.ref, size_bytes=ref.size_bytes, sha256=ref.sha256)
        )

    # --- SubmitJob by reference -------------------------------------------------------------

    async def inputs(self, tenant: str, input_ref: str) -> InputsByRef:
        """The caller's upload, decoded: NotFound (INPUT_NOT_FOUND / INPUT_EXPIRED; another
        tenant's ref is simply not there), InvalidArgument when it is not an InferInputs."""
        if not input_ref.startswith(INPUT_KIND + "/"):  # results are not inputs
            raise blob_not_found(input_ref, "input")
        info, data = await self._store.read(tenant, input_ref, max_bytes=self._config.gateway.max_upload_bytes)
        try:
            # Parsing up to max_upload_bytes takes long enough to matter to everyone else on the loop.
            message = await asyncio.to_thread(parse_inputs, data)
        except DecodeError:
            text = "the uploaded content is not a serialized asyncinfer.v1.InferInputs message"
            raise InvalidArgument(text, [FieldViolation("input_ref", text)], reason="INPUT_REF_UNREADABLE") from None
        del data
        try:
            inputs = tuple(decode_tensors(message.inputs, "input_ref.inputs"))
        except InvalidArgument as exc:
            raise InvalidArgument(f"the uploaded inputs are invalid: {exc.message}", exc.violations) from None
        return InputsByRef(ref=info.ref, inputs=inputs)

    async def delete_input(self, tenant: str, ref: str) -> job_service_pb2.DeleteInputResponse:
        """Deletes the caller's upload: NotFound (INPUT_NOT_FOUND) for a ref the tenant has not
        got, a result's ref included (results go with their jobs); FailedPrecondition
        (INPUT_IN_USE) while a batch over it has not ended."""
        if not ref.startswith(INPUT_KIND + "/"):
            raise blob_not_found(ref, "input")
        deleted = await self._store.delete_live(
            tenant, ref, check=functools.partial(self._refuse_while_a_batch_reads, tenant)
        )
        return job_service_pb2.DeleteInputResponse(
            ref=job_pb2.BlobRef(ref=deleted.ref, size_bytes=deleted.size_bytes, sha256=deleted.sha256)
        )

    async def _refuse_while_a_batch_reads(self, tenant: str, info: BlobInfo) -> None:
        """A batch reads its upload until it ends (an NPY batch's chunks read rows of it when they
        run): deleting it would fail the records not yet run. So does a batch whose create named
        it on the upload and may still write its record (create_settles_in_s, under half a
        minute): taken then, the batch failed NOT_FOUND. A batch record already gone (its
        retention passed, or a create that died before writing it) holds nothing."""
        if self._batches is None:
            return
        for batch_id in info.batches:
            batch = await self._batches.get(tenant, batch_id)
            if batch is not None and not batch.state.is_terminal:
                raise FailedPrecondition(
                    f"input {info.ref.ref!r} is the input of batch {batch_id}, which is {batch.state.value}: "
                    "delete it once the batch has ended (or cancel the batch first)",
                    reason="INPUT_IN_USE",
                    metadata={"ref": info.ref.ref, "batch_id": batch_id, "state": batch.state.value},
                )
            creating_s = create_settles_in_s(batch_id, now=self._clock()) if batch is None else 0.0
            if creating_s > 0:
                retry_s = math.ceil(creating_s)
                raise FailedPrecondition(
                    f"input {info.ref.ref!r} is the input of batch {batch_id}, which is being created: "
                    f"try again in {retry_s} s (if the create failed, the delete then goes through)",
                    reason="INPUT_IN_USE",
                    metadata={
                        "ref": info.ref.ref,
                        "batch_id": batch_id,
                        "state": "CREATING",
                        "retry_after_s": str(retry_s),
                    },
                )

    async def keep_for(self, tenant: str, ref: BlobRef, expires_at: float) -> None:
        """Extends the upload's expiry for a job that uses it (never shortens it)."""
        await self._store.extend(tenant, ref.ref, expires_at)

    # --- ReadResult -------------------------------------------------------------------------

    async def read_result(self, record: JobRecord) -> AsyncGenerator[job_service_pb2.ReadResultResponse, None]:
        if record.state != JobState.SUCCEEDED:
            raise FailedPrecondition(
                f"job {record.job_id} is {record.state.value}; only a SUCCEEDED job has a result",
                reason="JOB_NOT_SUCCEEDED",
                metadata={"job_id": record.job_id, "state": record.state.value},
            )
        if record.result_ref is not None:
            ref = record.result_ref
            first = True
            async for chunk in self._store.chunks(record.tenant, ref.ref):
                yield _result_message(chunk, ref if first else None)
                first = False
            if first:  # an empty result still announces its reference
                yield _result_message(b"", ref)
            return
        data = tensor_pb2.InferOutputs(
            outputs=[to_output_proto(t, raw=True) for t in record.outputs]
        ).SerializeToString()
        inline = BlobRef(ref="", size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        for start in range(0, max(len(data), 1), INLINE_CHUNK_BYTES):
            yield _result_message(data[start : start + INLINE_CHUNK_BYTES], inline if start == 0 else None)


def _result_message(chunk: bytes, ref: BlobRef | None) -> job_service_pb2.ReadResultResponse:
    message = job_service_pb2.ReadResultResponse(chunk=chunk)
    if ref is not None:
        message.ref.CopyFrom(job_pb2.BlobRef(ref=ref.ref, size_bytes=ref.size_bytes, sha256=ref.sha256))
    return message
