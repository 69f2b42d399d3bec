"""The SDK's batch files on the client's side, without a server: a download to a path is whole or
absent (a stream that breaks leaves no half file at the path), and arrays that np.savez would
pickle are refused before anything is uploaded."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from asyncinfer.client import AsyncClient
from asyncinfer.client.batches import write_file

pytestmark = pytest.mark.unit


class StreamBroke(Exception):
    pass


async def pieces(*chunks: bytes, then_fail: bool = False) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk
    if then_fail:
        raise StreamBroke("the gateway went away mid-stream")


async def test_a_download_to_a_path_is_renamed_into_place_once_whole(tmp_path: Path) -> None:
    target = tmp_path / "results.npz"
    assert await write_file(pieces(b"abc", b"def"), target) == 6
    assert target.read_bytes() == b"abcdef"
    assert sorted(os.listdir(tmp_path)) == ["results.npz"]


async def test_a_download_that_breaks_leaves_neither_a_half_file_nor_its_part(tmp_path: Path) -> None:
    target = tmp_path / "results.jsonl"
    target.write_bytes(b"an earlier complete download\n")
    with pytest.raises(StreamBroke):
        await write_file(pieces(b"half of ", b"a file", then_fail=True), target)
    assert target.read_bytes() == b"an earlier complete download\n"  # untouched, not truncated
    assert sorted(os.listdir(tmp_path)) == ["results.jsonl"]


async def test_a_mapping_with_an_object_array_is_refused_before_any_upload() -> None:
    # Port 1: nothing listens there, so reaching the upload would fail otherwise (UNAVAILABLE).
    async with AsyncClient("127.0.0.1:1") as client:
        with pytest.raises(ValueError, match="input 'text' is an array of Python objects"):
            await client.create_batch({"text": np.array(["a", 1], dtype=object)}, "demo")


async def test_a_download_to_a_device_or_fifo_writes_into_it_and_leaves_it_one(tmp_path: Path) -> None:
    """`--out /dev/null` must not replace /dev/null with a file: a path that is not a regular file
    is written as it is, without a .part renamed over it (here a FIFO, read as it is written)."""
    fifo = tmp_path / "results.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so that the writer's open does not block
    try:
        assert await write_file(pieces(b"abc", b"def"), fifo) == 6
        assert os.read(reader, 100) == b"abcdef"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(os.listdir(tmp_path)) == ["results.fifo"]


async def test_a_download_to_a_link_to_an_open_descriptor_goes_through_it_and_leaves_the_link(tmp_path: Path) -> None:
    """`--errors /dev/stdout > errors.jsonl`: /dev/stdout is a link to /proc/self/fd/1, which then
    names a regular file, so the .part was renamed over the link: as root /dev/stdout itself became
    a file holding the download, and errors.jsonl stayed empty. Here the same link in a folder of
    the test's own, to a descriptor it opened: the bytes go through the descriptor (after what was
    written to it before), the link stays a link."""
    captured = tmp_path / "captured.jsonl"
    descriptor = os.open(captured, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    link = tmp_path / "stdout"
    link.symlink_to(f"/proc/self/fd/{descriptor}")
    try:
        os.write(descriptor, b"a line printed first\n")
        assert await write_file(pieces(b"abc", b"def"), link) == 6
        os.write(descriptor, b"\na line printed after\n")
    finally:
        os.close(descriptor)
    assert link.is_symlink()
    assert captured.read_bytes() == b"a line printed first\nabcdef\na line printed after\n"
    assert sorted(os.listdir(tmp_path)) == ["captured.jsonl", "stdout"]


async def test_a_download_to_a_link_writes_the_file_it_names_and_leaves_the_link(tmp_path: Path) -> None:
    """A path that is a link to a file elsewhere (results.jsonl -> /data/results.jsonl): the file
    at its end gets the download, whole (its .part beside it), and the link stays; the rename
    replaced the link with a file and left the file it named as it was."""
    (tmp_path / "data").mkdir()
    target = tmp_path / "data" / "results.jsonl"
    target.write_bytes(b"an earlier download\n")
    link = tmp_path / "results.jsonl"
    link.symlink_to(Path("data") / "results.jsonl")
    assert await write_file(pieces(b"abc", b"def"), link) == 6
    assert link.is_symlink()
    assert target.read_bytes() == b"abcdef"
    assert sorted(os.listdir(tmp_path)) == ["data", "results.jsonl"]
    assert sorted(os.listdir(tmp_path / "data")) == ["results.jsonl"]
