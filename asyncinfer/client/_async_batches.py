"""AsyncClient's batches over files (asyncinfer.client._async): create_batch uploads the file (or arrays as
NPY/NPZ) and creates the batch; get, cancel, list, watch and wait it; download its output or error file, or
its outputs as arrays. The calls themselves are asyncinfer.client.batches's BatchCalls."""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import io
import os
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from asyncinfer.client._async_blobs import BlobCalls
from asyncinfer.client._retry import checked_timeout
from asyncinfer.client.batches import Batch, BatchCalls, BatchPage, create_batch_request, write_file
from asyncinfer.client.errors import (
    AsyncInferClientError,
    DeadlineExceededError,
    FailedPreconditionError,
    UnavailableError,
    ended_at,
)
from asyncinfer.client.types import BlobRef
from asyncinfer.tensors import booleans_misplaced

# What create_batch uploads: a file (bytes, a path, a binary file), an array (NPY) or arrays by input name (NPZ).
BatchData = (
    bytes
    | str
    | os.PathLike[str]
    | BinaryIO
    | npt.NDArray[Any]
    | list[Any]
    | tuple[Any, ...]
    | Mapping[str, npt.ArrayLike]
)


class BatchFiles(BlobCalls):
    """AsyncClient's batch methods, over the BatchCalls its channel made and its uploads."""

    @property
    def _batch_calls(self) -> BatchCalls:
        if self._closed:
            raise RuntimeError("the client is closed")
        return self._batches

    async def create_batch(
        self,
        data: BatchData,
        model: str,
        *,
        upload_timeout_s: float | None = None,
        on_uploaded: Callable[[BlobRef], None] | None = None,
        traceparent: str = "",
        **options: Any,
    ) -> Batch:
        """Uploads a JSONL (or NPY/NPZ) file of records and creates a batch over it (state
        VALIDATING); `options` are `create_batch_request`'s (version, input_format, priority,
        completion_window_s, max_attempts, labels, callback or callback_url, idempotency_key). `data` may
        also be an array (uploaded as an NPY file: one record per row, the model's only input)
        or a mapping of input name to array (an NPZ file), held in memory once more as a file;
        `output_arrays` then reads the outputs back as arrays. Without an `idempotency_key` one is
        generated (as `submit` does), so that a create sent again after a lost answer makes no second batch.
        `on_uploaded` hears the stored upload before the create is sent: a caller interrupted before
        then knows no batch was made (the gateway purges an upload cut short), one interrupted after
        that the batch may exist. `traceparent`: a W3C trace context for the CreateBatch call, whose
        span the batch's chunk jobs' traces link to when the gateway traces (`Batch.trace_id`)."""
        if isinstance(data, list | tuple):  # rows as lists, as submit takes them: an array
            rows = np.asarray(data)
            if rows.dtype.hasobject:
                raise ValueError("rows given as lists must make a numeric array (numpy.asarray(rows))")
            if misplaced := booleans_misplaced(data, None, rows):  # [True, 2.5] would be [1.0, 2.5]
                raise ValueError(f"the rows {misplaced}")
            data = rows
        if isinstance(data, np.ndarray):
            buffer = io.BytesIO()
            np.save(buffer, data, allow_pickle=False)
            data = buffer.getvalue()
        elif isinstance(data, Mapping):
            arrays = {name: np.asarray(array) for name, array in data.items()}
            for name, array in arrays.items():
                if misplaced := booleans_misplaced(data[name], None, array):
                    raise ValueError(f"input {name!r} {misplaced}")
                if array.dtype.hasobject:  # np.savez would pickle it, which the gateway refuses to load
                    raise ValueError(
                        f"input {name!r} is an array of Python objects ({array.dtype}): a batch's arrays are "
                        "numeric or fixed-width strings (for text, numpy.str_ or bytes_ arrays)"
                    )
            buffer = io.BytesIO()
            np.savez(buffer, **arrays)
            data = buffer.getvalue()
        request = create_batch_request("", model, **options)  # a bad option fails before the upload
        # As submit's: a create whose answer was lost (UNAVAILABLE) is sent again, and without a
        # key that made a second batch over the same upload, every record run twice.
        generated_key = not request.idempotency_key
        if generated_key:
            request.idempotency_key = str(uuid.uuid4())
        # A model the gateway does not serve is said before the file goes up (minutes for a large
        # one), not by the create's refusal after it; a model already known costs no call.
        await self._require_served(model)
        ref = await self.upload(data, timeout_s=upload_timeout_s)
        if on_uploaded is not None:
            on_uploaded(ref)
        request.input_ref = ref.ref
        try:
            batch = await self._batch_calls.create(request, traceparent=traceparent)
        except AsyncInferClientError as refused:
            # The upload was this call's own: a refused create (an unknown model, a bad option)
            # would leave it counting against the tenant's stored uploads until its retention ends.
            # (A create whose answer was lost may have made the batch: UNAVAILABLE and
            # DEADLINE_EXCEEDED keep the upload, which that batch reads.)
            if not isinstance(refused, UnavailableError | DeadlineExceededError):
                with contextlib.suppress(AsyncInferClientError):
                    await self.delete_input(ref)
            raise
        if batch.deduplicated and batch.input_ref != ref.ref:
            # A retry under an idempotency key: the batch reads the first upload, not this one.
            with contextlib.suppress(AsyncInferClientError):
                await self.delete_input(ref)
        if generated_key and batch.deduplicated:  # this call's own retry found its first create
            batch = dataclasses.replace(batch, deduplicated=False)
        return batch

    async def get_batch(self, batch: Batch | str) -> Batch:
        return await self._batch_calls.get(batch)

    async def cancel_batch(self, batch: Batch | str) -> Batch:
        """Stops the batch's chunks (CANCELLING, then CANCELLED); what finished is kept. Safe to
        repeat, as `cancel` is: a batch that had ended (FAILED_PRECONDITION BATCH_ALREADY_ENDED)
        is returned as it is."""
        try:
            return await self._batch_calls.cancel(batch)
        except FailedPreconditionError as error:
            if error.reason != "BATCH_ALREADY_ENDED":
                raise
        return await self._batch_calls.get(batch)

    async def list_batches(self, *, page_size: int = 0, page_token: str = "") -> tuple[builtins.list[Batch], str]:
        """One page of the caller's batches, newest first, and the next page's token ("" at the end).
        `list_batches_page` says too how many the gateway left out, unreadable."""
        page = await self.list_batches_page(page_size=page_size, page_token=page_token)
        return builtins.list(page.batches), page.next_page_token

    async def list_batches_page(self, *, page_size: int = 0, page_token: str = "") -> BatchPage:
        """One page of the caller's batches, newest first: with the next page's token ("" at the
        end) and how many batches the gateway left out of it because it cannot decode their record
        (`unreadable_skipped`)."""
        return await self._batch_calls.list(page_size=page_size, page_token=page_token)

    def watch_batch(self, batch: Batch | str, *, timeout_s: float | None = None) -> AsyncIterator[Batch]:
        """The batch now, then each change of state or progress, until it ends. `timeout_s`: as
        `watch`'s (0 or more; 0 raises DeadlineExceededError without opening the stream)."""
        checked_timeout(timeout_s)  # here, not at the first step
        return self._batch_calls.watch(batch, timeout_s=timeout_s)

    async def wait_batch(self, batch: Batch | str, *, timeout_s: float | None = None) -> Batch:
        """Waits until the batch ends and returns it. InternalError naming the state when the gateway
        ended it in one newer than this SDK (as a job's `wait` raises)."""
        last = batch if isinstance(batch, Batch) else None
        async for update in self.watch_batch(batch, timeout_s=timeout_s):
            last = update
        assert last is not None
        if not last.done:
            raise ended_at(f"batch {last.batch_id}", last.state)
        return last

    async def download(
        self,
        batch: Batch | str,
        target: str | os.PathLike[str] | BinaryIO,
        *,
        file: str | None = None,
        timeout_s: float | None = None,
    ) -> int:
        """Writes the batch's output file (JSONL in input order), or with file="errors" its error
        file, or with file="npz" the NPZ archive of a batch over an NPY or NPZ file (see
        `output_arrays`), to a path or a binary file; the bytes written. Without `file`, a path
        ending .npz gets the NPZ archive (as the CLI's `--out results.npz`; it got the JSONL, which
        numpy.load could not read), any other target the JSONL output. `timeout_s`: the most the
        whole download may take (none by default: a large file takes as long as it takes). Opened
        again after UNAVAILABLE until its first byte comes (the client's RetryPolicy); a stream
        that breaks after that raises (a path is then left as it was)."""
        if file is None:
            named_npz = isinstance(target, str | os.PathLike) and os.fspath(target).lower().endswith(".npz")
            file = "npz" if named_npz else "output"
        return await write_file(self._batch_calls.download(batch, file, timeout_s=timeout_s), target)

    async def output_arrays(self, batch: Batch | str) -> dict[str, npt.NDArray[Any]]:
        """The outputs of a batch over an NPY or NPZ file as arrays, in memory: "succeeded" (a bool
        per record) and one array per model output, first dimension every record in input order
        (a record that did not succeed is a row of zeros; `download(..., file="errors")` says
        why). FailedPreconditionError for a batch over a JSONL file, or a model whose outputs are
        not one numeric shape per record. For outputs larger than memory, `download(file="npz")`
        to a path and `numpy.load(path, mmap_mode=...)` on its members."""
        buffer = io.BytesIO()
        await write_file(self._batch_calls.download(batch, "npz"), buffer)
        buffer.seek(0)
        with np.load(buffer, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
