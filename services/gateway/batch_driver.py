"""The batch driver: a loop in every gateway that moves each running batch on (docs/BATCHES.md).

Each tick, per batch: VALIDATING is prepared (services.gateway.batch_prepare); otherwise the jobs
of its queued chunks are read, their outcomes applied (asyncinfer.batches.settle_chunks: done,
skipped, or split in halves), waiting chunks submitted up to batches.chunks_in_flight, a
cancelled batch's jobs cancelled, a batch past its completion window stopped from submitting; and
once no chunk is left waiting or queued the batch takes its terminal state. The record is then
written with one compare-and-set: a driver that lost the race (another gateway drives the same
batch) reads again next tick. What a tick does is derived from durable state alone (the record,
the chunks' jobs, whose IDs follow from the batch and the range), so a gateway killed at any
point leaves nothing that the next tick of any gateway cannot finish: a chunk submitted twice is
one job (the same ID; Nats-Msg-Id and the existing record), a chunk's outputs are read from its
job's result only when the files are read. The winner of a terminal write enqueues the batch's
webhook (services.gateway.batch_callbacks); a terminal record whose webhook is not known to be
enqueued is taken on again by the adoption pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable

import structlog

from asyncinfer import batches
from asyncinfer.batch_webhooks import callback_due
from asyncinfer.batches import BatchRecord, BatchState, Chunk, ChunkOutcome, ChunkStatus, ReadProgress, chunk_job_id
from asyncinfer.blobs import BlobStore
from asyncinfer.config import Config, ModelConfig
from asyncinfer.errors import AsyncInferError, FailedPrecondition
from asyncinfer.failure_lines import FailureLines, unreachable
from asyncinfer.job_store import NATS_FAILURES, JobStore, UnreadableOnce
from asyncinfer.jobs import BATCH_LABEL, CHUNK_LABEL, JobRecord, job_key
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.nats import Client as NatsClient
from asyncinfer.supervision import cancel_and_wait, end_if_cancelled
from asyncinfer.tracing import AttributeValue, TraceSpan, Tracing
from services.gateway import transitions
from services.gateway.batch_callbacks import BatchCallbacks
from services.gateway.batch_files import first_run_errors
from services.gateway.batch_metrics import BatchMetrics
from services.gateway.batch_prepare import Preparer
from services.gateway.batch_store import BatchConflict, BatchStore, UnreadableBatch, batch_key
from services.gateway.chunk_ends import BatchKey, ChunkEnds
from services.gateway.submit import JobSubmitter
from services.gateway.submit_request import SubmitRequest
from services.gateway.transitions import Expiry

log = structlog.get_logger("asyncinfer.gateway.batches")

CANCELLED_MESSAGE = "the batch was cancelled before this record ran"
# The waits before a failed preparation is tried again (doubling).
PREPARE_RETRY_FIRST_S = 0.5
PREPARE_RETRY_MAX_S = 30.0
EXPIRED_MESSAGE = "the batch's completion window passed before this record ran"


class BatchDriver:
    def __init__(
        self,
        config: Config,
        store: BatchStore,
        preparer: Preparer,
        *,
        records: JobStore,
        expiry: Expiry,
        submitter: JobSubmitter,
        nc: NatsClient,
        metrics: BatchMetrics | None = None,
        callbacks: BatchCallbacks | None = None,
        chunk_ends: ChunkEnds | None = None,
        blobs: BlobStore | None = None,
        clock: Callable[[], float] = time.time,
        tracing: Tracing | None = None,
    ) -> None:
        self._tracing = tracing or Tracing.off()
        self._config = config
        self._settings = config.batches
        self._store = store
        self._preparer = preparer
        self._records = records
        self._expiry = expiry
        self._submitter = submitter
        self._nc = nc
        self._callbacks = callbacks
        self._chunk_ends = chunk_ends
        self._blobs = blobs
        self._clock = clock
        # A batch's cancel cancels each of its queued jobs: a notice not sent said a line per job.
        self._cancel_lines = RepeatedLines()
        self._driven: set[BatchKey] = set()
        self._due: set[BatchKey] = set()  # batches whose next tick is at once (new, cancelled, prepared)
        self._wake = asyncio.Event()
        self._preparing: dict[tuple[str, str], asyncio.Task[None]] = {}
        # Batches whose preparation failed: how many times in a row, and the time.monotonic() before
        # which it is not tried again (it was tried again at once, 400 times a second, rereading the
        # whole upload each time, where its failure stayed: a full store, a line that broke the parser).
        self._prepare_failed: dict[tuple[str, str], tuple[int, float]] = {}
        # What the last tick read or wrote of each running batch (the gauges of running batches).
        # An ended one leaves it at once, though it is driven on until its webhook is enqueued.
        self._seen: dict[tuple[str, str], BatchRecord] = {}
        self._tick_failures = FailureLines()
        # Batches whose record this release cannot decode (a later release's, or corrupted): not
        # driven, and told once each (an adoption pass reads them again, every pass) until an
        # adoption pass reads the record readable.
        self._unreadable = UnreadableOnce("batch_driver", event="batch_unreadable")
        self.rounds = 0  # the loop's wake-ups (an idle gateway's are counted by a test)
        self._metrics = metrics
        if metrics is not None:
            metrics.watch(lambda: list(self._seen.values()))

    def drive(self, tenant: str, batch_id: str) -> None:
        """Takes a batch on at once (a new one, or one just cancelled)."""
        self._driven.add((tenant, batch_id))
        self._due.add((tenant, batch_id))
        self._wake.set()

    async def run(self) -> None:
        hearing = None
        if self._chunk_ends is not None:
            hearing = asyncio.create_task(self._hear_chunk_ends(self._chunk_ends), name="batch-chunk-ends")
        try:
            await self._drive()
        finally:
            # Preparations are this loop's: stopped with it (a later driver prepares again).
            await cancel_and_wait([*self._preparing.values(), *([hearing] if hearing is not None else [])])

    async def _hear_chunk_ends(self, chunk_ends: ChunkEnds) -> None:
        try:
            await chunk_ends.run(self._wake.set)
        except Exception:  # the ticks read every chunk from now on
            log.exception("batch_chunk_ends_failed")

    async def _drive(self) -> None:
        next_adopt = 0.0
        next_full = 0.0
        while True:
            end_if_cancelled()  # a stop's cancellation that the last round's NATS request lost
            self.rounds += 1
            # Cleared before the ticks: a wake during them (a batch prepared, a chunk ended) is
            # another round at once.
            self._wake.clear()
            now = time.monotonic()
            if now >= next_adopt:
                next_adopt = now + self._settings.adopt_interval_s
                await self._adopt()
            every_batch = now >= next_full
            if every_batch:
                next_full = now + self._settings.drive_interval_s
            due, self._due = self._due, set()
            with_ends = self._chunk_ends.batches_with_ends if self._chunk_ends is not None else set()
            for tenant, batch_id in list(self._driven):
                key = (tenant, batch_id)
                full = every_batch or key in due
                if not full and key not in with_ends:
                    continue
                try:
                    # Between full ticks, a batch only settles the chunk ends it heard (no reads).
                    if await self.tick(tenant, batch_id, full=full):
                        self._let_go(key)
                except BatchConflict:
                    continue  # another gateway wrote first: read again next tick
                except UnreadableBatch as exc:  # rewritten by a later release: a gateway of it drives it
                    self._let_go(key)
                    self._unreadable.say(exc, tenant=tenant)
                except Exception as exc:
                    if isinstance(exc, (AsyncInferError, OSError)) and unreachable(exc) is None:
                        log.warning("batch_tick_failed", batch_id=batch_id, tenant=tenant, error=str(exc))
                    else:
                        # NATS out of reach fails every batch's tick, each tick: a line per interval.
                        self._tick_failures.failed(log, "batch_tick_failed", exc, batch_id=batch_id, tenant=tenant)
            if self._wake.is_set():
                continue
            # With no batch to drive a full tick has nothing to read: the loop sleeps until a batch
            # is created, cancelled or prepared here (each wakes it) or the next adoption pass. It
            # woke every drive_interval_s (0.2 s), all day, on a gateway that ran no batch.
            next_round = next_full if self._driven else next_adopt
            try:
                async with asyncio.timeout(max(next_round - time.monotonic(), 0.0)):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _adopt(self) -> None:
        """Batches that no gateway may be driving (a new gateway, or another one died): every
        record not yet terminal."""
        # Answer by answer (100,000 keys at most each): a listing that fails part way keeps what
        # it adopted; so does a record read that fails, and the next pass reads it again. That
        # read's failure ended the driver, and with it the gateway: one started while the batches
        # bucket elected a leader (a node lost), with a batch running, died at its first pass.
        async with contextlib.aclosing(self._store.key_pages()) as pages:
            while True:
                try:
                    keys = await anext(pages, None)
                except AsyncInferError as exc:
                    log.warning("batch_adopt_failed", error=str(exc))
                    return
                if keys is None:
                    return
                for tenant, batch_id in keys:
                    if (tenant, batch_id) in self._driven:
                        continue
                    try:
                        record = await self._store.get(tenant, batch_id)
                    except UnreadableBatch as exc:
                        # That one alone is left: it was the decoder's ValueError, which ended the
                        # driver, and the gateway, at every pass (a later release's state during a
                        # rolling upgrade, or a corrupted value).
                        self._unreadable.say(exc, tenant=tenant)
                        continue
                    except AsyncInferError as exc:  # Unavailable: NATS away, or no leader yet
                        log.warning("batch_adopt_failed", batch_id=batch_id, tenant=tenant, error=str(exc))
                        return
                    self._unreadable.forget(batch_key(tenant, batch_id))  # said again if it turns unreadable again
                    # A terminal one whose webhook is not known to be enqueued: its gateway died between.
                    if record is not None and (not record.state.is_terminal or callback_due(record)):
                        self._driven.add((tenant, batch_id))

    def _let_go(self, key: BatchKey) -> None:
        """Drives the batch no more (ended, or unreadable here)."""
        self._driven.discard(key)
        self._seen.pop(key, None)
        self._prepare_failed.pop(key, None)
        if self._chunk_ends is not None:
            self._chunk_ends.forget_batch(key)

    async def tick(self, tenant: str, batch_id: str, *, full: bool = True) -> bool:
        """One step of the batch; True when it is terminal (nothing left to drive). A full tick
        reads every queued chunk's job; otherwise only the chunk ends heard are settled."""
        if self._chunk_ends is not None:
            self._chunk_ends.take((tenant, batch_id))
        record = await self._store.get(tenant, batch_id)
        if record is None:
            return True
        if record.state.is_terminal:
            self._seen.pop((tenant, batch_id), None)
            return await self._ended(record)
        self._seen[(tenant, batch_id)] = record
        now = self._clock()
        model = self._submitter.catalog.model(record.model_name)  # declared, or loaded at runtime
        if record.state is BatchState.VALIDATING:
            if model is None:  # the configuration changed since the batch was accepted
                failed = record.evolve(state=BatchState.FAILED, failure_message="the model is no longer served")
                return await self._ended(await self._write(record, failed.evolve(end_time=now)))
            if now >= record.expires_at:
                expired = batches.finish(record.evolve(state=BatchState.EXPIRED), now=now)
                return await self._ended(await self._write(record, expired))
            key = (tenant, batch_id)
            backoff = self._prepare_failed.get(key)
            if backoff is not None and time.monotonic() < backoff[1]:
                return False
            if key not in self._preparing:
                # Reading a large file takes a while: beside the ticks of the other batches.
                task = asyncio.create_task(self._prepare(record, model, now=now), name=f"batch-prepare-{batch_id}")
                self._preparing[key] = task
                task.add_done_callback(lambda _task: self._prepared(key))
            return False
        updated = await self._settle(record, full=full)
        if updated.state is BatchState.CANCELLING:
            updated = batches.skip_waiting(updated, code="CANCELLED", message=CANCELLED_MESSAGE)
            await self._cancel_jobs(updated)
        elif now >= updated.expires_at:
            updated = batches.skip_waiting(updated, code="DEADLINE_EXCEEDED", message=EXPIRED_MESSAGE)
        elif model is not None:
            updated = await self._submit(updated, model_rows=model.max_batch_size)
        if batches.finished(updated):
            updated = batches.finish(await self._with_run_errors(updated), now=now)
        if updated != record:
            written = await self._write(record, updated)
            if written.state.is_terminal:
                counts = written.counts
                log.info(
                    "batch_ended",
                    batch_id=batch_id,
                    state=written.state.value,
                    completed=counts.completed,
                    failed=counts.failed,
                    not_run=counts.not_run,
                )
                return await self._ended(written)
        return False

    async def _ended(self, record: BatchRecord) -> bool:
        """After the batch's terminal write (this gateway's, or one whose writer died before the
        webhook was enqueued): enqueues its webhook, then records that. True when nothing is left."""
        if self._callbacks is None or not callback_due(record):
            return True
        await self._callbacks.enqueue(record)  # Unavailable: this batch is tried again next tick
        with contextlib.suppress(BatchConflict):  # another driver recorded it first
            await self._write(record, record.evolve(callback_enqueued=True))
        return True

    async def _with_run_errors(self, record: BatchRecord) -> BatchRecord:
        """The record's first errors with those of its records that failed when run, were cancelled
        or expired (GetBatch's `first_errors`, in line order, as the error file has them): the
        preparation knew only the lines that failed validation."""
        if self._blobs is None:
            return record
        try:
            found = await first_run_errors(self._blobs, record, batches.FIRST_ERRORS_KEPT)
        except (AsyncInferError, OSError) as exc:  # the files still say it all; the batch ends anyway
            log.warning("batch_first_errors_unread", batch_id=record.batch_id, tenant=record.tenant, error=str(exc))
            return record
        if not found:
            return record
        return record.evolve(first_errors=batches.merge_first_errors(record.first_errors, found))

    def _prepared(self, key: tuple[str, str]) -> None:
        self._preparing.pop(key, None)
        self._due.add(key)
        self._wake.set()  # its next step at once

    async def _prepare(self, record: BatchRecord, model: ModelConfig, *, now: float) -> None:
        key = (record.tenant, record.batch_id)
        try:
            if self._tracing.enabled:
                written = await self._traced_prepare(record, model, now=now)
            else:
                written = await self._prepare_and_write(record, model, now=now)
        except BatchConflict:
            return  # cancelled meanwhile, or another gateway prepared it first: the next tick sees
        except (AsyncInferError, OSError, *NATS_FAILURES) as exc:
            delay = self._prepare_later(key)
            log.warning(
                "batch_prepare_failed", batch_id=record.batch_id, tenant=record.tenant, error=str(exc), retry_in_s=delay
            )
            return
        except Exception:
            delay = self._prepare_later(key)
            log.exception("batch_prepare_failed", batch_id=record.batch_id, tenant=record.tenant, retry_in_s=delay)
            return
        self._prepare_failed.pop(key, None)
        log.info("batch_prepared", batch_id=record.batch_id, state=written.state.value, chunks=len(written.chunks))

    async def _traced_prepare(self, record: BatchRecord, model: ModelConfig, *, now: float) -> BatchRecord:
        """The preparation and its write as a `prepare_batch` span, a child of the batch's CreateBatch
        span (its record keeps it, so a driver that took the batch over after a restart puts it
        there too; a batch created with tracing off: a trace of its own), naming what was read and
        the state the batch moved to: a FAILED batch, or a preparation that raised (tried again
        later), is a failed span."""
        attributes: dict[str, AttributeValue] = {
            "asyncinfer.batch_id": record.batch_id,
            "asyncinfer.tenant": record.tenant,
            "asyncinfer.model": record.model_name,
        }
        span = self._tracing.begin("prepare_batch", parent=record.traceparent, attributes=attributes)
        try:
            written = await self._prepare_and_write(record, model, now=now, span=span)
        except BatchConflict:
            # Cancelled meanwhile, or another gateway prepared it first: not a failure of the batch.
            span.set("asyncinfer.superseded", True)
            span.end()
            raise
        except asyncio.CancelledError:
            span.fail("stopped with the gateway's batch driver (the next driver prepares the batch again)")
            span.end()
            raise
        except BaseException as exc:
            span.fail(f"{type(exc).__name__}: {exc}")
            span.end()
            raise
        span.set("asyncinfer.batch_state", written.state.value)
        if written.state is BatchState.FAILED:
            span.fail(written.failure_message)
        span.end()
        return written

    async def _prepare_and_write(
        self, record: BatchRecord, model: ModelConfig, *, now: float, span: TraceSpan | None = None
    ) -> BatchRecord:
        """The preparation, its reports of how far it has read written to the record as they come
        (each over the last: a cancel or another gateway's write meanwhile is a BatchConflict that
        ends the reading), then the record it moved to, over the last report."""
        latest = record

        async def report(progress: ReadProgress) -> None:
            nonlocal latest
            latest = await self._write(latest, latest.evolve(reading=progress))

        prepared = await self._preparer.prepare(record, model, now=now, span=span, report=report)
        return await self._write(latest, prepared.evolve(reading=None, revision=latest.revision))

    def _prepare_later(self, key: tuple[str, str]) -> float:
        """After a failed preparation: how long until the next (doubling, up to PREPARE_RETRY_MAX_S)."""
        failures = self._prepare_failed.get(key, (0, 0.0))[0] + 1
        delay = min(PREPARE_RETRY_FIRST_S * 2.0 ** (failures - 1), PREPARE_RETRY_MAX_S)
        self._prepare_failed[key] = (failures, time.monotonic() + delay)
        return delay

    async def _write(self, before: BatchRecord, after: BatchRecord) -> BatchRecord:
        written = await self._store.write(after)
        key = (after.tenant, after.batch_id)
        if written.state.is_terminal:
            self._seen.pop(key, None)
        else:
            self._seen[key] = written
        if self._metrics is not None:
            self._metrics.wrote(before, written)
        return written

    def _job_key(self, record: BatchRecord, chunk: Chunk) -> str:
        return job_key(record.tenant, chunk_job_id(record.batch_id, chunk.start, chunk.end))

    async def _job(self, record: BatchRecord, chunk: Chunk) -> JobRecord | None:
        job = await self._records.get(self._job_key(record, chunk))
        return await self._expiry.settle(job) if job is not None else None

    async def _settle(self, record: BatchRecord, *, full: bool = True) -> BatchRecord:
        queued = [c for c in record.chunks if c.status is ChunkStatus.QUEUED]
        ends = self._chunk_ends
        heard = [ends.ended(self._job_key(record, c)) if ends is not None else None for c in queued]
        unheard = [c for c, job in zip(queued, heard, strict=True) if job is None]
        read = await asyncio.gather(*(self._job(record, c) for c in unheard)) if full else []
        known: list[tuple[Chunk, JobRecord | None]] = [(c, j) for c, j in zip(queued, heard, strict=True) if j]
        known += zip(unheard, read, strict=False)  # nothing read between full ticks
        outcomes = []
        lost = []
        for chunk, job in known:
            key = self._job_key(record, chunk)
            if job is None:
                lost.append(chunk.start)  # never published (a driver died in between): again
            elif job.state.is_terminal:
                outcomes.append(ChunkOutcome(chunk.start, job.state, job.error))
                if ends is not None:
                    ends.forget(key)
            elif ends is not None and not ends.watching(key):
                # Submitted before this gateway drove the batch: heard from now on (a change
                # before this is read by the next full tick).
                await ends.watch(key, (record.tenant, record.batch_id))
        settled = batches.settle_chunks(record, outcomes, max_splits=self._settings.max_splits)
        if lost:
            starts = set(lost)
            settled = settled.evolve(
                chunks=tuple(
                    Chunk(c.start, c.end) if c.start in starts and c.status is ChunkStatus.QUEUED else c
                    for c in settled.chunks
                )
            )
        return settled

    async def _submit(self, record: BatchRecord, *, model_rows: int) -> BatchRecord:
        """Submits the waiting chunks the window has room for; those refused (a full queue) wait."""
        submitted = []
        for chunk in batches.to_submit(record, window=self._settings.chunks_in_flight):
            job_id = chunk_job_id(record.batch_id, chunk.start, chunk.end)
            key = job_key(record.tenant, job_id)
            if self._chunk_ends is not None:  # before the submit: its end is heard, however soon
                await self._chunk_ends.watch(key, (record.tenant, record.batch_id))
            if await self._records.get(key) is None:
                try:
                    await self._submit_chunk(record, chunk, job_id, model_rows=model_rows)
                except AsyncInferError as exc:
                    log.info("batch_chunk_deferred", batch_id=record.batch_id, reason=exc.reason, error=exc.message)
                    if self._chunk_ends is not None:
                        self._chunk_ends.forget(key)
                    break
            submitted.append(chunk.start)
        return batches.mark_submitted(record, submitted) if submitted else record

    async def _submit_chunk(self, record: BatchRecord, chunk: Chunk, job_id: str, *, model_rows: int) -> None:
        model = self._submitter.catalog.model(record.model_name)  # declared, or loaded at runtime
        assert model is not None
        blob = await self._preparer.chunk_blob(record, chunk)
        parts = max(-(-chunk.records // max(model_rows, 1)), 1)
        request = SubmitRequest(
            model_name=record.model_name,
            model_version=record.model_version,
            input_blob=blob,
            priority=record.priority,
            deadline=record.expires_at,
            execution_timeout_s=model.default_execution_timeout_s * parts,
            result_retention_s=record.kept_until - self._clock(),
            max_attempts=record.max_attempts or model.max_attempts,
            labels={BATCH_LABEL: record.batch_id, CHUNK_LABEL: f"{chunk.start}-{chunk.end}"},
        )
        if not self._tracing.enabled:
            await self._submitter.enqueue_prepared(request, model, tenant=record.tenant, job_id=job_id)
            return
        # Each chunk job is a trace of its own, linked to the batch's CreateBatch span (which the
        # record keeps, so a driver that took the batch over after a restart links it too), not
        # a child of it: a batch's chunks are as many as its file makes, and one trace of them all
        # would grow without bound (docs/ARCHITECTURE.md, Traces). Its submit span names the batch
        # and chunk, to find them by.
        attributes: dict[str, AttributeValue] = {
            "asyncinfer.model": record.model_name,
            "asyncinfer.tenant": record.tenant,
            "asyncinfer.job_id": job_id,
            "asyncinfer.batch_id": record.batch_id,
            "asyncinfer.chunk": f"{chunk.start}-{chunk.end}",
        }
        span = self._tracing.begin("submit", attributes=attributes, links=(record.traceparent,))
        traced = dataclasses.replace(request, traceparent=span.traceparent)
        try:
            await self._submitter.enqueue_prepared(traced, model, tenant=record.tenant, job_id=job_id)
        except AsyncInferError:
            # Refused (a full queue, a full store): the chunk waits and is submitted again at a later
            # tick, so no job was made and its span is dropped unended (it would be one failed trace
            # per tick for as long as the queue stays full).
            raise
        except BaseException as exc:
            span.fail(f"{type(exc).__name__}: {exc}")
            span.end()
            raise
        span.end()

    async def _cancel_jobs(self, record: BatchRecord) -> None:
        for chunk in record.chunks:
            if chunk.status is not ChunkStatus.QUEUED:
                continue
            job = await self._job(record, chunk)
            if job is None or job.state.is_terminal or job.state.value == "CANCELLING":
                continue
            with contextlib.suppress(FailedPrecondition):  # it ended first: its outcome is read next tick
                await transitions.cancel(
                    self._records, self._nc, job, reason="batch cancelled", now=self._clock(), lines=self._cancel_lines
                )
