"""The scheduler's side of the claim check: inputs given by reference are read and decoded when a
job is dispatched (work orders carry tensors; the batcher knows nothing of NATS), results over
scheduler.inline_result_max_bytes are stored as objects ("<tenant>/out/<job_id>", kept for the
job's result retention after its end), and a sweeper deletes objects whose expiry passed."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog
from google.protobuf.message import DecodeError

from asyncinfer import ranged_inputs
from asyncinfer.blob_meta import RESULT_CHUNK_BYTES, BlobCorrupt, result_ref
from asyncinfer.blob_sweep import sweep
from asyncinfer.blobs import BlobStore, parse_inputs
from asyncinfer.config import Config
from asyncinfer.errors import AsyncInferError, InvalidArgument, NotFound
from asyncinfer.jobs import BlobRef, JobError, JobRecord, WorkEnvelope
from asyncinfer.supervision import Supervisor, cancel_and_wait
from asyncinfer.tensor_codec import decode_tensors, to_output_proto
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import tensor_pb2

log = structlog.get_logger("asyncinfer.scheduler.blobs")

DEFAULT_SWEEP_INTERVAL_S = 60.0
# An upload's chunks without a meta are an orphan once no chunk came for this many times the
# gateway's idle-upload timeout (a live upload sends one at least that often), and at least:
ORPHAN_IDLE_FACTOR = 4
MIN_ORPHAN_AGE_S = 300.0


def orphan_age_s(config: Config) -> float:
    return max(ORPHAN_IDLE_FACTOR * config.gateway.upload_idle_timeout_s, MIN_ORPHAN_AGE_S)


def _job_error(error: AsyncInferError, *, retriable: bool) -> JobError:
    return JobError.from_exception(error, retriable=retriable)


def _encode_outputs(outputs: Sequence[Tensor]) -> bytes:
    return tensor_pb2.InferOutputs(outputs=[to_output_proto(t, raw=True) for t in outputs]).SerializeToString()


class ClaimCheckIO:
    """Reads inputs and stores results for the job flow."""

    def __init__(self, store: BlobStore, config: Config) -> None:
        self._store = store
        self._config = config

    async def resolve(self, envelope: WorkEnvelope) -> WorkEnvelope | JobError:
        """The envelope with its referenced inputs filled in, or why it cannot run: a gone or
        unreadable input is final (NOT_FOUND / INVALID_ARGUMENT), NATS trouble is retriable."""
        ref = envelope.input_ref
        if ref is None:
            return envelope
        try:
            _, data = await self._store.read(envelope.tenant, ref.ref, max_bytes=self._config.gateway.max_upload_bytes)
            if ranged_inputs.is_ranged(data):
                inputs = await self._read_range(envelope.tenant, ranged_inputs.decode(data))
            else:
                message = await asyncio.to_thread(parse_inputs, data)
                del data
                inputs = tuple(decode_tensors(message.inputs, "input_ref.inputs"))
        except DecodeError:
            error = InvalidArgument("the uploaded content is not an InferInputs message", reason="INPUT_REF_UNREADABLE")
            return _job_error(error, retriable=False)
        except (NotFound, InvalidArgument) as exc:
            return _job_error(exc, retriable=False)
        except BlobCorrupt as exc:
            # Possibly a replica that was behind: worth another attempt.
            return _job_error(exc, retriable=True)
        except AsyncInferError as exc:
            return _job_error(exc, retriable=True)
        return WorkEnvelope(
            job_id=envelope.job_id,
            tenant=envelope.tenant,
            model_name=envelope.model_name,
            model_version=envelope.model_version,
            priority=envelope.priority,
            create_time=envelope.create_time,
            max_attempts=envelope.max_attempts,
            inputs=inputs,  # the order carries tensors: the batcher knows no object store
            deadline=envelope.deadline,
            execution_timeout_s=envelope.execution_timeout_s,
        )

    async def _read_range(self, tenant: str, ranged: ranged_inputs.RangedInputs) -> tuple[Tensor, ...]:
        """A batch chunk named as rows of its NPY upload (asyncinfer.ranged_inputs)."""
        data = await self._store.read_range(
            tenant, ranged.source, ranged.byte_offset, ranged.byte_length, sha256=ranged.source_sha256
        )
        # Off the loop: a file whose dtype differs from the model's is converted (MBs per chunk).
        return tuple(await asyncio.to_thread(ranged.tensors, data))

    async def store_result(self, record: JobRecord, outputs: Sequence[Tensor], now: float) -> BlobRef:
        """Stores the outputs as a serialized InferOutputs, kept until the job's end plus its
        retention; the record then carries only the reference. Raises Unavailable on NATS trouble
        (the result is then not stored and the attempt's message comes back)."""
        data = await asyncio.to_thread(_encode_outputs, outputs)
        return await self._store.put_bytes(
            record.tenant,
            result_ref(record.job_id),
            data,
            expires_at=now + record.result_retention_s,
            chunk_bytes=RESULT_CHUNK_BYTES,
        )


class BlobSweeper:
    """Deletes expired claim-check objects every interval_s (a supervised loop; `stop` awaits it)."""

    def __init__(
        self,
        store: BlobStore,
        supervisor: Supervisor,
        *,
        interval_s: float = DEFAULT_SWEEP_INTERVAL_S,
        orphans_after_s: float | None = None,
    ) -> None:
        self._store = store
        self._supervisor = supervisor
        self._interval_s = interval_s
        self._orphans_after_s = orphans_after_s
        self._task: asyncio.Task[None] | None = None
        self.swept = 0

    def start(self) -> None:
        if self._task is None:
            self._task = self._supervisor.start("scheduler-blob-sweeper", self._run())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                removed = await sweep(self._store, orphans_after_s=self._orphans_after_s)
            except Exception:
                log.exception("blob_sweep_failed")
                continue
            self.swept += removed
            if removed:
                log.info("blobs_swept", removed=removed)


# Work orders carry resolved inputs (up to gateway.max_upload_bytes) and results come back the
# same way: the scheduler's server and the batcher's channel allow that much, plus framing.
WORK_MESSAGE_HEADROOM_BYTES = 1024 * 1024
GRPC_MESSAGE_LIMIT_BYTES = 2**31 - 1


def work_message_bytes(config: Config, floor_bytes: int = 64 * 1024 * 1024) -> int:
    """The max message length both ends of the WorkerService stream use."""
    wanted = max(floor_bytes, config.gateway.max_upload_bytes + WORK_MESSAGE_HEADROOM_BYTES)
    return min(wanted, GRPC_MESSAGE_LIMIT_BYTES)
