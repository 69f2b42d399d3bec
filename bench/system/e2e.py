"""End to end: completed jobs per second through gateway -> NATS -> scheduler -> batcher -> result,
and the latency the system adds at light load (issue 6, item 2).

    .venv/bin/python -m bench.system.e2e [--quick]

Starts a nats-server and the three services as separate processes (a no-op model,
bench.system.noop_model, with the product's batching defaults: max batch 32, delay 2 ms), then:

- burst: submits N jobs (64 concurrent unary SubmitJob calls), then collects every result. Collecting:
  one WatchJob on the last job submitted (the queue is FIFO, so when it ends nearly every job has),
  then one GetJob per job, re-polling the few not finished yet. That is one unary call per job; a
  WatchJob per job would cost a stream and three messages per job (QUEUED, RUNNING, SUCCEEDED), and
  blind GetJob polling several calls per job. Reported: jobs/s from the first submit to the last
  result in hand (the figure compared with Celery), and from the first submit to the last job's
  end_time (the system alone);
- light load: one job at a time, SubmitJob then WatchJob (after the submit's revision) until
  SUCCEEDED; added latency = client-observed end to end minus the model's time (the record's
  batch.compute_duration); alternated with the same round trip in one call (SubmitJob with wait);
- CPU seconds per 1,000 jobs of every process during the bursts (from /proc), which names the
  busiest process; then a last burst with the three services under py-spy (sampling, not timed)
  gives that process's top functions;
- burst with the batch APIs: the same N jobs sent as SubmitJobs messages of 100 jobs each, then
  one WatchJobs stream on all of them until every one is terminal;
- reference in the same run: Celery 5 with a no-op task on Redis (broker and result backend), run
  as its users run it: the default prefork pool with concurrency = the cores: a burst of N
  apply_async then every result (ResultSet.get), and the round trip apply_async(...).get() one at
  a time.

Writes bench/results/e2e.{json,md}, e2e_latency_cdf.png and e2e_cpu.png.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import nats
import numpy as np
import uvloop

from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc, tensor_pb2
from bench.system import echo_server
from bench.system.common import (
    PYTHON,
    REDIS_INSTALL_HINT,
    Child,
    ProcessGroup,
    bench_config,
    cpu_seconds,
    free_port,
    log,
    matplotlib_pyplot,
    percentile,
    plot_path,
    port_open,
    ratio,
    row,
    summarize,
    top_functions,
    write_results,
)
from bench.system.noop_model import noop_model_config

SECTION = "e2e"
SUBMIT_CONCURRENCY = 64
JOBS_PER_SUBMIT_MESSAGE = 100
# Celery's default pool is prefork with one process per core: how its users run it.
CELERY_CONCURRENCY = os.cpu_count() or 1
COLLECT_CONCURRENCY = 32
PAYLOAD = [1.0, 2.0, 3.0, 4.0]
TERMINAL = {
    job_pb2.JOB_STATE_SUCCEEDED,
    job_pb2.JOB_STATE_FAILED,
    job_pb2.JOB_STATE_CANCELED,
    job_pb2.JOB_STATE_EXPIRED,
    job_pb2.JOB_STATE_TIMED_OUT,
}
SERVICES = ("gateway", "scheduler", "batcher")


@dataclass(frozen=True)
class Sizes:
    runs: int
    burst: int
    light: int


FULL = Sizes(runs=3, burst=3000, light=300)
QUICK = Sizes(runs=1, burst=300, light=30)
# The light-load hop references are paced like the light-load jobs (one about every 15 ms), so
# each process sleeps between calls as it does between a job's hops.
HOP_PACE_S = 0.015
HOP_CALLS = 200
# A job's critical path at light load, in one-way hops (see the report's note).
GRPC_HOPS = 6
NATS_HOPS = 4


@dataclass
class Burst:
    collected_rate: float  # first submit -> every result in hand
    processed_rate: float  # first submit -> last end_time
    submit_rate: float
    failed: int
    cpu_s: dict[str, float]  # per process, over the whole burst
    # The size of the batch each job ran in (its record's batch.batch_size: jobs in the batch).
    batch_sizes: list[int] = field(default_factory=list)


def mean_batch_size(burst: Burst) -> float:
    """Jobs a batch, over the batches the burst's jobs ran in (a batch of n counted once, not n
    times: jobs / batches); nan when no record said. The batcher's CPU per job follows it (one
    message, one model call, one wake-up per batch): bench/results/batcher_cpu_per_job_s32.md."""
    batches = sum(1 / size for size in burst.batch_sizes if size > 0)
    return sum(1 for size in burst.batch_sizes if size > 0) / batches if batches else math.nan


@dataclass
class Measured:
    bursts: list[Burst] = field(default_factory=list)
    batch_bursts: list[Burst] = field(default_factory=list)  # SubmitJobs of 100 jobs each, then WatchJobs
    end_to_end_ms: list[list[float]] = field(default_factory=list)  # per run
    # The same round trip in one call: SubmitJob with `wait` (the gateway holds the answer), per run.
    one_call_ms: list[list[float]] = field(default_factory=list)
    added_ms: list[list[float]] = field(default_factory=list)
    compute_ms: list[list[float]] = field(default_factory=list)
    submit_ms: list[list[float]] = field(default_factory=list)
    queue_ms: list[list[float]] = field(default_factory=list)
    run_ms: list[list[float]] = field(default_factory=list)
    celery_bursts: list[float] = field(default_factory=list)
    celery_round_trip_ms: list[list[float]] = field(default_factory=list)
    celery_cpu_s: list[dict[str, float]] = field(default_factory=list)
    celery_unavailable: str = ""
    # p50 of one round trip, per run: {"grpc back-to-back": [...], "grpc paced": [...], ...}
    hop_ms: dict[str, list[float]] = field(default_factory=dict)
    # per service: (samples, top self, top inclusive), from py-spy
    profiles: dict[str, tuple[int, list[tuple[str, float]], list[tuple[str, float]]]] = field(default_factory=dict)


def seconds(value: Any) -> float:
    """A protobuf Timestamp or Duration in seconds."""
    return float(value.seconds) + value.nanos / 1e9


def submit_request() -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend(PAYLOAD)
    return job_service_pb2.SubmitJobRequest(model_name="noop", inputs=[x])


# Set by bench.system.ab --keyed: every submit carries a fresh idempotency key, as the SDK's do.
KEYED_SUBMITS = False


def keyed(request: job_service_pb2.SubmitJobRequest) -> job_service_pb2.SubmitJobRequest:
    """`request` as sent: with a fresh idempotency key of its own when KEYED_SUBMITS is set."""
    if not KEYED_SUBMITS:
        return request
    copy = job_service_pb2.SubmitJobRequest()
    copy.CopyFrom(request)
    copy.idempotency_key = uuid.uuid4().hex
    return copy


class Stack:
    """nats-server + gateway + scheduler + batcher, each its own process."""

    def __init__(
        self,
        group: ProcessGroup,
        profile_dir: Path | None = None,
        profiled: tuple[str, ...] = (),
        *,
        name: str = "nats",
        batcher: dict[str, Any] | None = None,
        gateway: dict[str, Any] | None = None,
        scheduler: dict[str, Any] | None = None,
        webhooks: dict[str, Any] | None = None,
        source: Path | None = None,
        monitor_port: int = 0,
    ) -> None:
        self.group = group
        self.nats = group.nats("nats-profiled" if profile_dir else name, monitor_port=monitor_port)
        self.config = bench_config(
            self.nats.url,
            models=[noop_model_config()],
            batcher={"torch_threads": 1, **(batcher or {})},
            **({"gateway": gateway} if gateway else {}),
            **({"scheduler": scheduler} if scheduler else {}),
            **({"webhooks": webhooks} if webhooks else {}),
        )

        def profile(name: str) -> Path | None:
            return profile_dir / f"{name}.txt" if profile_dir and name in profiled else None

        self.gateway = group.service("gateway", self.config, profile_path=profile("gateway"), source=source)
        self.scheduler = group.service("scheduler", self.config, profile_path=profile("scheduler"), source=source)
        batcher_config = self.config.replace(batcher={"scheduler_address": self.scheduler.address})
        self.batcher = group.service("batcher", batcher_config, profile_path=profile("batcher"), source=source)

    @property
    def services(self) -> dict[str, Child]:
        return {"gateway": self.gateway, "scheduler": self.scheduler, "batcher": self.batcher}

    def cpu(self) -> dict[str, float]:
        assert self.nats.process is not None
        found = {name: child.cpu_seconds() for name, child in self.services.items()}
        found["nats-server"] = cpu_seconds(self.nats.process.pid)
        found["client (this benchmark)"] = cpu_seconds(os.getpid())
        return found

    def stop_services(self) -> None:
        for child in reversed(list(self.services.values())):
            self.group.stop(child, timeout_s=30)


async def run_one(stub: job_service_pb2_grpc.JobServiceStub, timeout_s: float = 30.0) -> job_pb2.Job:
    """Submits one job and watches it to its end; returns the final record."""
    job = (await stub.SubmitJob(keyed(submit_request()), timeout=timeout_s)).job
    async for update in stub.WatchJob(
        job_service_pb2.WatchJobRequest(job_id=job.job_id, after_revision=job.revision), timeout=timeout_s
    ):
        if update.job.state in TERMINAL:
            return update.job
    raise RuntimeError(f"the watch of {job.job_id} ended before the job did")


async def submit_unary(stub: job_service_pb2_grpc.JobServiceStub, count: int) -> list[str]:
    """Submits `count` no-op jobs with unary SubmitJob calls, SUBMIT_CONCURRENCY in flight; their IDs."""
    request = submit_request()
    job_ids: list[str] = [""] * count
    next_index = 0

    async def submitter() -> None:
        nonlocal next_index
        while next_index < count:
            index = next_index
            next_index += 1
            job_ids[index] = (await stub.SubmitJob(keyed(request))).job.job_id

    await asyncio.gather(*(submitter() for _ in range(SUBMIT_CONCURRENCY)))
    return job_ids


async def collect_finals(stub: job_service_pb2_grpc.JobServiceStub, job_ids: list[str]) -> list[job_pb2.Job]:
    """Each job's final record, by GetJob (COLLECT_CONCURRENCY in flight; the jobs not finished yet
    are polled again 10 ms later), in the order of `job_ids`."""
    finals: list[job_pb2.Job | None] = [None] * len(job_ids)
    pending = list(range(len(job_ids)))
    while pending:
        still: list[int] = []
        queue = list(pending)

        async def collector(queue: list[int] = queue, still: list[int] = still) -> None:
            while queue:
                index = queue.pop()
                job = (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_ids[index]))).job
                if job.state in TERMINAL:
                    finals[index] = job
                else:
                    still.append(index)

        await asyncio.gather(*(collector() for _ in range(COLLECT_CONCURRENCY)))
        pending = still
        if pending:
            await asyncio.sleep(0.01)
    return [job for job in finals if job is not None]


async def burst(stub: job_service_pb2_grpc.JobServiceStub, stack: Stack, count: int) -> Burst:
    cpu_before = stack.cpu()
    started_wall = time.time()
    started = time.perf_counter()
    job_ids = await submit_unary(stub, count)
    submitted = time.perf_counter()
    async for update in stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job_ids[-1])):
        if update.job.state in TERMINAL:
            break
    jobs = await collect_finals(stub, job_ids)
    collected = time.perf_counter()
    cpu_after = stack.cpu()
    failed = sum(1 for j in jobs if j.state != job_pb2.JOB_STATE_SUCCEEDED)
    last_end = max(seconds(j.end_time) for j in jobs)
    return Burst(
        collected_rate=count / (collected - started),
        processed_rate=count / max(last_end - started_wall, 1e-6),
        submit_rate=count / (submitted - started),
        failed=failed,
        cpu_s={name: cpu_after[name] - cpu_before[name] for name in cpu_before},
        batch_sizes=[j.batch.batch_size for j in jobs if j.HasField("batch")],
    )


async def batch_burst(stub: job_service_pb2_grpc.JobServiceStub, stack: Stack, count: int) -> Burst:
    """The same burst through the batch APIs: SubmitJobs messages of JOBS_PER_SUBMIT_MESSAGE jobs
    (one stream), then one WatchJobs stream on every job until all are terminal."""
    request = submit_request()
    cpu_before = stack.cpu()
    started_wall = time.time()
    started = time.perf_counter()

    async def messages() -> Any:
        for first in range(0, count, JOBS_PER_SUBMIT_MESSAGE):
            size = min(JOBS_PER_SUBMIT_MESSAGE, count - first)
            yield job_service_pb2.SubmitJobsRequest(
                items=[
                    job_service_pb2.SubmitJobsItem(job=keyed(request), correlation_id=str(first + i))
                    for i in range(size)
                ]
            )

    job_ids: list[str] = []
    failed = 0
    async for response in stub.SubmitJobs(messages()):
        for answer in response.answers:
            if answer.HasField("job"):
                job_ids.append(answer.job.job_id)
            else:
                failed += 1
    submitted = time.perf_counter()
    finals: dict[str, job_pb2.Job] = {}
    async for response in stub.WatchJobs(job_service_pb2.WatchJobsRequest(job_ids=job_ids)):
        for change in response.changes:
            if change.HasField("job") and change.job.state in TERMINAL:
                finals[change.job_id] = change.job
    collected = time.perf_counter()
    cpu_after = stack.cpu()
    failed += sum(1 for j in finals.values() if j.state != job_pb2.JOB_STATE_SUCCEEDED) + len(job_ids) - len(finals)
    last_end = max(seconds(j.end_time) for j in finals.values())
    return Burst(
        collected_rate=count / (collected - started),
        processed_rate=count / max(last_end - started_wall, 1e-6),
        submit_rate=count / (submitted - started),
        failed=failed,
        cpu_s={name: cpu_after[name] - cpu_before[name] for name in cpu_before},
        batch_sizes=[j.batch.batch_size for j in finals.values() if j.HasField("batch")],
    )


async def light_load(stub: job_service_pb2_grpc.JobServiceStub, count: int, out: Measured) -> None:
    end_to_end: list[float] = []
    added: list[float] = []
    compute: list[float] = []
    submit: list[float] = []
    queued: list[float] = []
    ran: list[float] = []
    one_call: list[float] = []
    request = submit_request()
    waiting = submit_request()
    waiting.wait.FromSeconds(10)
    for _ in range(count):
        # Alternated with the two-call round trip below, so that both see the same machine.
        t0 = time.perf_counter()
        answer = (await stub.SubmitJob(waiting, timeout=30)).job
        one_call.append((time.perf_counter() - t0) * 1e3)
        if answer.state != job_pb2.JOB_STATE_SUCCEEDED:
            raise RuntimeError(f"a one-call job did not succeed within its wait: {answer}")
        t0 = time.perf_counter()
        job = (await stub.SubmitJob(request)).job
        t1 = time.perf_counter()
        final = None
        async for update in stub.WatchJob(
            job_service_pb2.WatchJobRequest(job_id=job.job_id, after_revision=job.revision)
        ):
            if update.job.state in TERMINAL:
                final = update.job
                break
        t2 = time.perf_counter()
        if final is None or final.state != job_pb2.JOB_STATE_SUCCEEDED:
            raise RuntimeError(f"a light-load job did not succeed: {final}")
        model_s = seconds(final.batch.compute_duration)
        end_to_end.append((t2 - t0) * 1e3)
        added.append((t2 - t0 - model_s) * 1e3)
        compute.append(model_s * 1e3)
        submit.append((t1 - t0) * 1e3)
        queued.append(seconds(final.queue_duration) * 1e3)
        ran.append(seconds(final.run_duration) * 1e3)
    out.end_to_end_ms.append(end_to_end)
    out.one_call_ms.append(one_call)
    out.added_ms.append(added)
    out.compute_ms.append(compute)
    out.submit_ms.append(submit)
    out.queue_ms.append(queued)
    out.run_ms.append(ran)


async def hop_references(echo_address: str, js: Any, out: Measured) -> None:
    """What one round trip between two processes costs here, back to back and paced like the
    light-load jobs: a trivial unary gRPC call (bench/system/echo_server.py) and one awaited
    JetStream publish. A job's critical path is a chain of such hops."""

    async def p50(call: Any, pace_s: float) -> float:
        times = []
        for _ in range(HOP_CALLS):
            if pace_s:
                await asyncio.sleep(pace_s)
            t0 = time.perf_counter()
            await call()
            times.append((time.perf_counter() - t0) * 1e3)
        return percentile(times, 50)

    await js.add_stream(name="BENCH_HOPS", subjects=["bench_hops.>"], max_msgs=10_000)
    async with grpc.aio.insecure_channel(echo_address) as channel:
        method = channel.unary_unary(echo_server.METHOD)
        payload = os.urandom(1024)

        async def grpc_call() -> None:
            await method(payload)

        async def publish() -> None:
            await js.publish("bench_hops.x", payload)

        for _ in range(20):
            await grpc_call()
        for name, call in (("gRPC call", grpc_call), ("JetStream publish", publish)):
            for label, pace_s in (("back to back", 0.0), ("paced", HOP_PACE_S)):
                out.hop_ms.setdefault(f"{name}, {label}", []).append(await p50(call, pace_s))
    await js.delete_stream("BENCH_HOPS")


