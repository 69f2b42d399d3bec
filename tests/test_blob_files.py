"""Claim-check objects with their bytes in the objects' directory (nats.objects_directory,
asyncinfer.blob_files), their metas in NATS, against a real nats-server: the store's behaviours for
both homes of the bytes (chunks in the stream, files in the directory), an old chunks object read
where the directory is set, a directory object met where none is (FAILED_PRECONDITION), the start's
check of the directory, the sweep of files no meta names, and the per-tenant upload limit counting
files."""

from __future__ import annotations

import asyncio
import errno
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from asyncinfer import blob_writer
from asyncinfer.blob_files import DIRECTORY, ObjectFiles, file_name
from asyncinfer.blob_meta import CHUNK_BYTES, BlobCorrupt, new_input_ref, result_ref
from asyncinfer.blob_sweep import MetaCursor, sweep
from asyncinfer.blobs import BlobStore, ensure_objects_bucket
from asyncinfer.config import Config
from asyncinfer.contract import BYTES_IN_HEADER, CHUNK_SEQUENCES_HEADER
from asyncinfer.errors import ConfigError, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.ids import new_job_id
from asyncinfer.nats import OBJ_CHUNKS_PRE_TEMPLATE
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.streams import StoreFullError
from asyncinfer.v1 import job_pb2
from tests.stack import Stack, StartStack
from tests.test_claim_check import (
    ACME,
    bearer,
    by_ref,
    claim_check_config,
    finish,
    inline,
    inputs_bytes,
    rpc_error,
    upload,
)
from tests.test_delete_input import LIMIT, delete

pytestmark = pytest.mark.timeout(90)
SIZE = 3 * CHUNK_BYTES + 1000  # over INLINE_IO_BYTES: the whole reads and writes go to a thread
LATER = time.time() + 3600


def content(seed: int, size: int = SIZE) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


async def pieces(data: bytes, size: int = 50_000) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.fixture
def objects_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "objects"
    directory.mkdir()
    return directory


def with_directory(config: Config, directory: Path | None) -> Config:
    return config.replace(nats={"objects_directory": str(directory) if directory else None})


@pytest.fixture(params=["chunks", "directory"])
async def store(request: pytest.FixtureRequest, nc: NatsClient, config: Config, objects_dir: Path) -> BlobStore:
    """The store as a service builds it, its bytes in the stream's chunks or in the directory."""
    directory = objects_dir if request.param == "directory" else None
    return await ensure_objects_bucket(nc, with_directory(config, directory).nats)


def files_of(store: BlobStore) -> list[str]:
    return sorted(os.listdir(store.files.folder)) if store.files is not None else []


async def chunk_messages(store: BlobStore) -> int:
    subjects = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=store.bucket, obj=">")
    info = await store.js.stream_info(store.stream, subjects_filter=subjects)
    return sum((info.state.subjects or {}).values())


# --- the store's behaviours, either home of the bytes -------------------------------------------


async def test_an_object_reads_back_whole_in_chunks_and_by_range(store: BlobStore) -> None:
    data = content(1)
    ref = new_input_ref()
    stored = await store.put("t", ref, pieces(data), expires_at=LATER, max_bytes=SIZE)
    assert stored.size_bytes == SIZE
    info, whole = await store.read("t", ref, max_bytes=SIZE)
    assert bytes(whole) == data
    assert b"".join([chunk async for chunk in store.chunks("t", ref)]) == data
    for offset, length in [(0, 10), (CHUNK_BYTES - 3, 7), (5, SIZE - 5), (SIZE - 100, 100)]:
        assert await store.read_range("t", ref, offset, length) == data[offset : offset + length]
    with pytest.raises(InvalidArgument):
        await store.read_range("t", ref, SIZE - 10, 11)
    with pytest.raises(NotFound) as changed:
        await store.read_range("t", ref, 0, 10, sha256="0" * 64)
    assert changed.value.reason == "BLOB_CHANGED"
    headers = info.meta["headers"]
    if store.files is None:  # the wire format as before: no location header, chunks by sequence
        assert BYTES_IN_HEADER not in headers
        assert CHUNK_SEQUENCES_HEADER in headers
        assert await chunk_messages(store) == 4
    else:
        assert headers[BYTES_IN_HEADER] == [DIRECTORY]
        assert await chunk_messages(store) == 0
        assert files_of(store) == [file_name(info.nuid)]
        assert (store.files.folder / file_name(info.nuid)).read_bytes() == data


