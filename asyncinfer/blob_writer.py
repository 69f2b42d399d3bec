"""The claim-check store's write side: puts, from a stream of pieces (an upload's gRPC chunks) or
from pieces in hand (a result), into the stream's chunks or a file of the objects' directory.

Writes follow the Object Store's wire layout (what nats-py, the Go client and the `nats` CLI read):
chunks of 128 KiB on `$O.<bucket>.C.<nuid>`, then one JSON meta message (rolled up) on
`$O.<bucket>.M.<base64url(name)>`. nats-py's own `put` reads from a blocking file object in a
thread and cannot take an async stream (gRPC chunks), so this module writes the layout itself:
chunks are published as they arrive (a few acks in flight, never the whole object in memory),
the size limit and the SHA-256 are checked on the way, and on any refusal or error the chunk
subject is purged and no meta is written, so nothing partial is left.

With an objects' directory (nats.objects_directory), a new object's bytes are one file of it
instead of chunks (asyncinfer.blob_files), its meta written here as ever and saying so
(BYTES_IN_HEADER); reads find every object where its own meta says (asyncinfer.blob_reader).

BlobWriter is built on BlobReader (a put reads the meta it replaces and checks what it stored);
the store callers use, with expiry, holds and deletes, is asyncinfer.blobs.BlobStore.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog

from asyncinfer.blob_files import DIRECTORY, ObjectFiles, in_directory, io_failure, off_loop, write_all
from asyncinfer.blob_meta import (
    CHUNK_BYTES,
    INPUT_KIND,
    BlobCorrupt,
    BlobInfo,
    chunks_name,
    meta_subject,
    object_name,
    sequence_runs,
    upload_too_large,
)
from asyncinfer.blob_reader import NATS_FAILURES, PUBLISH_WINDOW, BlobReader
from asyncinfer.contract import (
    BYTES_IN_HEADER,
    CHUNK_SEQUENCES_HEADER,
    EXPIRES_HEADER,
    ROLLUP_HEADER,
    SHA256_HEADER,
)
from asyncinfer.errors import FieldViolation, InvalidArgument, Unavailable
from asyncinfer.jobs import BlobRef
from asyncinfer.nats import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_DIGEST_TEMPLATE, api
from asyncinfer.nats.requests import js_publish
from asyncinfer.nats.streams import store_full

log = structlog.get_logger("asyncinfer.blobs")

# A stored chunk's publish waits this long for its ack: nats-py's JetStream default, which the
# chunks were published under before they went through the adapter (asyncinfer.nats.requests).
CHUNK_PUBLISH_TIMEOUT_S = 5.0
# A result's put that took this long reads its first chunk back before its meta. A live put stores
# a chunk at least every 10 s and its meta within 15 s of its last chunk (each publish is acked
# within CHUNK_PUBLISH_TIMEOUT_S or the put fails), far inside the sweep's orphan bound (at least
# 300 s) while its process runs; one paused meanwhile (SIGSTOP, a frozen VM) counts none of those
# timeouts and may find its chunks purged as a dead put's. Under this, nothing is read back.
SLOW_PUT_CHECKED_AFTER_S = 60.0
ROLLUP_HEADERS: dict[str, Any] = {ROLLUP_HEADER: "sub"}


@dataclass(frozen=True)
class _StoredBytes:
    """A put's bytes, stored and not yet visible: their SHA-256 (a hashlib object), size, count of
    chunks (of the put's chunk_bytes) and `where`, the meta's headers saying where they lie."""

    sha256: Any
    size: int
    chunks: int
    where: dict[str, list[str]]


class BlobWriter(BlobReader):
    """The puts of the claim-check store (put, put_bytes, put_pieces): the base of BlobStore
    (asyncinfer.blobs), which adds expiry, holds and deletes."""

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
        readers). The bytes go to the stream's chunks (_store_chunks) or, with an objects' directory, to a
        file of it (_store_file); what follows is the same for both (_commit, or the discard)."""
        name = object_name(tenant, ref)
        nuid = chunks_name(tenant, ref)
        discard: Callable[[], Awaitable[None]]
        if self.files is not None:
            files = self.files
            store = self._store_file(files, nuid, chunks, max_bytes=max_bytes, chunk_bytes=chunk_bytes)

            async def discard() -> None:
                await asyncio.shield(asyncio.to_thread(files.unlink, nuid))

        else:
            chunk_subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=nuid)
            store = self._store_chunks(chunk_subject, nuid, chunks, max_bytes=max_bytes, chunk_bytes=chunk_bytes)

            async def discard() -> None:
                await self._purge_quietly(chunk_subject)

        try:
            stored = await store
            previous = await self._commit(
                name,
                nuid,
                stored,
                expires_at=expires_at,
                expected_sha256=expected_sha256,
                expected_size=expected_size,
                before_commit=before_commit,
                chunk_bytes=chunk_bytes,
            )
        except BaseException as exc:
            await discard()
            failure = _put_failure(exc)
            if failure is None:
                raise
            raise failure from exc
        if previous is not None and previous.nuid != nuid:
            await self._remove_bytes_quietly(previous)
        return BlobRef(ref=ref, size_bytes=stored.size, sha256=stored.sha256.hexdigest())

    async def _store_chunks(
        self,
        chunk_subject: str,
        nuid: str,
        chunks: AsyncIterable[bytes | memoryview],
        *,
        max_bytes: int,
        chunk_bytes: int,
    ) -> _StoredBytes:
        """put's way into the stream: the pieces cut into chunks of `chunk_bytes`, published a few
        acks in flight, then checked still there (the sweep may have taken a slow put's). On any
        failure every publish sent is seen through to its ack before it raises (put purges them)."""
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
                # purge could miss it; every publish is seen through to its ack instead.
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
        except BaseException:
            await asyncio.gather(*pending, return_exceptions=True)
            raise
        if nuid.startswith(INPUT_KIND + "."):
            await self._check_chunks_kept(chunk_subject, count)
        elif sequences and time.monotonic() - started >= SLOW_PUT_CHECKED_AFTER_S:
            await self._check_first_chunk_kept(chunk_subject, sequences[0])
        return _StoredBytes(digest, total, count, {CHUNK_SEQUENCES_HEADER: [sequence_runs(sequences)]})

    async def _store_file(
        self,
        files: ObjectFiles,
        nuid: str,
        chunks: AsyncIterable[bytes | memoryview],
        *,
        max_bytes: int,
        chunk_bytes: int,
    ) -> _StoredBytes:
        """put's way into the objects' directory: each piece written at its offset as it comes (no
        cut into chunks: that is for NATS's max_payload), then the same checks and meta as chunks
        get, the meta saying BYTES_IN_HEADER. On any failure put unlinks the file, no meta written."""
        digest = hashlib.sha256()
        total = 0
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
        return _StoredBytes(digest, total, -(-total // chunk_bytes), {BYTES_IN_HEADER: [DIRECTORY]})

    async def _commit(
        self,
        name: str,
        nuid: str,
        stored: _StoredBytes,
        *,
        expires_at: float,
        expected_sha256: str,
        expected_size: int | None,
        before_commit: Callable[[], Awaitable[None]] | None,
        chunk_bytes: int,
    ) -> BlobInfo | None:
        """A put's end, its bytes stored: the declared size and SHA-256 checked, `before_commit`
        run, then the meta (with the stored bytes' `where` headers) written; the object it
        replaced, if any."""
        total = stored.size
        sha256 = stored.sha256.hexdigest()
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
            chunks=stored.chunks,
            mtime=datetime.now(UTC).isoformat(),
            digest=OBJ_DIGEST_TEMPLATE.format(digest=base64.urlsafe_b64encode(stored.sha256.digest()).decode()),
            headers={EXPIRES_HEADER: [repr(expires_at)], SHA256_HEADER: [sha256], **stored.where},
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
