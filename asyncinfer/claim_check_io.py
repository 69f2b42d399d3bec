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
from asyncinfer.outputs_wire import infer_outputs_pieces
from asyncinfer.tensor_codec import decode_tensors
from asyncinfer.tensors import Tensor

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


async def store_outputs(
    store: BlobStore,
    tenant: str,
    name: str,
    outputs: Sequence[Tensor],
    *,
    expires_at: float,
) -> BlobRef:
    """Stores the outputs as a serialized InferOutputs named `name`, kept until `expires_at`. The
    message is written around the tensors' data (asyncinfer.outputs_wire), which is copied once,
    into the stored chunks: no encoding step to move off the loop."""
    return await store.put_pieces(
        tenant, name, infer_outputs_pieces(outputs), expires_at=expires_at, chunk_bytes=RESULT_CHUNK_BYTES
    )
