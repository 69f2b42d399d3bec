"""A/B of SubmitJobs with many jobs per message (the submission section's bulk case: one stream,
100 jobs per message, 512 jobs unanswered at most), two revisions' gateways side by side on one
nats-server, rounds interleaved (the order alternating) so that a busy moment spreads over both.

    .venv/bin/python -m bench.system.bulk_ab A_TREE B_TREE [--rounds 3] [--window-s 3] [--strace]

A_TREE and B_TREE are worktrees (or checkouts) of the two revisions; their gateways run from
there, sharing this checkout's virtual environment and benchmark code. Per window: accepted
jobs/s and the gateway's CPU per accepted job; with --celery, Celery's apply_async loop in the same
rounds (the issue's reference); with --strace, afterwards, the gateway's write syscalls per job
over a fixed burst of each (strace -f -c on the gateway, counts, not times). Writes
bench/results/bulk_ab.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
from pathlib import Path
from typing import Any

import grpc
import nats
import uvloop

from asyncinfer.v1 import job_service_pb2, job_service_pb2_grpc
from bench.system.common import Child, ProcessGroup, bench_config, log, ratio, row, summarize, write_results
from bench.system.submission import (
    JOBS_PER_MESSAGE,
    STREAM_WINDOW,
    Sizes,
    celery_enqueue_rate,
    grouped_stream_window,
    submit_request,
)

SECTION = "bulk_ab"
STRACE_MESSAGES = 100  # messages of JOBS_PER_MESSAGE jobs in the strace burst
WRITE_CALLS = ("writev", "write", "sendmsg", "sendto")


async def burst(stub: Any, messages: int) -> int:
    """`messages` messages on one stream, STREAM_WINDOW jobs unanswered at most; accepted jobs."""
    batch = job_service_pb2.SubmitJobsRequest(
        items=[
            job_service_pb2.SubmitJobsItem(job=submit_request(), correlation_id=str(i)) for i in range(JOBS_PER_MESSAGE)
        ]
    )
    room = asyncio.Semaphore(max(STREAM_WINDOW // JOBS_PER_MESSAGE, 1))
    call = stub.SubmitJobs()
    accepted = 0

    async def write() -> None:
        for _ in range(messages):
            await room.acquire()
            await call.write(batch)
        await call.done_writing()

    async def read() -> None:
        nonlocal accepted
        async for answer in call:
            room.release()
            accepted += sum(1 for a in answer.answers if not a.HasField("error"))

    async with asyncio.TaskGroup() as group:
        group.create_task(write())
        group.create_task(read())
    return accepted


def strace_counts(path: Path) -> dict[str, int]:
    """Calls per syscall from `strace -c` output."""
    counts: dict[str, int] = {}
    for line in path.read_text().splitlines():
        match = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$", line)
        if match:
            counts[match.group(2)] = int(match.group(1))
    return counts


async def measure(
    gateways: dict[str, Child], nats_url: str, sizes: Sizes, rounds: int, celery_broker: str | None, strace: bool
) -> tuple[dict[str, list[float]], dict[str, list[float]], list[float], dict[str, dict[str, float]]]:
    rates: dict[str, list[float]] = {name: [] for name in gateways}
    cpu_us: dict[str, list[float]] = {name: [] for name in gateways}
    celery: list[float] = []
    syscalls: dict[str, dict[str, float]] = {}
    nc = await nats.connect(nats_url)
    js = nc.jetstream()

    async def purge() -> None:
        await js.purge_stream("WORK")

    try:
        async with contextlib.AsyncExitStack() as stack:
            stubs = {}
            for name, gateway in gateways.items():
                channel = await stack.enter_async_context(grpc.aio.insecure_channel(gateway.address))
                stubs[name] = job_service_pb2_grpc.JobServiceStub(channel)
                await stubs[name].SubmitJob(submit_request())  # connects, warms the gateway
            names = list(gateways)
            for round_number in range(1, rounds + 1):
                order = names if round_number % 2 else names[::-1]
                for name in order:
                    used = gateways[name].cpu_seconds()
                    window = await grouped_stream_window(stubs[name], sizes)
                    jobs = window.rate * sizes.window_s
                    spent = gateways[name].cpu_seconds() - used
                    rates[name].append(window.rate)
                    # CPU over warm-up and window, per job, taking the warm-up's rate as the window's.
                    cpu_us[name].append(spent / max(jobs, 1) * 1e6 * sizes.window_s / (sizes.window_s + sizes.warmup_s))
                    log(
                        f"round {round_number}, {name}: {window.rate:.0f} accepted jobs/s (errors {window.errors}), "
                        f"gateway ~{cpu_us[name][-1]:.0f} µs CPU/job"
                    )
                    await purge()
                if celery_broker is not None:
                    celery.append(await asyncio.to_thread(celery_enqueue_rate, celery_broker, sizes, tracked=False))
                    log(f"round {round_number}, Celery apply_async: {celery[-1]:.0f}/s")
            if strace:
                for name in names:
                    syscalls[name] = await traced_burst(gateways[name], stubs[name])
                    await purge()
    finally:
        await nc.close()
    return rates, cpu_us, celery, syscalls


async def traced_burst(gateway: Child, stub: Any) -> dict[str, float]:
    out = gateway.log_path.with_suffix(".strace")
    tracer = await asyncio.create_subprocess_exec(
        *("strace", "-f", "-c", "-e", "trace=" + ",".join(WRITE_CALLS), "-p", str(gateway.pid), "-o", str(out)),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert tracer.stderr is not None
    # strace says "Process N attached" (per thread, with -f) once it is tracing.
    attached = await asyncio.wait_for(tracer.stderr.readuntil(b"attached"), 10)
    assert attached
    accepted = await burst(stub, STRACE_MESSAGES)
    tracer.send_signal(signal.SIGINT)
    await asyncio.wait_for(tracer.communicate(), 30)
    counts = strace_counts(out)
    per_job = {call: counts.get(call, 0) / max(accepted, 1) for call in WRITE_CALLS}
    log(f"strace {gateway.name}: {accepted} jobs; per job " + ", ".join(f"{k} {v:.3f}" for k, v in per_job.items()))
    return per_job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # One metavar: argparse's --help fails on a tuple for a positional (ValueError).
    parser.add_argument("trees", nargs=2, type=Path, metavar="TREE", help="the A and the B revision's checkouts")
    parser.add_argument("--names", nargs=2, default=("A", "B"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window-s", type=float, default=3.0)
    parser.add_argument("--celery", action="store_true", help="Celery's apply_async loop each round (needs redis)")
    parser.add_argument("--strace", action="store_true", help="write syscalls per job, after the rounds")
    args = parser.parse_args()
    sizes = Sizes(runs=args.rounds, window_s=args.window_s, warmup_s=0.5, streams=(1,))
    with ProcessGroup() as group:
        nats_server = group.nats()
        gateways = {
            name: group.service(
                "gateway", bench_config(nats_server.url), label=f"gateway-{name}", source=tree.resolve()
            )
            for name, tree in zip(args.names, args.trees, strict=True)
        }
        broker = None
        if args.celery:
            redis = group.redis()
            broker = f"redis://127.0.0.1:{redis.port}/0"
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            rates, cpu_us, celery, syscalls = runner.run(
                measure(gateways, nats_server.url, sizes, args.rounds, broker, args.strace)
            )
    report(args.names, rates, cpu_us, celery, syscalls, sizes)


def report(
    names: list[str],
    rates: dict[str, list[float]],
    cpu_us: dict[str, list[float]],
    celery: list[float],
    syscalls: dict[str, dict[str, float]],
    sizes: Sizes,
) -> None:
    rows = []
    for name in names:
        rows.append(
            row(f"{name}: SubmitJobs, 1 stream, {JOBS_PER_MESSAGE} jobs per message: accepted", rates[name], "jobs/s")
        )
        rows.append(row(f"{name}: gateway CPU per accepted job (estimated)", cpu_us[name], "µs"))
        for call, per_job in syscalls.get(name, {}).items():
            rows.append(row(f"{name}: gateway {call} syscalls per job (strace)", [per_job], "calls"))
    if celery:
        rows.append(row("Celery 5 apply_async(ignore_result=True), Redis broker, one loop", celery, "tasks/s"))

    def med(values: list[float]) -> float:
        return float(summarize(values)["value"])

    a, b = names
    paired = [rb / ra for ra, rb in zip(rates[a], rates[b], strict=True) if ra > 0]
    rows.append(row(f"{b} / {a}, round by round: accepted jobs/s", paired, "x", "each round's own ratio"))
    ratios = [ratio(f"{b} / {a}: accepted jobs/s", med(rates[b]) / med(rates[a]), "for the decision", None)]
    ratios.append(ratio(f"{b}: accepted jobs/s (not a ratio)", med(rates[b]), "≥ 5,000", med(rates[b]) >= 5000))
    if celery:
        for name in names:
            value = med(rates[name]) / med(celery)
            ratios.append(ratio(f"{name} / Celery apply_async", value, "≥ 3", value >= 3))
    notes = [
        f"{sizes.runs} rounds; each round one window per gateway (the order alternating), {sizes.window_s:g} s after "
        f"{sizes.warmup_s:g} s of warm-up, one stream of messages of {JOBS_PER_MESSAGE} jobs, {STREAM_WINDOW} jobs "
        "unanswered at most; both gateways run the whole time on one nats-server (the idle one costs next to "
        "nothing); the WORK stream is purged after each window. No scheduler: jobs stay queued.",
        f"strace: one burst of {STRACE_MESSAGES} messages per gateway after the rounds, `strace -f -c` on the "
        "gateway process (all threads): counts only, strace's own slowdown does not change them.",
    ]
    notes.append(
        "The machine's 2 cores are shared with other work: load average {:.2f} / {:.2f} / {:.2f} at the end of the "
        "run. Rates are counted in whole messages of {} jobs over a {:g} s window (steps of {:.0f} jobs/s).".format(
            *os.getloadavg(), JOBS_PER_MESSAGE, sizes.window_s, JOBS_PER_MESSAGE / sizes.window_s
        )
    )
    write_results(SECTION, f"A/B: SubmitJobs many jobs per message, {a} vs {b}", rows, ratios, notes)
    log(f"wrote bench/results/{SECTION}.md")


if __name__ == "__main__":
    main()
