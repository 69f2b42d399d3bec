"""A prototype for issue 15's MLP file-batch target: the claim-check store with its objects' bytes in a
directory the services share, their metadata in NATS as now ("object data in a directory, metadata
in NATS"). Bench only: it changes none of the shipped services; bench/system/batch_files_ab.py's
`dir-store` modifier puts it into the gateway's, the scheduler's and the batcher's processes
(`sitecustomize`, below), so that a variant and the same variant with `+dir-store` alternate round
by round.

Why: on 2 cores, per 100,000 MLP records, nats-server spends ~2.1 CPU-s storing and serving the
chunks' bytes (page-cache copies and page zeroing, beside torch's), the largest share of the 5.1
CPU-s that are not the model's (docs/BATCHES.md, "The CPU budget on 2 cores"). With the bytes in
files, the process that stores an object writes it into the page cache itself and the one that
reads a range reads it from there: no publish, no socket, no second copy in nats-server.

What changes (asyncinfer.blobs.BlobStore's methods, replaced on the class once the module is
imported in a service process):
- put (and put_pieces, put_bytes through it): every piece is written at its offset in the file
  `<directory>/<bucket>/<nuid>` (one file per object, named by its meta's chunk name) instead of
  published on `$O.<bucket>.C.<nuid>`; size limit, SHA-256 (still on the event loop, as today),
  SIZE/SHA256 checks, `before_commit` and the rolled-up meta message are as they were; the meta
  carries DIR_STORE_HEADER instead of the chunk sequences. On any failure the file is unlinked and
  no meta is written; a put replacing an object removes the replaced one's file.
  put_pieces writes its pieces as they are (no cut into 128 KiB or 512 KiB chunks: that cut is
  for NATS's max_payload).
- read, chunks, read_range: the meta is read from NATS as now (expiry, NOT_FOUND, BLOB_CHANGED);
  then the bytes by os.pread at the offset asked; read and chunks still check the whole object's
  size and SHA-256 (read_range, as today, checks its length only). A missing file or a short read
  is what a purged chunk was: NOT_FOUND when the meta changed meanwhile, else DATA_LOSS.
- delete (remove, delete_live): tombstone and meta purge as now, the file unlinked where the chunk
  subject was purged.
An object whose meta lacks DIR_STORE_HEADER (stored by an unpatched process) goes the original way.

Off the event loop: a write or read over INLINE_IO_BYTES runs in asyncio's default executor (a
thread; os.pread/os.pwrite release the GIL), one at a time per put or read; smaller ones run inline.
Measured on the 2-core bench machine (page cache warm): pread of 128 KiB ~4 us, pwrite ~9 us,
against ~45 us for a hop to a thread and back; 4 MiB ~0.4 ms either way. A batch chunk's rows (4 MiB)
and its result (~4 MiB, a few pieces) each go to a thread; an upload's 1 MiB gRPC pieces too.

What it skips (a prototype, not a design): no sweep of the files (a put that crashes leaves its
file; NATS's sweep finds no chunk subject to purge; expired objects' files are removed since the
sweep calls remove), no per-tenant upload accounting (gateway.max_stored_upload_bytes_per_tenant
counts chunk messages, none now: the bench sets no limit), no cluster (one directory on one host:
every process on one machine; several nodes would need a shared filesystem or an object server),
no fsync (nor does a file-backed JetStream stream by default: it syncs every 2 minutes), no
replicas, and a reader of another client (the `nats` CLI, nats-py's object store) finds no chunks.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

# The directory the services share, in their environment (set by bench.system.batch_files).
DIRECTORY_ENV = "BENCH_DIR_STORE"
# In an object's meta headers: its bytes are in the directory, not in the stream.
DIR_STORE_HEADER = "Asyncinfer-Bench-Dir-Store"
# Reads and writes up to this size run inline on the event loop: cheaper than a hop to a thread.
INLINE_IO_BYTES = 256 * 1024
TARGET = "asyncinfer.blobs"


def sitecustomize_source() -> str:
    """The lines of a sitecustomize that installs the prototype in a service's process once it
    imports asyncinfer.blobs (not before: at site time sys.path does not yet name the service's own
    tree, which for a base-revision run is another worktree)."""
    return "import bench.system.dir_store\nbench.system.dir_store.install_from_environment()\n"


def install_from_environment() -> None:
    directory = os.environ.get(DIRECTORY_ENV)
    if not directory:
        raise SystemExit(f"{DIRECTORY_ENV} names no directory: the dir-store prototype cannot run")
    if TARGET in sys.modules:
        patch(sys.modules[TARGET], Path(directory))
    else:
        sys.meta_path.insert(0, _PatchOnImport(Path(directory)))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds asyncinfer.blobs as the path finder would and patches it right after it runs."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        directory = self.directory

        class Patching(importlib.abc.Loader):
            def create_module(self, spec: Any) -> ModuleType | None:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                patch(module, directory)

        spec.loader = Patching()
        return spec


def _file_name(nuid: str) -> str:
    return nuid.replace(os.sep, "%")


def patch(blobs: Any, directory: Path) -> None:
    """Replaces BlobStore's byte-moving methods with the directory's (the module docstring)."""
    from asyncinfer.blob_meta import BlobCorrupt, cut_short, meta_subject, upload_too_large
    from asyncinfer.errors import FieldViolation, InvalidArgument, NotFound, Unavailable
    from asyncinfer.jobs import BlobRef
    from asyncinfer.nats.streams import store_full

    store = blobs.BlobStore
    original = {name: getattr(store, name) for name in ("_chunks_of", "read", "read_range", "_purge_object")}
    log = blobs.log

    def file_of(bucket: str, nuid: str) -> Path:
        folder = directory / bucket
        folder.mkdir(parents=True, exist_ok=True)
        return folder / _file_name(nuid)

    def in_dir(info: Any) -> bool:
        return bool((info.meta.get("headers") or {}).get(DIR_STORE_HEADER))

    async def off_loop(size: int, work: Callable[..., Any], *args: Any) -> Any:
        if size <= INLINE_IO_BYTES:
            return work(*args)
        future = asyncio.ensure_future(asyncio.to_thread(work, *args))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The thread still uses the file descriptor: let it finish before the caller closes it.
            await asyncio.wait([future])
            raise

    def write_all(fd: int, view: memoryview, offset: int) -> None:
        while view:
            done = os.pwrite(fd, view, offset)
            view, offset = view[done:], offset + done

    def read_exactly(path: Path, offset: int, length: int) -> bytes | None:
        """The bytes, or None when the file is gone or shorter (what a purged chunk was)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        return data if len(data) == length else None

    def read_whole(path: Path, size: int) -> bytearray | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            data = bytearray(size)
            got = os.preadv(fd, [data], 0) if size else 0
        finally:
            os.close(fd)
        return data if got == size else None

    def unlink_quietly(path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("bench_dir_store_not_unlinked", path=str(path), error=str(exc))

    async def remove_bytes(self: Any, info: Any) -> None:
        if in_dir(info):
            await asyncio.to_thread(unlink_quietly, file_of(self.bucket, info.nuid))
        else:
            await self._purge_quietly(blobs.OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=info.nuid))

    async def put(
        self: Any,
        tenant: str,
        ref: str,
        chunks: AsyncIterable[bytes | memoryview],
        *,
        expires_at: float,
        max_bytes: int,
        expected_sha256: str = "",
        expected_size: int | None = None,
        before_commit: Callable[[], Any] | None = None,
        chunk_bytes: int = blobs.CHUNK_BYTES,
    ) -> Any:
        name = blobs.object_name(tenant, ref)
        nuid = blobs.chunks_name(tenant, ref)
        path = file_of(self.bucket, nuid)
        digest = hashlib.sha256()
        total = 0
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                async for piece in chunks:
                    view = memoryview(piece).cast("B")  # bytes, whatever the view's item type
                    if total + view.nbytes > max_bytes:
                        raise upload_too_large(max_bytes, total + view.nbytes, declared=False)
                    digest.update(view)
                    # Awaited before the next piece is asked for: the caller cannot change it meanwhile.
                    await off_loop(view.nbytes, write_all, fd, view, total)
                    total += view.nbytes
            finally:
                os.close(fd)
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
            info = blobs.api.ObjectInfo(
                name=name,
                bucket=self.bucket,
                nuid=nuid,
                size=total,
                chunks=-(-total // chunk_bytes),
                mtime=datetime.now(UTC).isoformat(),
                digest=blobs.OBJ_DIGEST_TEMPLATE.format(digest=base64.urlsafe_b64encode(digest.digest()).decode()),
                headers={
                    blobs.EXPIRES_HEADER: [repr(expires_at)],
                    blobs.SHA256_HEADER: [sha256],
                    DIR_STORE_HEADER: ["1"],
                },
                options=blobs.api.ObjectMetaOptions(max_chunk_size=chunk_bytes),
            )
            await self._js.publish(
                meta_subject(self.bucket, name), json.dumps(info.as_dict()).encode(), headers=blobs.ROLLUP_HEADERS
            )
        except BaseException as exc:
            await asyncio.to_thread(unlink_quietly, path)
            full = store_full(exc)
            if full is not None:
                raise full from exc
            if isinstance(exc, blobs.NATS_FAILURES):
                raise Unavailable(f"cannot store the object: {exc}", reason="NATS_UNAVAILABLE") from exc
            raise
        if previous is not None and previous.nuid != nuid:
            await remove_bytes(self, previous)
        return BlobRef(ref=ref, size_bytes=total, sha256=sha256)

    async def put_pieces(
        self: Any,
        tenant: str,
        ref: str,
        pieces: Sequence[bytes],
        *,
        expires_at: float,
        chunk_bytes: int = blobs.CHUNK_BYTES,
    ) -> Any:
        total = sum(len(memoryview(piece).cast("B")) for piece in pieces)

        async def each() -> AsyncIterator[bytes]:
            for piece in pieces:
                yield piece

        return await self.put(tenant, ref, each(), expires_at=expires_at, max_bytes=total, chunk_bytes=chunk_bytes)

    async def corrupt_or_gone(self: Any, info: Any) -> BaseException:
        return cut_short(info, await self._info_or_none(info.name))

    async def chunks_of(self: Any, info: Any) -> AsyncIterator[bytes]:
        if not in_dir(info):
            async for chunk in original["_chunks_of"](self, info):
                yield chunk
            return
        chunk_bytes = int((info.meta.get("options") or {}).get("max_chunk_size") or blobs.CHUNK_BYTES)
        path = file_of(self.bucket, info.nuid)
        digest = hashlib.sha256()
        total = 0
        while total < info.ref.size_bytes:
            length = min(chunk_bytes, info.ref.size_bytes - total)
            data = await off_loop(length, read_exactly, path, total, length)
            if data is None:
                raise await corrupt_or_gone(self, info)
            digest.update(data)
            total += length
            yield data
        if digest.hexdigest() != info.ref.sha256:
            raise await corrupt_or_gone(self, info)

    async def read(self: Any, tenant: str, ref: str, *, max_bytes: int) -> Any:
        info = await self.info(tenant, ref)
        if not in_dir(info):
            return await original["read"](self, tenant, ref, max_bytes=max_bytes)
        if info.ref.size_bytes > max_bytes:
            raise upload_too_large(max_bytes, info.ref.size_bytes, declared=True)
        size = info.ref.size_bytes
        data = await off_loop(size, read_whole, file_of(self.bucket, info.nuid), size)
        if data is None or hashlib.sha256(data).hexdigest() != info.ref.sha256:
            raise await corrupt_or_gone(self, info)
        return info, data

    async def read_range(self: Any, tenant: str, ref: str, offset: int, length: int, *, sha256: str = "") -> bytes:
        info = await self.info(tenant, ref)
        if not in_dir(info):
            return await original["read_range"](self, tenant, ref, offset, length, sha256=sha256)  # type: ignore[no-any-return]
        if sha256 and info.ref.sha256 != sha256:
            raise NotFound(f"the object {ref!r} changed since it was named", reason="BLOB_CHANGED")
        if offset < 0 or length < 0 or offset + length > info.ref.size_bytes:
            raise InvalidArgument(
                f"bytes {offset}:{offset + length} are past the object's {info.ref.size_bytes}", reason="RANGE_INVALID"
            )
        if length == 0:
            return b""
        data = await off_loop(length, read_exactly, file_of(self.bucket, info.nuid), offset, length)
        if data is None:
            found = await corrupt_or_gone(self, info)
            raise found if isinstance(found, NotFound) else BlobCorrupt(f"the stored object {ref!r} is short")
        return data  # type: ignore[no-any-return]

    async def purge_object(self: Any, info: Any) -> None:
        if not in_dir(info):
            await original["_purge_object"](self, info)
            return
        # The bytes first, as the chunks were: a crash between the two leaves a meta that reads as
        # corrupt and is deleted again, never bytes nothing names.
        await asyncio.to_thread(unlink_quietly, file_of(self.bucket, info.nuid))
        await self._js.purge_stream(self.stream, subject=meta_subject(self.bucket, info.name))
        log.info("blob_deleted", name=info.name, size_bytes=info.ref.size_bytes)

    store.put = put
    store.put_pieces = put_pieces
    store._chunks_of = chunks_of
    store.read = read
    store.read_range = read_range
    store._purge_object = purge_object
    log.info("bench_dir_store_installed", directory=str(directory))
