"""WatchJob fan-out at scale: memory per watcher and the delay from a state change to each
watcher's message, with N concurrent WatchJob streams on one gateway process.

    .venv/bin/python bench/watch_bench.py [--watchers 2000 10000] [--per-job 10]

A nats-server and `asyncinfer gateway --config FILE` run as their own processes (so the gateway's
VmRSS is its own). The bench writes job records straight into the jobs bucket (as the scheduler
would, with asyncinfer.job_store), so only the gateway's fan-out is measured: no scheduler and no
batcher run. Watchers live in WORKERS client processes, spread over a few channels each.

For each N: the gateway's RSS before and with N watchers (the difference over N is the memory
per watcher), then two rounds of changes with the delay from the KV write (the writer's clock
just before the write) to each watcher's receipt of that revision (same machine, same clock):
  - paced: each job QUEUED -> RUNNING, RATE jobs a second (a steady feed);
  - burst: every job RUNNING -> SUCCEEDED at once (the feed's worst case).
Prints a markdown table and writes it to bench/results/watch.md. Figures are reported, never
asserted; the machine is shared, so read them beside the load average printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc

from asyncinfer.config import Config, render_default_config
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.ids import new_job_id
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobRecord, JobState, Priority
from asyncinfer.nats.connection import connect
from asyncinfer.nats.kv import open_kv_bucket
from asyncinfer.v1 import job_service_pb2, job_service_pb2_grpc

RESULTS = Path(__file__).parent / "results" / "watch.md"
BIN = Path(sys.executable).parent
WORKERS = 2
CHANNELS_PER_WORKER = 4
# New calls opened at once per worker: grpc's server core cancels calls beyond 1000 waiting for
# the application to take them up (grpc.server.max_pending_requests), see tests/test_watch_scale.py.
WAVE = 250
PACED_RATE = 200.0
WARM_UP_JOBS = 10  # jobs changed a second in the paced round
TENANT = "default"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def watchers_gauge(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("asyncinfer_watchers "):
                return float(line.split()[1])
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- the watcher processes ---------------------------------------------------------------------


def watcher_process(port: int, job_ids: list[str], per_job: int, conn: Connection) -> None:
    """Opens len(job_ids) * per_job watches, says when all are open, then records every message
    (job_id, revision, receipt time) until every stream ended, and sends them back."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    conn.send(asyncio.run(_watch_all(port, job_ids, per_job, conn)))
    conn.close()


async def _watch_all(port: int, job_ids: list[str], per_job: int, conn: Connection) -> dict[str, Any]:
    options = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(CHANNELS_PER_WORKER)]
    stubs = [job_service_pb2_grpc.JobServiceStub(channel) for channel in channels]
    received: list[tuple[str, int, float]] = []
    errors: list[str] = []
    opened = 0

    async def watch(stub: Any, job_id: str, first: asyncio.Event) -> None:
        nonlocal opened
        try:
            async for response in stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job_id)):
                received.append((job_id, response.job.revision, time.time()))
                if not first.is_set():
                    opened += 1
                    first.set()
        except grpc.aio.AioRpcError as exc:
            errors.append(f"{exc.code().name}: {exc.details()}")
        finally:
            first.set()

    targets = [job_ids[i % len(job_ids)] for i in range(len(job_ids) * per_job)]
    tasks: list[asyncio.Task[None]] = []
    started = time.monotonic()
    for start in range(0, len(targets), WAVE):
        firsts = []
        for i, job_id in enumerate(targets[start : start + WAVE], start):
            first = asyncio.Event()
            firsts.append(first)
            tasks.append(asyncio.create_task(watch(stubs[i % len(stubs)], job_id, first)))
        await asyncio.gather(*(f.wait() for f in firsts))
    conn.send({"opened": opened, "open_s": time.monotonic() - started, "errors": list(errors)})
    received.clear()  # the first (current) records are not changes
    await asyncio.gather(*tasks)
    for channel in channels:
        await channel.close()
    return {"received": received, "errors": errors}


# --- the bench ---------------------------------------------------------------------------------


@dataclass
class Round:
    name: str
    delays_ms: list[float]
    expected: int


@dataclass
class Outcome:
    watchers: int
    jobs: int
    open_s: float
    rss_before: int
    rss_with: int
    rss_after: int
    gauge_with: float
    gauge_after: float
    rounds: list[Round]
    errors: list[str]

    @property
    def per_watcher_bytes(self) -> float:
        return (self.rss_with - self.rss_before) / self.watchers