async def test_a_refused_put_leaves_nothing(store: BlobStore) -> None:
    data = content(2)
    ref = new_input_ref()
    with pytest.raises(InvalidArgument) as large:
        await store.put("t", ref, pieces(data), expires_at=LATER, max_bytes=SIZE - 1)
    assert large.value.reason == "UPLOAD_TOO_LARGE"
    with pytest.raises(InvalidArgument) as mismatch:
        await store.put("t", ref, pieces(data), expires_at=LATER, max_bytes=SIZE, expected_sha256="0" * 64)
    assert mismatch.value.reason == "SHA256_MISMATCH"
    assert (await store.js.stream_info(store.stream)).state.messages == 0
    assert files_of(store) == []
    with pytest.raises(NotFound):
        await store.info("t", ref)


async def test_a_replaced_object_leaves_only_the_new_ones_bytes(store: BlobStore) -> None:
    ref = result_ref(new_job_id())
    await store.put_bytes("t", ref, content(3), expires_at=LATER)
    await store.put_bytes("t", ref, content(4, 1000), expires_at=LATER)
    assert bytes((await store.read("t", ref, max_bytes=SIZE))[1]) == content(4, 1000)
    assert await chunk_messages(store) == (0 if store.files else 1)
    assert len(files_of(store)) == (1 if store.files else 0)


async def test_a_deleted_or_expired_object_goes_with_its_bytes(store: BlobStore) -> None:
    kept, deleted, expired = new_input_ref(), new_input_ref(), new_input_ref()
    await store.put_bytes("t", kept, content(5), expires_at=LATER)
    kept_files = files_of(store)
    await store.put_bytes("t", deleted, content(6), expires_at=LATER)
    await store.put_bytes("t", expired, content(7), expires_at=time.time() - 1)
    await store.delete_live("t", deleted)
    assert await sweep(store) == 1
    for gone in (deleted, expired):
        with pytest.raises(NotFound):
            await store.info("t", gone)
    assert await chunk_messages(store) == (0 if store.files else 4)
    assert files_of(store) == kept_files
    assert bytes((await store.read("t", kept, max_bytes=SIZE))[1]) == content(5)


async def test_lost_bytes_read_as_data_loss_and_deleted_ones_as_not_found(store: BlobStore) -> None:
    ref = new_input_ref()
    await store.put_bytes("t", ref, content(8), expires_at=LATER)
    info = await store.info("t", ref)
    if store.files is not None:
        os.truncate(store.files.path(info.nuid), CHUNK_BYTES)
    else:
        await store.js.purge_stream(
            store.stream, subject=OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=store.bucket, obj=info.nuid), keep=1
        )
    with pytest.raises(BlobCorrupt):
        await store.read("t", ref, max_bytes=SIZE)
    with pytest.raises(BlobCorrupt):
        _ = [chunk async for chunk in store.chunks("t", ref)]
    await store.delete("t", ref)
    with pytest.raises(NotFound):
        await store.read("t", ref, max_bytes=SIZE)


async def test_a_put_cancelled_midway_leaves_nothing_and_one_whose_file_the_sweep_took_is_refused(
    nc: NatsClient, config: Config, objects_dir: Path
) -> None:
    store = await ensure_objects_bucket(nc, with_directory(config, objects_dir).nats)
    files = store.files
    assert files is not None
    written, never = asyncio.Event(), asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        yield content(12)
        written.set()
        await never.wait()  # a client that stops sending; its RPC is then cancelled
        yield b"never"

    put = asyncio.create_task(store.put("t", new_input_ref(), stalls(), expires_at=LATER, max_bytes=2 * SIZE))
    await written.wait()
    assert len(files_of(store)) == 1, "the first piece is in its file"
    put.cancel()
    with pytest.raises(asyncio.CancelledError):
        await put
    assert files_of(store) == []
    assert (await store.js.stream_info(store.stream)).state.messages == 0

    # A put that stalled past the orphan bound finds its file unlinked by the sweep: refused, no meta.
    async def swept_midway() -> AsyncIterator[bytes]:
        yield content(13)
        for name in files_of(store):
            (files.folder / name).unlink()  # what the sweep does to a file idle past its bound
        yield b"the rest"

    ref = new_input_ref()
    with pytest.raises(Unavailable) as lost:
        await store.put("t", ref, swept_midway(), expires_at=LATER, max_bytes=2 * SIZE)
    assert lost.value.reason == "UPLOAD_CHUNKS_LOST"
    with pytest.raises(NotFound):
        await store.info("t", ref)
    assert files_of(store) == []


