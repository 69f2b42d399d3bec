"""The BatchService servicer: converts at the edge (batch_convert.py), keeps the records in their
bucket (batch_store.py), hands new and cancelled batches to this gateway's driver
(batch_driver.py), and streams the files (batch_files.py)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import structlog

from asyncinfer.batches import (
    CREATE_RECORD_WITHIN_S,
    NOT_ACCEPTED_WHY,
    BatchRecord,
    BatchState,
    create_settled_after_s,
    create_settles_in_s,
    is_withdrawn,
    may_read_its_input,
    superseded_why,
    withdrawn_batch,
)
from asyncinfer.blob_meta import BlobInfo
from asyncinfer.blobs import BlobStore
from asyncinfer.config import Config
from asyncinfer.error_bounds import clip_text
from asyncinfer.errors import (
    AlreadyExists,
    AsyncInferError,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from asyncinfer.ids import is_job_id, new_job_id
from asyncinfer.job_store import JobStore, UnreadableOnce
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.nats import Client
from asyncinfer.nats.streams import StoreFullError
from asyncinfer.tracing import Tracing, traceparent_in
from asyncinfer.v1 import batch_service_pb2, batch_service_pb2_grpc
from services.gateway.auth import Authenticator
from services.gateway.batch_convert import batch_from_request, batch_to_proto, fields_unlike
from services.gateway.batch_driver import BatchDriver
from services.gateway.batch_files import error_file, output_file
from services.gateway.batch_npz import output_npz, refuse_npz
from services.gateway.batch_store import BatchConflict, BatchStore
from services.gateway.batch_watch import watch_batch
from services.gateway.callbacks import check_callback
from services.gateway.idempotency import KEY_QUOTED_BYTES, KEY_REUSED_REASON
from services.gateway.list_batches import batch_page
from services.gateway.list_jobs import say_unreadable_skipped
from services.gateway.model_catalog import ModelCatalog
from services.gateway.store_health import store_full_error

Context = grpc.aio.ServicerContext[Any, Any]
log = structlog.get_logger("asyncinfer.gateway.batches")
DEFAULT_PAGE_SIZE = 20
MAX_PAGE_SIZE = 100
# How often a create looks again for the batch that claimed its idempotency key while that batch's
# create may still write it (for up to create_settled_after_s()).
CLAIM_WAIT_STEP_S = 0.1
# Wait, find the claim stale, lose its takeover to another duplicate, wait again...; and writes of a
# create's record lost to a withdrawal (its create stalled while a duplicate took its key over).
MAX_CLAIM_ROUNDS = 4
# When a create minted its batch's ID: (monotonic, wall) clocks. A suspend stops the monotonic one
# (on Linux), a wall clock may step back; the create's bound is past when either says so.
Minted = tuple[float, float]

READABLE_FILES = (
    batch_service_pb2.BATCH_FILE_OUTPUT,
    batch_service_pb2.BATCH_FILE_ERRORS,
    batch_service_pb2.BATCH_FILE_OUTPUT_NPZ,
)


def batch_not_found(batch_id: str) -> NotFound:
    return NotFound(f"no batch {batch_id[:64]!r}", reason="BATCH_NOT_FOUND", metadata={"batch_id": batch_id[:64]})


class BatchService(batch_service_pb2_grpc.BatchServiceServicer):
    def __init__(
        self,
        config: Config,
        store: BatchStore,
        driver: BatchDriver,
        *,
        blobs: BlobStore,
        records: JobStore,
        nc: Client,
        catalog: ModelCatalog | None = None,
        clock: Callable[[], float] = time.time,
        tracing: Tracing | None = None,
    ) -> None:
        self._tracing = tracing or Tracing.off()
        self._config = config
        # The models known now: declared, or loaded at runtime (OpsService.LoadModel), as a submit's.
        self._catalog = catalog or ModelCatalog(config)
        self._store = store
        self._unreadable = UnreadableOnce(
            "list_batches", event="batch_unreadable"
        )  # ListBatches' records it cannot decode, said once each
        self._skipped_lines = RepeatedLines()  # ListBatches' pages that left such records out
        self._driver = driver
        self._blobs = blobs
        self._records = records
        self._nc = nc
        self._clock = clock
        self._authenticator = Authenticator(config.gateway.api_keys, config.gateway.default_tenant)

    def _tenant(self, context: Context) -> str:
        return self._authenticator.tenant(context.invocation_metadata() or ())

    def _proto(self, record: BatchRecord) -> batch_service_pb2.Batch:
        return batch_to_proto(record, now=self._clock())

    async def _read(self, tenant: str, batch_id: str) -> BatchRecord:
        if not is_job_id(batch_id):
            raise batch_not_found(batch_id)
        record = await self._store.get(tenant, batch_id)
        if record is None:
            raise batch_not_found(batch_id)
        return record

    async def CreateBatch(
        self, request: batch_service_pb2.CreateBatchRequest, context: Context
    ) -> batch_service_pb2.CreateBatchResponse:
        tenant = self._tenant(context)
        if not self._tracing.enabled:
            return await self._create(request, tenant, traceparent="")
        # A span of its own in the caller's trace, whose traceparent the record keeps: each chunk
        # job's trace links to it (docs/ARCHITECTURE.md, Traces: a batch's chunk jobs).
        attributes = {"asyncinfer.model": request.model_name, "asyncinfer.tenant": tenant}
        caller = traceparent_in(context.invocation_metadata())
        with self._tracing.span("create_batch", parent=caller, server=True, attributes=attributes) as span:
            response = await self._create(request, tenant, traceparent=span.traceparent)
            span.set("asyncinfer.batch_id", response.batch.batch_id)
            span.set("asyncinfer.deduplicated", response.deduplicated)
            return response

    async def _create(
        self, request: batch_service_pb2.CreateBatchRequest, tenant: str, *, traceparent: str
    ) -> batch_service_pb2.CreateBatchResponse:
        record = batch_from_request(
            request, self._config, tenant=tenant, batch_id=new_job_id(), now=self._clock(), catalog=self._catalog
        ).evolve(traceparent=traceparent)
        upload = await self._blobs.info(tenant, record.input_ref)  # NOT_FOUND (or …_EXPIRED) now, not later
        if record.callback is not None:  # as a job's: a secret to sign with, an address allowed
            await check_callback(record.callback, self._config.webhooks, tenant=tenant)
        # Minted again after the checks that may wait on others (a resolver): a create writes its
        # record within CREATE_RECORD_WITHIN_S of minting its batch's ID, or never.
        record, minted = self._mint(record)
        if record.idempotency_key:
            claimed = await self._claim(tenant, record)
            if claimed is None:
                first = await self._first_of_key(tenant, record)
                if isinstance(first, BatchRecord):
                    return await self._deduplicated(request, record, first, upload)
                record, minted = first
        for _ in range(MAX_CLAIM_ROUNDS):
            try:
                written = await self._write_new(tenant, record, minted)
            except BatchConflict:
                if not record.idempotency_key:  # a fresh ID's create: nobody else writes it
                    raise
                # Its create stalled past its bound and a duplicate took the key over, withdrawing
                # this batch first: it never runs, and this create answers what a duplicate gets.
                log.warning("batch_withdrawn_while_stalled", tenant=tenant, batch_id=record.batch_id)
                first = await self._first_of_key(tenant, record)
                if isinstance(first, BatchRecord):
                    return await self._deduplicated(request, record, first, upload)
                record, minted = first
                continue
            self._driver.drive(tenant, written.batch_id)
            return batch_service_pb2.CreateBatchResponse(batch=self._proto(written))
        raise Unavailable(
            f"idempotency key {record.idempotency_key[:64]!r} is contended; try again", reason="IDEMPOTENCY_CONTENDED"
        )

    def _mint(self, record: BatchRecord) -> tuple[BatchRecord, Minted]:
        """`record` under a new batch ID, and when it was minted: its create's bound starts then."""
        return record.evolve(batch_id=new_job_id()), (time.monotonic(), self._clock())

    async def _write_new(self, tenant: str, record: BatchRecord, minted: Minted) -> BatchRecord:
        """Names the batch on its upload, then creates its record. BatchConflict when a takeover
        of its key withdrew the batch first; any other failure frees its key (_release_key)."""
        try:
            await self._name_on_upload(tenant, record, minted)
        except BaseException:
            if record.idempotency_key:
                await self._release_key(tenant, record, sent=False)
            raise
        try:
            return await self._store.write(record)
        except BatchConflict:
            raise
        except BaseException:
            if record.idempotency_key:
                await self._release_key(tenant, record, sent=True)
            raise

    async def _name_on_upload(self, tenant: str, record: BatchRecord, minted: Minted) -> None:
        """Names the batch on its upload, within its create's bound of `minted`."""
        # Named on the upload before the record is written, so a DeleteInput from then on sees the
        # batch (and refuses while it runs, or while its create may still write it); NOT_FOUND if
        # the upload went meanwhile. Batches named before that have ended are dropped in the same
        # write.
        try:
            await self._blobs.hold_for_batch(
                tenant,
                record.input_ref,
                record.batch_id,
                still_reading=functools.partial(self._batches_reading, tenant),
            )
        except StoreFullError as full:  # as the record's write answers a full store
            raise store_full_error(full, what="the batch was not written") from None
        # Both clocks: a suspended host's monotonic clock stopped while the readers' wall clocks ran.
        if max(time.monotonic() - minted[0], self._clock() - minted[1]) >= CREATE_RECORD_WITHIN_S:
            # Past it, a duplicate may take the key over and a DeleteInput may take the upload.
            raise Unavailable(
                f"creating the batch took over {CREATE_RECORD_WITHIN_S:g} s (NATS slow to answer); "
                "no batch was created: create it again",
                reason="BATCH_CREATE_TOO_SLOW",
            )

    async def _release_key(self, tenant: str, record: BatchRecord, *, sent: bool) -> None:
        """Frees the idempotency key of a create that failed after claiming it, if the claim is
        still its own, so that a retry with the key creates the batch at once (it waited for the
        claim to go stale: 26 s). A create whose record write was `sent` (it may land later: NATS
        unanswered) first withdraws its batch, a FAILED record created under its ID, which that
        write then loses; a record found there instead (the write landed, its answer lost; or a
        takeover's withdrawal) keeps the claim. It read the record instead, and a write landing
        after that read made a batch beside the retry's. When that cannot be told, the claim goes
        stale, as a crashed create's."""
        try:
            if sent:
                withdrawal = withdrawn_batch(record, batch_id=record.batch_id, now=self._clock(), why=NOT_ACCEPTED_WHY)
                written, found = await self._store.create_first(withdrawal)
                if written is None and found is not None:
                    return
            await self._store.release(tenant, record.idempotency_key, record.batch_id)
        except AsyncInferError as exc:
            log.warning("batch_idempotency_key_not_released", tenant=tenant, batch_id=record.batch_id, error=str(exc))

    async def _claim(self, tenant: str, record: BatchRecord) -> BatchRecord | None:
        """`record` when this create claimed its idempotency key; None when another holds it."""
        holder = await self._store.claim(tenant, record.idempotency_key, record.batch_id, until=record.kept_until)
        return record if holder == record.batch_id else None

    async def _first_of_key(self, tenant: str, record: BatchRecord) -> BatchRecord | tuple[BatchRecord, Minted]:
        """The batch holding the idempotency key, once its create has written it; or, when the
        create that claimed it can no longer write it (it died, gave up, or stalled), `record`
        under a new batch ID that took the claim over, with when it was minted (its create's
        bound starts again). A live claim is waited for: UNAVAILABLE (IDEMPOTENCY_CONTENDED) if it
        has not gone stale once a create's bound has passed (its holder's clock is ahead of ours).
        A takeover first withdraws the holder's batch (_withdraw), so that a create that only
        stalled past its bound (a frozen process, a suspended host) cannot write it on waking.

        Stale means stale by two clocks: the wall clocks (the time in the holder's batch ID, its
        minting gateway's, against ours) and the server's (when it stored the claim, against its
        time now), so that a step of one gateway's clock cannot hand a live claim to a duplicate:
        two batches for one key. (It was taken over after 5 s, whatever its age.)"""
        key = record.idempotency_key
        waited_s = create_settled_after_s() + 2.0
        for _ in range(MAX_CLAIM_ROUNDS):
            until = time.monotonic() + waited_s
            while True:
                held = await self._store.holder(tenant, key)
                if held is None:  # expired or released meanwhile: claim it afresh
                    fresh, minted = self._mint(record)
                    if await self._claim(tenant, fresh) is not None:
                        return fresh, minted
                    if time.monotonic() >= until:  # claimed by another, removed again, ...
                        raise Unavailable(
                            f"idempotency key {key[:64]!r} was claimed and removed again and again for "
                            f"{waited_s:g} s; no batch was created, create it again",
                            reason="IDEMPOTENCY_CONTENDED",
                        )
                    continue
                holder, revision = held
                first = await self._store.get(tenant, holder)
                # A withdrawal is no batch: the claim moves on (a takeover, or its holder's release).
                if first is not None and not is_withdrawn(first):
                    return first
                if await self._stale(holder, revision):
                    break
                if time.monotonic() >= until:
                    raise Unavailable(
                        f"idempotency key {key[:64]!r} is still held by batch {holder}, whose create has not "
                        f"written it for {waited_s:g} s; try again",
                        reason="IDEMPOTENCY_CONTENDED",
                        metadata={"batch_id": holder},
                    )
                await asyncio.sleep(CLAIM_WAIT_STEP_S)
            # A new ID, as a fresh create's: the bound a reader applies runs from its minting.
            fresh, minted = self._mint(record)
            live = await self._withdraw(tenant, record, holder, successor=fresh.batch_id)
            if live is not None:  # its create wrote it after all: the key's batch
                return live
            taker = await self._store.take_over(tenant, key, holder, fresh.batch_id, until=fresh.kept_until)
            if taker == fresh.batch_id:
                log.warning("batch_idempotency_claim_taken_over", tenant=tenant, abandoned_batch_id=holder)
                return fresh, minted
            # Another duplicate took it over first: its create now writes the batch; wait for it.
        raise Unavailable(f"idempotency key {key[:64]!r} is contended; try again", reason="IDEMPOTENCY_CONTENDED")

    async def _withdraw(self, tenant: str, record: BatchRecord, holder: str, *, successor: str) -> BatchRecord | None:
        """Before a stale claim is taken over: the holder's batch is withdrawn, a FAILED record
        (`record`'s request, the taker's: the holder's is not kept) created where the holder's own
        would be, which the holder's create, if it only stalled, then loses (BatchConflict). The
        holder's batch when it has a record of its own after all; None when the takeover may go
        on: the batch was withdrawn, by this create or another duplicate's (or its create's own
        release), or only a marker is left."""
        withdrawal = withdrawn_batch(
            record, batch_id=holder, now=self._clock(), why=superseded_why(successor, create_settled_after_s())
        )
        _, found = await self._store.create_first(withdrawal)
        if found is None or is_withdrawn(found):
            return None
        return found

    async def _stale(self, holder: str, revision: int) -> bool:
        """Whether the claim of a batch with no record can no longer get one: past a create's bound
        by the wall clocks, and by the server's (asked only then: a message get and a stream info)."""
        if create_settles_in_s(holder, now=self._clock()) > 0:
            return False
        stored_s = await self._store.stored_age_s(self._nc, revision)
        # None: replaced or removed since it was read; the next look reads what took its place.
        return stored_s is not None and stored_s >= create_settled_after_s()

    async def _batches_reading(self, tenant: str, batch_ids: tuple[str, ...]) -> list[str]:
        """Of the batches named on an upload, those that may still read it (their records read at
        once; UNAVAILABLE when NATS cannot answer, before anything of the create is written)."""
        records = await asyncio.gather(*(self._store.get(tenant, batch_id) for batch_id in batch_ids))
        now = self._clock()
        return [b for b, r in zip(batch_ids, records, strict=True) if may_read_its_input(b, r, now=now)]

    async def _deduplicated(
        self, request: batch_service_pb2.CreateBatchRequest, record: BatchRecord, first: BatchRecord, upload: BlobInfo
    ) -> batch_service_pb2.CreateBatchResponse:
        """The batch holding the key, for a create that asks for the same batch; ALREADY_EXISTS
        for one that asks for another (as SubmitJob answers a key reused with another request): a
        retry must not quietly get a batch over another file. A retry that uploaded the same file
        again names another ref with the same content (SHA-256 and size): the same batch."""
        same_input = None
        if record.input_ref != first.input_ref:
            same_input = await self._same_content(upload, first)
        unlike = fields_unlike(request, record, first, same_input=same_input)
        if unlike:
            raise AlreadyExists(
                # As a job's (idempotency.key_reused), the fields last: what a clipped message loses
                # is the end of their list, which the metadata has whole.
                f"idempotency key {clip_text(record.idempotency_key, KEY_QUOTED_BYTES)!r} was first used for "
                f"batch {first.batch_id}, with a different request: a key can be sent again only with its first "
                "request (a retry, answered with that batch). Get that batch with GetBatch, or use a new key "
                f"for a different batch (differing: {', '.join(unlike)})",
                reason=KEY_REUSED_REASON,
                metadata={"batch_id": first.batch_id, "fields": ",".join(unlike)},
            )
        return batch_service_pb2.CreateBatchResponse(batch=self._proto(first), deduplicated=True)

    async def _same_content(self, upload: BlobInfo, first: BatchRecord) -> bool:
        """Whether this create's upload holds the bytes the first batch's does; False when that
        one is gone."""
        try:
            theirs = await self._blobs.info(first.tenant, first.input_ref)
        except NotFound:
            return False
        return (upload.ref.sha256, upload.ref.size_bytes) == (theirs.ref.sha256, theirs.ref.size_bytes)

    async def GetBatch(
        self, request: batch_service_pb2.GetBatchRequest, context: Context
    ) -> batch_service_pb2.GetBatchResponse:
        return batch_service_pb2.GetBatchResponse(
            batch=self._proto(await self._read(self._tenant(context), request.batch_id))
        )

    async def WatchBatch(
        self, request: batch_service_pb2.WatchBatchRequest, context: Context
    ) -> AsyncIterator[batch_service_pb2.WatchBatchResponse]:
        """The batch now (unless not newer than after_revision), then each write (its state,
        counts or chunks) as it is made (batch_watch.py), until the batch is terminal."""
        tenant = self._tenant(context)
        if not is_job_id(request.batch_id):  # before it names a subject: no wildcard gets through
            raise batch_not_found(request.batch_id)
        async with watch_batch(self._store.bucket, tenant, request.batch_id) as updates:
            # Subscribed first, so no write falls between this read and the feed.
            record = await self._read(tenant, request.batch_id)
            if request.after_revision > record.revision:
                message = f"after_revision {request.after_revision} is ahead of the batch's revision {record.revision}"
                raise InvalidArgument(message, [FieldViolation("after_revision", message)])
            if record.revision > request.after_revision or not request.after_revision:
                yield batch_service_pb2.WatchBatchResponse(batch=self._proto(record))
            sent = record.revision
            while not record.state.is_terminal:
                latest = await updates.next()
                if latest is None:  # deleted
                    return
                if latest.revision <= sent:
                    continue  # the feed's first message: the record already sent
                record, sent = latest, latest.revision
                yield batch_service_pb2.WatchBatchResponse(batch=self._proto(record))

    async def CancelBatch(
        self, request: batch_service_pb2.CancelBatchRequest, context: Context
    ) -> batch_service_pb2.CancelBatchResponse:
        tenant = self._tenant(context)
        while True:
            record = await self._read(tenant, request.batch_id)
            if record.state.is_terminal:
                raise FailedPrecondition(
                    f"batch {record.batch_id} already ended ({record.state.value}); there is nothing to cancel",
                    reason="BATCH_ALREADY_ENDED",
                    metadata={"batch_id": record.batch_id, "state": record.state.value},
                )
            if record.state is BatchState.CANCELLING:
                break
            try:
                record = await self._store.write(record.evolve(state=BatchState.CANCELLING))
                break
            except BatchConflict:
                continue  # the driver wrote first: decide again on what it wrote
        self._driver.drive(tenant, record.batch_id)
        return batch_service_pb2.CancelBatchResponse(batch=self._proto(record))

    async def ListBatches(
        self, request: batch_service_pb2.ListBatchesRequest, context: Context
    ) -> batch_service_pb2.ListBatchesResponse:
        tenant = self._tenant(context)
        if not 0 <= request.page_size <= MAX_PAGE_SIZE:
            message = f"page_size must be between 1 and {MAX_PAGE_SIZE} (0: {DEFAULT_PAGE_SIZE})"
            raise InvalidArgument(message, [FieldViolation("page_size", message)])
        size = request.page_size or DEFAULT_PAGE_SIZE
        if request.page_token and not is_job_id(request.page_token):  # a token is the last batch ID of a page
            message = "invalid page_token: not a token from ListBatches"
            raise InvalidArgument(message, [FieldViolation("page_token", message)], reason="INVALID_PAGE_TOKEN")
        page = await batch_page(
            self._store, tenant, after=request.page_token or None, size=size, unreadable=self._unreadable
        )
        say_unreadable_skipped(self._skipped_lines, log, "ListBatches", tenant, page.unreadable_skipped)
        return batch_service_pb2.ListBatchesResponse(
            batches=[self._proto(r) for r in page.records],
            next_page_token=page.next_page_token,
            unreadable_skipped=page.unreadable_skipped,
        )

    async def ReadBatchFile(
        self, request: batch_service_pb2.ReadBatchFileRequest, context: Context
    ) -> AsyncIterator[batch_service_pb2.ReadBatchFileResponse]:
        tenant = self._tenant(context)
        record = await self._read(tenant, request.batch_id)
        if request.file not in READABLE_FILES:
            message = "file must be BATCH_FILE_OUTPUT, BATCH_FILE_ERRORS or BATCH_FILE_OUTPUT_NPZ"
            raise InvalidArgument(message, [FieldViolation("file", message)])
        if not record.state.is_terminal:
            # A running batch's files would be partial: a download that succeeds with part of the
            # records (an NPZ's missing rows read as failed ones) passed for the whole (OpenAI's
            # Batch API has no output file before the end either).
            counts = record.counts
            raise FailedPrecondition(
                f"batch {record.batch_id} is {record.state.value} ({counts.completed + counts.failed} of "
                f"{counts.total} records done): its files are whole once it ends; watch it (WatchBatch, "
                "`asyncinfer batch watch`), or cancel it to end it with what is done",
                reason="BATCH_NOT_ENDED",
                metadata={"batch_id": record.batch_id, "state": record.state.value},
            )
        if request.file == batch_service_pb2.BATCH_FILE_OUTPUT_NPZ:
            refused = refuse_npz(record)
            if refused is not None:
                raise refused
            pieces = output_npz(self._blobs, self._records, record, self._catalog.model(record.model_name))
        elif request.file == batch_service_pb2.BATCH_FILE_OUTPUT:
            pieces = output_file(self._blobs, self._records, record)
        else:
            pieces = error_file(self._blobs, record)
        async for piece in pieces:
            yield batch_service_pb2.ReadBatchFileResponse(chunk=piece)