# --- Celery ----------------------------------------------------------------------------------


def celery_measure(redis: Child, worker: Child, sizes: Sizes, out: Measured) -> None:
    """One Celery burst of N and `light` round trips one at a time (blocking; run in a thread)."""
    from celery.result import ResultSet

    from bench.system.celery_app import noop

    def cpu() -> dict[str, float]:
        return {
            "celery worker": worker.cpu_seconds(),
            "redis-server": redis.cpu_seconds(),
            "client (this benchmark)": cpu_seconds(os.getpid()),
        }

    before = cpu()
    started = time.perf_counter()
    results = ResultSet([noop.apply_async(args=(PAYLOAD,)) for _ in range(sizes.burst)])
    values = results.get(timeout=300)
    elapsed = time.perf_counter() - started
    after = cpu()
    if len(values) != sizes.burst or values[0] != PAYLOAD:
        raise RuntimeError("the Celery burst did not return every result")
    out.celery_bursts.append(sizes.burst / elapsed)
    out.celery_cpu_s.append({k: after[k] - before[k] for k in before})
    round_trips = []
    for _ in range(sizes.light):
        t0 = time.perf_counter()
        noop.apply_async(args=(PAYLOAD,)).get(timeout=30)
        round_trips.append((time.perf_counter() - t0) * 1e3)
    out.celery_round_trip_ms.append(round_trips)


