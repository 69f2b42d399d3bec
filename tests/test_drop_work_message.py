"""A cancelled job's work message dropped while its queue's consumer holds other jobs' deliveries:
none of them is stranded below the consumer's ack floor (a subject purge stranded the older ones:
docs/ARCHITECTURE.md, "Work messages stranded below their consumer's ack floor")."""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client as NatsClient

from asyncinfer.config import Config
from asyncinfer.contract import job_work_subject
from asyncinfer.declarations import ensure_jobs_bucket, ensure_work_consumer, ensure_work_stream
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobRecord, JobState, Priority


def record(job_id: str) -> JobRecord:
    now = time.time()
    return JobRecord(
        job_id=job_id,
        tenant="default",
        model_name="m",
        model_version="1",
        state=JobState.CANCELED,
        priority=Priority.NORMAL,
        create_time=now,
        update_time=now,
        max_attempts=3,
        result_retention_s=60.0,
    )


async def test_a_dropped_message_strands_no_older_delivery(nc: NatsClient, config: Config) -> None:
    js = nc.jetstream()
    await ensure_work_stream(js, config.nats)
    store = JobStore(await ensure_jobs_bucket(js, config.nats), work_stream=config.nats.work_stream)
    consumer = await ensure_work_consumer(js, config.nats, model_name="m", priority=Priority.NORMAL, ack_wait_s=1.0)
    jobs = [record(f"job-{k}") for k in (1, 2, 3)]
    for job in jobs:
        await js.publish(job_work_subject(job.model_name, job.priority, job.tenant, job.job_id), b"x")
    pull = await js.pull_subscribe_bind(consumer, config.nats.work_stream)
    first, _, third = await pull.fetch(3, timeout=2)

    await store.drop_work_message(jobs[1])  # cancelled while delivered, with its neighbours
    await third.ack_sync()
    await asyncio.sleep(1.5)  # AckWait: the first job's delivery lapses

    again = await pull.fetch(1, timeout=3)  # old code: TimeoutError, the first job's message stranded
    assert again[0].metadata.sequence.stream == first.metadata.sequence.stream
    info = await js.stream_info(config.nats.work_stream)
    assert info.state.messages == 1  # the dropped job's message is gone, the first job's remains
