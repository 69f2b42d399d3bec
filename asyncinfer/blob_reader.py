"""The claim-check store's read side, and what its write side shares: the bucket's state (its
client, stream and objects' directory), the meta of an object by its name, and a chunk's read.

Reads go to wherever the object's own meta says its bytes are: the stream's chunks (a direct get,
which any replica may answer, then the leader's read) or a file of the objects' directory
(asyncinfer.blob_files). Every read checks what it got against the meta: a whole object by its
size and SHA-256, a range by each chunk's subject and size; an object deleted or replaced while it
was read is NOT_FOUND, one that is there but short is BlobCorrupt (blob_meta.cut_short).

The writes are asyncinfer.blob_writer's BlobWriter, built on this class; the store callers use,
with expiry, holds and deletes, is asyncinfer.blobs.BlobStore.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncGenerator, AsyncIterator

import structlog

from asyncinfer.blob_files import ObjectFiles, in_directory, not_configured, off_loop
from asyncinfer.blob_meta import (
    CHUNK_BYTES,
    BlobCorrupt,
    BlobInfo,
    blob_expired,
    blob_not_found,
    chunk_sequences,
    cut_short,
    meta_subject,
    object_name,
    parse_meta,
    upload_too_large,
)
from asyncinfer.errors import InvalidArgument, NotFound, Unavailable
from asyncinfer.nats import (
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_STREAM_TEMPLATE,
    Client,
    JetStreamContext,
    NatsError,
    NotFoundError,
)
from asyncinfer.nats.requests import direct_get

log = structlog.get_logger("asyncinfer.blobs")

# Chunk publishes awaiting their ack at once (and a range's chunk gets, read_range): enough to hide
# the round trip, few enough to bound memory.
PUBLISH_WINDOW = 8
# A chunk's read from the stream leader waits this long for its answer: nats-py's JetStream
# default, as a stored chunk's publish does (asyncinfer.blob_writer, CHUNK_PUBLISH_TIMEOUT_S).
CHUNK_READ_TIMEOUT_S = 5.0
# A chunk's direct get, which any replica may answer (allow_direct, set by nats-py on every object
# store): the server hands a client's request to a random member of the stream's direct-get queue
# group, local or not, so a replica that hangs (SIGSTOP, a stalled disk) gets a third of them, and
# one that is behind (just resumed, catching up) answers 404 for chunks the leader acknowledged.
# Short, because a direct get that fails or misses is asked again of the leader (`_get_chunk`).
DIRECT_READ_TIMEOUT_S = 1.0
NATS_FAILURES = (NatsError, asyncio.TimeoutError)


class BlobReader:
    """The claim-check bucket's state and its reads (info, chunks, read, read_range): the base of
    BlobWriter (asyncinfer.blob_writer), whose puts read what they replace and check what they
    stored with the same calls."""

    def __init__(self, nc: Client, bucket: str, *, directory: str | None = None) -> None:
        """`directory`: the objects' directory (nats.objects_directory) new objects' bytes go to;
        None, the stream's chunks. Objects stored either way are read either way."""
        self._nc = nc  # for stream info answers past the first 100,000 subjects (the sweep's)
        self._js = nc.jetstream()
        self.bucket = bucket
        self.stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
        self.files = ObjectFiles(directory, bucket) if directory else None

    @property
    def js(self) -> JetStreamContext:
        """The JetStream context it reads and writes through (the sweep's: asyncinfer.blob_sweep)."""
        return self._js

    @property
    def nc(self) -> Client:
        """The NATS client under it: the sweep's requests that nats-py's JetStream context cannot
        make (a stream info's subjects past the first 100,000, asyncinfer.nats.streams.subject_pages)."""
        return self._nc

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


async def _numbered(chunks: AsyncIterator[bytes]) -> AsyncGenerator[tuple[int, bytes]]:
    k = 0
    async for chunk in chunks:
        yield k, chunk
        k += 1
