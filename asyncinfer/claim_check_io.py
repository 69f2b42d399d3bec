"""A work order's claim-checked bytes: reading the inputs an `input_ref` names, and storing
outputs too large for a job record as an object. The scheduler does both for batchers that do not
(services.scheduler.blobs); a batcher with `batcher.claim_check_io` does them itself
(services.batcher.claim_checks), so that a file batch's rows and outputs do not cross the work
stream twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import TypeVar

from google.protobuf.message import DecodeError

from asyncinfer import ranged_inputs
from asyncinfer.blob_meta import RESULT_CHUNK_BYTES
from asyncinfer.blobs import BlobStore, parse_inputs
from asyncinfer.errors import InvalidArgument
from asyncinfer.jobs import BlobRef
from asyncinfer.tensor_codec import decode_tensors, to_output_proto
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import tensor_pb2

T = TypeVar("T")


async def _off_loop(executor: Executor | None, work: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(executor, work, *args)


async def read_inputs(
    store: BlobStore, tenant: str, ref: str, *, max_bytes: int, executor: Executor | None = None
) -> tuple[Tensor, ...]:
    """The tensors `ref` names: an uploaded InferInputs message, or a batch chunk's rows of its NPY
    upload (asyncinfer.ranged_inputs). Raises NotFound or InvalidArgument when the input is gone or
    unreadable for good, BlobCorrupt (maybe a replica behind: worth another try), and the store's
    Unavailable on NATS trouble. The decoding runs off the loop, on `executor` (default: asyncio's)."""
    _, data = await store.read(tenant, ref, max_bytes=max_bytes)
    if ranged_inputs.is_ranged(data):
        ranged = ranged_inputs.decode(data)
        rows = await store.read_range(
            tenant, ranged.source, ranged.byte_offset, ranged.byte_length, sha256=ranged.source_sha256
        )
        # Off the loop: a file whose dtype differs from the model's is converted (MBs per chunk).
        return tuple(await _off_loop(executor, ranged.tensors, rows))
    try:
        message = await _off_loop(executor, parse_inputs, data)
    except DecodeError as exc:
        raise InvalidArgument(
            "the uploaded content is not an InferInputs message", reason="INPUT_REF_UNREADABLE"
        ) from exc
    del data
    return tuple(decode_tensors(message.inputs, "input_ref.inputs"))


def encode_outputs(outputs: Sequence[Tensor]) -> bytes:
    return tensor_pb2.InferOutputs(outputs=[to_output_proto(t, raw=True) for t in outputs]).SerializeToString()


async def store_outputs(
    store: BlobStore,
    tenant: str,
    name: str,
    outputs: Sequence[Tensor],
    *,
    expires_at: float,
    executor: Executor | None = None,
) -> BlobRef:
    """Stores the outputs as a serialized InferOutputs named `name`, kept until `expires_at` (the
    encoding runs on `executor`)."""
    data = await _off_loop(executor, encode_outputs, outputs)
    return await store.put_bytes(tenant, name, data, expires_at=expires_at, chunk_bytes=RESULT_CHUNK_BYTES)
