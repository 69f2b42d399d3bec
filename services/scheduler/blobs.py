"""The scheduler's side of the claim check: inputs given by reference are read and decoded when a
job is dispatched (work orders carry tensors; the batcher knows nothing of NATS), results over
scheduler.inline_result_max_bytes are stored as objects ("<tenant>/out/<job_id>", kept for the
job's result retention after its end), and a sweeper deletes objects whose expiry passed."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog

from asyncinfer.blob_meta import result_ref
from asyncinfer.blob_sweep import MetaCursor, sweep
from asyncinfer.blobs import BlobStore
from asyncinfer.claim_check_io import read_inputs, store_outputs
from asyncinfer.config import Config
from asyncinfer.errors import AsyncInferError, InvalidArgument, NotFound
from asyncinfer.failure_lines import FailureLines
from asyncinfer.jobs import BlobRef, JobError, JobRecord, WorkEnvelope
from asyncinfer.supervision import Supervisor, cancel_and_wait, end_if_cancelled
from asyncinfer.tensors import Tensor

log = structlog.get_logger("asyncinfer.scheduler.blobs")

DEFAULT_SWEEP_INTERVAL_S = 60.0
# An object's chunks without a meta are an orphan once no chunk came for this many times the
# gateway's idle-upload timeout, and at least MIN_ORPHAN_AGE_S. An upload's gateway hears a piece at
# least that often (it stores a 128 KiB chunk less often: BlobStore.put then refuses the upload);
# a result's put, from memory, stores a chunk every 10 s at most and its meta 15 s after its last
# (asyncinfer.blob_writer, SLOW_PUT_CHECKED_AFTER_S): 20 times inside the bound, which also covers
# clocks up to 4 minutes apart (the sweeper's against the NATS server's stamps).
ORPHAN_IDLE_FACTOR = 4
MIN_ORPHAN_AGE_S = 300.0


def orphan_age_s(config: Config) -> float:
    return max(ORPHAN_IDLE_FACTOR * config.gateway.upload_idle_timeout_s, MIN_ORPHAN_AGE_S)


def _job_error(error: AsyncInferError, *, retriable: bool) -> JobError:
    return JobError.from_exception(error, retriable=retriable)


class ClaimCheckIO:
    """Reads inputs and stores results for the job flow (for batchers that do not: see
    batcher.claim_check_io)."""

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
            inputs = await read_inputs(
                self._store, envelope.tenant, ref.ref, max_bytes=self._config.gateway.max_upload_bytes
            )
        except (NotFound, InvalidArgument) as exc:
            return _job_error(exc, retriable=False)
        except AsyncInferError as exc:  # BlobCorrupt (maybe a replica behind) and NATS trouble
            return _job_error(exc, retriable=True)
        return WorkEnvelope(
            job_id=envelope.job_id,
            tenant=envelope.tenant,
            model_name=envelope.model_name,
            model_version=envelope.model_version,
            priority=envelope.priority,
            create_time=envelope.create_time,
            max_attempts=envelope.max_attempts,
            inputs=inputs,  # the order carries tensors: this batcher reads no object store
            deadline=envelope.deadline,
            execution_timeout_s=envelope.execution_timeout_s,
        )

    async def store_result(self, record: JobRecord, outputs: Sequence[Tensor], now: float) -> BlobRef:
        """Stores the outputs as a serialized InferOutputs, kept until the job's end plus its
        retention; the record then carries only the reference. Raises Unavailable on NATS trouble
        (the result is then not stored and the attempt's message comes back)."""
        return await store_outputs(
            self._store,
            record.tenant,
            result_ref(record.job_id),
            outputs,
            expires_at=now + record.result_retention_s,
        )

    async def delete_result(self, tenant: str, ref: str) -> bool:
        """Deletes a result object no record names (before its expiry would); False when it was
        already gone. Raises Unavailable on NATS trouble (the sweep then removes it at its expiry)."""
        try:
            await self._store.delete_live(tenant, ref)
        except NotFound:
            return False
        return True


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
        # Kept between passes, so that each reads only the metas written since the last.
        self.cursor = MetaCursor()
        self.swept = 0
        # A sweep fails every interval while NATS is out of reach: a line, not a traceback, each time.
        self._failures = FailureLines()

    def start(self) -> None:
        if self._task is None:
            self._task = self._supervisor.start("scheduler-blob-sweeper", self._run())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def _run(self) -> None:
        while True:
            end_if_cancelled()  # a stop's cancellation that the last round's NATS request lost
            await asyncio.sleep(self._interval_s)
            try:
                removed = await sweep(self._store, orphans_after_s=self._orphans_after_s, cursor=self.cursor)
            except Exception as exc:
                self._failures.failed(log, "blob_sweep_failed", exc)
                continue
            self.swept += removed
            if removed:
                log.info("blobs_swept", removed=removed)
