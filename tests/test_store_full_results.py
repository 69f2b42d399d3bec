"""A result computed while NATS cannot store it (its JetStream store full) is kept and stored once
there is room (a helper's limits pass, session 24): it was dropped, the job ran again after AckWait,
and one on its last attempt ended FAILED LEASE_EXPIRED though it had succeeded. A real nats-server
with a small store, filled to the last byte while the job runs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import APIError

from asyncinfer.client import AsyncClient, JobState
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.nats.connection import connect
from services.batcher.models import demo
from tests.stack import StartStack
from tests.test_batch_lifecycle import GATED, gate

__all__ = ["gate"]  # the fixture, used by name
STORE_BYTES = 24 * 1024 * 1024


@pytest.fixture
def small_store(tmp_path: Path) -> Iterator[NatsServerProcess]:
    conf = tmp_path / "nats.conf"
    conf.write_text(f"jetstream {{ max_file_store: {STORE_BYTES} }}\n")
    server = NatsServerProcess(
        store_dir=tmp_path / "nats", log_file=tmp_path / "nats.log", extra_args=("-c", str(conf))
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_a_result_that_found_the_store_full_is_stored_once_there_is_room(
    config: Config, small_store: NatsServerProcess, start_stack: StartStack, gate: None
) -> None:
    stack = await start_stack(config.replace(nats={"url": small_store.url}, models=[DEMO_MODEL.model_dump(), GATED]))
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
            demo.GATE.set()  # the result comes while nothing more can be written
            await asyncio.sleep(2.0)  # it tried and failed (the old code gave up there)
            still = await client.get(job)
            assert still.state is JobState.RUNNING
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