async def make_jobs(store: JobStore, count: int) -> list[JobRecord]:
    now = time.time()
    records = [
        JobRecord(
            job_id=new_job_id(),
            tenant=TENANT,
            model_name="demo",
            model_version="1",
            state=JobState.QUEUED,
            priority=Priority.NORMAL,
            create_time=now,
            update_time=now,
            max_attempts=3,
            result_retention_s=3600.0,
        )
        for _ in range(count)
    ]
    return list(await asyncio.gather(*(store.create(r) for r in records)))


async def change_all(
    store: JobStore, records: list[JobRecord], *, rate: float | None, **changes: Any
) -> tuple[list[JobRecord], dict[tuple[str, int], float]]:
    """Each record changed (compare-and-set), at `rate` a second or all at once; the write time of
    each new revision."""
    written: dict[tuple[str, int], float] = {}

    async def change(record: JobRecord) -> JobRecord:
        at = time.time()
        new = await store.replace(record.evolve(update_time=at, **changes))
        written[(new.job_id, new.revision)] = at
        return new

    if rate is None:
        return list(await asyncio.gather(*(change(r) for r in records))), written
    changed: list[asyncio.Task[JobRecord]] = []
    started = time.monotonic()
    for i, record in enumerate(records):
        await asyncio.sleep(max(started + i / rate - time.monotonic(), 0))
        changed.append(asyncio.create_task(change(record)))
    return list(await asyncio.gather(*changed)), written


def start_gateway(config: Config, tmp: Path) -> tuple[subprocess.Popen[str], int, int]:
    port, metrics_port = free_port(), free_port()
    config = config.replace(gateway={"port": port, "metrics_port": metrics_port}, logging={"level": "warning"})
    path = tmp / "gateway.toml"
    path.write_text(render_default_config(config))
    log = open(tmp / "gateway.log", "w")  # noqa: SIM115 - the child holds it; closed below
    process = subprocess.Popen(
        [str(BIN / "asyncinfer"), "gateway", "--config", str(path)], stdout=subprocess.PIPE, stderr=log, text=True
    )
    log.close()
    assert process.stdout is not None
    line = process.stdout.readline()
    if f"serving on 127.0.0.1:{port}" not in line:
        process.kill()
        raise RuntimeError(f"the gateway did not start: {line!r}\n{(tmp / 'gateway.log').read_text()[-2000:]}")
    return process, port, metrics_port


