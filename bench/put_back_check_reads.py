"""What a scheduler's stats round spends checking its put-backs' records (services.scheduler.
put_back_checks: whether another scheduler took a job this one put back), outside the stack: a fresh
nats-server, N work messages pulled and put back on one model's queues (ModelQueues.put_back, as a
nak's bookkeeping; nothing is nak'ed, so they stay put back) and their QUEUED records in the jobs
bucket naming the delivery put back (so every check leaves them counted: the steady state of a
backlog nobody pulls, a version no batcher serves, a paused queue's held pulls' rest). A round reads
at most CHECKS_PER_ROUND (256) records, those checked longest ago first; each round is timed as the
stats loop calls it: wall time (the median round), this process's CPU (the scheduler's) and
nats-server's (the mean round), and both as a share of one core over the stats interval
(`scheduler.queue_stats_interval_s`, 2 s by default).

    .venv/bin/python -m bench.put_back_check_reads [--sizes 10,100,1000,5000] [--rounds 7]

The figures docs/ARCHITECTURE.md quotes: bench/results/put_back_check_reads.txt.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from nats.js.api import AckPolicy, ConsumerConfig

from asyncinfer.codecs.record import encode_record
from asyncinfer.config import LoggingConfig
from asyncinfer.contract import JOB_ID_HEADER, TENANT_HEADER
from asyncinfer.declarations import ensure_jobs_bucket
from asyncinfer.ids import new_job_id
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobRecord, JobState, Priority
from asyncinfer.logs import configure_logging
from asyncinfer.nats.connection import connect
from bench.system.common import bench_config, measured_cpu, run_against_a_nats_server
from services.scheduler.priority import PrioritySelector
from services.scheduler.put_back_checks import CHECKS_PER_ROUND, check_put_backs
from services.scheduler.work_queue import ModelQueues

SIZES = (10, 100, 1_000, 5_000)
ROUNDS = 7
STREAM = "PUTBACKS"
FETCH_AT_ONCE = 500


def queued_record(job_id: str, now: float, lease_subject: str) -> JobRecord:
    return JobRecord(
        job_id=job_id,
        tenant="default",
        model_name="demo",
        model_version="1",
        priority=Priority.NORMAL,
        create_time=now,
        state=JobState.QUEUED,
        update_time=now,
        attempt=1,
        max_attempts=3,
        result_retention_s=3600.0,
        dispatched_by="bench",
        lease_subject=lease_subject,
    )


async def measure(url: str, nats_pid: int, sizes: list[int], rounds: int) -> None:
    for size in sizes:
        await measure_size(url, nats_pid, size, rounds)


async def measure_size(url: str, nats_pid: int, size: int, rounds: int) -> None:
    config = bench_config(url)
    nc = await connect(config.nats, name="put-back-check-reads")
    js = nc.jetstream()
    bucket = await ensure_jobs_bucket(js, config.nats)
    store = JobStore(bucket, work_stream=config.nats.work_stream)
    await js.add_stream(name=STREAM, subjects=[f"{STREAM.lower()}.>"])
    await js.add_consumer(
        STREAM, ConsumerConfig(durable_name="held", ack_policy=AckPolicy.EXPLICIT, ack_wait=600, max_ack_pending=-1)
    )
    queues = ModelQueues(nc, STREAM, "demo", PrioritySelector({p: 1 for p in Priority}, aging_s=30.0))
    for first in range(0, size, FETCH_AT_ONCE):
        ids = [new_job_id() for _ in range(min(FETCH_AT_ONCE, size - first))]
        await asyncio.gather(
            *(
                js.publish(
                    f"{STREAM.lower()}.{job_id}", b"x", headers={JOB_ID_HEADER: job_id, TENANT_HEADER: "default"}
                )
                for job_id in ids
            )
        )
    sub = await js.pull_subscribe(f"{STREAM.lower()}.>", durable="held", stream=STREAM)
    now = time.time()
    put_back = 0
    while put_back < size:
        for msg in await sub.fetch(min(FETCH_AT_ONCE, size - put_back), timeout=5):
            job_id = msg.subject.rsplit(".", 1)[-1]
            record = queued_record(job_id, now, msg.reply or "")
            await bucket.kv.put(record.key, encode_record(record))
            queues.put_back(Priority.NORMAL, msg)
            put_back += 1
    assert queues.put_back_count(Priority.NORMAL) == size
    rows: list[tuple[float, float, float]] = []
    for _ in range(rounds):
        with measured_cpu({"nats-server": nats_pid}) as used:
            await check_put_backs(store, [queues])
        rows.append((1000 * used.wall_s, 1000 * used.this_process_s, 1000 * used.processes_s["nats-server"]))
    assert queues.put_back_count(Priority.NORMAL) == size  # every one still counted
    interval_s = config.scheduler.queue_stats_interval_s
    # Wall time: the median round; CPU: the mean (nats-server's is read in 10 ms clock ticks, so a
    # round's own reads mostly 0 or 10).
    walls, clients, servers = zip(*rows, strict=True)
    wall, client, server = statistics.median(walls), statistics.fmean(clients), statistics.fmean(servers)
    share = (client + server) / 1000 / interval_s
    read = min(size, CHECKS_PER_ROUND)
    print(
        f"{size:5d} put back, {read:3d} read a round ({rounds} rounds): {wall:6.1f} ms,"
        f" this process {client:6.1f} CPU-ms ({1000 * client / read:5.1f} CPU-us a read),"
        f" nats-server {server:6.1f} CPU-ms = {share:.3%} of a core over {interval_s:.0f} s",
        flush=True,
    )
    await js.delete_stream(STREAM)
    await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(str(size) for size in SIZES))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    configure_logging(LoggingConfig(level="warning"), service="bench")
    run_against_a_nats_server(lambda url, pid: measure(url, pid, sizes, args.rounds))


if __name__ == "__main__":
    main()
