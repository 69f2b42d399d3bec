"""A stored result's bytes: the serialized `InferOutputs` message (raw contents) of a job's or a
batch chunk's outputs, written as pieces around each tensor's data rather than as one message.

protobuf builds the message by copying each tensor's data into it, and serializing copies it again
(three copies of a chunk's megabytes before the object store takes its own slices). Here the
tensors' data are pieces of their own, so the bytes are copied once, into the stored chunks
(asyncinfer.blob_writer, BlobStore.put_pieces). The encoding is protobuf's own wire format, field by
field in number order, empty fields left out as proto3 does: tests/test_outputs_wire.py checks it
byte for byte against `SerializeToString`.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncinfer.tensors import Tensor

# Field tags (field number << 3 | wire type 2, length-delimited).
_OUTPUTS = 0x0A  # InferOutputs.outputs = 1
_NAME = 0x0A  # InferOutputTensor.name = 1
_DATATYPE = 0x12  # InferOutputTensor.datatype = 2
_SHAPE = 0x1A  # InferOutputTensor.shape = 3 (packed int64)
_RAW_CONTENTS = 0x32  # InferOutputTensor.raw_contents = 6


def varint(value: int) -> bytes:
    """An unsigned base-128 varint (a negative int64 is its two's complement, 10 bytes)."""
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _delimited(tag: int, payload: bytes) -> bytes:
    return bytes((tag,)) + varint(len(payload)) + payload


def infer_outputs_pieces(outputs: Sequence[Tensor]) -> list[bytes]:
    """The serialized InferOutputs of these tensors (raw contents), as pieces: each tensor's data
    is one of them, as it is (joined, they equal protobuf's serialization)."""
    pieces: list[bytes] = []
    for tensor in outputs:
        head = b""
        if tensor.name:
            head += _delimited(_NAME, tensor.name.encode())
        if tensor.datatype:
            head += _delimited(_DATATYPE, tensor.datatype.encode())
        if tensor.shape:
            head += _delimited(_SHAPE, b"".join(varint(d) for d in tensor.shape))
        data = tensor.data
        if data:
            head += bytes((_RAW_CONTENTS,)) + varint(len(data))
        pieces.append(bytes((_OUTPUTS,)) + varint(len(head) + len(data)) + head)
        if data:
            pieces.append(data)
    return pieces
