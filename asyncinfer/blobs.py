"""The claim-check store: large inputs and results as objects in a JetStream Object Store bucket.

Names are tenant-scoped: "<tenant>/in/<id>" for uploads and "<tenant>/out/<job_id>" for results.
Callers only ever see the part after the tenant ("in/<id>", "out/<job_id>"), and every lookup
prefixes the caller's own tenant, so a reference can never reach another tenant's object: another
tenant's reference and an unknown one are the same NOT_FOUND.

BlobStore is the store callers use. Its reads are asyncinfer.blob_reader's (the stream's chunks or
a file of the objects' directory, wherever the object's meta says), its puts asyncinfer.blob_writer's
(the Object Store's wire layout, nothing partial left on a failure); this module holds what an
object's life adds to them: expiry, the batches that hold an upload, and deletes. Expiry, holds,
compare-and-sets, tombstones and the errors are the same for an object in chunks and one in a file.

Expiry lives in the meta's headers (`Asyncinfer-Expires-At`, Unix seconds). Reads refuse an
object past it (…_EXPIRED) and the sweep (asyncinfer.blob_sweep) deletes such objects. Extending and sweeping are
compare-and-set on the meta message's subject sequence, so a sweep can never delete an object
that a submit has just extended, and a submit can never extend one the sweep has just deleted.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import structlog

from asyncinfer.blob_files import in_directory
from asyncinfer.blob_meta import BlobInfo, blob_not_found, meta_subject, object_name
from asyncinfer.blob_reader import NATS_FAILURES
from asyncinfer.blob_writer import ROLLUP_HEADERS, BlobWriter
from asyncinfer.config import NatsConfig
from asyncinfer.contract import BATCHES_HEADER, EXPIRES_HEADER
from asyncinfer.contract import EXPECTED_LAST_SUBJECT_SEQUENCE_HEADER as EXPECTED_LAST_SUBJECT_SEQUENCE
from asyncinfer.errors import Unavailable
from asyncinfer.jobs import BlobRef
from asyncinfer.nats import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE, APIError, Client, NotFoundError, api
from asyncinfer.nats.streams import declaration, store_full
from asyncinfer.v1 import tensor_pb2

log = structlog.get_logger("asyncinfer.blobs")

WRONG_LAST_SEQUENCE = 10071


def parse_inputs(data: bytearray) -> tensor_pb2.InferInputs:
    """An uploaded InferInputs, parsed in place (protobuf reads any buffer; its stub says bytes).
    Raises DecodeError. Slow for large inputs: run it in a thread."""
    return tensor_pb2.InferInputs.FromString(data)  # type: ignore[arg-type]


async def ensure_objects_bucket(nc: Client, config: NatsConfig) -> BlobStore:
    """The claim-check bucket (created on first use), as a BlobStore; its objects' directory, when
    configured, checked (ConfigError when it is missing or cannot be written)."""
    js = nc.jetstream()

    async def declare(_: float) -> BlobStore:
        stream = OBJ_STREAM_TEMPLATE.format(bucket=config.objects_bucket)
        try:
            await js.stream_info(stream)
        except NotFoundError:
            await js.create_object_store(
                config.objects_bucket,
                api.ObjectStoreConfig(
                    description="asyncinfer claim check: uploaded inputs and large results, per tenant",
                    storage=api.StorageType.FILE,
                    replicas=config.replicas,
                ),
            )
            log.info("bucket_created", bucket=config.objects_bucket)
        return BlobStore(nc, config.objects_bucket, directory=config.objects_directory)

    store = await declaration(declare, retry_for_s=config.connect_timeout_s, what="declare the objects bucket")
    if store.files is not None:
        await asyncio.to_thread(store.files.check)
    return store


class BlobStore(BlobWriter):
    """The claim-check store: reads (BlobReader), puts (BlobWriter), and here expiry, holds and
    deletes."""

    @classmethod
    def of(cls, nc: Client, config: NatsConfig) -> BlobStore:
        """The configured store, its directory (if any) checked: ConfigError when it is missing or
        cannot be written (a service's start)."""
        store = cls(nc, config.objects_bucket, directory=config.objects_directory)
        if store.files is not None:
            store.files.check()
        return store

    # --- expiry -----------------------------------------------------------------------------

    async def extend(self, tenant: str, ref: str, expires_at: float) -> BlobInfo:
        """Moves the object's expiry to at least expires_at (never earlier), compare-and-set
        against the sweeper; NotFound if it is gone or already expired."""
        while True:
            info = await self.info(tenant, ref)
            if info.expires_at is None or info.expires_at >= expires_at:
                return info
            try:
                await self._rewrite_meta(info, expires_at=expires_at)
            except APIError as exc:
                if exc.err_code == WRONG_LAST_SEQUENCE:
                    continue  # the sweeper or another submit wrote first: look again
                raise Unavailable(f"cannot extend the object's retention: {exc}") from exc
            except NATS_FAILURES as exc:
                raise Unavailable(f"cannot extend the object's retention: {exc}") from exc
            return info

    async def hold_for_batch(
        self,
        tenant: str,
        ref: str,
        batch_id: str,
        *,
        still_reading: Callable[[tuple[str, ...]], Awaitable[Sequence[str]]] | None = None,
    ) -> BlobInfo:
        """Names the batch on the upload's meta (BATCHES_HEADER), compare-and-set like extend, so
        that a DeleteInput racing it looks again and sees the batch; NotFound if it is gone or
        already expired; StoreFullError when the store has no room for the write.

        The same write drops the batches named before that `still_reading` (given those, it keeps
        the ones that may still read the upload) does not keep: the list held every batch ever
        created over the upload (a nightly batch over one file grew it, a header, without bound,
        and DeleteInput read every one's record). A create racing this one makes the write fail
        its compare-and-set; both look again, so no batch named meanwhile is dropped unasked."""
        while True:
            info = await self.info(tenant, ref)
            if batch_id in info.batches:
                return info
            kept = info.batches
            if still_reading is not None and kept:
                kept = tuple(await still_reading(kept))
            try:
                await self._rewrite_meta(info, batches=(*kept, batch_id))
            except APIError as exc:
                if exc.err_code == WRONG_LAST_SEQUENCE:
                    continue
                full = store_full(exc)
                if full is not None:
                    raise full from exc
                raise Unavailable(f"cannot mark the upload as the batch's input: {exc}") from exc
            except NATS_FAILURES as exc:
                raise Unavailable(f"cannot mark the upload as the batch's input: {exc}") from exc
            return info

    async def delete(self, tenant: str, ref: str) -> None:
        info = await self._info_or_none(object_name(tenant, ref))
        if info is not None:
            await self.remove(info)

    async def delete_live(
        self, tenant: str, ref: str, *, check: Callable[[BlobInfo], Awaitable[None]] | None = None
    ) -> BlobRef:
        """Deletes the tenant's object (expired or not) and returns what it was; NotFound when the
        tenant has none of that name (or it is already deleted). `check` may refuse the object as
        read (raising); a write racing the tombstone (an extension, a batch's mark) wins its
        compare-and-set or loses it, and the delete looks (and checks) again."""
        name = object_name(tenant, ref)
        while True:
            info = await self._info_or_none(name)
            if info is None or info.deleted:
                raise blob_not_found(ref)
            if check is not None:
                await check(info)
            try:
                await self.remove(info)
            except APIError as exc:
                if exc.err_code == WRONG_LAST_SEQUENCE:
                    continue
                if store_full(exc) is None:
                    raise Unavailable(f"cannot delete the object: {exc}") from exc
                # No room for a tombstone, which is when room is most wanted: purges need none.
                # Chunks first, so that a crash between the two leaves a meta (which reads as
                # corrupt and is deleted again or swept), never chunks nothing names.
                try:
                    await self._purge_object(info)
                except NATS_FAILURES as purge_failed:
                    raise Unavailable(f"cannot delete the object: {purge_failed}") from purge_failed
            except NATS_FAILURES as exc:
                raise Unavailable(f"cannot delete the object: {exc}") from exc
            return info.ref

    async def remove(self, info: BlobInfo) -> None:
        """A tombstone first (compare-and-set, so an extension made meanwhile wins), then the
        chunks, then the meta subject itself: nothing of the object is left in the stream."""
        if not info.deleted:
            await self._rewrite_meta(info, deleted=True)
        await self._purge_object(info)

    async def _purge_object(self, info: BlobInfo) -> None:
        if not in_directory(info):
            await self._js.purge_stream(
                self.stream, subject=OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=info.nuid)
            )
        elif self.files is not None:
            await asyncio.to_thread(self.files.unlink, info.nuid)
        else:
            # No directory here to unlink its file from: the meta goes all the same (the delete is
            # NATS's), and the file, named by no meta, is the sweep's orphan where a directory is set.
            log.warning("blob_file_left_to_sweep", name=info.name, setting="nats.objects_directory")
        await self._js.purge_stream(self.stream, subject=meta_subject(self.bucket, info.name))
        log.info("blob_deleted", name=info.name, size_bytes=info.ref.size_bytes)

    # --- meta messages ----------------------------------------------------------------------

    async def _rewrite_meta(
        self,
        info: BlobInfo,
        *,
        expires_at: float | None = None,
        deleted: bool = False,
        batches: tuple[str, ...] | None = None,
    ) -> None:
        obj = dict(info.meta)
        if deleted:
            obj["deleted"] = True
        if expires_at is not None:
            obj["headers"] = {**(obj.get("headers") or {}), EXPIRES_HEADER: [repr(expires_at)]}
        if batches is not None:
            obj["headers"] = {**(obj.get("headers") or {}), BATCHES_HEADER: list(batches)}
        headers: dict[str, Any] = {**ROLLUP_HEADERS, EXPECTED_LAST_SUBJECT_SEQUENCE: str(info.meta_sequence)}
        await self._js.publish(meta_subject(self.bucket, info.name), json.dumps(obj).encode(), headers=headers)
