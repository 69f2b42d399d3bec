"""The chaos soak's watch of the jobs bucket (bench/soak.py) across a nats-server killed and started
again: remade from the write after its last, it sees the writes made at once after the restart
(nats-py's own remake came after two missed heartbeats, ~10 s, and a write replaced meanwhile, the
bucket keeping one a key, was never seen: the soak's checks then missed it)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from asyncinfer.codecs.record import encode_record
from asyncinfer.config import Config
from asyncinfer.declarations import ensure_jobs_bucket
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.jobs import JobRecord, JobState, Priority
from asyncinfer.nats.connection import connect
from bench.soak import History, watch_jobs_bucket


def record(job_id: str, state: JobState) -> JobRecord:
    now = time.time()
    return JobRecord(
        job_id=job_id,
        tenant="default",
        model_name="m",
        model_version="1",
        state=state,
        priority=Priority.NORMAL,
        create_time=now,
        update_time=now,
        max_attempts=3,
        result_retention_s=3600.0,
    )


async def put_all(config: Config, state: JobState) -> None:
    nc = await connect(config.nats, name="soak-watch-test")
    try:
        bucket = await ensure_jobs_bucket(nc.jetstream(), config.nats)
        for k in range(3):
            await bucket.kv.put(f"default.job-{k}", encode_record(record(f"job-{k}", state)))
    finally:
        await nc.close()


async def test_the_watch_sees_the_writes_made_as_the_server_came_back(
    nats_server: NatsServerProcess, config: Config
) -> None:
    await put_all(config, JobState.QUEUED)  # the bucket, as a service makes it
    history = History()
    watch = asyncio.create_task(watch_jobs_bucket(nats_server.url, history))
    try:
        await asyncio.wait_for(history.ready.wait(), 30)
        nats_server.kill()
        nats_server.start()
        await asyncio.wait_for(history.remade.wait(), 30)  # old code: no remake of its own
        await put_all(config, JobState.RUNNING)  # replaced at once: the bucket keeps one write a key
        await put_all(config, JobState.SUCCEEDED)
        async with asyncio.timeout(30):
            while True:
                history.written.clear()
                if len(history.writes) == 3 and not history.open_keys():
                    break
                await history.written.wait()
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    for k in range(3):
        states = [r.state for _, r in history.writes[f"default.job-{k}"]]
        assert states == [JobState.QUEUED, JobState.RUNNING, JobState.SUCCEEDED]
    assert history.resumed == 1
    assert history.missed == 0
