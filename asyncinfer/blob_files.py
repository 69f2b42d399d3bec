"""Claim-check objects' bytes as files of a directory every service shares (`nats.objects_directory`),
their metas in NATS as ever (asyncinfer.blobs): the other home of an object's bytes beside the
stream's chunks.

Why: on 2 cores nats-server spent ~2.1 CPU-s per 100,000 MLP file-batch records storing and serving
the chunks' bytes (page-cache copies beside torch's); with the bytes in files the process that
stores an object writes it into the page cache itself and the one that reads a range reads it
there (docs/BATCHES.md, "Objects' bytes in a directory").

Layout: one file per object, `<directory>/<bucket>/<chunk name>`, the chunk name being the meta's
`nuid` (an upload's `in.<tenant>.<nuid>`, so a tenant's stored uploads are the files with that
prefix). The meta says where the bytes are (BYTES_IN_HEADER = "directory"); a meta without it names
chunks in the stream, so a process reads both kinds whatever its own setting, and one without the
directory answers FAILED_PRECONDITION for a directory object (`not_configured`).

Off the event loop: a read or write over INLINE_IO_BYTES runs in a thread (os.pread and os.pwrite
release the GIL); smaller ones inline. Measured by the session-33 prototype on the 2-core bench
machine, page cache warm: 128 KiB pread ~4 us, pwrite ~9 us, against ~45 us for a hop to a thread
and back; 4 MiB ~0.4 ms either way.

No fsync: a file's bytes are in the page cache when its put writes the meta, so a process that
dies loses nothing stored; a host that crashes may lose what the kernel had not written back
(~30 s by default, dirty_expire_centisecs), as JetStream's file store by default loses up to its
2-minute sync interval. A meta whose file came back short or changed reads as DATA_LOSS where the
whole object is read (its size and SHA-256 are checked), never as other bytes.
"""

from __future__ import annotations

import asyncio
import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog

from asyncinfer.blob_meta import CHUNK_BYTES, INPUT_KIND, BlobInfo
from asyncinfer.contract import BYTES_IN_HEADER
from asyncinfer.errors import ConfigError, FailedPrecondition, Unavailable
from asyncinfer.nats.streams import StoreFullError

log = structlog.get_logger("asyncinfer.blobs")

DIRECTORY = "directory"  # BYTES_IN_HEADER's value for an object stored here
SETTING = "nats.objects_directory"
INLINE_IO_BYTES = 256 * 1024
FILE_MODE = 0o640  # the services run as one user or share a group; tenants' bytes are not world-readable

T = TypeVar("T")


def in_directory(info: BlobInfo) -> bool:
    """Whether the object's bytes are a file of the directory (else chunks in the stream)."""
    return DIRECTORY in ((info.meta.get("headers") or {}).get(BYTES_IN_HEADER) or ())


class ObjectsDirectoryNotSet(FailedPrecondition):
    """A directory object met by a process without the directory. Retriable, unlike other failed
    preconditions of an order: it is this process's configuration, not the job's, and another
    batcher (or the scheduler) configured with the directory reads it (a rolling change half done)."""

    default_reason = "OBJECTS_DIRECTORY_NOT_SET"


def not_configured(info: BlobInfo) -> ObjectsDirectoryNotSet:
    return ObjectsDirectoryNotSet(
        f"the object {info.ref.ref[:80]!r} keeps its bytes in the objects' directory, and this process has none "
        f"configured ({SETTING}): every gateway, scheduler and batcher must name the same shared directory",
        metadata={"setting": SETTING, "ref": info.ref.ref[:80]},
    )


