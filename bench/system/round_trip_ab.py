"""A/B of the back-to-back round trip (SubmitJob, then WatchJob to the terminal state) with both
stacks up at once, measured in alternating blocks, so that whatever else the machine does falls
on both alike (the light-load latency is what a busy machine disturbs most).

    .venv/bin/python -m bench.system.round_trip_ab --setting scheduler.hold_pulls_open [--blocks 30] [--per-block 20]
    .venv/bin/python -m bench.system.round_trip_ab --revisions A B --name NAME

With --setting, A is the setting false, B true; with --revisions, each stack runs its revision's
services from a worktree of it (bench.system.ab.worktrees). Each stack: its own nats-server,
gateway, scheduler and batcher (the no-op model). Writes bench/results/round_trip_<key or
NAME>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time

import grpc
import uvloop

from asyncinfer.v1 import job_service_pb2_grpc
from bench.system.ab import worktrees
from bench.system.common import ProcessGroup, load_average, log, ratio, row, write_results
from bench.system.e2e import Stack, run_one


async def trips(stub: job_service_pb2_grpc.JobServiceStub, count: int) -> list[float]:
    found = []
    for _ in range(count):
        started = time.perf_counter()
        await run_one(stub)
        found.append((time.perf_counter() - started) * 1e3)
    return found


async def measure(stacks: dict[str, Stack], blocks: int, per_block: int) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {name: [] for name in stacks}
    channels = {name: grpc.aio.insecure_channel(stack.gateway.address) for name, stack in stacks.items()}
    try:
        stubs = {name: job_service_pb2_grpc.JobServiceStub(channel) for name, channel in channels.items()}
        for stub in stubs.values():
            for _ in range(20):  # warm-up; the first one also waits for the batcher's credits
                await run_one(stub, timeout_s=120)
        for block in range(blocks):
            order = list(stubs) if block % 2 == 0 else list(reversed(stubs))
            for name in order:
                found[name] += await trips(stubs[name], per_block)
    finally:
        for channel in channels.values():
            await channel.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    chosen = parser.add_mutually_exclusive_group(required=True)
    chosen.add_argument("--setting", help="section.key of a boolean setting, e.g. scheduler.hold_pulls_open")
    chosen.add_argument("--revisions", nargs=2, metavar=("A", "B"), help="two git revisions")
    parser.add_argument("--name", default="revisions", help="with --revisions: bench/results/round_trip_<name>")
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--per-block", type=int, default=20)
    args = parser.parse_args()
    load_before = load_average()[0]
    with contextlib.ExitStack() as scope:
        group = scope.enter_context(ProcessGroup())
        runner = scope.enter_context(asyncio.Runner(loop_factory=uvloop.new_event_loop))
        if args.revisions:
            key, title = args.name, f"revisions {args.revisions[0]} and {args.revisions[1]}"
            trees = scope.enter_context(worktrees(args.revisions))
            stacks = {
                f"{side}: {revision}": Stack(group, name=f"nats-{side.lower()}", source=tree)
                for side, revision, tree in zip("AB", args.revisions, trees, strict=True)
            }
        else:
            section_name, key = args.setting.split(".")
            title = args.setting
            stacks = {
                f"A: {args.setting} = false": Stack(group, name="nats-a", **{section_name: {key: False}}),
                f"B: {args.setting} = true": Stack(group, name="nats-b", **{section_name: {key: True}}),
            }
        found = runner.run(measure(stacks, args.blocks, args.per_block))
        for stack in stacks.values():
            stack.stop_services()
    rows, p50s = [], {}
    for name, values in found.items():
        values.sort()
        p50s[name] = statistics.median(values)
        p99 = values[int(len(values) * 0.99) - 1]
        rows.append(row(f"{name}: round trip p50", [p50s[name]], "ms"))
        rows.append(row(f"{name}: round trip p99", [p99], "ms"))
        log(f"{name}: p50 {p50s[name]:.2f} ms, p99 {p99:.2f} ms over {len(values)} trips")
    a, b = p50s.values()
    notes = [
        f"Both stacks up at once; {args.blocks} alternating blocks of {args.per_block} round trips each "
        "(SubmitJob, then WatchJob after its revision until SUCCEEDED; the no-op model), after 20 warm-up trips "
        f"per stack. Load average (1 min) at the start: {load_before:.2f}.",
    ]
    write_results(
        f"round_trip_{key}",
        f"Round trip A/B: {title}",
        rows,
        [ratio("B / A: round trip p50", b / a, "for the decision", None)],
        notes,
    )
    log(f"wrote bench/results/round_trip_{key}.md")


if __name__ == "__main__":
    main()
