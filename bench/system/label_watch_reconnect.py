"""Label watches after a gateway restart: N SDK label watches, as a pipeline's workers each watching
their run's label (RUNS runs, N / RUNS workers each), on a gateway (its own process) whose tenant
holds RUNS x JOBS_PER_RUN finished jobs with those labels. The gateway is stopped and started again
on the same port; every watch reopens and lists its run's jobs (ListJobs, the SDK's catch-up).

Measured from the stop: when the new gateway serves, when every watch has caught up (its catch-up's
listing ended), the new gateway's CPU seconds until then, and its ListJobs calls and the listings
it ran for them (its metrics).

    .venv/bin/python -m bench.system.label_watch_reconnect [--watches 50 200] [--runs 4] [--jobs-per-run 500] [--keep-logs]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import traceback
import urllib.request
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from asyncinfer.client import AsyncClient, Job
from asyncinfer.client._async_watch import JobWatches
from asyncinfer.client._retry import Deadline
from asyncinfer.client.jobs_watch import DeliveredRevisions
from asyncinfer.config import DEMO_MODEL
from bench.system.backlog_tools import services_config
from bench.system.common import Child, ProcessGroup, free_port, log

X = np.array([[1, 2, 3, 4]], dtype=np.float32)
TIMEOUT_S = 300.0


@dataclass
class Outcome:
    watches: int
    serving_s: float  # the stop to the new gateway answering
    caught_up_s: float  # the stop to the last watch's catch-up ended
    catch_ups: int
    gave_up: int  # watches that raised (the SDK's 30-s resume window ran out)
    first_error: str
    list_calls: float
    listings: float  # the scans the gateway ran for those calls
    gateway_cpu_s: float


class CatchUps:
    """Counts the SDK's catch-up listings as they end (the bench's own hook around JobWatches)."""

    def __init__(self) -> None:
        self.ended: list[float] = []
        self.changed = asyncio.Event()
        self._original = JobWatches._missed_by_label_watch

    def install(self) -> None:
        original = self._original
        ended, changed = self.ended, self.changed

        async def counted(
            client: JobWatches,
            labels: Mapping[str, str],
            since: Any,
            delivered: DeliveredRevisions,
            deadline: Deadline,
            stream: Any,
        ) -> AsyncGenerator[Job, None]:
            async with contextlib.aclosing(original(client, labels, since, delivered, deadline, stream)) as jobs:
                async for job in jobs:
                    yield job
            ended.append(time.monotonic())
            changed.set()

        JobWatches._missed_by_label_watch = counted  # type: ignore[method-assign,assignment]

    async def until(self, count: int, watching: list[asyncio.Task[None]]) -> None:
        """Until `count` catch-ups ended, or every watch that has not caught up gave up (raised)."""
        async with asyncio.timeout(TIMEOUT_S):
            while len(self.ended) < count - sum(task.done() for task in watching):
                self.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), 1.0)


def raised_where(task: asyncio.Task[None]) -> str:
    """What a watch raised, the SDK's line that raised it, and gRPC's own account of the call that
    failed (its debug string: who ended it, and how)."""
    error = task.exception()
    frames = traceback.extract_tb(error.__traceback__) if error is not None else []
    sdk = [frame for frame in frames if "asyncinfer" in frame.filename]
    where = f" at {sdk[-1].filename.rsplit('/', 1)[-1]}:{sdk[-1].lineno}" if sdk else ""
    cause = error.__cause__ if error is not None else None
    grpc_said = f" (grpc: {cause.debug_error_string()})" if isinstance(cause, grpc.aio.AioRpcError) else ""
    return f"{error!r}"[:300] + where + grpc_said


def list_calls(metrics_port: int) -> tuple[float, float]:
    """The gateway's ListJobs calls, and the listings it ran for them (identical concurrent calls share
    one; a gateway before session 30 runs one a call, and has no such metric: NaN)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    lines = text.splitlines()
    calls = sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("asyncinfer_rpc_server_handled_total{") and 'method="ListJobs"' in line
    )
    listings = [
        float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("asyncinfer_list_jobs_listings_total")
    ]
    return calls, listings[0] if listings else float("nan")