def start_celery(group: ProcessGroup) -> tuple[Child, Child]:
    redis = group.redis()
    broker = f"redis://127.0.0.1:{redis.port}/0"
    os.environ["BENCH_CELERY_BROKER"] = broker
    argv = [
        PYTHON, "-m", "celery", "-A", "bench.system.celery_app", "worker", "--pool=prefork",
        f"--concurrency={CELERY_CONCURRENCY}", "--loglevel=WARNING",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]  # fmt: skip
    worker = group.command("celery-worker", argv, ready=lambda c: True, env={"BENCH_CELERY_BROKER": broker})
    from bench.system.celery_app import noop

    if noop.apply_async(args=(PAYLOAD,)).get(timeout=120) != PAYLOAD:  # the worker is up
        raise RuntimeError("the Celery worker answered wrongly")
    return redis, worker


# --- the run ---------------------------------------------------------------------------------


async def measure_stack(
    stack: Stack, sizes: Sizes, out: Measured, celery: tuple[Child, Child] | None, echo_address: str
) -> None:
    nc = await nats.connect(stack.nats.url)
    js = nc.jetstream()
    try:
        async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
            stub = job_service_pb2_grpc.JobServiceStub(channel)
            for _ in range(20):  # warm-up; the first one also waits for the batcher's credits
                await run_one(stub, timeout_s=120)
            for run in range(1, sizes.runs + 1):
                b = await burst(stub, stack, sizes.burst)
                out.bursts.append(b)
                log(
                    f"run {run}: burst of {sizes.burst}: {b.collected_rate:.0f}/s collected, {b.processed_rate:.0f}/s "
                    f"processed, submit {b.submit_rate:.0f}/s, failed {b.failed}; CPU s "
                    + ", ".join(f"{k} {v:.2f}" for k, v in b.cpu_s.items())
                )
                await js.purge_stream("KV_jobs")
                bb = await batch_burst(stub, stack, sizes.burst)
                out.batch_bursts.append(bb)
                log(
                    f"run {run}: batch-API burst of {sizes.burst}: {bb.collected_rate:.0f}/s collected, "
                    f"{bb.processed_rate:.0f}/s processed, submit {bb.submit_rate:.0f}/s, failed {bb.failed}; CPU s "
                    + ", ".join(f"{k} {v:.2f}" for k, v in bb.cpu_s.items())
                )
                await js.purge_stream("KV_jobs")
                await light_load(stub, sizes.light, out)
                log(
                    f"run {run}: light load: end to end p50 {percentile(out.end_to_end_ms[-1], 50):.2f} ms "
                    f"(one call {percentile(out.one_call_ms[-1], 50):.2f} ms), added p50 "
                    f"{percentile(out.added_ms[-1], 50):.2f} ms, model p50 {percentile(out.compute_ms[-1], 50):.3f} ms"
                )
                await js.purge_stream("KV_jobs")
                await hop_references(echo_address, js, out)
                log(
                    f"run {run}: one hop: "
                    + ", ".join(f"{name} p50 {values[-1]:.2f} ms" for name, values in out.hop_ms.items())
                )
                if celery is not None:
                    await asyncio.to_thread(celery_measure, *celery, sizes, out)
                    log(
                        f"run {run}: Celery burst {out.celery_bursts[-1]:.0f}/s, round trip p50 "
                        f"{percentile(out.celery_round_trip_ms[-1], 50):.2f} ms"
                    )
    finally:
        await nc.close()


