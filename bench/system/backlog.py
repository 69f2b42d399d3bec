"""Backlog scaling (issue 6, item 4): queue N jobs (100,000; --quick 2,000) with no batcher running,
then start one batcher and let it drain the queue.

nats-server, the gateway, the scheduler and the batcher each run as their own process, so each RSS
is its own. In order:

1. the reference: a batcher drains small backlogs (3,000 jobs, 3 runs: the queue paused while each
   fills, then resumed) while the queue and the job store are nearly empty; then, for information,
   jobs completed per second while they are being submitted; then that batcher stops;
2. N jobs are queued with no batcher running: RSS of every process (sampled), the submit rate per
   tenth of the backlog (does it slow down as the queue grows?), the NATS store size per job;
3. a fresh batcher of the same config (warmed up through its own KServe API while the queue is
   paused) drains the first --drain-share (30%) of the backlog, while the queue is at its deepest:
   the drain rate against the reference, and RSS while draining. The rest stays queued (draining
   it all would not fit the section's time budget, and says nothing more about a deep queue).

    .venv/bin/python -m bench.system.backlog [--quick] [--jobs N] [--drain-share 0.3]

Writes bench/results/backlog.json, .md and backlog_memory.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import nats
import numpy as np

from asyncinfer.config import Config
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.v1 import job_service_pb2, job_service_pb2_grpc, ops_service_pb2, ops_service_pb2_grpc, tensor_pb2
from bench.system.backlog_tools import Results, batcher_config, demo_model, du_bytes, services_config, wait_batchers
from bench.system.common import Child, ProcessGroup, cpu_seconds, matplotlib_pyplot, plot_path, rss_bytes
from services.scheduler.dispatcher import MAX_PULL_PER_ROUND

MODEL = "demo"
SUBMIT_CONCURRENCY = 128
SUBMIT_CHANNELS = 4
STREAM_WINDOW = 1024
SAMPLE_INTERVAL_S = 0.5
BUCKETS = 10
MIB = 1024 * 1024


def demo_request() -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.raw_contents = np.arange(4, dtype="<f4").tobytes()
    return job_service_pb2.SubmitJobRequest(model_name=MODEL, inputs=[x])


# --- submitting ------------------------------------------------------------------------------


@dataclass
class SubmitLog:
    """When each accepted job was acknowledged (monotonic), and refusals."""

    accepted: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1


async def submit_unary(address: str, count: int, log: SubmitLog, concurrency: int = SUBMIT_CONCURRENCY) -> None:
    """`count` SubmitJob calls from `concurrency` clients over a few channels; a refused call is
    retried after a short pause (it counts as an error, not as a job)."""
    request = demo_request()
    remaining = [count]
    channels = [grpc.aio.insecure_channel(address) for _ in range(SUBMIT_CHANNELS)]
    try:
        stubs = [job_service_pb2_grpc.JobServiceStub(c) for c in channels]

        async def client(index: int) -> None:
            stub = stubs[index % len(stubs)]
            while remaining[0] > 0:
                remaining[0] -= 1
                while True:
                    try:
                        await stub.SubmitJob(request, timeout=30)
                        break
                    except grpc.aio.AioRpcError as error:
                        log.error(error.code().name)
                        await asyncio.sleep(0.05)
                log.accepted.append(time.monotonic())

        await asyncio.gather(*(client(i) for i in range(concurrency)))
    finally:
        for channel in channels:
            await channel.close()


async def submit_stream(address: str, count: int, log: SubmitLog, streams: int = 2) -> None:
    """`count` jobs through SubmitJobs bulk streams, each with up to STREAM_WINDOW unanswered."""
    request = demo_request()
    share = [count // streams + (1 if i < count % streams else 0) for i in range(streams)]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)

        async def one(total: int) -> None:
            window = asyncio.Semaphore(STREAM_WINDOW)
            call = stub.SubmitJobs()

            async def write() -> None:
                for index in range(total):
                    await window.acquire()
                    await call.write(job_service_pb2.SubmitJobsRequest(job=request, correlation_id=str(index)))
                await call.done_writing()

            writer = asyncio.create_task(write())
            try:
                async for answer in call:
                    window.release()
                    if answer.HasField("error"):
                        log.error(answer.error.reason or str(answer.error.code))
                    else:
                        log.accepted.append(time.monotonic())
            finally:
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)

        await asyncio.gather(*(one(n) for n in share if n))


async def bulk_stream_works(address: str) -> bool:
    """Whether the gateway implements SubmitJobs (one probe job is queued when it does)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = job_service_pb2_grpc.JobServiceStub(channel).SubmitJobs()
        try:
            await call.write(job_service_pb2.SubmitJobsRequest(job=demo_request(), correlation_id="probe"))
            await call.done_writing()
            async for answer in call:
                return not answer.HasField("error")
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                return False
            raise
    return False


