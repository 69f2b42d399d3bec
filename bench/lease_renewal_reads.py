"""What a scheduler's lease renewal round costs with the record reads that find the attempts another
scheduler took over (services.scheduler.superseded), against the round without them, outside the
stack: a fresh nats-server, N work messages pulled and held unacked (as a scheduler's attempts in
flight) and their RUNNING records in the jobs bucket. Each round is alternated two ways: the
in-progress acks alone (the round before), and the records read first (READS_AT_ONCE at a time),
then the acks. Wall time, this process's CPU (the scheduler's) and nats-server's; the last column is
the round's CPU, both processes together, as a share of one core over the renewal interval
(`scheduler.lease_renew_interval_s`, 10 s by default).

    .venv/bin/python -m bench.lease_renewal_reads [--sizes 100,1000,5000] [--rounds 5]

The figures docs/ARCHITECTURE.md quotes: bench/results/lease_renewal_reads.txt.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import structlog
from nats.js.api import AckPolicy, ConsumerConfig

from asyncinfer.codecs.record import encode_record
from asyncinfer.config import LoggingConfig
from asyncinfer.declarations import ensure_jobs_bucket
from asyncinfer.ids import new_job_id
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobRecord, JobState, Priority
from asyncinfer.logs import configure_logging
from asyncinfer.nats import JetStreamContext
from asyncinfer.nats.connection import connect
from asyncinfer.nats.kv import KvBucket
from bench.system.common import bench_config, measured_cpu, run_against_a_nats_server
from services.scheduler.batchers import BatcherSession
from services.scheduler.leases import InFlightJob, Leases
from services.scheduler.messages import WorkerHello
from services.scheduler.superseded import superseded

SIZES = (100, 1_000, 5_000)
ROUNDS = 5
STREAM = "RENEWALS"
FETCH_AT_ONCE = 500
log = structlog.get_logger("bench.lease_renewal_reads")


def running_record(job_id: str, now: float) -> JobRecord:
    return JobRecord(
        job_id=job_id,
        tenant="default",
        model_name="demo",
        model_version="1",
        priority=Priority.NORMAL,
        create_time=now,
        state=JobState.RUNNING,
        update_time=now,
        attempt=1,
        start_time=now,
        max_attempts=3,
        result_retention_s=3600.0,
        dispatched_by="bench",
    )


async def hold(size: int, leases: Leases, bucket: KvBucket, js: JetStreamContext) -> None:
    """`size` attempts in flight: a message pulled and unacked, and its RUNNING record written, each."""
    await js.add_stream(name=STREAM, subjects=[f"{STREAM.lower()}.>"])
    await js.add_consumer(
        STREAM, ConsumerConfig(durable_name="held", ack_policy=AckPolicy.EXPLICIT, ack_wait=600, max_ack_pending=-1)
    )
    now = time.time()
    session = BatcherSession(WorkerHello(batcher_id="bench", models=()))
    records: dict[str, JobRecord] = {}
    for first in range(0, size, FETCH_AT_ONCE):
        ids = [new_job_id() for _ in range(min(FETCH_AT_ONCE, size - first))]
        await asyncio.gather(*(js.publish(f"{STREAM.lower()}.{job_id}", b"x") for job_id in ids))
        for job_id in ids:
            record = running_record(job_id, now)
            records[job_id] = record.evolve(revision=await bucket.kv.put(record.key, encode_record(record)))
    sub = await js.pull_subscribe(f"{STREAM.lower()}.>", durable="held", stream=STREAM)
    held = 0
    while held < size:
        for msg in await sub.fetch(min(FETCH_AT_ONCE, size - held), timeout=5):
            job_id = msg.subject.rsplit(".", 1)[-1]
            job = InFlightJob(
                job_id=job_id, attempt=1, model_name="demo", session=session, msg=msg, record=records[job_id], log=log
            )
            leases.hold(job, on_timeout=lambda _job: None)
            held += 1


async def measure(url: str, nats_pid: int, sizes: list[int], rounds: int) -> None:
    for size in sizes:
        await measure_size(url, nats_pid, size, rounds)


async def measure_size(url: str, nats_pid: int, size: int, rounds: int) -> None:
    config = bench_config(url)
    nc = await connect(config.nats, name="lease-renewal-reads")
    js = nc.jetstream()
    bucket = await ensure_jobs_bucket(js, config.nats)
    store = JobStore(bucket, work_stream=config.nats.work_stream)
    leases = Leases()
    await hold(size, leases, bucket, js)

    async def acks_alone() -> None:  # the round before
        await leases.renew()
        await nc.flush()

    async def reads_then_acks() -> None:  # the round now
        assert not await superseded(store, list(leases.jobs.values()))
        await leases.renew()
        await nc.flush()

    passes: dict[str, Callable[[], Awaitable[None]]] = {
        "in-progress acks alone (before)": acks_alone,
        "records read, then the acks": reads_then_acks,
    }
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in passes}
    for round_number in range(rounds):
        order = list(passes.items()) if round_number % 2 == 0 else list(reversed(passes.items()))
        for name, one_round in order:
            with measured_cpu({"nats-server": nats_pid}) as used:
                await one_round()
            results[name].append(
                (1000 * used.wall_s, 1000 * used.this_process_s, 1000 * used.processes_s["nats-server"])
            )
    interval_s = config.scheduler.lease_renew_interval_s
    print(f"\n{size} attempts in flight, median of {rounds} rounds, alternated:", flush=True)
    for name, rows in results.items():
        wall, client, server = (statistics.median(column) for column in zip(*rows, strict=True))
        share = (client + server) / 1000 / interval_s
        print(
            f"  {name:32s} {wall:6.1f} ms, this process {client:6.1f} CPU-ms, nats-server {server:6.1f} CPU-ms"
            f" = {share:.3%} of a core over {interval_s:.0f} s",
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