async def profiled_burst(stack: Stack, count: int) -> None:
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        for _ in range(5):
            await run_one(stub, timeout_s=120)
        b = await burst(stub, stack, count)
        log(f"profiled burst (not a figure): {b.collected_rate:.0f}/s")


# --- report ----------------------------------------------------------------------------------


def med(values: list[float]) -> float:
    return float(summarize(values)["value"])


def per_run(samples: list[list[float]], q: float) -> list[float]:
    return [percentile(s, q) for s in samples]


def cpu_per_1000_jobs(out: Measured, burst_size: int) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    for b in out.bursts:
        for name, used in b.cpu_s.items():
            found.setdefault(name, []).append(used / burst_size * 1000)
    return found


SYSTEM_PROCESSES = ("gateway", "scheduler", "batcher", "nats-server")


def system_cpu_ms_per_job(bursts: list[Burst], burst_size: int) -> list[float]:
    """Per burst: CPU milliseconds per job summed over the system's four processes."""
    return [sum(b.cpu_s.get(name, 0.0) for name in SYSTEM_PROCESSES) / burst_size * 1000 for b in bursts]


def busiest_service(out: Measured, burst_size: int) -> str:
    cpu = cpu_per_1000_jobs(out, burst_size)
    return max((k for k in cpu if k in SERVICES), key=lambda k: med(cpu[k]), default="gateway")