# --- sampling --------------------------------------------------------------------------------


@dataclass
class Sample:
    at: float
    phase: str
    depth: int
    accepted: int
    store_bytes: int
    rss: dict[str, int]
    cpu: dict[str, float]


class Sampler:
    """Every SAMPLE_INTERVAL_S: each process's RSS, the WORK stream's depth, the store's size."""

    def __init__(self, nats_server: NatsServerProcess, js: Any, log: SubmitLog) -> None:
        assert nats_server.process is not None
        self._nats_pid = nats_server.process.pid
        self._store_dir = nats_server.store_dir
        self._js = js
        self._log = log
        self.processes: dict[str, Child] = {}
        self.phase = "idle"
        self.samples: list[Sample] = []
        self._task: asyncio.Task[None] | None = None

    async def depth(self) -> int:
        info = await self._js.stream_info("WORK")
        return int(info.state.messages)

    async def take(self) -> Sample:
        rss = {"nats-server": rss_bytes(self._nats_pid)}
        rss.update({name: p.rss_bytes() for name, p in self.processes.items()})
        cpu = {"nats-server": cpu_seconds(self._nats_pid), "bench clients": time.process_time()}
        cpu.update({name: p.cpu_seconds() for name, p in self.processes.items()})
        sample = Sample(
            time.monotonic(),
            self.phase,
            await self.depth(),
            len(self._log.accepted),
            du_bytes(self._store_dir),
            rss,
            cpu,
        )
        self.samples.append(sample)
        return sample

    def start(self) -> None:
        async def loop() -> None:
            while True:
                with contextlib.suppress(Exception):
                    await self.take()
                await asyncio.sleep(SAMPLE_INTERVAL_S)

        self._task = asyncio.create_task(loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def wait_depth(sampler: Sampler, done: Callable[[int], bool], timeout_s: float, poll_s: float = 0.05) -> float:
    """Polls the WORK stream's depth until done(depth); the monotonic time it became true."""
    deadline = time.monotonic() + timeout_s
    while True:
        depth = await sampler.depth()
        if done(depth):
            return time.monotonic()
        if time.monotonic() > deadline:
            raise RuntimeError(f"queue depth still {depth} after {timeout_s}s")
        await asyncio.sleep(poll_s)


async def watch_drain(sampler: Sampler, until_depth: int, timeout_s: float) -> list[tuple[float, int]]:
    """(time, depth) every 0.1 s until the queue is down to until_depth."""
    points = []
    deadline = time.monotonic() + timeout_s
    while True:
        depth = await sampler.depth()
        points.append((time.monotonic(), depth))
        if depth <= until_depth:
            return points
        if time.monotonic() > deadline:
            raise RuntimeError(f"drain stuck at depth {depth} (waiting for {until_depth})")
        await asyncio.sleep(0.1)


async def in_flight(scheduler_address: str) -> int:
    async with grpc.aio.insecure_channel(scheduler_address) as channel:
        stub = ops_service_pb2_grpc.OpsServiceStub(channel)
        answer = await stub.GetQueueStats(ops_service_pb2.GetQueueStatsRequest(model_name=MODEL), timeout=5)
    return sum(m.in_flight for m in answer.models)


async def submit_within(
    submit: Callable[[str, int, SubmitLog], Awaitable[None]], address: str, count: int, log: SubmitLog
) -> None:
    """submit(...), with a generous bound so that a stalled gateway fails the run instead of hanging it."""
    timeout_s = 120.0 + count / 20
    try:
        await asyncio.wait_for(submit(address, count, log), timeout_s)
    except TimeoutError:
        raise RuntimeError(
            f"submitting stalled: {len(log.accepted)} of {count} accepted in {timeout_s:.0f} s"
        ) from None


async def wait_until(count: Callable[[], Awaitable[int]], timeout_s: float) -> None:
    """Polls until count() is 0."""
    deadline = time.monotonic() + timeout_s
    while (left := await count()) > 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{left} jobs still in flight after {timeout_s}s")
        await asyncio.sleep(0.05)


def crossing_times(points: list[tuple[float, int]], thresholds: list[float]) -> list[float]:
    """When the (falling) depth first reached each threshold, interpolated between points."""
    out = []
    for threshold in thresholds:
        index = next((i for i, (_t, depth) in enumerate(points) if depth <= threshold), len(points) - 1)
        if index == 0:
            out.append(points[0][0])
            continue
        (t0, d0), (t1, d1) = points[index - 1], points[index]
        out.append(t1 if d0 == d1 else t0 + (t1 - t0) * (d0 - threshold) / (d0 - d1))
    return out


def bucket_rates(times: list[float], buckets: int) -> list[float]:
    """Jobs per second within each successive 1/buckets of an ordered list of event times."""
    size = len(times) // buckets
    rates = []
    for b in range(buckets):
        chunk = times[b * size : (b + 1) * size]
        if len(chunk) > 1 and chunk[-1] > chunk[0]:
            rates.append((len(chunk) - 1) / (chunk[-1] - chunk[0]))
    return rates


# --- the run ---------------------------------------------------------------------------------


async def pause(address: str, paused: bool) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = ops_service_pb2_grpc.OpsServiceStub(channel)
        if paused:
            await stub.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name=MODEL), timeout=5)
        else:
            await stub.ResumeQueue(ops_service_pb2.ResumeQueueRequest(model_name=MODEL), timeout=5)


