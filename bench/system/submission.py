"""Submission: accepted jobs per second and SubmitJob latency (issue 6, item 1).

    .venv/bin/python -m bench.system.submission [--quick]

Starts a nats-server, a gateway (its own process; no scheduler: jobs stay queued, and the WORK
stream and the jobs bucket are purged between runs), the reference servers, and measures from one
client process on uvloop:

- unary SubmitJob (demo model, a [1, 4] FP32 input inline) at 1, 16 and 128 concurrent clients
  (closed loop: each client sends its next request when the previous one is answered), with p50/p99;
- the SubmitJobs bulk stream (1 and 4 streams, 512 unanswered requests at most per stream), or
  "not available" while the gateway answers UNIMPLEMENTED;
- SubmitJob latency at half the highest unary rate, open loop (requests sent on a fixed schedule;
  latency counted from the scheduled time, so a slow answer cannot hide the queueing it causes);
- references, in the same run: raw nats-py JetStream publishes of the same work message (one at a
  time with ack; gather windows of 256; publish_async), Celery 5 apply_async onto Redis (one loop,
  as an application would enqueue), and a trivial unary grpc.aio call (1 KB in, 2 bytes out; server
  on uvloop like the services) at the same concurrencies: the ceiling for a Python gRPC server here;
- what bounds the ratios: the trivial server awaiting one JetStream publish per call (at 128
  clients), and server CPU per call at a light paced load (100 calls/s) for the trivial call and
  for SubmitJob, against the same at 128 clients (the cost of waking up per call).

Runs are interleaved (every setup once per round) so that noise from a shared machine spreads over
all of them. Writes bench/results/submission.{json,md} and submission_throughput.png,
submission_latency_cdf.png.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import nats
import numpy as np
import uvloop
from nats.js import api

from asyncinfer.codecs.envelope import encode_envelope
from asyncinfer.jobs import Priority, WorkEnvelope
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import job_service_pb2, job_service_pb2_grpc, tensor_pb2
from bench.system import echo_server
from bench.system.common import (
    PYTHON,
    REDIS_INSTALL_HINT,
    Child,
    ProcessGroup,
    bench_config,
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

SECTION = "submission"
CONCURRENCY = (1, 16, 128)
STREAM_WINDOW = 512
JOBS_PER_MESSAGE = 100  # SubmitJobs with many jobs per message (items)
NATS_WINDOW = 256
PAYLOAD = [1.0, 2.0, 3.0, 4.0]
LIGHT_RATE = 100  # calls/s: the light load at which per-call CPU is measured


@dataclass(frozen=True)
class Sizes:
    runs: int
    window_s: float
    warmup_s: float
    streams: tuple[int, ...]


FULL = Sizes(runs=3, window_s=3.0, warmup_s=0.5, streams=(1, 4))
QUICK = Sizes(runs=1, window_s=0.6, warmup_s=0.2, streams=(1,))


@dataclass
class Window:
    rate: float
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    total: int = 0  # every answered call, warm-up included

    @property
    def p50(self) -> float:
        return percentile(self.latencies_ms, 50)

    @property
    def p99(self) -> float:
        return percentile(self.latencies_ms, 99)


Call = Callable[[], Awaitable[Any]]


async def closed_loop(call: Call, concurrency: int, sizes: Sizes) -> Window:
    """`concurrency` clients calling back to back; rate and latencies over the window after warm-up."""
    latencies: list[float] = []
    errors = 0
    total = 0
    measuring = False
    stop_at = time.perf_counter() + sizes.warmup_s + sizes.window_s

    async def client() -> None:
        nonlocal errors, total
        while (started := time.perf_counter()) < stop_at:
            try:
                await call()
            except grpc.aio.AioRpcError:
                if measuring:
                    errors += 1
                continue
            total += 1
            if measuring:
                latencies.append((time.perf_counter() - started) * 1e3)

    async def clock() -> float:
        nonlocal measuring
        await asyncio.sleep(sizes.warmup_s)
        measuring = True
        began = time.perf_counter()
        await asyncio.sleep(sizes.window_s)
        measuring = False
        return time.perf_counter() - began

    elapsed, *_ = await asyncio.gather(clock(), *(client() for _ in range(concurrency)))
    return Window(len(latencies) / elapsed, latencies, errors, total)


async def open_loop(call: Call, rate: float, sizes: Sizes) -> Window:
    """Requests sent at `rate` per second whatever the answers do; latency from each request's
    scheduled time (no coordinated omission)."""
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter()
    measure_from = start + sizes.warmup_s
    end = measure_from + sizes.window_s
    tasks: set[asyncio.Task[None]] = set()

    answered = 0

    async def one(intended: float) -> None:
        nonlocal errors, answered
        try:
            await call()
        except grpc.aio.AioRpcError:
            if intended >= measure_from:
                errors += 1
            return
        answered += 1
        if intended >= measure_from:
            latencies.append((time.perf_counter() - intended) * 1e3)

    sent = 0
    total = int((end - start) * rate)
    while sent < total:
        due = min(int((time.perf_counter() - start) * rate), total)
        while sent < due:
            task = asyncio.create_task(one(start + sent / rate))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            sent += 1
        await asyncio.sleep(max(start + (sent + 1) / rate - time.perf_counter(), 0.0))
    await asyncio.gather(*tasks)
    return Window(len(latencies) / sizes.window_s, latencies, errors, answered)


def submit_request() -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend(PAYLOAD)
    return job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[x])


def work_payload() -> bytes:
    """The work message the gateway publishes for that request (the raw-publish payload)."""
    envelope = WorkEnvelope(
        job_id="0190c0de-0000-7000-8000-000000000000",
        tenant="default",
        model_name="demo",
        model_version="1",
        priority=Priority.NORMAL,
        create_time=time.time(),
        max_attempts=3,
        inputs=(Tensor.from_numpy("x", np.array([PAYLOAD], dtype=np.float32)),),
        execution_timeout_s=60.0,
    )
    return encode_envelope(envelope)


# --- the setups ------------------------------------------------------------------------------


class StreamUnavailable(Exception):
    pass


async def stream_window(stub: job_service_pb2_grpc.JobServiceStub, streams: int, sizes: Sizes) -> Window:
    """SubmitJobs streams sending as fast as their window of unanswered requests allows; the rate
    counts accepted jobs whose answer arrived in the window; latency is request sent -> answer."""
    request = submit_request()

    def message(index: int) -> job_service_pb2.SubmitJobsRequest:
        return job_service_pb2.SubmitJobsRequest(job=request, correlation_id=str(index))

    return await _stream_window(stub.SubmitJobs, message, lambda answer: answer.HasField("error"), streams, sizes)


async def grouped_stream_window(stub: job_service_pb2_grpc.JobServiceStub, sizes: Sizes) -> Window:
    """One SubmitJobs stream of messages carrying JOBS_PER_MESSAGE jobs each, with at most
    STREAM_WINDOW jobs unanswered; the rate counts accepted jobs whose answer arrived in the
    window, latency is message sent -> its answer (one answer holds all its jobs')."""
    request = submit_request()
    batch = job_service_pb2.SubmitJobsRequest(
        items=[job_service_pb2.SubmitJobsItem(job=request, correlation_id=str(i)) for i in range(JOBS_PER_MESSAGE)]
    )
    start = time.perf_counter()
    measure_from = start + sizes.warmup_s
    stop_at = measure_from + sizes.window_s
    latencies: list[float] = []
    accepted = errors = 0
    call = stub.SubmitJobs()
    room = asyncio.Semaphore(max(STREAM_WINDOW // JOBS_PER_MESSAGE, 1))
    sent_at: list[float] = []

    async def write() -> None:
        while time.perf_counter() < stop_at:
            await room.acquire()
            sent_at.append(time.perf_counter())
            await call.write(batch)
        await call.done_writing()

    async def read() -> None:
        nonlocal accepted, errors
        received = 0
        async for answer in call:
            now = time.perf_counter()
            room.release()
            if measure_from <= now < stop_at:
                failed = sum(1 for a in answer.answers if a.HasField("error"))
                errors += failed
                accepted += len(answer.answers) - failed
                latencies.append((now - sent_at[received]) * 1e3)
            received += 1

    async with asyncio.TaskGroup() as group:
        group.create_task(write())
        group.create_task(read())
    return Window(accepted / sizes.window_s, latencies, errors)


async def echo_stream_window(channel: grpc.aio.Channel, streams: int, sizes: Sizes) -> Window:
    """The same load on the trivial echo stream (1 KB per message, b"ok" back)."""
    ping = os.urandom(1024)
    call = channel.stream_stream(echo_server.STREAM_METHOD)
    return await _stream_window(call, lambda _: ping, lambda _: False, streams, sizes)


async def _stream_window(
    open_call: Any, message: Callable[[int], Any], is_error: Callable[[Any], bool], streams: int, sizes: Sizes
) -> Window:
    """Answers come back in request order (both streams promise it), so the n-th answer is the
    n-th request's."""
    start = time.perf_counter()
    measure_from = start + sizes.warmup_s
    stop_at = measure_from + sizes.window_s
    latencies: list[float] = []
    errors = 0

    async def one_stream() -> None:
        nonlocal errors
        call = open_call()
        room = asyncio.Semaphore(STREAM_WINDOW)
        sent_at: list[float] = []

        async def write() -> None:
            while time.perf_counter() < stop_at:
                await room.acquire()
                sent_at.append(time.perf_counter())
                await call.write(message(len(sent_at)))
            await call.done_writing()

        async def read() -> None:
            nonlocal errors
            received = 0
            async for answer in call:
                now = time.perf_counter()
                room.release()
                if measure_from <= now < stop_at:
                    if is_error(answer):
                        errors += 1
                    else:
                        latencies.append((now - sent_at[received]) * 1e3)
                received += 1

        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(write())
                group.create_task(read())
        except* grpc.aio.AioRpcError as failures:
            error = failures.exceptions[0]
            assert isinstance(error, grpc.aio.AioRpcError)
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise StreamUnavailable(error.details()) from None
            raise

    try:
        await asyncio.gather(*(one_stream() for _ in range(streams)))
    except* StreamUnavailable as unavailable:
        raise unavailable.exceptions[0] from None
    return Window(len(latencies) / sizes.window_s, latencies, errors)


async def nats_window(js: Any, mode: str, payload: bytes, sizes: Sizes) -> float:
    """Publishes per second to a WorkQueue file stream like WORK (warm-up first)."""
    subject = "bench.publish"

    async def burst(seconds: float) -> tuple[int, float]:
        count = 0
        started = time.perf_counter()
        stop_at = started + seconds
        while time.perf_counter() < stop_at:
            if mode == "one":
                await js.publish(subject, payload)
                count += 1
            elif mode == "window":
                await asyncio.gather(*(js.publish(subject, payload) for _ in range(NATS_WINDOW)))
                count += NATS_WINDOW
            else:
                for _ in range(NATS_WINDOW):
                    await js.publish_async(subject, payload)
                count += NATS_WINDOW
        if mode == "async":
            await js.publish_async_completed()
        return count, time.perf_counter() - started

    await burst(sizes.warmup_s)
    count, elapsed = await burst(sizes.window_s)
    return count / elapsed


def celery_enqueue_rate(broker: str, sizes: Sizes, *, tracked: bool) -> float:
    """apply_async calls per second from one thread, as an application enqueues (blocking).
    tracked: the result will be read (Celery's Redis backend then subscribes to the task's result
    channel at each call, as for a job one can look up later); else ignore_result=True, Celery's
    fastest enqueue (fire and forget)."""
    os.environ["BENCH_CELERY_BROKER"] = broker
    from bench.system.celery_app import app, noop

    options = {} if tracked else {"ignore_result": True}

    def burst(seconds: float) -> tuple[int, float]:
        count = 0
        started = time.perf_counter()
        stop_at = started + seconds
        while time.perf_counter() < stop_at:
            noop.apply_async(args=(PAYLOAD,), **options)
            count += 1
        return count, time.perf_counter() - started

    burst(sizes.warmup_s)
    count, elapsed = burst(sizes.window_s)
    with app.connection_for_write() as connection:
        app.control.purge(connection=connection)
    return count / elapsed


# --- the run ---------------------------------------------------------------------------------


@dataclass
class Measured:
    submit: dict[int, list[Window]] = field(default_factory=dict)
    echo: dict[int, list[Window]] = field(default_factory=dict)
    stream: dict[int, list[Window]] = field(default_factory=dict)
    grouped: list[Window] = field(default_factory=list)  # SubmitJobs, JOBS_PER_MESSAGE jobs per message
    parse: list[Window] = field(default_factory=list)  # the trivial server parsing a SubmitJobRequest, top clients
    echo_stream: list[Window] = field(default_factory=list)  # 1 stream
    stream_unavailable: str = ""
    nats: dict[str, list[float]] = field(default_factory=dict)
    celery: list[float] = field(default_factory=list)  # ignore_result=True, the faster
    celery_tracked: list[float] = field(default_factory=list)
    celery_unavailable: str = ""
    half_load: list[Window] = field(default_factory=list)
    half_load_rate: float = math.nan
    profile: tuple[int, list[tuple[str, float]], list[tuple[str, float]]] | None = None
    gateway_cpu_us_per_job: list[float] = field(default_factory=list)
    echo_cpu_us_per_call: list[float] = field(default_factory=list)
    nats_cpu_us_per_job: list[float] = field(default_factory=list)
    # The trivial call that also makes one JetStream publish, at the top concurrency.
    echo_publish: list[Window] = field(default_factory=list)
    echo_publish_cpu_us_per_call: list[float] = field(default_factory=list)
    # Server CPU per call at a light paced load (LIGHT_RATE/s, open loop): the cost of waking up.
    light_echo_cpu_us: list[float] = field(default_factory=list)
    light_submit_cpu_us: list[float] = field(default_factory=list)


async def measure(
    sizes: Sizes,
    nats_url: str,
    gateway: Child,
    nats_pid: int,
    echo: Child,
    echo_publish: Child,
    redis: Child | None,
) -> Measured:
    from bench.system.common import cpu_seconds

    out = Measured()
    request = submit_request()
    payload = work_payload()
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await js.add_stream(
        api.StreamConfig(
            name="BENCH",
            subjects=["bench.>"],
            retention=api.RetentionPolicy.WORK_QUEUE,
            storage=api.StorageType.FILE,
        )
    )

    async def purge() -> None:
        for stream in ("WORK", "KV_jobs", "BENCH", echo_server.PUBLISH_STREAM):
            await js.purge_stream(stream)

    try:
        async with (
            grpc.aio.insecure_channel(gateway.address) as gateway_channel,
            grpc.aio.insecure_channel(echo.address) as echo_channel,
            grpc.aio.insecure_channel(echo_publish.address) as echo_publish_channel,
        ):
            stub = job_service_pb2_grpc.JobServiceStub(gateway_channel)
            echo_call = echo_channel.unary_unary(echo_server.METHOD)
            ping = os.urandom(1024)
            await stub.SubmitJob(request)  # connects, warms the gateway

            async def submit() -> Any:
                return await stub.SubmitJob(request)

            async def call_echo() -> Any:
                return await echo_call(ping)

            parse_call = echo_channel.unary_unary(
                echo_server.PARSE_METHOD,
                request_serializer=job_service_pb2.SubmitJobRequest.SerializeToString,
                response_deserializer=job_service_pb2.SubmitJobResponse.FromString,
            )

            async def call_parse() -> Any:
                return await parse_call(request)

            echo_publish_call = echo_publish_channel.unary_unary(echo_server.METHOD)

            async def call_echo_publish() -> Any:
                return await echo_publish_call(ping)

            async def cpu_per_call(child: Child, run: Callable[[], Awaitable[Window]]) -> tuple[Window, float]:
                used = child.cpu_seconds()
                window = await run()
                return window, (child.cpu_seconds() - used) / max(window.total, 1) * 1e6

            for run in range(1, sizes.runs + 1):
                log(f"round {run}/{sizes.runs}")
                for concurrency in CONCURRENCY:
                    echo_cpu = echo.cpu_seconds()
                    echo_window = await closed_loop(call_echo, concurrency, sizes)
                    out.echo.setdefault(concurrency, []).append(echo_window)
                    if concurrency == CONCURRENCY[-1]:
                        out.parse.append(await closed_loop(call_parse, concurrency, sizes))
                    if concurrency == CONCURRENCY[-1]:
                        used = echo.cpu_seconds() - echo_cpu
                        out.echo_cpu_us_per_call.append(used / max(echo_window.total, 1) * 1e6)
                    before = gateway.cpu_seconds(), cpu_seconds(nats_pid)
                    window = await closed_loop(submit, concurrency, sizes)
                    out.submit.setdefault(concurrency, []).append(window)
                    if concurrency == CONCURRENCY[-1]:
                        jobs = max(window.total, 1)
                        out.gateway_cpu_us_per_job.append((gateway.cpu_seconds() - before[0]) / jobs * 1e6)
                        out.nats_cpu_us_per_job.append((cpu_seconds(nats_pid) - before[1]) / jobs * 1e6)
                    log(
                        f"  c={concurrency:<4} SubmitJob {window.rate:7.0f}/s p50 {window.p50:6.2f} p99 "
                        f"{window.p99:6.2f} ms (errors {window.errors}); echo {out.echo[concurrency][-1].rate:7.0f}/s"
                    )
                    await purge()
                window, cpu = await cpu_per_call(
                    echo_publish, lambda: closed_loop(call_echo_publish, CONCURRENCY[-1], sizes)
                )
                out.echo_publish.append(window)
                out.echo_publish_cpu_us_per_call.append(cpu)
                _, cpu = await cpu_per_call(echo, lambda: open_loop(call_echo, LIGHT_RATE, sizes))
                out.light_echo_cpu_us.append(cpu)
                _, cpu = await cpu_per_call(gateway, lambda: open_loop(submit, LIGHT_RATE, sizes))
                out.light_submit_cpu_us.append(cpu)
                await purge()
                log(
                    f"  echo + one JetStream publish, c={CONCURRENCY[-1]}: {out.echo_publish[-1].rate:.0f}/s; at "
                    f"{LIGHT_RATE}/s paced: echo {out.light_echo_cpu_us[-1]:.0f} µs, SubmitJob "
                    f"{out.light_submit_cpu_us[-1]:.0f} µs of server CPU per call"
                )
                out.echo_stream.append(await echo_stream_window(echo_channel, 1, sizes))
                log(f"  echo stream x1: {out.echo_stream[-1].rate:7.0f}/s")
                if not out.stream_unavailable:
                    for streams in sizes.streams:
                        try:
                            window = await stream_window(stub, streams, sizes)
                        except StreamUnavailable as exc:
                            out.stream_unavailable = exc.args[0] if exc.args else "UNIMPLEMENTED"
                            log(f"  SubmitJobs: not available ({out.stream_unavailable})")
                            break
                        out.stream.setdefault(streams, []).append(window)
                        log(f"  SubmitJobs x{streams}: {window.rate:7.0f}/s (errors {window.errors})")
                        await purge()
                    out.grouped.append(await grouped_stream_window(stub, sizes))
                    log(
                        f"  SubmitJobs, {JOBS_PER_MESSAGE} jobs per message: {out.grouped[-1].rate:7.0f}/s "
                        f"(errors {out.grouped[-1].errors})"
                    )
                    await purge()
                for mode in ("one", "window", "async"):
                    rate = await nats_window(js, mode, payload, sizes)
                    out.nats.setdefault(mode, []).append(rate)
                    await purge()
                log("  NATS publish " + ", ".join(f"{m} {v[-1]:.0f}/s" for m, v in out.nats.items()))
                if redis is not None:
                    url = _redis_url(redis)
                    out.celery.append(await asyncio.to_thread(celery_enqueue_rate, url, sizes, tracked=False))
                    out.celery_tracked.append(await asyncio.to_thread(celery_enqueue_rate, url, sizes, tracked=True))
                    log(
                        f"  Celery apply_async {out.celery[-1]:.0f}/s fire and forget, "
                        f"{out.celery_tracked[-1]:.0f}/s result tracked"
                    )
            best = max(summarize([w.rate for w in windows])["value"] for windows in out.submit.values())
            out.half_load_rate = best / 2
            log(f"open loop at {out.half_load_rate:.0f}/s (half of {best:.0f}/s)")
            for _ in range(sizes.runs):
                out.half_load.append(await open_loop(submit, out.half_load_rate, sizes))
                log(f"  p50 {out.half_load[-1].p50:.2f} p99 {out.half_load[-1].p99:.2f} ms")
                await purge()
    finally:
        await nc.close()
    return out


async def profiled_window(gateway: Child, sizes: Sizes) -> None:
    request = submit_request()
    async with grpc.aio.insecure_channel(gateway.address) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)

        async def submit() -> Any:
            return await stub.SubmitJob(request)

        window = await closed_loop(submit, CONCURRENCY[-1], Sizes(1, max(sizes.window_s, 2.0), sizes.warmup_s, ()))
        log(f"  under py-spy: {window.rate:.0f}/s")


def _redis_url(redis: Child) -> str:
    return f"redis://127.0.0.1:{redis.port}/0"


# --- report ----------------------------------------------------------------------------------


def report(out: Measured, sizes: Sizes, quick: bool) -> None:
    rows: list[dict[str, Any]] = []
    for c, windows in out.submit.items():
        rows.append(row(f"SubmitJob, {c} clients: accepted", [w.rate for w in windows], "jobs/s"))
        rows.append(row(f"SubmitJob, {c} clients: p50", [w.p50 for w in windows], "ms"))
        rows.append(row(f"SubmitJob, {c} clients: p99", [w.p99 for w in windows], "ms"))
    for c, windows in out.echo.items():
        rows.append(row(f"trivial grpc.aio call, {c} clients", [w.rate for w in windows], "calls/s", "the ceiling"))
    for s, windows in out.stream.items():
        rows.append(row(f"SubmitJobs, {s} stream(s): accepted", [w.rate for w in windows], "jobs/s"))
        rows.append(row(f"SubmitJobs, {s} stream(s): p99 per item", [w.p99 for w in windows], "ms"))
    if out.grouped:
        rows.append(
            row(
                f"SubmitJobs, 1 stream, {JOBS_PER_MESSAGE} jobs per message: accepted",
                [w.rate for w in out.grouped],
                "jobs/s",
            )
        )
        rows.append(
            row(f"SubmitJobs, {JOBS_PER_MESSAGE} jobs per message: p99 per message", [w.p99 for w in out.grouped], "ms")
        )
    if out.stream_unavailable:
        rows.append(row("SubmitJobs stream", [], "jobs/s", f"not available: {out.stream_unavailable}"))
    rows.append(
        row(
            f"trivial grpc.aio bidi stream, 1 stream, {STREAM_WINDOW} unanswered at most",
            [w.rate for w in out.echo_stream],
            "msgs/s",
            "the ceiling for a per-message stream",
        )
    )
    names = {
        "one": "raw JetStream publish, one at a time with ack",
        "window": f"raw JetStream publish, gather windows of {NATS_WINDOW}",
        "async": "raw JetStream publish_async",
    }
    for mode, rates in out.nats.items():
        rows.append(row(names[mode], rates, "msgs/s", "the broker's limit for a Python client"))
    if out.celery:
        rows.append(
            row(
                "Celery 5 apply_async(ignore_result=True), Redis broker, one loop",
                out.celery,
                "tasks/s",
                "Celery's enqueue rate in the ratios",
            )
        )
        rows.append(row("Celery 5 apply_async, result tracked (Redis backend)", out.celery_tracked, "tasks/s"))
    else:
        rows.append(row("Celery 5 apply_async", [], "tasks/s", out.celery_unavailable or "not measured"))
    rows.append(
        row(
            f"SubmitJob at half the max load ({out.half_load_rate:.0f}/s, open loop): p50",
            [w.p50 for w in out.half_load],
            "ms",
        )
    )
    rows.append(row("SubmitJob at half the max load: p99", [w.p99 for w in out.half_load], "ms"))
    rows.append(
        row("SubmitJob at half the max load: errors", [float(w.errors) for w in out.half_load], "calls", "should be 0")
    )
    rows.append(row("gateway CPU per accepted job (128 clients)", out.gateway_cpu_us_per_job, "µs"))
    rows.append(row("nats-server CPU per accepted job (128 clients)", out.nats_cpu_us_per_job, "µs"))
    rows.append(row("trivial gRPC server CPU per call (128 clients)", out.echo_cpu_us_per_call, "µs"))
    rows.append(
        row(
            f"trivial call + one JetStream publish, {CONCURRENCY[-1]} clients",
            [w.rate for w in out.echo_publish],
            "calls/s",
            "the least a gRPC front end that makes a request durable can do",
        )
    )
    rows.append(
        row(
            f"trivial call + one JetStream publish: server CPU per call ({CONCURRENCY[-1]} clients)",
            out.echo_publish_cpu_us_per_call,
            "µs",
        )
    )
    rows.append(row(f"trivial gRPC server CPU per call at {LIGHT_RATE} calls/s", out.light_echo_cpu_us, "µs"))
    rows.append(row(f"gateway CPU per SubmitJob at {LIGHT_RATE} jobs/s", out.light_submit_cpu_us, "µs"))

    def med(values: list[float]) -> float:
        return float(summarize(values)["value"])

    top = CONCURRENCY[-1]
    submit_top = med([w.rate for w in out.submit[top]])
    echo_top = med([w.rate for w in out.echo[top]])
    celery = med(out.celery)
    stream_best = max((med([w.rate for w in ws]) for ws in out.stream.values()), default=math.nan)
    p99_half = med([w.p99 for w in out.half_load])

    def met(value: float, ok: bool) -> bool | None:
        return None if math.isnan(value) else ok

    vs_echo = submit_top / echo_top
    vs_celery = submit_top / celery
    stream_vs_celery = stream_best / celery
    grouped = med([w.rate for w in out.grouped])
    grouped_vs_celery = grouped / celery
    vs_parse = submit_top / med([w.rate for w in out.parse])
    rows.append(
        row(
            f"trivial grpc.aio call parsing the same SubmitJobRequest, {top} clients",
            [w.rate for w in out.parse],
            "calls/s",
            "issue 14's unary reference",
        )
    )
    ratios = [
        ratio(
            f"unary SubmitJob / a trivial grpc.aio server parsing the same request, {top} clients",
            vs_parse,
            "≥ 0.45",
            met(vs_parse, vs_parse >= 0.45),
        ),
        ratio(
            f"SubmitJobs, {JOBS_PER_MESSAGE} jobs per message, accepted jobs/s (not a ratio)",
            grouped,
            "≥ 5,000",
            met(grouped, grouped >= 5000),
        ),
        ratio(
            f"SubmitJobs, {JOBS_PER_MESSAGE} jobs per message / Celery apply_async",
            grouped_vs_celery,
            "≥ 3",
            met(grouped_vs_celery, grouped_vs_celery >= 3),
        ),
        ratio(f"unary SubmitJob / trivial gRPC call, {top} clients", vs_echo, "≥ 0.70", met(vs_echo, vs_echo >= 0.7)),
        ratio(f"unary SubmitJob ({top} clients) / Celery apply_async", vs_celery, "> 1", met(vs_celery, vs_celery > 1)),
        ratio(
            "SubmitJobs stream (best) / Celery apply_async",
            stream_vs_celery,
            "≥ 3" + ("" if not out.stream_unavailable else " (stream not available)"),
            met(stream_vs_celery, stream_vs_celery >= 3),
        ),
        ratio(
            "SubmitJob p99 at half the max load, ms (not a ratio)", p99_half, "< 10 ms", met(p99_half, p99_half < 10)
        ),
        ratio(
            "gateway CPU per accepted job / trivial gRPC server CPU per call",
            med(out.gateway_cpu_us_per_job) / med(out.echo_cpu_us_per_call),
            "for reference (less sensitive to a busy machine than rates)",
            None,
        ),
        ratio(
            "trivial echo stream (1 stream) / Celery apply_async",
            med([w.rate for w in out.echo_stream]) / celery,
            "for reference: the most the stream ratio could be here, with no work per message",
            None,
        ),
        ratio(
            f"trivial call + one JetStream publish / trivial call, {top} clients",
            med([w.rate for w in out.echo_publish]) / echo_top,
            "for reference: the ceiling of the first ratio with one write instead of SubmitJob's two",
            None,
        ),
        ratio(
            f"unary SubmitJob ({top} clients) / raw publish one at a time",
            submit_top / med(out.nats.get("one", [])),
            "for reference",
            None,
        ),
    ]
    notes = [
        f"Each figure is the median of {sizes.runs} run(s) of {sizes.window_s:g} s after {sizes.warmup_s:g} s "
        "of warm-up; setups interleaved round by round. One client process (grpc.aio on uvloop, one channel per "
        "server) shares the 2 cores with the servers, as in the references measured before the project. "
        "Celery's enqueue rate in the ratios is its faster mode (ignore_result=True).",
        "The open-loop latency wakes idle processes for each request, so on a busy machine it includes CPU "
        "run-queue delays that closed-loop figures hide: read it from a run on an otherwise idle machine.",
        "A SubmitJob is two JetStream round trips (publish the work message with a Nats-Msg-Id, then create "
        "the record in the jobs KV bucket) plus validation and one gRPC call: at best it costs about what a trivial "
        "call costs plus two publishes one at a time.",
        f"Gateway CPU per accepted job at {top} clients: {med(out.gateway_cpu_us_per_job):.0f} µs; nats-server: "
        f"{med(out.nats_cpu_us_per_job):.0f} µs; the trivial gRPC server: {med(out.echo_cpu_us_per_call):.0f} µs per "
        "call. On 2 cores shared by the client, the gateway and nats-server, these CPU costs set the rates.",
        f"What bounds the first ratio: the same trivial server awaiting one JetStream publish per call (nats-py "
        f"js.publish, no code of its own) reaches {med([w.rate for w in out.echo_publish]):.0f} calls/s at {top} "
        f"clients, {med([w.rate for w in out.echo_publish]) / echo_top:.2f} of the trivial call, at "
        f"{med(out.echo_publish_cpu_us_per_call):.0f} µs of server CPU per call; a SubmitJob makes two such writes "
        "(work message, record) and validates, converts and answers the job.",
        f"What bounds the stream ratio: a trivial grpc.aio bidi stream that answers each 1 KB message with 2 bytes "
        f"carries {med([w.rate for w in out.echo_stream]):.0f} messages/s with the same window "
        f"({med([w.rate for w in out.echo_stream]) / celery:.2f}x Celery's enqueue rate): each message read and "
        "each answer written is a gRPC completion handed from the core's thread to the event loop.",
        f"At a light load ({LIGHT_RATE} calls/s, paced) a grpc.aio server wakes up for every call: the trivial "
        f"server spends {med(out.light_echo_cpu_us):.0f} µs of CPU per call there against "
        f"{med(out.echo_cpu_us_per_call):.0f} µs at {top} clients, and the gateway {med(out.light_submit_cpu_us):.0f} "
        "µs per SubmitJob (each NATS round trip is one more wake-up). On 2 shared cores this per-wake-up cost, not "
        "the network, sets light-load latency.",
    ]
    if out.profile is not None and out.profile[0]:
        total, own, inclusive = out.profile
        generic = ("_run_module_as_main", "_run_code", "main (", "<module>", "Runner.run", "_run (", "Thread.")
        notes.append(
            f"Profile of the gateway at {top} clients (py-spy, {total} samples of its active threads); top self time: "
            + "; ".join(f"{f} {share:.0%}" for f, share in own[:10])
        )
        shown = [(f, share) for f, share in inclusive if not f.startswith(generic)][:12]
        notes.append("gateway: top inclusive time: " + "; ".join(f"{f} {share:.0%}" for f, share in shown))
        notes.append(
            "py-spy without --native cannot see C frames: uvloop, the gRPC core and system calls show as self time "
            "of Runner.run or of their Python caller (StreamWriter.writelines: socket writes)."
        )
    if out.stream_unavailable:
        notes.append(f"SubmitJobs: the gateway answered UNIMPLEMENTED ({out.stream_unavailable}); not available.")
    plots = [plot_throughput(out), plot_cdf(out)]
    write_results(
        SECTION,
        "Submission: accepted jobs per second and SubmitJob latency",
        rows,
        ratios,
        notes,
        plots=plots,
        quick=quick,
    )


def plot_throughput(out: Measured) -> Any:
    plt = matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = list(CONCURRENCY)

    def med(values: list[float]) -> float:
        return float(summarize(values)["value"])

    ax.plot(xs, [med([w.rate for w in out.submit[c]]) for c in xs], "o-", label="SubmitJob (unary)")
    ax.plot(xs, [med([w.rate for w in out.echo[c]]) for c in xs], "s--", label="trivial grpc.aio call (ceiling)")
    if out.stream:
        streams = sorted(out.stream)
        ax.plot(streams, [med([w.rate for w in out.stream[s]]) for s in streams], "^-", label="SubmitJobs (x streams)")
    styles = {"one": ":", "window": "-.", "async": "--"}
    names = {"one": "raw publish, one at a time", "window": "raw publish, windows of 256", "async": "publish_async"}
    for mode, rates in out.nats.items():
        ax.axhline(med(rates), linestyle=styles[mode], color="grey", label=names[mode])
    if out.celery:
        ax.axhline(med(out.celery), color="tab:red", linestyle="-", label="Celery apply_async (ignore_result)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent clients (streams for SubmitJobs)")
    ax.set_ylabel("accepted per second")
    ax.set_title("Submission throughput vs concurrency")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    path = plot_path(SECTION, "throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_cdf(out: Measured) -> Any:
    plt = matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))

    def cdf(latencies: list[float], label: str, style: str = "-") -> None:
        if latencies:
            values = np.sort(np.asarray(latencies))
            ax.plot(values, np.arange(1, len(values) + 1) / len(values), style, label=label)

    for c, windows in out.submit.items():
        cdf([v for w in windows for v in w.latencies_ms], f"SubmitJob, {c} clients (closed loop)")
    cdf([v for w in out.half_load for v in w.latencies_ms], "SubmitJob at half max load (open loop)", "--")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("SubmitJob latency CDF")
    ax.axvline(10, color="grey", linestyle=":", label="10 ms")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    path = plot_path(SECTION, "latency_cdf")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny windows, 1 run (for development)")
    parser.add_argument("--no-profile", action="store_true", help="skip the py-spy window")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    with ProcessGroup() as group:
        nats_server = group.nats()
        gateway = group.service("gateway", bench_config(nats_server.url))
        echo_port = free_port()
        echo = group.command(
            "echo",
            [PYTHON, "-m", "bench.system.echo_server", str(echo_port)],
            ready=lambda c: port_open(c.port),
            port=echo_port,
        )
        echo_publish_port = free_port()
        echo_publish = group.command(
            "echo-publish",
            [PYTHON, "-m", "bench.system.echo_server", str(echo_publish_port), nats_server.url],
            ready=lambda c: port_open(c.port),
            port=echo_publish_port,
        )
        redis: Child | None = None
        unavailable = ""
        try:
            import celery  # noqa: F401  (the bench extra)

            redis = group.redis()
        except ImportError:
            unavailable = "not available: celery is not installed (pip install -e '.[bench]')"
            log(unavailable)
        except RuntimeError as exc:
            unavailable = f"not available: {exc} ({REDIS_INSTALL_HINT})"
            log(unavailable)
        assert nats_server.process is not None
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            out = runner.run(
                measure(sizes, nats_server.url, gateway, nats_server.process.pid, echo, echo_publish, redis)
            )
            out.celery_unavailable = unavailable
            if not args.no_profile:
                log(f"profiling: the gateway under py-spy, {CONCURRENCY[-1]} clients (not a figure)")
                group.stop(gateway)
                profile_path = group.tmp / "gateway-profile.txt"
                profiled = group.service("gateway", bench_config(nats_server.url), profile_path=profile_path)
                runner.run(profiled_window(profiled, sizes))
                group.stop(profiled, timeout_s=30)
                if profile_path.exists():
                    out.profile = top_functions(profile_path, count=30)
    report(out, sizes, args.quick)
    log(f"wrote bench/results/{SECTION}.md")


if __name__ == "__main__":
    main()
