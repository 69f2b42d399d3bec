"""asyncinfer.outputs_wire: a stored result's InferOutputs written around the tensors' data is
byte for byte protobuf's own serialization, for every kind of tensor; BlobStore.put_pieces cuts
pieces into the store's chunks whatever their sizes."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from asyncinfer.blobs import BlobStore
from asyncinfer.ids import new_job_id
from asyncinfer.outputs_wire import infer_outputs_pieces, varint
from asyncinfer.tensor_codec import decode_tensors, to_output_proto
from asyncinfer.tensors import Tensor, join_bytes_elements
from asyncinfer.v1 import tensor_pb2
from tests.stack import Stack

CASES = {
    "a chunk's FP32 rows": [Tensor.from_numpy("y", np.arange(2048 * 512, dtype=np.float32).reshape(2048, 512))],
    "two outputs": [
        Tensor.from_numpy("y", np.ones((3, 4), np.float32)),
        Tensor.from_numpy("ids", np.array([[1, -2], [3, 2**40]], np.int64)),
    ],
    "a scalar": [Tensor.from_numpy("s", np.float64(1.5))],
    "no rows": [Tensor.from_numpy("y", np.empty((0, 4), np.float32))],
    "no name": [Tensor(name="", datatype="FP32", shape=(1,), data=b"\x00\x00\x80?")],
    "BYTES": [Tensor(name="t", datatype="BYTES", shape=(2,), data=join_bytes_elements([b"ab", "é".encode()]))],
    "a long name and a wide dimension": [Tensor(name="n" * 300, datatype="UINT8", shape=(1, 70000), data=bytes(70000))],
    "nothing": [],
}


@pytest.mark.parametrize("outputs", CASES.values(), ids=CASES.keys())
def test_the_pieces_are_protobufs_serialization(outputs: list[Tensor]) -> None:
    expected = tensor_pb2.InferOutputs(outputs=[to_output_proto(t, raw=True) for t in outputs]).SerializeToString()
    assert b"".join(infer_outputs_pieces(outputs)) == expected
    if all(t.name for t in outputs):  # what a reader decodes (it refuses a nameless tensor)
        assert decode_tensors(tensor_pb2.InferOutputs.FromString(expected).outputs, "outputs") == outputs


def test_a_tensors_data_is_a_piece_of_its_own_not_a_copy() -> None:
    (tensor,) = CASES["a chunk's FP32 rows"]
    pieces = infer_outputs_pieces([tensor])
    assert len(pieces) == 2
    assert pieces[1] is tensor.data


def test_varints_match_protobufs() -> None:
    for value in (0, 1, 127, 128, 300, 2**31, 2**63 - 1, -1):
        message = tensor_pb2.InferOutputTensor(shape=[value])
        assert message.SerializeToString() == b"\x1a" + varint(len(varint(value))) + varint(value)


@pytest.mark.parametrize("sizes", [[10], [8, 8], [3, 13, 1], [0, 16, 0, 5], [33], []])
async def test_put_pieces_stores_the_pieces_joined_in_chunks_of_the_size_asked(stack: Stack, sizes: list[int]) -> None:
    store: BlobStore = stack.blobs
    pieces = [bytes([n]) * size for n, size in enumerate(sizes, 1)]
    data = b"".join(pieces)
    name = f"out/{new_job_id()}"
    ref = await store.put_pieces("default", name, pieces, expires_at=2e9, chunk_bytes=8)
    assert ref.size_bytes == len(data)
    assert ref.sha256 == hashlib.sha256(data).hexdigest()
    info = await store.info("default", ref.ref)
    assert info.meta["chunks"] == -(-len(data) // 8)
    stored = b"".join([chunk async for chunk in store.chunks("default", ref.ref)])
    assert stored == data