def io_failure(exc: OSError) -> StoreFullError | Unavailable:
    """What a failed read or write of the directory raises: no room (a full disk or quota) as
    JetStream's own (StoreFullError: not worth retrying at once), anything else UNAVAILABLE."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreFullError(f"no room in the objects' directory ({SETTING}): {exc}")
    return Unavailable(f"the objects' directory ({SETTING}) failed: {exc}", reason="OBJECTS_DIRECTORY_UNAVAILABLE")


def file_name(nuid: str) -> str:
    """The object's file name: its chunk name, which holds no separator (a NUID, a tenant's name
    between dots); the replacement is a guard, not a format."""
    return nuid.replace(os.sep, "%")


async def off_loop(size: int, work: Callable[..., T], *args: Any) -> T:
    """work(*args), inline when `size` is small, else in a thread that is seen through to its end
    even when the caller is cancelled (it holds the caller's file descriptor or buffer)."""
    if size <= INLINE_IO_BYTES:
        return work(*args)
    future = asyncio.ensure_future(asyncio.to_thread(work, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        raise


class ObjectFiles:
    """The bucket's folder of the objects' directory."""

    def __init__(self, directory: str | Path, bucket: str) -> None:
        self.folder = Path(directory) / bucket

    def check(self) -> None:
        """Raises ConfigError unless the directory exists and the bucket's folder in it can be made,
        written and read (a service's start: a wrong mount fails there, not at the first upload)."""
        directory = self.folder.parent
        if not directory.is_dir():
            raise ConfigError(
                f"{SETTING} = {str(directory)!r} is not a directory (it must exist, shared by every service)"
            )
        probe = self.folder / f".probe-{os.getpid()}-{time.monotonic_ns()}"
        try:
            self.folder.mkdir(exist_ok=True)
            probe.write_bytes(b"ok")
            readable = probe.read_bytes() == b"ok"
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"{SETTING} = {str(directory)!r} cannot be written: {exc}") from exc
        if not readable:
            raise ConfigError(f"{SETTING} = {str(directory)!r} does not read back what was written")

    def path(self, nuid: str) -> Path:
        return self.folder / file_name(nuid)

    def create(self, nuid: str) -> int:
        """A new object's file, open for writing (O_EXCL: a chunk name is never reused)."""
        return os.open(self.path(nuid), os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)

    def _open_to_read(self, nuid: str) -> int | None:
        """The object's file open for reading, or None when it is gone."""
        try:
            return os.open(self.path(nuid), os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise io_failure(exc) from exc

    def read_at(self, nuid: str, offset: int, length: int) -> bytes | None:
        """The bytes, or None when the file is gone or shorter (what a purged chunk was)."""
        if (fd := self._open_to_read(nuid)) is None:
            return None
        try:
            data = os.pread(fd, length, offset)
        except OSError as exc:
            raise io_failure(exc) from exc
        finally:
            os.close(fd)
        return data if len(data) == length else None

    def read_whole(self, nuid: str, size: int) -> bytearray | None:
        """The whole file into one bytearray (protobuf parses it without a copy), or None when it is
        gone or not `size` bytes long."""
        if (fd := self._open_to_read(nuid)) is None:
            return None
        try:
            data = bytearray(size)
            got = os.preadv(fd, [data], 0) if size else 0
            longer = os.fstat(fd).st_size != size
        except OSError as exc:
            raise io_failure(exc) from exc
        finally:
            os.close(fd)
        return None if got != size or longer else data

    def unlink(self, nuid: str) -> None:
        """Removes the object's file; a failure is logged, the file left to the sweep."""
        try:
            self.path(nuid).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("blob_file_not_removed", path=str(self.path(nuid)), error=str(exc))

    def tenant_upload_bytes(self, tenant: str) -> int:
        """The tenant's stored upload files, each in whole CHUNK_BYTES as the stream's chunks are
        counted (gateway.max_stored_upload_bytes_per_tenant): one directory scan."""
        prefix = file_name(f"{INPUT_KIND}.{tenant}.")
        total = 0
        with os.scandir(self.folder) as entries:
            for entry in entries:
                if entry.name.startswith(prefix):
                    try:
                        total += -(-entry.stat().st_size // CHUNK_BYTES) * CHUNK_BYTES
                    except FileNotFoundError:
                        continue  # deleted meanwhile
        return total

    def names(self) -> list[str]:
        """Every object file's name (the sweep's listing; probes left by a crash included, as orphans)."""
        with os.scandir(self.folder) as entries:
            return [entry.name for entry in entries if entry.is_file(follow_symlinks=False)]

    def remove_orphans(self, names: list[str], named: set[str], now: float, idle_s: float) -> int:
        """Unlinks the listed files that no meta names (`named`: the metas' file names) and that
        nothing wrote for `idle_s`: a put that died before its meta. A live put writes its file
        far more often (its mtime moves with each write) and its meta within seconds of the last."""
        removed = 0
        for name in names:
            if name in named:
                continue
            path = self.folder / name
            try:
                if now - path.stat().st_mtime < idle_s:
                    continue  # an object still being stored, or just made visible
                path.unlink()
            except FileNotFoundError:
                continue
            log.warning("blob_orphan_file_removed", path=str(path))
            removed += 1
        return removed


def write_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done