def report(out: Measured, sizes: Sizes, quick: bool) -> None:
    n = sizes.burst
    rows = [
        row(
            f"burst of {n}: completed jobs/s (first submit -> every result collected)",
            [b.collected_rate for b in out.bursts],
            "jobs/s",
        ),
        row(
            f"burst of {n}: processed jobs/s (first submit -> last job's end_time)",
            [b.processed_rate for b in out.bursts],
            "jobs/s",
        ),
        row(
            f"burst of {n}: submit phase ({SUBMIT_CONCURRENCY} clients)", [b.submit_rate for b in out.bursts], "jobs/s"
        ),
        row(f"burst of {n}: jobs not SUCCEEDED", [float(b.failed) for b in out.bursts], "jobs"),
        row(
            f"batch-API burst of {n}: completed jobs/s (SubmitJobs of {JOBS_PER_SUBMIT_MESSAGE} jobs per message, "
            "then one WatchJobs)",
            [b.collected_rate for b in out.batch_bursts],
            "jobs/s",
        ),
        row(
            f"batch-API burst of {n}: processed jobs/s (first submit -> last end_time)",
            [b.processed_rate for b in out.batch_bursts],
            "jobs/s",
        ),
        row(f"batch-API burst of {n}: submit phase", [b.submit_rate for b in out.batch_bursts], "jobs/s"),
        row(f"batch-API burst of {n}: jobs not SUCCEEDED", [float(b.failed) for b in out.batch_bursts], "jobs"),
        row(
            f"Celery burst of {n} (apply_async all, then every result; prefork, concurrency {CELERY_CONCURRENCY})",
            out.celery_bursts,
            "tasks/s",
            out.celery_unavailable,
        ),
        row("light load: end to end p50 (SubmitJob -> WatchJob SUCCEEDED)", per_run(out.end_to_end_ms, 50), "ms"),
        row("light load: end to end p99", per_run(out.end_to_end_ms, 99), "ms"),
        row(
            "light load: end to end p50, one call (SubmitJob with wait: the answer is the finished job)",
            per_run(out.one_call_ms, 50),
            "ms",
            "alternated with the two-call round trip above",
        ),
        row("light load: added latency p50 (end to end - model time)", per_run(out.added_ms, 50), "ms"),
        row("light load: added latency p99", per_run(out.added_ms, 99), "ms"),
        row("light load: model time p50 (batch compute_duration)", per_run(out.compute_ms, 50), "ms"),
        row("light load: SubmitJob call p50", per_run(out.submit_ms, 50), "ms"),
        row("light load: queue_duration p50 (created -> dispatched)", per_run(out.queue_ms, 50), "ms"),
        row("light load: run_duration p50 (dispatched -> result stored)", per_run(out.run_ms, 50), "ms"),
        row("Celery round trip p50 (apply_async().get(), one at a time)", per_run(out.celery_round_trip_ms, 50), "ms"),
        *(
            row(
                f"one hop: {name} p50",
                values,
                "ms",
                "paced: one every 15 ms, as the light-load jobs" if "paced" in name else "",
            )
            for name, values in out.hop_ms.items()
        ),
        row("Celery round trip p99", per_run(out.celery_round_trip_ms, 99), "ms"),
    ]
    cpu_per_1000 = cpu_per_1000_jobs(out, n)
    for name, values in cpu_per_1000.items():
        rows.append(row(f"CPU per 1,000 jobs: {name}", values, "s", "during the bursts"))
    celery_cpu: dict[str, list[float]] = {}
    for celery_used in out.celery_cpu_s:
        for name, value in celery_used.items():
            celery_cpu.setdefault(name, []).append(value / n * 1000)
    for name, values in celery_cpu.items():
        rows.append(row(f"Celery CPU per 1,000 tasks: {name}", values, "s", "during the bursts"))

    ours = med([b.collected_rate for b in out.bursts])
    ours_batched = med([b.collected_rate for b in out.batch_bursts])
    celery = med(out.celery_bursts)
    added = med(per_run(out.added_ms, 50))
    vs_celery, batched_vs_celery = ours / celery, ours_batched / celery
    round_trip = med(per_run(out.end_to_end_ms, 50)) / med(per_run(out.celery_round_trip_ms, 50))
    one_call_vs_celery = med(per_run(out.one_call_ms, 50)) / med(per_run(out.celery_round_trip_ms, 50))
    cpu_ms_per_job = system_cpu_ms_per_job(out.bursts, n)
    cpu_ms_per_batched_job = system_cpu_ms_per_job(out.batch_bursts, n)
    rows.append(row("CPU per job, unary burst: gateway + scheduler + batcher + nats-server", cpu_ms_per_job, "ms"))
    rows.append(row("CPU per job, batch-API burst: the same four processes", cpu_ms_per_batched_job, "ms"))

    def at_least(value: float, floor: float) -> bool | None:
        return None if math.isnan(value) else value >= floor

    def at_most(value: float, ceiling: float) -> bool | None:
        return None if math.isnan(value) else value <= ceiling

    celery_how = f"Celery prefork, concurrency {CELERY_CONCURRENCY} (its default pool, one process per core)"
    ratios = [
        ratio(f"completed jobs/s, unary burst of {n} / {celery_how}", vs_celery, "≥ 1.0", at_least(vs_celery, 1.0)),
        ratio(
            f"completed jobs/s, batch-API burst of {n} / {celery_how}",
            batched_vs_celery,
            "≥ 2.0",
            at_least(batched_vs_celery, 2.0),
        ),
        ratio(
            "round trip back to back p50 (SubmitJob -> WatchJob terminal) / Celery apply_async().get() p50",
            round_trip,
            "≤ 1.5",
            at_most(round_trip, 1.5),
        ),
        ratio(
            "round trip in one call p50 (SubmitJob with wait) / Celery apply_async().get() p50 (not the target's "
            "measure, which is the two calls above)",
            one_call_vs_celery,
            "for reference",
            None,
        ),
        ratio("median added latency at light load, ms (not a ratio)", added, "≤ 5 ms", at_most(added, 5.0)),
        ratio(
            "CPU per job during the unary burst, ms, four processes (not a ratio)",
            med(cpu_ms_per_job),
            "≤ 3 ms",
            at_most(med(cpu_ms_per_job), 3.0),
        ),
    ]
    busiest = busiest_service(out, n)
    notes = [
        f"{sizes.runs} run(s): each a burst of {n} jobs (unary calls, then the batch APIs), {sizes.light} jobs one "
        f"at a time, then the same for Celery (prefork pool, concurrency {CELERY_CONCURRENCY}). "
        "The services and the Celery worker share the 2 cores with the client; the no-op model makes every figure "
        "the system's own cost.",
        "Collecting results: one WatchJob on the last job, then one GetJob per job (re-polled while not finished): "
        "the cheapest for the client (one unary call per job; a WatchJob per job costs a stream and 3 messages).",
        "CPU per 1,000 jobs (s): "
        + ", ".join(f"{name} {med(values):.2f}" for name, values in cpu_per_1000.items())
        + f". Busiest service: the {busiest}.",
    ]
    if out.end_to_end_ms:
        rest = [
            [e - q - r for e, q, r in zip(ends, queued, ran, strict=True)]
            for ends, queued, ran in zip(out.end_to_end_ms, out.queue_ms, out.run_ms, strict=True)
        ]
        parts = {
            "queued (create_time -> dispatched; it overlaps the SubmitJob call)": med(per_run(out.queue_ms, 50)),
            "running (dispatched -> result stored; model included)": med(per_run(out.run_ms, 50)),
            "the rest (the request reaching the gateway; the final record reaching the watcher and the client)": med(
                per_run(rest, 50)
            ),
        }
        notes.append(
            "Light load, where the end-to-end time goes (p50s): "
            + "; ".join(f"{k} {v:.2f} ms" for k, v in parts.items())
            + f"; for comparison the SubmitJob call alone: {med(per_run(out.submit_ms, 50)):.2f} ms. Dispatch "
            "starts once the submit's two writes are done: the gateway's queued notice (sent after the record write, "
            "carrying the record) wakes the scheduler, which then pulls the message and writes RUNNING, so the "
            "queued time is about the SubmitJob call plus those three steps."
        )
    grpc_paced, nats_paced = (out.hop_ms.get(f"{name}, paced") for name in ("gRPC call", "JetStream publish"))
    if grpc_paced and nats_paced:
        grpc_hop, nats_hop = med(grpc_paced) / 2, med(nats_paced) / 2
        estimate = GRPC_HOPS * grpc_hop + NATS_HOPS * nats_hop
        notes.append(
            f"What bounds the light-load latency: a job's critical path is a chain of {GRPC_HOPS + NATS_HOPS} "
            f"one-way hops between processes (or threads): {GRPC_HOPS} over gRPC or to a thread (client -> gateway, "
            "scheduler -> batcher, the batcher's loop -> its compute thread and back, batcher -> scheduler, "
            f"gateway -> client) and {NATS_HOPS} through NATS (the gateway's work publish, which the scheduler's "
            "held pull delivers; its terminal write, which the gateway's watch feed delivers; the RUNNING "
            'compare-and-set goes beside the order, off the path; docs/ARCHITECTURE.md, "Hops"). The one-call '
            "round trip (SubmitJob with wait) takes the same hops, less the client's WatchJob call. Between jobs "
            "every process sleeps, and waking one costs here: a trivial gRPC "
            f"round trip paced like the jobs takes {med(grpc_paced):.2f} ms "
            f"(back to back {med(out.hop_ms.get('gRPC call, back to back', [math.nan])):.2f} ms), an awaited "
            f"JetStream publish {med(nats_paced):.2f} ms (back to back "
            f"{med(out.hop_ms.get('JetStream publish, back to back', [math.nan])):.2f} ms). At half a round trip "
            f"per hop the chain alone is ~{estimate:.1f} ms, before any of the services' own work: a median under "
            f"5 ms allows ~{5 / (estimate / (GRPC_HOPS + NATS_HOPS)):.0f} such hops and no work (Celery's round "
            "trip is 4 hops: client -> Redis -> worker -> Redis -> client)."
        )
    for name, (total, own, inclusive) in out.profiles.items():
        if total == 0:
            continue
        label = f"Profile of the {name} during one more burst (py-spy, {total} samples of its active threads)"
        notes.append(f"{label}; top self time: " + "; ".join(f"{f} {s:.0%}" for f, s in own[:10]))
        shown = [(f, s) for f, s in inclusive if not _is_generic_frame(f)]
        notes.append(f"{name}: top inclusive time: " + "; ".join(f"{f} {s:.0%}" for f, s in shown[:12]))
    notes.append(
        "py-spy without --native cannot see C frames: time in the event loop (uvloop), the gRPC core and system "
        "calls appears as self time of Runner.run or of the Python function that called them "
        "(StreamWriter.writelines: socket writes). BENCH_PYSPY_FLAGS=--native shows them, but pauses the "
        "process at each sample (figures from such a run mean nothing)."
    )
    plots = [plot_cdf(out), plot_cpu(cpu_per_1000, celery_cpu)]
    write_results(
        SECTION,
        "End to end: completed jobs per second and added latency (no-op model)",
        rows,
        ratios,
        notes,
        plots=plots,
        quick=quick,
        extra={
            "busiest_service": busiest,
            "light_load_last_run_ms": {
                "end_to_end": out.end_to_end_ms[-1:],
                "submit": out.submit_ms[-1:],
                "queued": out.queue_ms[-1:],
                "running": out.run_ms[-1:],
                "model": out.compute_ms[-1:],
            },
        },
    )


