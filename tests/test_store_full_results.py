"""A result computed while NATS cannot store it (its JetStream store full) is kept and stored once
there is room (a helper's limits pass, session 24): it was dropped, the job ran again after AckWait,
and one on its last attempt ended FAILED LEASE_EXPIRED though it had succeeded. A real nats-server
with a small store, filled to the last byte while the job runs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import APIError
from structlog.testing import capture_logs

from asyncinfer.client import AsyncClient, JobState
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.nats.connection import connect
from asyncinfer.v1 import ops_service_pb2, ops_service_pb2_grpc
from services.batcher.models import demo
from tests.batch_helpers import batches_stub, create_request, demo_records, jsonl, upload
from tests.stack import StartStack
from tests.test_batch_lifecycle import GATED, gate
from tests.test_store_full_server import nats_with_a_store_of

__all__ = ["gate"]  # the fixture, used by name
STORE_BYTES = 24 * 1024 * 1024


@pytest.fixture
def small_store(tmp_path: Path) -> Iterator[NatsServerProcess]:
    with nats_with_a_store_of(tmp_path, STORE_BYTES) as server:
        yield server


async def test_a_result_that_found_the_store_full_is_stored_once_there_is_room(
    config: Config, small_store: NatsServerProcess, start_stack: StartStack, gate: None
) -> None:
    stack = await start_stack(
        config.replace(
            nats={"url": small_store.url},
            models=[DEMO_MODEL.model_dump(), GATED],
            scheduler={"queue_stats_interval_s": 0.2},
        )
    )
    nc = await connect(stack.config.nats, name="filler")
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="FILL", subjects=["fill.>"], storage=StorageType.FILE))
    try:
        async with AsyncClient(stack.address) as client:
            job = await client.submit("gated", {"x": np.ones((1, 4), np.float32)}, max_attempts=1)
            async for seen in client.watch(job, timeout_s=30):
                if seen.state is JobState.RUNNING:
                    break
            for size in (256 * 1024, 16 * 1024, 1024, 64):  # to the last byte
                while await _stored(js, size):
                    pass
            with capture_logs() as logs:
                demo.GATE.set()  # the result comes while nothing more can be written
                await asyncio.sleep(2.0)  # it tried and failed (the old code gave up there)
                still = await client.get(job)
                assert still.state is JobState.RUNNING
                # An operator's call is told why (it answered UNKNOWN, naming nats-py's exception).
                async with grpc.aio.insecure_channel(stack.ops_address) as channel:
                    ops = ops_service_pb2_grpc.OpsServiceStub(channel)
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name="demo"))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert unpack_details(status_details(refused.value))["ErrorInfo"].reason == "STORE_FULL"  # type: ignore[arg-type]
            # The snapshots that cannot be written: a line, not a traceback every 0.2 s.
            stats = [e for e in logs if e["event"] == "queue_stats_failed"]
            assert len(stats) == 1, stats
            assert "exc_info" not in stats[0]
            await js.purge_stream("FILL")
            done = await client.wait(job, timeout_s=30)
    finally:
        await nc.close()
    assert done.state is JobState.SUCCEEDED, done.error
    assert done.attempt == 1


async def _stored(js: object, size: int) -> bool:
    try:
        await js.publish("fill.x", b"\0" * size)  # type: ignore[attr-defined]
    except APIError:  # insufficient resources
        return False
    return True


async def test_a_batch_created_on_a_full_store_is_resource_exhausted(
    config: Config, small_store: NatsServerProcess, start_stack: StartStack
) -> None:
    """As UploadInput and SubmitJob answer (a helper's batch pass: it was UNAVAILABLE quoting
    nats-py's exception, which a client retries at once)."""
    stack = await start_stack(config.replace(nats={"url": small_store.url}))
    stub = batches_stub(stack.channel)
    ref = await upload(stack.jobs, jsonl(demo_records(5)))
    nc = await connect(stack.config.nats, name="filler")
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="FILL", subjects=["fill.>"], storage=StorageType.FILE))
    try:
        for size in (256 * 1024, 16 * 1024, 1024, 64):
            while await _stored(js, size):
                pass
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CreateBatch(create_request(ref))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert unpack_details(status_details(refused.value))["ErrorInfo"].reason == "STORE_FULL"  # type: ignore[arg-type]
        await js.purge_stream("FILL")
        created = await stub.CreateBatch(create_request(ref))
        assert created.batch.batch_id
    finally:
        await nc.close()
