"""What the scheduler's deadline sweep (services/scheduler/deadline_sweep.py) costs, outside the
stack: a fresh nats-server, a paused queue of 10,000 submit-shaped work messages (a 1x4 FP32 input,
each with a deadline an hour away) and an idle one (no messages); the scheduler's CPU seconds
(this process) and nats-server's per sweep, while the sweep reads the queue, once it has read it
all, and while it expires all 10,000 (a clock two hours ahead).

    .venv/bin/python -m bench.deadline_sweep_cost

The figures docs/ARCHITECTURE.md ("A paused queue's deadlines") quotes.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
from prometheus_client import CollectorRegistry

from asyncinfer.codecs.envelope import deadline_header, encode_envelope
from asyncinfer.config import LoggingConfig
from asyncinfer.contract import routing_headers
from asyncinfer.declarations import ensure_jobs_bucket, ensure_work_stream
from asyncinfer.ids import new_job_id
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobRecord, JobState, Priority, queued_envelope
from asyncinfer.logs import configure_logging
from asyncinfer.nats.connection import connect
from asyncinfer.tensors import Tensor
from bench.system.common import bench_config, measured_cpu, run_against_a_nats_server
from services.scheduler.deadline_sweep import DeadlineSweep
from services.scheduler.metrics import SchedulerMetrics

JOBS = 10_000
PUBLISH_GROUP = 500


def work_message(now: float) -> tuple[str, bytes, dict[str, str]]:
    record = JobRecord(
        job_id=new_job_id(),
        tenant="bench",
        model_name="paused",
        model_version="",
        state=JobState.QUEUED,
        priority=Priority.NORMAL,
        create_time=now,
        update_time=now,
        max_attempts=3,
        result_retention_s=3600.0,
        deadline=now + 3600.0,
    )
    envelope = queued_envelope(record, (Tensor.from_numpy("x", np.ones((1, 4), dtype=np.float32)),))
    headers = routing_headers(
        tenant=record.tenant, job_id=record.job_id, priority=record.priority, model_name=record.model_name
    ) | deadline_header(record.deadline)
    return envelope.subject, encode_envelope(envelope), headers


async def measure(url: str, nats_pid: int) -> None:
    config = bench_config(url)
    nc = await connect(config.nats, name="deadline-sweep-cost")
    js = nc.jetstream()
    await ensure_work_stream(js, config.nats)
    store = JobStore(await ensure_jobs_bucket(js, config.nats), work_stream=config.nats.work_stream)
    now = time.time()
    for first in range(0, JOBS, PUBLISH_GROUP):
        messages = [work_message(now) for _ in range(min(PUBLISH_GROUP, JOBS - first))]
        await asyncio.gather(*(js.publish(s, p, headers=h) for s, p, h in messages))
    print(f"{JOBS} work messages of {len(messages[0][1])} bytes stored")

    ahead_s = 0.0

    def sweep_for(model_name: str) -> DeadlineSweep:
        return DeadlineSweep(
            nc=nc,
            js=js,
            store=store,
            stream=config.nats.work_stream,
            metrics=SchedulerMetrics(CollectorRegistry()),
            models=lambda: [model_name],
            is_paused=lambda name: True,
            backlog_s=60.0,
            clock=lambda: time.time() + ahead_s,
        )

    async def one(sweep: DeadlineSweep, label: str) -> None:
        read, expired = sweep.messages_read, sweep.jobs_expired
        with measured_cpu({"nats-server": nats_pid}) as used:
            await sweep.sweep()
        print(
            f"{label}: read {sweep.messages_read - read}, expired {sweep.jobs_expired - expired}: "
            f"scheduler {1000 * used.this_process_s:.1f} CPU-ms, nats-server "
            f"{1000 * used.processes_s['nats-server']:.0f} CPU-ms, {1000 * used.wall_s:.1f} ms"
        )

    idle = sweep_for("idle")
    for i in range(3):
        await one(idle, f"idle queue, sweep {i + 1}")
    paused = sweep_for("paused")
    i = 0
    while True:
        i += 1
        await one(paused, f"paused queue of {JOBS}, sweep {i}")
        if paused.messages_read >= JOBS:
            break
    for _ in range(3):
        i += 1
        await one(paused, f"paused queue of {JOBS}, read whole, sweep {i}")
    ahead_s = 7200.0  # every deadline passed
    while paused.jobs_expired < JOBS:
        i += 1
        await one(paused, f"paused queue of {JOBS}, all overdue, sweep {i}")
    await nc.close()


def main() -> None:
    configure_logging(LoggingConfig(level="warning"), service="bench")
    run_against_a_nats_server(measure)


if __name__ == "__main__":
    main()
