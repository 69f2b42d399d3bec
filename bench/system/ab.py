"""A/B of one batcher setting through the whole system, in one run on one machine: the e2e
section's bursts (unary SubmitJob then GetJob per job; the batch APIs) against two stacks that
differ in that setting alone, alternated round by round so that a busy moment spreads over both.

    .venv/bin/python -m bench.system.ab --setting batcher.work_batches [--rounds 3] [--burst 3000]

A is the setting false, B true (the default):
- batcher.work_batches: the WorkerService stream one message per order / result / credit, against
  WorkOrders and WorkUpdates (work moving a batch at a time).
Writes bench/results/ab_<key>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio

import grpc
import uvloop

from asyncinfer.v1 import job_service_pb2_grpc
from bench.system.common import ProcessGroup, log, ratio, row, summarize, write_results
from bench.system.e2e import Burst, Stack, batch_burst, burst, run_one, system_cpu_ms_per_job

TITLES = {
    "batcher.work_batches": "the WorkerService stream, one message per item vs batches",
}


async def measure(stack: Stack, count: int) -> tuple[Burst, Burst]:
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        for _ in range(20):  # warm-up; the first one also waits for the batcher's credits
            await run_one(stub, timeout_s=120)
        unary = await burst(stub, stack, count)
        batched = await batch_burst(stub, stack, count)
    return unary, batched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", choices=sorted(TITLES), required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst", type=int, default=3000)
    args = parser.parse_args()
    section_name, key = args.setting.split(".")
    section = f"ab_{key}"
    setups = {f"A: {args.setting} = false": False, f"B: {args.setting} = true": True}
    found: dict[str, list[tuple[Burst, Burst]]] = {name: [] for name in setups}
    with ProcessGroup() as group, asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        for round_number in range(1, args.rounds + 1):
            for name, value in setups.items():
                stack = Stack(group, name=f"nats-{round_number}-{value}", **{section_name: {key: value}})
                unary, batched = runner.run(measure(stack, args.burst))
                stack.stop_services()
                found[name].append((unary, batched))
                log(
                    f"round {round_number}, {name}: unary {unary.collected_rate:.0f}/s, batch APIs "
                    f"{batched.collected_rate:.0f}/s; CPU per job {system_cpu_ms_per_job([unary], args.burst)[0]:.2f} / "
                    f"{system_cpu_ms_per_job([batched], args.burst)[0]:.2f} ms"
                )
    rows = []
    medians: dict[str, dict[str, float]] = {}
    for name, pairs in found.items():
        unary = [u for u, _ in pairs]
        batched = [b for _, b in pairs]
        figures = {
            "unary burst, completed jobs/s": [b.collected_rate for b in unary],
            "batch-API burst, completed jobs/s": [b.collected_rate for b in batched],
            "CPU per job, unary burst (4 processes), ms": system_cpu_ms_per_job(unary, args.burst),
            "CPU per job, batch-API burst (4 processes), ms": system_cpu_ms_per_job(batched, args.burst),
            "scheduler CPU per job, unary burst, ms": [b.cpu_s["scheduler"] / args.burst * 1e3 for b in unary],
            "batcher CPU per job, unary burst, ms": [b.cpu_s["batcher"] / args.burst * 1e3 for b in unary],
        }
        medians[name] = {}
        for label, values in figures.items():
            unit = "ms" if "ms" in label else "jobs/s"
            rows.append(row(f"{name}: {label}", values, unit))
            medians[name][label] = float(summarize(values)["value"])
    a, b = (medians[name] for name in setups)
    ratios = [
        ratio(f"B / A: {label}", b[label] / a[label], "for the decision", None)
        for label in a
        if a[label] == a[label] and a[label] > 0
    ]
    notes = [
        f"{args.rounds} rounds, each a fresh stack per setup (nats-server, gateway, scheduler, batcher as processes), "
        f"A then B; per stack 20 warm-up jobs, a unary burst of {args.burst} (64 in flight, then GetJob per job) "
        "and a batch-API burst of the same size. The no-op model makes every figure the system's own cost.",
    ]
    write_results(section, f"A/B: {TITLES[args.setting]}", rows, ratios, notes)
    log(f"wrote bench/results/{section}.md")


if __name__ == "__main__":
    main()