async def measure(watchers: int, per_job: int, config: Config, tmp: Path) -> Outcome:
    jobs = max(watchers // per_job, 1)
    gateway, port, metrics_port = start_gateway(config, tmp)
    nc = await connect(config.nats, name="watch-bench")
    try:
        store = JobStore(
            await open_kv_bucket(nc.jetstream(), config.nats.jobs_bucket), work_stream=config.nats.work_stream
        )
        warm_up, records = await make_jobs(store, WARM_UP_JOBS), await make_jobs(store, jobs)

        # A few watches opened and run to the end first, so that lazily built state is not counted.
        async def end_warm_up() -> None:
            await change_all(store, warm_up, rate=None, state=JobState.SUCCEEDED)

        await run_watchers(port, [r.job_id for r in warm_up], per_job, end_warm_up)
        await asyncio.sleep(1.0)
        rss_before = rss_bytes(gateway.pid)
        rss_with, gauge_with = 0, 0.0
        paced: dict[tuple[str, int], float] = {}
        burst: dict[tuple[str, int], float] = {}

        async def changes() -> None:
            nonlocal rss_with, gauge_with
            await asyncio.sleep(1.0)  # let the gateway settle with every watch open
            rss_with, gauge_with = rss_bytes(gateway.pid), watchers_gauge(metrics_port)
            running, written = await change_all(store, records, rate=PACED_RATE, state=JobState.RUNNING, attempt=1)
            paced.update(written)
            await asyncio.sleep(1.0)
            _, written = await change_all(store, running, rate=None, state=JobState.SUCCEEDED, end_time=time.time())
            burst.update(written)

        result = await run_watchers(port, [r.job_id for r in records], per_job, changes)
        rounds = [Round("paced", [], len(paced) * per_job), Round("burst", [], len(burst) * per_job)]
        for job_id, revision, at in result["received"]:
            for round_, written in zip(rounds, (paced, burst), strict=True):
                if (job_id, revision) in written:
                    round_.delays_ms.append((at - written[(job_id, revision)]) * 1000)
        await asyncio.sleep(1.0)
        return Outcome(
            watchers=jobs * per_job,
            jobs=jobs,
            open_s=result["open_s"],
            rss_before=rss_before,
            rss_with=rss_with,
            rss_after=rss_bytes(gateway.pid),
            gauge_with=gauge_with,
            gauge_after=watchers_gauge(metrics_port),
            rounds=rounds,
            errors=result["errors"],
        )
    finally:
        await nc.close()
        gateway.terminate()
        try:
            gateway.wait(timeout=15)
        except subprocess.TimeoutExpired:
            gateway.kill()
            gateway.wait()
        if gateway.stdout is not None:
            gateway.stdout.close()


async def run_watchers(port: int, job_ids: list[str], per_job: int, changes: Any) -> dict[str, Any]:
    """Runs the watcher processes; once every watch is open, awaits `changes()` (which must end
    every job); returns what the watchers received."""
    context = multiprocessing.get_context("spawn")
    shares = [job_ids[i::WORKERS] for i in range(WORKERS)]
    pipes, processes = [], []
    for share in shares:
        ours, theirs = context.Pipe()
        process = context.Process(target=watcher_process, args=(port, share, per_job, theirs), daemon=True)
        process.start()
        theirs.close()
        pipes.append(ours)
        processes.append(process)
    loop = asyncio.get_running_loop()
    ready = await asyncio.gather(*(loop.run_in_executor(None, pipe.recv) for pipe in pipes))
    errors = [e for r in ready for e in r["errors"]]
    if sum(r["opened"] for r in ready) != len(job_ids) * per_job:
        raise RuntimeError(f"not every watch opened: {errors[:5]}")
    await changes()
    done = await asyncio.gather(*(loop.run_in_executor(None, pipe.recv) for pipe in pipes))
    for process in processes:
        process.join(timeout=30)
    return {
        "received": [m for d in done for m in d["received"]],
        "errors": errors + [e for d in done for e in d["errors"]],
        "open_s": max(r["open_s"] for r in ready),
    }


def table(outcomes: list[Outcome]) -> str:
    mib = 1024 * 1024
    lines = [
        "| watchers | jobs | open all (s) | gateway RSS before (MiB) | with watchers (MiB) | per watcher (KiB) "
        "| after (MiB) | watchers gauge with / after | round | messages | delay p50 (ms) | p99 (ms) | max (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for o in outcomes:
        for i, r in enumerate(o.rounds):
            head = (
                f"| {o.watchers} | {o.jobs} | {o.open_s:.1f} | {o.rss_before / mib:.1f} | {o.rss_with / mib:.1f} "
                f"| {o.per_watcher_bytes / 1024:.1f} | {o.rss_after / mib:.1f} | {o.gauge_with:.0f} / {o.gauge_after:.0f} "
                if i == 0
                else "| | | | | | | | "
            )
            got = len(r.delays_ms)
            stats = (
                f"{statistics.median(r.delays_ms):.1f} | {percentile(r.delays_ms, 0.99):.1f} | {max(r.delays_ms):.1f}"
                if got
                else "- | - | -"
            )
            lines.append(f"{head}| {r.name} | {got} of {r.expected} | {stats} |")
    return "\n".join(lines)


async def main(watcher_counts: list[int], per_job: int) -> None:
    load_before = os.getloadavg()
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        with NatsServerProcess(store_dir=tmp / "nats", log_file=tmp / "nats.log") as nats:
            config = Config().replace(nats={"url": nats.url})
            for count in watcher_counts:
                started = time.monotonic()
                outcome = await measure(count, per_job, config, tmp)
                outcomes.append(outcome)
                print(f"{count} watchers: done in {time.monotonic() - started:.0f} s", flush=True)
                for error in sorted(set(outcome.errors))[:5]:
                    print(f"  watcher error: {error}", flush=True)
    report = "\n".join(
        [
            "# WatchJob fan-out",
            "",
            "Written by `bench/watch_bench.py` (`make bench-watch`). One gateway process (`asyncinfer gateway`), "
            f"{WORKERS} client processes with {CHANNELS_PER_WORKER} channels each, {per_job} watchers per job; the "
            "bench writes the record changes into the jobs bucket itself (no scheduler or batcher), so only the "
            "gateway's fan-out is measured. Per watcher = (RSS with watchers - RSS before) / watchers. Delay = "
            "watcher's receipt - the KV write's start (one clock). Paced: jobs go QUEUED -> RUNNING at "
            f"{PACED_RATE:.0f} jobs/s ({PACED_RATE * per_job:.0f} messages/s); burst: every job RUNNING -> SUCCEEDED "
            "at once.",
            "",
            table(outcomes),
            "",
            f"Machine: {os.cpu_count()} cores, {platform.platform()}; python {platform.python_version()}, "
            f"grpcio {grpc.__version__}; load average before {[round(x, 1) for x in load_before]}, "
            f"after {[round(x, 1) for x in os.getloadavg()]}.",
            "",
        ]
    )
    print(report)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(report)
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--watchers", type=int, nargs="+", default=[2000, 10000])
    parser.add_argument("--per-job", type=int, default=10)
    args = parser.parse_args()
    asyncio.run(main(args.watchers, args.per_job))