async def fill(address: str, runs: int, jobs_per_run: int) -> None:
    """Each run's jobs, submitted and canceled: finished records with the run's label."""
    async with AsyncClient(address) as client:
        for run in range(runs):
            labels = {"run": str(run)}
            for start in range(0, jobs_per_run, 100):
                jobs = await asyncio.gather(
                    *(client.submit("demo", {"x": X}, labels=labels) for _ in range(min(100, jobs_per_run - start)))
                )
                await asyncio.gather(*(client.cancel(job) for job in jobs))


async def consume(client: AsyncClient, labels: dict[str, str], ready: asyncio.Event) -> None:
    watch = client.watch_jobs(labels=labels)
    try:
        await watch.ready()
        ready.set()
        async for _ in watch:
            pass
    finally:
        await watch.aclose()


async def measure(group: ProcessGroup, watches: int, runs: int, jobs_per_run: int) -> Outcome:
    nats_server = group.nats(f"nats-{watches}")
    config = services_config(nats_server.url, [DEMO_MODEL], gateway={"metrics_port": free_port()})
    gateway: Child = await asyncio.to_thread(group.service, "gateway", config, label=f"gateway-{watches}")
    await fill(gateway.address, runs, jobs_per_run)
    catch_ups = CatchUps()
    catch_ups.install()
    clients = [AsyncClient(gateway.address) for _ in range(watches)]
    readies = [asyncio.Event() for _ in range(watches)]
    tasks = [
        asyncio.create_task(consume(client, {"run": str(i % runs)}, ready))
        for i, (client, ready) in enumerate(zip(clients, readies, strict=True))
    ]
    try:
        async with asyncio.timeout(TIMEOUT_S):
            await asyncio.gather(*(ready.wait() for ready in readies))
        log(f"{watches} watches ready; restarting the gateway")
        stopped_at = time.monotonic()
        await asyncio.to_thread(group.stop, gateway)
        gateway = await asyncio.to_thread(group.service, "gateway", config, label=f"gateway-{watches}-again")
        serving_s = time.monotonic() - stopped_at
        cpu_before = gateway.cpu_seconds()
        await catch_ups.until(watches, tasks)
        caught_up_s = catch_ups.ended[-1] - stopped_at if catch_ups.ended else float("nan")
        errors = [raised_where(task) for task in tasks if task.done() and task.exception() is not None]
        return Outcome(
            watches,
            serving_s,
            caught_up_s,
            len(catch_ups.ended),
            len(errors),
            errors[0] if errors else "",
            *list_calls(config.gateway.metrics_port),
            gateway.cpu_seconds() - cpu_before,
        )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(client.close() for client in clients))
        group.stop(gateway)


async def run(args: argparse.Namespace) -> list[Outcome]:
    outcomes = []
    with ProcessGroup(keep_logs=args.keep_logs) as group:
        for watches in args.watches:
            outcome = await measure(group, watches, args.runs, args.jobs_per_run)
            log(str(outcome))
            outcomes.append(outcome)
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--watches", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--jobs-per-run", type=int, default=500)
    parser.add_argument("--keep-logs", action="store_true", help="keep the services' logs (their path is logged)")
    args = parser.parse_args()
    for o in asyncio.run(run(args)):
        print(
            f"{o.watches} watches ({args.runs} runs x {args.jobs_per_run} jobs): serving again "
            f"{o.serving_s:.2f} s, all caught up {o.caught_up_s:.2f} s after the stop, {o.catch_ups} catch-ups, "
            f"{o.list_calls:.0f} ListJobs ({o.listings:.0f} listings), gateway CPU {o.gateway_cpu_s:.2f} s, {o.gave_up} watches gave up"
            + (f" (first: {o.first_error})" if o.first_error else "")
        )


if __name__ == "__main__":
    main()
