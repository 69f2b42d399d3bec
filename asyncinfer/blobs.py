"""The claim-check store: large inputs and results as objects in a JetStream Object Store bucket.

Names are tenant-scoped: "<tenant>/in/<id>" for uploads and "<tenant>/out/<job_id>" for results.
Callers only ever see the part after the tenant ("in/<id>", "out/<job_id>"), and every lookup
prefixes the caller's own tenant, so a reference can never reach another tenant's object: another
tenant's reference and an unknown one are the same NOT_FOUND.

Writes follow the Object Store's wire layout (what nats-py, the Go client and the `nats` CLI read):
chunks of 128 KiB on `$O.<bucket>.C.<nuid>`, then one JSON meta message (rolled up) on
`$O.<bucket>.M.<base64url(name)>`. nats-py's own `put` reads from a blocking file object in a
thread and cannot take an async stream (gRPC chunks), so this module writes the layout itself:
chunks are published as they arrive (a few acks in flight, never the whole object in memory),
the size limit and the SHA-256 are checked on the way, and on any refusal or error the chunk
subject is purged and no meta is written, so nothing partial is left.

With an objects' directory (nats.objects_directory), a new object's bytes are one file of it
instead of chunks (asyncinfer.blob_files), its meta written here as ever and saying so
(BYTES_IN_HEADER): expiry, holds, compare-and-sets, tombstones and the errors below are the same
for both, and every object is read from where its own meta says.

Expiry lives in the meta's headers (`Asyncinfer-Expires-At`, Unix seconds). Reads refuse an
object past it (…_EXPIRED) and the sweep (asyncinfer.blob_sweep) deletes such objects. Extending and sweeping are
compare-and-set on the meta message's subject sequence, so a sweep can never delete an object
that a submit has just extended, and a submit can never extend one the sweep has just deleted.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import structlog

from asyncinfer.blob_files import (
    DIRECTORY,
    ObjectFiles,
    in_directory,
    io_failure,
    not_configured,
    off_loop,
    write_all,
)
from asyncinfer.blob_meta import (
    CHUNK_BYTES,
    INPUT_KIND,
    BlobCorrupt,
    BlobInfo,
    blob_expired,
    blob_not_found,
    chunk_sequences,
    chunks_name,
    cut_short,
    meta_subject,
    object_name,
    parse_meta,
    sequence_runs,
    upload_too_large,
)
from asyncinfer.config import NatsConfig
from asyncinfer.contract import (
    BATCHES_HEADER,
    BYTES_IN_HEADER,
    CHUNK_SEQUENCES_HEADER,
    EXPIRES_HEADER,
    ROLLUP_HEADER,
    SHA256_HEADER,
)
from asyncinfer.contract import EXPECTED_LAST_SUBJECT_SEQUENCE_HEADER as EXPECTED_LAST_SUBJECT_SEQUENCE
from asyncinfer.errors import FieldViolation, InvalidArgument, NotFound, Unavailable
from asyncinfer.jobs import BlobRef
from asyncinfer.nats import (
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DIGEST_TEMPLATE,
    OBJ_STREAM_TEMPLATE,
    APIError,
    Client,
    JetStreamContext,
    NatsError,
    NotFoundError,
    api,
)
from asyncinfer.nats.requests import direct_get, js_publish
from asyncinfer.nats.streams import declaration, store_full
from asyncinfer.v1 import tensor_pb2

log = structlog.get_logger("asyncinfer.blobs")

# Chunk publishes awaiting their ack at once: enough to hide the round trip, few enough to bound memory.
PUBLISH_WINDOW = 8
# A stored chunk's publish waits this long for its ack: nats-py's JetStream default, which the
# chunks were published under before they went through the adapter (asyncinfer.nats.requests).
CHUNK_PUBLISH_TIMEOUT_S = 5.0
CHUNK_READ_TIMEOUT_S = 5.0  # a chunk's read from the stream leader, likewise
# A chunk's direct get, which any replica may answer (allow_direct, set by nats-py on every object
# store): the server hands a client's request to a random member of the stream's direct-get queue
# group, local or not, so a replica that hangs (SIGSTOP, a stalled disk) gets a third of them, and
# one that is behind (just resumed, catching up) answers 404 for chunks the leader acknowledged.
# Short, because a direct get that fails or misses is asked again of the leader (`_get_chunk`).
DIRECT_READ_TIMEOUT_S = 1.0
# A result's put that took this long reads its first chunk back before its meta. A live put stores
# a chunk at least every 10 s and its meta within 15 s of its last chunk (each publish is acked
# within CHUNK_PUBLISH_TIMEOUT_S or the put fails), far inside the sweep's orphan bound (at least
# 300 s) while its process runs; one paused meanwhile (SIGSTOP, a frozen VM) counts none of those
# timeouts and may find its chunks purged as a dead put's. Under this, nothing is read back.
SLOW_PUT_CHECKED_AFTER_S = 60.0
ROLLUP_HEADERS: dict[str, Any] = {ROLLUP_HEADER: "sub"}
WRONG_LAST_SEQUENCE = 10071
NATS_FAILURES = (NatsError, asyncio.TimeoutError)


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


class BlobStore:
    def __init__(self, nc: Client, bucket: str, *, directory: str | None = None) -> None:
        """`directory`: the objects' directory (nats.objects_directory) new objects' bytes go to;
        None, the stream's chunks. Objects stored either way are read either way."""
        self._nc = nc  # for stream info answers past the first 100,000 subjects (the sweep's)
        self._js = nc.jetstream()
        self.bucket = bucket
        self.stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
        self.files = ObjectFiles(directory, bucket) if directory else None

    @classmethod
    def of(cls, nc: Client, config: NatsConfig) -> BlobStore:
        """The configured store, its directory (if any) checked: ConfigError when it is missing or
        cannot be written (a service's start)."""
        store = cls(nc, config.objects_bucket, directory=config.objects_directory)
        if store.files is not None:
            store.files.check()
        return store

    @property
    def js(self) -> JetStreamContext:
        """The JetStream context it reads and writes through (the sweep's: asyncinfer.blob_sweep)."""
        return self._js

    @property
    def nc(self) -> Client:
        """The NATS client under it: the sweep's requests that nats-py's JetStream context cannot
        make (a stream info's subjects past the first 100,000, asyncinfer.nats.streams.subject_pages)."""
        return self._nc

    # --- writing ----------------------------------------------------------------------------

    async def put(
        self,
        tenant: str,
        ref: str,
        chunks: AsyncIterable[bytes | memoryview],
        *,
        expires_at: float,
        max_bytes: int,
        expected_sha256: str = "",
        expected_size: int | None = None,
        before_commit: Callable[[], Awaitable[None]] | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> BlobRef:
        """Streams `chunks` into the object `ref` of `tenant`, replacing any object of that name.

        Raises InvalidArgument (UPLOAD_TOO_LARGE past max_bytes, SHA256_MISMATCH, SIZE_MISMATCH),
        StoreFullError when JetStream has no room, and Unavailable when NATS fails otherwise; in
        every failure, and on cancellation, the chunks (or file) written so far are purged and no
        meta is written. `before_commit` runs once every chunk
        is stored and before the meta makes the object visible; what it raises refuses the
        object the same way. `chunk_bytes`: the size of its stored chunks (its meta says so to
        readers). With an objects' directory, the bytes go to a file of it instead (_put_file)."""
        name = object_name(tenant, ref)
        nuid = chunks_name(tenant, ref)
        if self.files is not None:
            return await self._put_file(
                self.files,
                name,
                ref,
                nuid,
                chunks,
                expires_at=expires_at,
                max_bytes=max_bytes,
                expected_sha256=expected_sha256,
                expected_size=expected_size,
                before_commit=before_commit,
                chunk_bytes=chunk_bytes,
            )
        chunk_subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=nuid)
        digest = hashlib.sha256()
        total = 0
        count = 0
        pending: list[asyncio.Task[int]] = []
        sequences: list[int] = []
        buffer = bytearray()
        started = time.monotonic()

        async def send(payload: bytes | memoryview) -> None:
            nonlocal count
            publish = js_publish(self._js, chunk_subject, payload, timeout_s=CHUNK_PUBLISH_TIMEOUT_S)
            pending.append(asyncio.ensure_future(publish))
            count += 1
            if len(pending) >= PUBLISH_WINDOW:
                # Shielded: a publish cancelled after it was sent may still land, and then the
                # purge below could miss it; every publish is seen through to its ack instead.
                sequences.append(await asyncio.shield(pending[0]))
                pending.pop(0)

        try:
            async for piece in chunks:
                view = memoryview(piece).cast("B")  # bytes, whatever the view's item type
                total += view.nbytes
                if total > max_bytes:
                    raise upload_too_large(max_bytes, total, declared=False)
                digest.update(view)
                if not buffer and _immutable(piece):
                    # Whole chunks as views of the piece: each is copied once, into its PUB
                    # command, when its publish runs (the piece cannot change before then).
                    while len(view) >= chunk_bytes:
                        await send(view[:chunk_bytes])
                        view = view[chunk_bytes:]
                buffer += view
                while len(buffer) >= chunk_bytes:
                    with memoryview(buffer) as whole:
                        stored = bytes(whole[:chunk_bytes])
                    await send(stored)
                    del buffer[:chunk_bytes]
            if buffer:
                await send(bytes(buffer))
            sequences.extend(await asyncio.shield(asyncio.gather(*pending)))
            pending.clear()
            if nuid.startswith(INPUT_KIND + "."):
                await self._check_chunks_kept(chunk_subject, count)
            elif sequences and time.monotonic() - started >= SLOW_PUT_CHECKED_AFTER_S:
                await self._check_first_chunk_kept(chunk_subject, sequences[0])
            previous = await self._commit(
                name,
                nuid,
                digest,
                total,
                count,
                {CHUNK_SEQUENCES_HEADER: [sequence_runs(sequences)]},
                expires_at=expires_at,
                expected_sha256=expected_sha256,
                expected_size=expected_size,
                before_commit=before_commit,
                chunk_bytes=chunk_bytes,
            )
        except BaseException as exc:
            await asyncio.gather(*pending, return_exceptions=True)
            await self._purge_quietly(chunk_subject)
            failure = _put_failure(exc)
            if failure is None:
                raise
            raise failure from exc
        if previous is not None and previous.nuid != nuid:
            await self._remove_bytes_quietly(previous)
        return BlobRef(ref=ref, size_bytes=total, sha256=digest.hexdigest())

    async def _put_file(
        self,
        files: ObjectFiles,
        name: str,
        ref: str,
        nuid: str,
        chunks: AsyncIterable[bytes | memoryview],
        *,
        expires_at: float,
        max_bytes: int,
        expected_sha256: str,
        expected_size: int | None,
        before_commit: Callable[[], Awaitable[None]] | None,
        chunk_bytes: int,
    ) -> BlobRef:
        """put's way into the objects' directory: each piece written at its offset as it comes (no
        cut into chunks: that is for NATS's max_payload), then the same checks and meta as chunks
        get, the meta saying BYTES_IN_HEADER. On any failure the file is unlinked, no meta written."""
        digest = hashlib.sha256()
        total = 0
        try:
            fd = files.create(nuid)
            try:
                async for piece in chunks:
                    view = memoryview(piece).cast("B")
                    if total + view.nbytes > max_bytes:
                        raise upload_too_large(max_bytes, total + view.nbytes, declared=False)
                    digest.update(view)
                    # Awaited before the next piece is asked for: the caller cannot change it meanwhile.
                    await off_loop(view.nbytes, write_all, fd, view, total)
                    total += view.nbytes
                # The sweep unlinks a file nothing wrote for its orphan bound (a put that died); a put
                # that stalled that long (a paused process, a client idle between pieces) finds its
                # file gone here, before a meta would name it, as the chunks' checks find theirs purged.
                if os.fstat(fd).st_nlink == 0:
                    kind = "UPLOAD" if nuid.startswith(INPUT_KIND + ".") else "RESULT"
                    raise Unavailable(
                        "the object's file was removed while it was stored (it stalled so long that the store's "
                        "sweep took it for a dead put's): nothing was kept",
                        reason=f"{kind}_CHUNKS_LOST",
                    )
            finally:
                os.close(fd)
            previous = await self._commit(
                name,
                nuid,
                digest,
                total,
                -(-total // chunk_bytes),
                {BYTES_IN_HEADER: [DIRECTORY]},
                expires_at=expires_at,
                expected_sha256=expected_sha256,
                expected_size=expected_size,
                before_commit=before_commit,
                chunk_bytes=chunk_bytes,
            )
        except BaseException as exc:
            await asyncio.shield(asyncio.to_thread(files.unlink, nuid))
            failure = _put_failure(exc)
            if failure is None:
                raise
            raise failure from exc
        if previous is not None and previous.nuid != nuid:
            await self._remove_bytes_quietly(previous)
        return BlobRef(ref=ref, size_bytes=total, sha256=digest.hexdigest())

    async def _commit(
        self,
        name: str,
        nuid: str,
        digest: Any,
        total: int,
        count: int,
        where: dict[str, list[str]],
        *,
        expires_at: float,
        expected_sha256: str,
        expected_size: int | None,
        before_commit: Callable[[], Awaitable[None]] | None,
        chunk_bytes: int,
    ) -> BlobInfo | None:
        """A put's end, its bytes stored: the declared size and SHA-256 checked, `before_commit`
        run, then the meta (with `where`'s headers: where the bytes are) written; the object it
        replaced, if any."""
        sha256 = digest.hexdigest()
        if expected_size is not None and expected_size != total:
            message = f"the upload declared {expected_size} bytes but streamed {total}; nothing was kept"
            raise InvalidArgument(message, [FieldViolation("metadata.size_bytes", message)], reason="SIZE_MISMATCH")
        if expected_sha256 and expected_sha256 != sha256:
            message = f"the content's SHA-256 is {sha256}, not the declared {expected_sha256}; nothing was kept"
            raise InvalidArgument(message, [FieldViolation("metadata.sha256", message)], reason="SHA256_MISMATCH")
        if before_commit is not None:
            await before_commit()
        previous = await self._info_or_none(name)
        info = api.ObjectInfo(
            name=name,
            bucket=self.bucket,
            nuid=nuid,
            size=total,
            chunks=count,
            mtime=datetime.now(UTC).isoformat(),
            digest=OBJ_DIGEST_TEMPLATE.format(digest=base64.urlsafe_b64encode(digest.digest()).decode()),
            headers={EXPIRES_HEADER: [repr(expires_at)], SHA256_HEADER: [sha256], **where},
            options=api.ObjectMetaOptions(max_chunk_size=chunk_bytes),
        )
        await self._js.publish(
            meta_subject(self.bucket, name), json.dumps(info.as_dict()).encode(), headers=ROLLUP_HEADERS
        )
        return previous

    async def _check_chunks_kept(self, chunk_subject: str, count: int) -> None:
        """Raises Unavailable (UPLOAD_CHUNKS_LOST) unless the stream still holds every chunk the put
        stored. The sweep purges an upload's chunks once none came for its orphan bound, and a live
        upload that streams slowly stores one 128 KiB chunk at a time: a client sending 100 bytes
        every 20 s is never idle to the gateway yet stores a chunk every 7 hours. Its meta would
        name chunks that are gone (every read DATA_LOSS). Checked after its last chunk, which was
        stored just now, so the sweep does not take it between this look and the meta."""
        try:
            info = await self._js.stream_info(self.stream, subjects_filter=chunk_subject)
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot check the stored object: {exc}", reason="NATS_UNAVAILABLE") from exc
        kept = (info.state.subjects or {}).get(chunk_subject, 0)
        if kept != count:
            raise Unavailable(
                f"{count - kept} of the upload's {count} stored chunks were purged while it streamed (the store's "
                "sweep takes chunks that no upload added to for 4 x gateway.upload_idle_timeout_s, at least "
                f"300 s, for a crashed upload's; each holds {CHUNK_BYTES} bytes): nothing was kept, upload it again",
                reason="UPLOAD_CHUNKS_LOST",
                metadata={"stored_chunks": str(count), "kept_chunks": str(kept)},
            )

    async def _check_first_chunk_kept(self, chunk_subject: str, sequence: int) -> None:
        """Raises Unavailable (RESULT_CHUNKS_LOST) when the put's first chunk is gone: the sweep
        purges an orphan's chunk subject whole, so the first chunk is there if none was purged.
        A read, not a stream info: a batcher's NATS user may read chunks, not the stream's info."""
        try:
            await self._chunk_at(chunk_subject, sequence)
        except BlobCorrupt as exc:
            raise Unavailable(
                "the result's stored chunks were purged while it was stored (it took so long that the store's "
                "sweep took them for a dead put's): nothing was kept",
                reason="RESULT_CHUNKS_LOST",
            ) from exc

    async def put_bytes(
        self, tenant: str, ref: str, data: bytes, *, expires_at: float, chunk_bytes: int = CHUNK_BYTES
    ) -> BlobRef:
        return await self.put_pieces(tenant, ref, [data], expires_at=expires_at, chunk_bytes=chunk_bytes)

    async def put_pieces(
        self,
        tenant: str,
        ref: str,
        pieces: Sequence[bytes],
        *,
        expires_at: float,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> BlobRef:
        """Stores the pieces, joined, as the object `ref`: each stored chunk is a view of one
        piece where it lies within one (copied once, into the chunk), joined only where it
        spans two."""
        total = sum(len(piece) for piece in pieces)

        async def whole() -> AsyncIterator[bytes | memoryview]:
            for piece in pieces:
                yield piece

        if self.files is not None:  # a file takes the pieces as they are: no cut, no join
            return await self.put(tenant, ref, whole(), expires_at=expires_at, max_bytes=total, chunk_bytes=chunk_bytes)

        async def chunks() -> AsyncIterator[bytes | memoryview]:
            pending: list[memoryview] = []
            pending_bytes = 0
            for piece in pieces:
                view = memoryview(piece)
                while view:
                    take = min(len(view), chunk_bytes - pending_bytes)
                    if not pending and take == chunk_bytes:
                        yield view[:take]
                    else:
                        pending.append(view[:take])
                        pending_bytes += take
                        if pending_bytes == chunk_bytes:
                            yield b"".join(pending)
                            pending, pending_bytes = [], 0
                    view = view[take:]
            if pending:
                yield b"".join(pending)

        return await self.put(tenant, ref, chunks(), expires_at=expires_at, max_bytes=total, chunk_bytes=chunk_bytes)

    # --- reading ----------------------------------------------------------------------------

    async def info(self, tenant: str, ref: str, *, now: float | None = None) -> BlobInfo:
        """The live object's info; NotFound (…_NOT_FOUND, or …_EXPIRED past its expiry)."""
        name = object_name(tenant, ref)
        info = await self._info_or_none(name)
        if info is None or info.deleted:
            raise blob_not_found(ref)
        if info.expired(time.time() if now is None else now):
            raise blob_expired(ref)
        return info

    async def chunks(self, tenant: str, ref: str) -> AsyncGenerator[bytes]:
        """The object's chunks in order, one request per chunk (so a slow reader holds one chunk,
        not a subscription's backlog); raises DataLoss at the end if the content does not match
        its size and digest."""
        info = await self.info(tenant, ref)
        async for chunk in self._chunks_of(info):
            yield chunk

    async def _chunks_of(self, info: BlobInfo) -> AsyncIterator[bytes]:
        """The chunks of the object `info` describes, in order; at the end, NotFound when it was
        deleted (or replaced) while it was read, BlobCorrupt when it is there but short or not
        its digest (blob_meta.cut_short)."""
        if in_directory(info):
            async for chunk in self._file_chunks(info):
                yield chunk
            return
        subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=info.nuid)
        digest = hashlib.sha256()
        total = 0
        sequence = 1
        while total < info.ref.size_bytes:
            try:
                _, found, data = await self._get_chunk(sequence, next_by_subject=subject)
            except NotFoundError:
                break
            except NATS_FAILURES as exc:
                raise Unavailable(f"cannot read the object: {exc}") from exc
            digest.update(data)
            total += len(data)
            sequence = found + 1
            yield data
        if total != info.ref.size_bytes or digest.hexdigest() != info.ref.sha256:
            raise cut_short(info, await self._info_or_none(info.name))

    def _files_of(self, info: BlobInfo) -> ObjectFiles:
        """The directory holding the object's file; FailedPrecondition when this process has none."""
        if self.files is None:
            raise not_configured(info)
        return self.files

    async def _file_chunks(self, info: BlobInfo) -> AsyncIterator[bytes]:
        """A directory object's bytes in pieces of its chunk size, checked whole at the end as chunks are."""
        files = self._files_of(info)
        chunk_bytes = int((info.meta.get("options") or {}).get("max_chunk_size") or CHUNK_BYTES)
        digest = hashlib.sha256()
        total = 0
        while total < info.ref.size_bytes:
            length = min(chunk_bytes, info.ref.size_bytes - total)
            data = await off_loop(length, files.read_at, info.nuid, total, length)
            if data is None:
                break
            digest.update(data)
            total += length
            yield data
        if total != info.ref.size_bytes or digest.hexdigest() != info.ref.sha256:
            raise cut_short(info, await self._info_or_none(info.name))

    async def read(self, tenant: str, ref: str, *, max_bytes: int) -> tuple[BlobInfo, bytearray]:
        """The whole object (for decoding), refused past max_bytes before anything is read; a
        bytearray, which protobuf parses without another copy."""
        info = await self.info(tenant, ref)
        if info.ref.size_bytes > max_bytes:
            raise upload_too_large(max_bytes, info.ref.size_bytes, declared=True)
        if in_directory(info):
            files = self._files_of(info)
            whole = await off_loop(info.ref.size_bytes, files.read_whole, info.nuid, info.ref.size_bytes)
            if whole is None or hashlib.sha256(whole).hexdigest() != info.ref.sha256:
                raise cut_short(info, await self._info_or_none(info.name))
            return info, whole
        data = bytearray()
        async for chunk in self._chunks_of(info):
            data += chunk
        return info, data

    async def read_range(self, tenant: str, ref: str, offset: int, length: int, *, sha256: str = "") -> bytes:
        """Bytes [offset, offset + length) of the object: only the chunks the range covers, by
        their sequences (an object without them is walked from its start). The object's digest
        covers it whole, so a range is checked by each chunk's subject and size (and JetStream's
        own per-message checksum); `sha256`, when given, must still be the object's (NotFound,
        BLOB_CHANGED, when it was replaced)."""
        info = await self.info(tenant, ref)
        if sha256 and info.ref.sha256 != sha256:
            raise NotFound(f"the object {ref!r} changed since it was named", reason="BLOB_CHANGED")
        if offset < 0 or length < 0 or offset + length > info.ref.size_bytes:
            raise InvalidArgument(
                f"bytes {offset}:{offset + length} are past the object's {info.ref.size_bytes}", reason="RANGE_INVALID"
            )
        if length == 0:
            return b""
        if in_directory(info):
            files = self._files_of(info)
            data = await off_loop(length, files.read_at, info.nuid, offset, length)
            if data is None:
                gone = cut_short(info, await self._info_or_none(info.name))
                raise gone if isinstance(gone, NotFound) else BlobCorrupt(f"the stored object {ref!r} is short")
            return data
        chunk_bytes = int((info.meta.get("options") or {}).get("max_chunk_size") or CHUNK_BYTES)
        first, last = offset // chunk_bytes, (offset + length - 1) // chunk_bytes
        sequences = chunk_sequences(info)
        if sequences is None:
            pieces = []
            async with contextlib.aclosing(_numbered(self._chunks_of(info))) as numbered:
                async for k, chunk in numbered:
                    if first <= k <= last:
                        pieces.append(chunk)
                    if k >= last:
                        break
        else:
            subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=info.nuid)
            pieces = []
            for start in range(first, last + 1, PUBLISH_WINDOW):
                # A window of gets at once: the round trips overlap, memory holds the range.
                window = sequences[start : min(start + PUBLISH_WINDOW, last + 1)]
                pieces += await asyncio.gather(*(self._chunk_at(subject, s) for s in window))
        skip = offset - first * chunk_bytes
        if sum(len(piece) for piece in pieces) < skip + length:
            raise BlobCorrupt(f"the stored object {ref!r} is shorter than its size")
        # The range alone, joined from views of its chunks: one copy (a batch chunk's rows are MBs).
        views = [memoryview(piece) for piece in pieces]
        views[0] = views[0][skip:]
        views[-1] = views[-1][: len(views[-1]) - (sum(len(v) for v in views) - length)]
        return b"".join(views)

    async def _chunk_at(self, subject: str, sequence: int) -> bytes:
        try:
            found, _, data = await self._get_chunk(sequence, expect_subject=subject)
        except NotFoundError:
            raise BlobCorrupt(f"a chunk of {subject!r} is gone (sequence {sequence})") from None
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot read the object: {exc}") from exc
        if found != subject:
            raise BlobCorrupt(f"sequence {sequence} is not a chunk of {subject!r}")
        return data

    async def _get_chunk(
        self, sequence: int, *, next_by_subject: str = "", expect_subject: str = ""
    ) -> tuple[str, int, bytes]:
        """(subject, sequence, data) of the message at `sequence` (or the first at or after it on
        `next_by_subject`): a direct get first (cheap, any replica), then, when that replica did
        not answer within DIRECT_READ_TIMEOUT_S, had no such message, or had another subject at
        that sequence, the same read from the stream's leader (STREAM.MSG.GET), which has every
        acknowledged write. Raises NotFoundError when the leader has none either, and the NATS
        errors of the leader's read."""
        try:
            found = await direct_get(
                self._js, self.stream, seq=sequence, next_by_subject=next_by_subject, timeout_s=DIRECT_READ_TIMEOUT_S
            )
            if not expect_subject or found[0] == expect_subject:
                return found
        except NotFoundError:
            pass  # a replica behind the leader (or truly none: the leader says which)
        except NATS_FAILURES:
            pass  # a replica that hangs, or is busy catching up
        log.debug("blob_chunk_read_from_leader", stream=self.stream, sequence=sequence)
        raw = await asyncio.wait_for(
            self._js.get_msg(self.stream, seq=sequence, subject=next_by_subject or None, next=bool(next_by_subject)),
            CHUNK_READ_TIMEOUT_S,
        )
        return raw.subject or "", raw.seq or sequence, raw.data or b""

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

    async def latest_info(self, name: str) -> BlobInfo | None:
        """The object's meta as it is now, by its full name (the sweep's), or None when it has none."""
        return await self._info_or_none(name)

    async def _info_or_none(self, name: str) -> BlobInfo | None:
        try:
            msg = await self._js.get_last_msg(self.stream, meta_subject(self.bucket, name))
        except NotFoundError:
            return None
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot read the object's metadata: {exc}") from exc
        return parse_meta(msg.data or b"", msg.seq or 0)

    async def _remove_bytes_quietly(self, info: BlobInfo) -> None:
        """A replaced object's bytes, wherever they are (a failure left to the sweep)."""
        if not in_directory(info):
            await self._purge_quietly(OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=info.nuid))
        elif self.files is not None:
            await asyncio.shield(asyncio.to_thread(self.files.unlink, info.nuid))

    async def _purge_quietly(self, subject: str) -> None:
        try:
            await asyncio.shield(self._js.purge_stream(self.stream, subject=subject))
        except Exception as exc:
            # The sweep (asyncinfer/blob_sweep.py) purges chunks whose meta is gone on its next round.
            log.warning("blob_chunks_not_purged", subject=subject, error=str(exc))


def _put_failure(exc: BaseException) -> BaseException | None:
    """What a failed put raises in place of `exc` (None: `exc` itself)."""
    full = store_full(exc)
    if full is not None:  # no room: not worth retrying at once (the caller says so)
        return full
    if isinstance(exc, NATS_FAILURES):
        return Unavailable(f"cannot store the object: {exc}", reason="NATS_UNAVAILABLE")
    if isinstance(exc, OSError):  # the objects' directory (a full disk, a lost mount): after NATS's timeouts
        return io_failure(exc)
    return None


def _immutable(piece: bytes | memoryview) -> bool:
    """Whether nothing can change the piece's bytes: bytes, or a read-only view of bytes."""
    if isinstance(piece, memoryview):
        return piece.readonly and isinstance(piece.obj, bytes)
    return isinstance(piece, bytes)


async def _numbered(chunks: AsyncIterator[bytes]) -> AsyncGenerator[tuple[int, bytes]]:
    k = 0
    async for chunk in chunks:
        yield k, chunk
        k += 1