async def test_a_directory_that_fails_answers_no_room_or_unavailable_never_internal(
    nc: NatsClient, config: Config, objects_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await ensure_objects_bucket(nc, with_directory(config, objects_dir).nats)
    files = store.files
    assert files is not None

    # Writes: a full disk (injected: a test cannot fill one portably) is no room, as a full stream
    # is; another failure is UNAVAILABLE. Either way nothing is left.
    for code, expected in ((errno.ENOSPC, StoreFullError), (errno.EIO, Unavailable)):

        def failing(fd: int, view: memoryview, offset: int, code: int = code) -> None:
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(blob_writer, "write_all", failing)
        with pytest.raises(expected):
            await store.put_bytes("t", new_input_ref(), content(14), expires_at=LATER)
        assert files_of(store) == []
    monkeypatch.undo()
    assert (await store.js.stream_info(store.stream)).state.messages == 0

    # Reads: where the file should be, a folder (open succeeds, pread fails EISDIR): UNAVAILABLE.
    ref = new_input_ref()
    await store.put_bytes("t", ref, content(15), expires_at=LATER)
    path = files.path((await store.info("t", ref)).nuid)
    path.unlink()
    path.mkdir()
    for read in (lambda: store.read("t", ref, max_bytes=SIZE), lambda: store.read_range("t", ref, 0, 10)):
        with pytest.raises(Unavailable) as failed:
            await read()
        assert failed.value.reason == "OBJECTS_DIRECTORY_UNAVAILABLE"
        assert "nats.objects_directory" in failed.value.message


# --- both homes at once: a change of the setting loses nothing -----------------------------------


async def test_objects_stored_either_way_are_read_either_way_and_a_process_without_the_directory_says_so(
    nc: NatsClient, config: Config, objects_dir: Path
) -> None:
    chunks = await ensure_objects_bucket(nc, config.nats)
    files = await ensure_objects_bucket(nc, with_directory(config, objects_dir).nats)
    old, new = new_input_ref(), new_input_ref()
    await chunks.put_bytes("t", old, content(9), expires_at=LATER)
    await files.put_bytes("t", new, content(10), expires_at=LATER)

    # Where the directory is set, an object stored as chunks before reads as it did.
    assert bytes((await files.read("t", old, max_bytes=SIZE))[1]) == content(9)
    assert b"".join([c async for c in files.chunks("t", old)]) == content(9)
    assert await files.read_range("t", old, CHUNK_BYTES - 1, 2) == content(9)[CHUNK_BYTES - 1 : CHUNK_BYTES + 1]

    # Where it is not, a directory object is a clear FAILED_PRECONDITION naming the setting.
    for read in (
        lambda: chunks.read("t", new, max_bytes=SIZE),
        lambda: chunks.read_range("t", new, 0, 10),
        lambda: chunks.chunks("t", new).__anext__(),
    ):
        with pytest.raises(FailedPrecondition) as refused:
            await read()
        assert refused.value.reason == "OBJECTS_DIRECTORY_NOT_SET"
        assert refused.value.metadata["setting"] == "nats.objects_directory"

    # A delete where the directory is set removes an old object's chunks as before.
    await files.delete_live("t", old)
    assert await chunk_messages(chunks) == 0
    assert len(files_of(files)) == 1


async def test_a_batcher_without_the_directory_fails_a_directory_input_clearly_and_serves_on(
    config: Config, objects_dir: Path, start_stack: StartStack
) -> None:
    """A batcher reading inputs itself (claim_check_io) whose configuration lacks the directory the
    gateway stored an upload in (a rolling change half done): each attempt fails with the reason
    naming the setting, never a crash or a wrong read, and is retried (a batcher with the directory
    would read it); with this batcher alone the job ends FAILED after its attempts, and the batcher
    serves other jobs."""
    stack_config = claim_check_config(with_directory(config, objects_dir))
    batcher_config = claim_check_config(config).replace(batcher={"claim_check_io": True})
    stack = await start_stack(stack_config, batcher_config=batcher_config)
    ref = await upload(stack.jobs, inputs_bytes(np.ones((4, 4))))
    assert BYTES_IN_HEADER in (await stack.blobs.info("acme", ref.ref)).meta["headers"]

    refused = await finish(stack.jobs, (await stack.jobs.SubmitJob(by_ref(ref.ref), metadata=bearer(ACME))).job.job_id)
    assert refused.state == job_pb2.JOB_STATE_FAILED
    assert refused.error.reason == "OBJECTS_DIRECTORY_NOT_SET", refused.error
    assert "nats.objects_directory" in refused.error.message
    assert refused.attempt == stack.config.models[0].max_attempts > 1, "retried: another batcher may read it"
    served = await finish(
        stack.jobs, (await stack.jobs.SubmitJob(inline([[1, 2, 3, 4]]), metadata=bearer(ACME))).job.job_id
    )
    assert served.state == job_pb2.JOB_STATE_SUCCEEDED


# --- the start's check ----------------------------------------------------------------------------


async def test_a_missing_or_unwritable_directory_stops_a_service_at_start(
    config: Config, objects_dir: Path, start_stack: StartStack, nc: NatsClient
) -> None:
    missing = objects_dir / "not-there"
    with pytest.raises(ConfigError, match=r"nats\.objects_directory") as refused:
        await start_stack(with_directory(config, missing), scheduler=False, batcher=False)
    assert "not a directory" in str(refused.value)
    # A file where the bucket's folder should be: the folder cannot be made, so nothing can be written.
    blocked = objects_dir / "blocked"
    blocked.mkdir()
    (blocked / config.nats.objects_bucket).write_text("a file, not a folder")
    with pytest.raises(ConfigError, match="cannot be written"):
        await ensure_objects_bucket(nc, with_directory(config, blocked).nats)
    with pytest.raises(ConfigError, match=r"nats\.objects_directory"):
        BlobStore.of(nc, with_directory(config, missing).nats)


# --- the sweep ------------------------------------------------------------------------------------


async def test_the_sweep_removes_files_no_meta_names_once_idle_and_keeps_the_rest(
    nc: NatsClient, config: Config, objects_dir: Path
) -> None:
    store = await ensure_objects_bucket(nc, with_directory(config, objects_dir).nats)
    files = store.files
    assert isinstance(files, ObjectFiles)
    live = new_input_ref()
    await store.put_bytes("t", live, content(11), expires_at=LATER)
    dead, fresh = "in.t.DEADPUT", "in.t.STREAMING"  # a put that crashed long ago, one still writing
    for name in (dead, fresh):
        os.close(files.create(name))
    long_ago = time.time() - 3600
    for name in (dead, file_name((await store.info("t", live)).nuid)):
        os.utime(files.folder / name, (long_ago, long_ago))

    assert await sweep(store, orphans_after_s=300) == 1
    assert dead not in files_of(store)
    assert fresh in files_of(store)
    assert bytes((await store.read("t", live, max_bytes=SIZE))[1]) == content(11)

    # The scheduler's sweeper keeps a cursor over the metas between passes: the same, pass after pass.
    cursor = MetaCursor()
    assert await sweep(store, orphans_after_s=300, cursor=cursor) == 0
    os.close(files.create(dead))
    os.utime(files.folder / dead, (long_ago, long_ago))
    assert await sweep(store, orphans_after_s=300, cursor=cursor) == 1
    assert sorted(files_of(store)) == sorted([fresh, file_name((await store.info("t", live)).nuid)])


# --- the per-tenant upload limit ------------------------------------------------------------------


async def test_the_tenants_upload_limit_counts_directory_files_and_old_chunks(
    config: Config, objects_dir: Path, start_stack: StartStack
) -> None:
    limited = claim_check_config(
        with_directory(config, objects_dir), max_upload_bytes=1024 * 1024, max_stored_upload_bytes_per_tenant=LIMIT
    )
    stack: Stack = await start_stack(limited, scheduler=False, batcher=False)
    two_chunks = inputs_bytes(np.ones((12_000, 4)))  # ~192 KB: two chunks' worth
    # One upload stored as chunks before the directory was set, one in the directory: the limit.
    old = BlobStore(stack.nc, config.nats.objects_bucket)
    await old.put_bytes("acme", new_input_ref(), two_chunks, expires_at=LATER)
    first = await upload(stack.jobs, two_chunks)
    assert stack.blobs.files is not None
    assert len(files_of(stack.blobs)) == 1

    error = await rpc_error(upload(stack.jobs, two_chunks))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = status_details(error)
    assert status is not None
    info = unpack_details(status)["ErrorInfo"]
    assert info.reason == "TENANT_STORAGE_EXCEEDED"
    assert info.metadata["stored_bytes"] == str(4 * CHUNK_BYTES)
    assert len(files_of(stack.blobs)) == 1, "the refused upload left no file"

    await delete(stack, first.ref)  # type: ignore[misc]
    assert files_of(stack.blobs) == []
    await upload(stack.jobs, two_chunks, key=ACME)  # the room the delete made
    assert len(files_of(stack.blobs)) == 1