async def warm_up(batcher_address: str, calls: int = 200) -> None:
    """Batches through the batcher's own KServe API: torch and the engine warm, no job touched."""
    import tritonclient.grpc.aio as triton

    client = triton.InferenceServerClient(batcher_address)
    try:
        x = triton.InferInput("x", [1, 4], "FP32")
        x.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
        for _ in range(calls // 20):
            await asyncio.gather(*(client.infer(MODEL, [x]) for _ in range(20)))
    finally:
        await client.close()


async def start_batcher(group: ProcessGroup, config: Config, scheduler_address: str, label: str) -> Child:
    """A batcher process, connected and warmed up (in a thread, so sampling goes on meanwhile)."""
    batcher = await asyncio.to_thread(group.service, "batcher", batcher_config(config, scheduler_address), label=label)
    await wait_batchers(scheduler_address, MODEL, 1)
    await warm_up(batcher.address)
    return batcher


async def stream_bytes(js: Any, name: str) -> tuple[int, int]:
    info = await js.stream_info(name)
    return int(info.state.bytes), int(info.state.messages)


async def run(args: argparse.Namespace) -> Results:
    jobs = args.jobs or (2_000 if args.quick else 100_000)
    small = max(jobs // 20, 200) if args.quick else 3_000
    runs = 1 if args.quick else 3
    drain_share = args.drain_share or (0.5 if args.quick else 0.3)
    drain_jobs = round(jobs * drain_share)
    results = Results(
        "backlog", f"Backlog scaling: {jobs:,} queued jobs, then one batcher drains them", quick=args.quick
    )
    model = demo_model()
    with ProcessGroup() as group:
        nats_server = group.nats()
        config = services_config(nats_server.url, [model])
        gateway = group.service("gateway", config)
        scheduler = group.service("scheduler", config)
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        log = SubmitLog()
        sampler = Sampler(nats_server, js, log)
        sampler.processes = {"gateway": gateway, "scheduler": scheduler}
        sampler.start()
        try:
            await asyncio.sleep(1.5)
            idle = await sampler.take()
            use_stream = await bulk_stream_works(gateway.address)
            how = (
                f"SubmitJobs bulk streams (2, window {STREAM_WINDOW})"
                if use_stream
                else f"unary SubmitJob, {SUBMIT_CONCURRENCY} concurrent clients on {SUBMIT_CHANNELS} channels "
                "(SubmitJobs answered UNIMPLEMENTED)"
            )
            submit: Callable[[str, int, SubmitLog], Awaitable[None]] = submit_stream if use_stream else submit_unary

            # 1. the reference: a batcher draining small backlogs (the queue paused while each
            # fills, then resumed), with the queue and the job store still nearly empty
            print(f"reference: {runs} drain(s) of {small:,} jobs; submitting through {how}", flush=True)
            sampler.phase = "reference"
            reference_batcher = await start_batcher(group, config, scheduler.address, "batcher-reference")
            sampler.processes["batcher"] = reference_batcher
            reference_rates = []
            for _ in range(runs):
                await pause(scheduler.address, True)
                await submit_within(submit, gateway.address, small, SubmitLog())
                await wait_depth(sampler, lambda d: d >= small, 30)
                await pause(scheduler.address, False)
                ref_points = await watch_drain(sampler, 0, timeout_s=300)
                reference_rates.append(small / (ref_points[-1][0] - ref_points[0][0]))
            reference_sample = await sampler.take()

            # information: submitting and draining at once
            sampler.phase = "steady"
            steady_jobs = small
            steady_start = time.monotonic()
            depth_peak = [0]

            async def track_depth() -> None:
                while True:
                    depth_peak[0] = max(depth_peak[0], await sampler.depth())
                    await asyncio.sleep(0.1)

            tracker = asyncio.create_task(track_depth())
            await submit_within(submit, gateway.address, steady_jobs, SubmitLog())
            await wait_depth(sampler, lambda d: d == 0, 300)
            steady_s = time.monotonic() - steady_start
            tracker.cancel()
            await asyncio.gather(tracker, return_exceptions=True)
            await asyncio.to_thread(group.stop, reference_batcher)
            del sampler.processes["batcher"]

            # 2. the backlog grows, no batcher running
            print(f"queueing {jobs:,} jobs with no batcher running", flush=True)
            sampler.phase = "before"
            await asyncio.sleep(1.0)
            before = await sampler.take()
            kv_before_bytes, kv_before_msgs = await stream_bytes(js, "KV_jobs")
            store_before = du_bytes(nats_server.store_dir)
            sampler.phase = "grow"
            log.accepted.clear()
            started = time.monotonic()
            await submit_within(submit, gateway.address, jobs, log)
            submit_s = time.monotonic() - started
            sampler.phase = "full"
            await asyncio.sleep(1.0)
            full = await sampler.take()
            work_bytes, work_msgs = await stream_bytes(js, "WORK")
            kv_bytes, kv_msgs = await stream_bytes(js, "KV_jobs")
            store_full = du_bytes(nats_server.store_dir)

            # 3. a fresh batcher (same config) drains the first drain_share of it. The queue is
            # paused while the batcher starts and warms up, as for the reference.
            print(f"  queued in {submit_s:.1f} s; starting a batcher", flush=True)
            await pause(scheduler.address, True)
            sampler.phase = "drain"
            batcher = await start_batcher(group, config, scheduler.address, "batcher-backlog")
            sampler.processes["batcher"] = batcher
            drain_start = await sampler.take()
            await pause(scheduler.address, False)
            print(f"  draining {drain_jobs:,} of {drain_start.depth:,} jobs", flush=True)
            points = await watch_drain(sampler, full.depth - drain_jobs, timeout_s=300.0 + drain_jobs / 20)
            drain_s = points[-1][0] - points[0][0]
            drained_n = full.depth - points[-1][1]
            sampler.phase = "drained"
            # The rest stays queued: pause, and let the jobs in flight finish.
            await pause(scheduler.address, True)
            await wait_until(lambda: in_flight(scheduler.address), 60)
            done_n = full.depth - await sampler.depth()
            drained = await sampler.take()
            kv_after_bytes, kv_after_msgs = await stream_bytes(js, "KV_jobs")
            print(f"  drained {drained_n:,} in {drain_s:.1f} s", flush=True)
        finally:
            await sampler.stop()
            await nc.close()

    # --- figures ---
    accepted = sorted(log.accepted)
    submit_rates = bucket_rates(accepted, BUCKETS)
    results.row("jobs queued", [jobs], "jobs", how)
    results.row("submit rate, whole backlog", [jobs / submit_s], "jobs/s", f"{submit_s:.1f} s to queue them")
    results.row(
        f"submit rate per {100 // BUCKETS}% of the backlog",
        submit_rates,
        "jobs/s",
        "one run; min/max over the tenths: " + ", ".join(f"{r:,.0f}" for r in submit_rates),
    )
    if submit_rates:
        last_vs_first = submit_rates[-1] / submit_rates[0]
        results.ratio(
            "submit rate, last tenth / first tenth",
            last_vs_first,
            "no slow-down as the backlog grows (>= 0.9)",
            last_vs_first >= 0.9,
        )
    grow = [s for s in sampler.samples if s.phase == "grow"]
    warm = next((s for s in grow if s.accepted >= jobs // BUCKETS), grow[0] if grow else idle)
    for name in ("gateway", "scheduler", "nats-server"):
        peak = max([s.rss[name] for s in grow] + [full.rss[name]])
        results.row(
            f"{name} RSS: idle / before the backlog / at 10% / at full backlog / peak while growing",
            [r / MIB for r in (idle.rss[name], before.rss[name], warm.rss[name], full.rss[name], peak)],
            "MiB",
            f"idle {idle.rss[name] / MIB:.0f} (started), before {before.rss[name] / MIB:.0f} (after the "
            f"reference runs), 10% {warm.rss[name] / MIB:.0f}, full {full.rss[name] / MIB:.0f}, peak "
            f"{peak / MIB:.0f}",
        )
        if name != "nats-server":
            growth = peak / warm.rss[name]
            results.ratio(
                f"{name} RSS peak while growing / RSS at 10% of the backlog",
                growth,
                "flat within 10% (<= 1.10)",
                growth <= 1.10,
            )
    results.row(
        "NATS store per queued job (du of the store dir)",
        [(store_full - store_before) / jobs],
        "bytes",
        f"{(store_full - store_before) / MIB:.1f} MiB for {jobs:,} jobs (store {store_full / MIB:.1f} MiB in all)",
    )
    results.row(
        "WORK stream per queued job (stream info bytes / messages)",
        [work_bytes / max(work_msgs, 1)],
        "bytes",
        f"{work_msgs:,} messages",
    )
    # The KV keeps one revision per key. Before the backlog it held only the reference runs'
    # SUCCEEDED records; the backlog added one QUEUED record per job; the drain turned done_n of
    # those into SUCCEEDED ones.
    queued_record = (kv_bytes - kv_before_bytes) / max(kv_msgs - kv_before_msgs, 1)
    succeeded_record = kv_before_bytes / max(kv_before_msgs, 1)
    results.row(
        "KV_jobs per queued job's record (stream info bytes / messages)",
        [queued_record],
        "bytes",
        f"{kv_msgs - kv_before_msgs:,} records",
    )
    results.row(
        "KV_jobs per SUCCEEDED record (with its outputs)",
        [succeeded_record],
        "bytes",
        f"{kv_before_msgs:,} records of the reference runs; kept for their retention (default 1 day)",
    )
    results.row(
        "KV_jobs per record after the drain",
        [kv_after_bytes / max(kv_after_msgs, 1)],
        "bytes",
        f"{done_n:,} of the backlog's jobs done, {kv_after_msgs:,} records in all",
    )

    drain_rate = drained_n / drain_s
    top = points[0][1]
    thresholds = [top - drained_n * k / BUCKETS for k in range(BUCKETS + 1)]
    crossings = crossing_times(points, thresholds)
    drain_rates = [(drained_n / BUCKETS) / (b - a) for a, b in itertools.pairwise(crossings) if b > a]
    share = f"the first {drained_n:,} of {full.depth:,} queued jobs" if drained_n < full.depth else "all of them"
    results.row(
        "drain rate, full backlog",
        [drain_rate],
        "jobs/s",
        f"{share} in {drain_s:.1f} s, from the queue's resumption (batcher connected and warm)",
    )
    results.row(
        f"drain rate per {100 // BUCKETS}% of the drained jobs",
        drain_rates,
        "jobs/s",
        "first to last: " + ", ".join(f"{r:,.0f}" for r in drain_rates),
    )
    ref_median = float(np.median(reference_rates))
    results.row(
        f"drain rate, small backlog ({small:,} jobs; reference)",
        reference_rates,
        "jobs/s",
        "measured first, near-empty store; a batcher of the same config, warm; queue paused while filling, "
        "then resumed",
    )
    results.ratio(
        "drain rate full backlog / small backlog",
        drain_rate / ref_median,
        "within 10% (>= 0.90)",
        drain_rate / ref_median >= 0.90,
    )
    if drain_rates:
        first = drain_rates[0] / ref_median
        results.ratio(
            "drain rate of the first tenth drained (deepest queue) / small backlog",
            first,
            "within 10% (>= 0.90)",
            first >= 0.90,
        )
    results.row(
        "completed/s while submitting (information)",
        [steady_jobs / steady_s],
        "jobs/s",
        f"{steady_jobs:,} jobs submitted with the batcher running; queue depth peaked at {depth_peak[0]:,}; "
        "clients, gateway and batcher share the CPUs",
    )
    drain = [s for s in sampler.samples if s.phase == "drain" and s.rss.get("batcher")]
    drain_warm = next((s for s in drain if s.depth <= top - drained_n / BUCKETS), drain[0] if drain else drained)
    for name in ("scheduler", "batcher", "nats-server"):
        peak = max([s.rss.get(name, 0) for s in drain] + [drained.rss[name]])
        base = drain_warm.rss.get(name, 0) or 1
        results.row(
            f"{name} RSS: after the reference runs / after the first tenth of the drain / peak while draining / "
            "drained",
            [reference_sample.rss[name] / MIB, base / MIB, peak / MIB, drained.rss[name] / MIB],
            "MiB",
            f"after the references {reference_sample.rss[name] / MIB:.0f} (the reference batcher), first tenth "
            f"{base / MIB:.0f}, peak {peak / MIB:.0f}, drained {drained.rss[name] / MIB:.0f}",
        )
        if name != "nats-server":
            results.ratio(
                f"{name} RSS peak while draining / after the first tenth of the drain",
                peak / base,
                "flat within 10% (<= 1.10)",
                peak / base <= 1.10,
            )

    per_job_store = (store_full - store_before) / jobs
    results.note(
        "CPU per 1,000 jobs while queueing: "
        + cpu_note(before, full, jobs)
        + "; while draining: "
        + cpu_note(drain_start, drained, done_n)
        + f" (wall time per 1,000 jobs: {submit_s / jobs * 1000:.2f} s queueing, {drain_s / drained_n * 1000:.2f} s "
        "draining; a process using about as many CPU-s as the wall time is the limit, and on 2 cores the "
        "processes' sum against 2x the wall time says how much of the machine they had)."
    )
    results.note(
        f"Setup: nats-server, gateway, scheduler and batcher as separate processes on {_cpus()} CPUs, the "
        f"submitting clients in the bench process. Model: the demo model (y = 2x + 1, 16-byte input) with "
        f"max_batch_size {model.max_batch_size}, max_queue_delay_ms {model.max_queue_delay_ms:g}, "
        f"max_queue_size {model.max_queue_size} (the batcher's credits: it holds at most that many jobs), "
        f"max_inflight_batches {model.max_inflight_batches}; the scheduler pulls at most "
        f"{MAX_PULL_PER_ROUND} messages per round, poll_interval_ms "
        f"{config.scheduler.poll_interval_ms:g}, ack_wait_s {config.scheduler.ack_wait_s:g}."
    )
    results.note(
        f"Submission: {how}. Submit errors: {log.errors or 'none'}. The full backlog is one run (its tenths "
        f"give the spread); the small-backlog reference is {runs} run(s)."
    )
    if jobs < 1_000_000:
        results.note(
            f"1,000,000 jobs were not queued: at {jobs / submit_s:,.0f} jobs/s it takes "
            f"{1_000_000 / (jobs / submit_s) / 60:.1f} min to queue and {1_000_000 / drain_rate / 60:.1f} min to "
            f"drain, beyond the section's budget on this machine. Extrapolated from this run: the store "
            f"would hold about {per_job_store * 1_000_000 / 1024**3:.2f} GiB (on disk; {per_job_store:.0f} bytes "
            "a job); the services' memory "
            + (
                "was flat here, so it would not grow with it"
                if all(r["met"] for r in results.ratios if "RSS" in r["name"])
                else "was not flat here (see the ratios)"
            )
            + "; nats-server's own memory is the one to watch (see its row)."
        )
    results.plots.append(plot(sampler.samples, jobs))
    return results


def cpu_note(start: Sample, end: Sample, jobs: int) -> str:
    parts = []
    for name, value in sorted(end.cpu.items(), key=lambda kv: -(kv[1] - start.cpu.get(kv[0], 0.0))):
        used = value - start.cpu.get(name, 0.0)
        parts.append(f"{name} {used / jobs * 1000:.2f} s")
    return ", ".join(parts)


def _cpus() -> int:
    return os.cpu_count() or 0


def plot(samples: list[Sample], jobs: int) -> Path:
    """RSS against the backlog while it grows; RSS and depth over the whole run."""
    plt = matplotlib_pyplot()
    fig, (grow_ax, time_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = sorted({n for s in samples for n in s.rss})
    grow = [s for s in samples if s.phase in ("before", "grow", "full")]
    for name in [n for n in names if any(s.rss.get(n) for s in grow)]:
        grow_ax.plot([s.depth for s in grow], [s.rss.get(name, 0) / MIB for s in grow], marker=".", label=name)
    grow_ax.set(title=f"RSS while {jobs:,} jobs are queued (no batcher)", xlabel="jobs queued", ylabel="RSS (MiB)")
    grow_ax.legend(fontsize=8)
    t0 = samples[0].at if samples else 0.0
    for name in names:
        pts = [(s.at - t0, s.rss[name] / MIB) for s in samples if s.rss.get(name)]
        time_ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name)
    time_ax.set(title="RSS and queue depth over the run", xlabel="seconds", ylabel="RSS (MiB)")
    depth_ax = time_ax.twinx()
    depth_ax.plot([s.at - t0 for s in samples], [s.depth for s in samples], color="grey", linestyle=":", label="depth")
    depth_ax.set_ylabel("jobs in the WORK stream")
    time_ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path = plot_path("backlog", "memory")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2,000 jobs, one reference run: seconds")
    parser.add_argument("--jobs", type=int, default=0, help="jobs to queue (default 100,000; quick 2,000)")
    parser.add_argument(
        "--drain-share",
        type=float,
        default=0.0,
        help="share of the backlog drained and measured before the rest is purged (default 0.3; quick 0.5)",
    )
    args = parser.parse_args()
    started = time.monotonic()
    results = asyncio.run(run(args))
    path = results.write()
    print(f"wrote {path} in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
