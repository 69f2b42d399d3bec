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
