"""A/B of two revisions for clients that never watch: what the gateway's watch feed costs a
client that only submits, and what it saves one that submits and then polls with GetJob.

    .venv/bin/python -m bench.system.feed_ab --revisions A B --name N [--rounds 6] [--burst 3000]

Each round, a fresh stack per revision (as bench/system/ab.py, its services from a worktree of
the revision), A then B; per stack: 20 warm-up jobs submitted, then WARM_UP_S without a call;
then two bursts of `--burst` no-op jobs, each SubmitJob with 64 in flight:
- submit only: the jobs are left to run (results by webhook, say); it ends when the last job
  submitted has ended (polled every 10 ms once every job is submitted), its CPU counted from the
  first submit to then;
- submit then poll, right after: then GetJob for every job (32 at a time, again for those not
  finished), as the e2e section's unary burst without its WatchJob: a client that polls.
No call watches, so a revision whose feed runs only while someone watches reads every poll.
Writes bench/results/ab_<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from typing import Any

import grpc
import uvloop

from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc
from bench.system.ab import worktrees
from bench.system.common import ProcessGroup, log, ratio, row, summarize, write_results
from bench.system.e2e import TERMINAL, Stack, collect_finals, submit_request, submit_unary

Stub = job_service_pb2_grpc.JobServiceStub
PROCESSES = ("gateway", "scheduler", "batcher", "nats-server")
# After the warm-up jobs are submitted: time for the batcher to connect and run them.
WARM_UP_S = 3.0


async def poll_to_end(stub: Stub, job_id: str, interval_s: float, timeout_s: float = 120.0) -> job_pb2.Job:
    deadline = time.monotonic() + timeout_s
    while True:
        job = (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id), timeout=timeout_s)).job
        if job.state in TERMINAL:
            return job
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job_id} did not end within {timeout_s} s")
        await asyncio.sleep(interval_s)


async def measure(stack: Stack, count: int) -> dict[str, float]:
    found: dict[str, float] = {}
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = Stub(channel)
        for _ in range(20):
            await stub.SubmitJob(submit_request(), timeout=120)
        await asyncio.sleep(WARM_UP_S)  # no call that reads: the feed stays off in both
        for phase in ("submit only", "submit then poll"):
            cpu_before, started = stack.cpu(), time.perf_counter()
            job_ids = await submit_unary(stub, count)
            submitted = time.perf_counter()
            if phase == "submit only":
                await poll_to_end(stub, job_ids[-1], 0.01)
            else:
                await collect_finals(stub, job_ids)
            ended, cpu_after = time.perf_counter(), stack.cpu()
            found[f"{phase}: jobs/s (first submit -> last job ended, or every result collected)"] = count / (
                ended - started
            )
            found[f"{phase}: submit phase, jobs/s"] = count / (submitted - started)
            for process in PROCESSES:
                spent = cpu_after[process] - cpu_before[process]
                found[f"{phase}: {process} CPU per job, ms"] = spent / count * 1e3
            found[f"{phase}: CPU per job, 4 processes, ms"] = (
                sum(cpu_after[p] - cpu_before[p] for p in PROCESSES) / count * 1e3
            )
    return found


def rows_and_ratios(results: dict[str, list[dict[str, float]]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per setup (A, then B) and figure, a row of its rounds; per figure, B's median over A's."""
    rows, medians = [], {}
    for name, rounds in results.items():
        medians[name] = {}
        for label in rounds[0]:
            values = [r[label] for r in rounds]
            rows.append(row(f"{name}: {label}", values, "ms" if label.endswith("ms") else "jobs/s"))
            medians[name][label] = float(summarize(values)["value"])
    a, b = medians.values()
    ratios = [ratio(f"B / A: {label}", b[label] / a[label], "for the decision", None) for label in a if a[label] > 0]
    return rows, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--revisions", nargs=2, metavar=("A", "B"), required=True)
    parser.add_argument("--name", required=True, help="bench/results/ab_<name>")
    parser.add_argument("--title", default="")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--burst", type=int, default=3000)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    with contextlib.ExitStack() as exits:
        trees = exits.enter_context(worktrees(args.revisions))
        group = exits.enter_context(ProcessGroup())
        runner = exits.enter_context(asyncio.Runner(loop_factory=uvloop.new_event_loop))
        setups = {f"{ab}: {rev}": tree for ab, rev, tree in zip("AB", args.revisions, trees, strict=True)}
        for number in range(1, args.rounds + 1):
            for n, (name, tree) in enumerate(setups.items()):
                stack = Stack(group, name=f"nats-{number}-{n}", source=tree)
                found = runner.run(measure(stack, args.burst))
                stack.stop_services()
                results.setdefault(name, []).append(found)
                log(
                    f"round {number}, {name}: "
                    + "; ".join(f"{k.split(':')[0]} {found[k]:.0f}/s" for k in found if "(first submit" in k)
                    + "; CPU per job "
                    + " / ".join(f"{found[k]:.2f}" for k in found if "4 processes" in k)
                    + " ms"
                )
    rows, ratios = rows_and_ratios(results)
    notes = [
        f"{args.rounds} rounds, each a fresh stack per revision, A then B; bursts of {args.burst} no-op jobs. "
        + (__doc__ or "").split("\n\n")[2].replace("\n", " ")
    ]
    title = args.title or " vs ".join(args.revisions)
    write_results(f"ab_{args.name}", f"A/B, clients that never watch: {title}", rows, ratios, notes)
    log(f"wrote bench/results/ab_{args.name}.md")


if __name__ == "__main__":
    main()
