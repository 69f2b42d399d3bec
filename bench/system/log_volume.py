"""Log bytes per job: each service of the whole stack (as processes, logging JSON at info unless
--level says otherwise, as an operator runs them) through a unary burst of no-op jobs, its log's
growth over the burst divided by the jobs, with the events that made it. One stack per revision
given (a worktree of each, as bench.system.ab makes), or this checkout's.

    .venv/bin/python -m bench.system.log_volume [--revisions REV ...] [--burst 3000] [--level info]

Prints a table per revision; writes nothing (the figures go into the change that needs them).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
from pathlib import Path

import grpc
import uvloop

from asyncinfer.v1 import job_service_pb2_grpc
from bench.system.ab import worktrees
from bench.system.common import ProcessGroup, log
from bench.system.e2e import Stack, burst, run_one


async def warm_up(stack: Stack) -> None:
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        for _ in range(20):  # the first one also waits for the batcher's credits
            await run_one(stub, timeout_s=120)


async def through(stack: Stack, count: int) -> None:
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        await burst(job_service_pb2_grpc.JobServiceStub(channel), stack, count)


def events(text: str) -> collections.Counter[str]:
    found: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        try:
            found[json.loads(line)["event"]] += len(line) + 1
        except (ValueError, KeyError, TypeError):
            found["(not JSON)"] += len(line) + 1
    return found


def measure(name: str, count: int, source: Path | None) -> None:
    with ProcessGroup() as group, asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        stack = Stack(group, name=f"nats-{name}", source=source)
        runner.run(warm_up(stack))
        before = {svc: child.log_path.stat().st_size for svc, child in stack.services.items()}
        runner.run(through(stack, count))
        stack.stop_services()  # its lines count too: a stop logs what the last interval counted
        grown = {}
        for svc, child in stack.services.items():
            with child.log_path.open("rb") as f:
                f.seek(before[svc])
                grown[svc] = f.read().decode(errors="replace")
    total = sum(len(text.encode()) for text in grown.values())
    print(
        f"\n{name}: {count} jobs (after 20 not counted), the burst and the stop: log bytes per job: {total / count:.0f}"
    )
    for svc, text in grown.items():
        by_event = events(text)
        top = ", ".join(f"{event} {size / count:.0f}" for event, size in by_event.most_common(6))
        print(f"  {svc}: {len(text.encode()) / count:.1f} B/job, {text.count(chr(10))} lines ({top})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--revisions", nargs="*", default=[], metavar="REV")
    parser.add_argument("--burst", type=int, default=3000)
    parser.add_argument("--level", default="info", choices=["debug", "info", "warning"])
    args = parser.parse_args()
    # The environment wins over the services' files (bench_config says warning).
    os.environ.update(ASYNCINFER_LOGGING__LEVEL=args.level, ASYNCINFER_LOGGING__FORMAT="json")
    with contextlib.ExitStack() as stack:
        if args.revisions:
            trees = stack.enter_context(worktrees(args.revisions))
            for revision, tree in zip(args.revisions, trees, strict=True):
                measure(revision, args.burst, tree)
        else:
            measure("this checkout", args.burst, None)
    log("done")


if __name__ == "__main__":
    main()
