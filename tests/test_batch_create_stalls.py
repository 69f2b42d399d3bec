"""A CreateBatch that stalls between minting its batch's ID and writing its record, against a real
stack (gateway, nats-server): a suspend seen by the wall clock alone (services/gateway/
batch_service.py)."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest

from asyncinfer import batches
from asyncinfer.blob_meta import BlobInfo
from asyncinfer.blobs import BlobStore
from asyncinfer.config import Config
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.v1 import batch_service_pb2
from services.gateway.batch_store import BatchStore, ensure_batches_bucket
from tests.batch_helpers import batches_stub, create_request, demo_records, jsonl, upload
from tests.stack import Stack, StartStack

TENANT = "default"
HANG_GUARD_S = 60.0


def stalls_config(config: Config) -> Config:
    return config.replace(batches={"chunk_records": 50, "drive_interval_s": 0.05})


async def claim_holder(stack: Stack, key: str) -> str | None:
    store = BatchStore(await ensure_batches_bucket(stack.nc.jetstream(), stack.config.nats))
    held = await store.holder(TENANT, key)
    return held[0] if held is not None else None


async def test_a_create_suspended_past_its_bound_by_the_wall_clock_writes_no_batch(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A suspended host's monotonic clock stops while the wall clock (and every reader's) runs on:
    # the create's bound, checked on the monotonic clock alone, passed, and it wrote its record
    # past the time a duplicate or a DeleteInput reads as "can no longer be written".
    ahead_s = [0.0]
    stack = await start_stack(stalls_config(config), batcher=False, gateway_wall_clock=lambda: time.time() + ahead_s[0])
    stub = batches_stub(stack.channel)
    hold = BlobStore.hold_for_batch

    async def suspended(store: BlobStore, *args: Any, **kwargs: Any) -> BlobInfo:
        ahead_s[0] = batches.CREATE_RECORD_WITHIN_S  # the suspend, as the wall clock saw it
        return await hold(store, *args, **kwargs)

    monkeypatch.setattr(BlobStore, "hold_for_batch", suspended)
    request = create_request(await upload(stack.jobs, jsonl(demo_records(5))), idempotency_key="suspended")
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await stub.CreateBatch(request, timeout=HANG_GUARD_S)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    status = status_details(failed.value)
    assert status is not None
    assert unpack_details(status)["ErrorInfo"].reason == "BATCH_CREATE_TOO_SLOW"
    listed = await stub.ListBatches(batch_service_pb2.ListBatchesRequest())
    assert list(listed.batches) == []
    assert await claim_holder(stack, "suspended") is None  # nothing was sent: the key is free at once