GENERIC_FRAMES = (
    "_run_module_as_main", "_run_code", "main (", "<module>", "Runner.run", "_run (", "Thread.", "_worker (",
    "run_until_stopped", "Context.run", "Handle._run",
)  # fmt: skip


def _is_generic_frame(frame: str) -> bool:
    return frame.startswith(GENERIC_FRAMES)


def plot_cdf(out: Measured) -> Path:
    plt = matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, samples in (
        ("asyncinfer end to end (SubmitJob -> SUCCEEDED)", out.end_to_end_ms),
        ("asyncinfer added latency", out.added_ms),
        ("Celery round trip (no durable state)", out.celery_round_trip_ms),
    ):
        values = np.sort(np.asarray([v for s in samples for v in s]))
        if len(values):
            ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=label)
    ax.axvline(5, color="grey", linestyle=":", label="5 ms")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms), one job at a time")
    ax.set_ylabel("fraction of jobs")
    ax.set_title("Light-load latency CDF, no-op model")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    path = plot_path(SECTION, "latency_cdf")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_cpu(ours: dict[str, list[float]], celery: dict[str, list[float]]) -> Path:
    plt = matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [*ours, *(f"Celery: {k}" for k in celery)]
    values = [med(v) for v in ours.values()] + [med(v) for v in celery.values()]
    colors = ["tab:blue"] * len(ours) + ["tab:red"] * len(celery)
    ax.barh(labels, values, color=colors)
    ax.invert_yaxis()
    ax.set_xlabel("CPU seconds per 1,000 jobs (burst)")
    ax.set_title("Where the CPU goes, end to end")
    ax.grid(True, axis="x", alpha=0.3)
    path = plot_path(SECTION, "cpu")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 run (for development)")
    parser.add_argument("--no-profile", action="store_true", help="skip the py-spy burst")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    out = Measured()
    with ProcessGroup() as group:
        celery: tuple[Child, Child] | None = None
        try:
            celery = start_celery(group)
        except ImportError:
            out.celery_unavailable = "not available: celery is not installed (pip install -e '.[bench]')"
            log(out.celery_unavailable)
        except RuntimeError as exc:
            out.celery_unavailable = f"not available: {exc} ({REDIS_INSTALL_HINT})"
            log(out.celery_unavailable)
        log("starting nats-server, gateway, scheduler, batcher")
        stack = Stack(group)
        echo_port = free_port()
        group.command(
            "echo",
            [PYTHON, "-m", "bench.system.echo_server", str(echo_port)],
            ready=lambda c: port_open(c.port),
            port=echo_port,
        )
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(measure_stack(stack, sizes, out, celery, f"127.0.0.1:{echo_port}"))
            stack.stop_services()
            if not args.no_profile:
                busiest = busiest_service(out, sizes.burst)
                log(f"profiling: the busiest service, the {busiest}, under py-spy, one more burst")
                profiled = Stack(group, profile_dir=group.tmp, profiled=(busiest,))
                runner.run(profiled_burst(profiled, sizes.burst))
                profiled.stop_services()
                path = group.tmp / f"{busiest}.txt"
                if path.exists():
                    out.profiles[busiest] = top_functions(path, count=30)
    report(out, sizes, args.quick)
    log(f"wrote bench/results/{SECTION}.md")


if __name__ == "__main__":
    main()
