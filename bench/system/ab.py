"""A/B through the whole system, in one run on one machine: the e2e section's bursts (unary
SubmitJob then GetJob per job; the batch APIs) and a back-to-back round trip against two stacks
that differ in one setting, or in the code they run, alternated round by round so that a busy
moment spreads over both.

    .venv/bin/python -m bench.system.ab --setting batcher.work_batches [--rounds 3] [--burst 3000]
    .venv/bin/python -m bench.system.ab --revisions REV_A REV_B --name one_write [--title ...] [--quiet-first S]

With --setting, A is the setting false, B true (the default):
- batcher.work_batches: the WorkerService stream one message per order / result / credit, against
  WorkOrders and WorkUpdates (work moving a batch at a time);
- scheduler.hold_pulls_open: an idle dispatcher woken by a queued notice that then pulls, against
  one holding a pull open on each priority's queue (services/scheduler/held_pulls.py).
With --revisions, A's and B's services run from a worktree of each git revision (made in a temp
dir, removed after), sharing this checkout's virtual environment and benchmark code.
--quiet-first S: S seconds without a call between the warm-up and the unary burst, longer than the
gateway's watch feed outlives the last watch (gateway.watch_feed_idle_s, 10 s): the e2e section's
second and third runs, whose unary bursts start after ~15 s of Celery and the hop references.
Each setup's batcher's mean batch size (jobs a batch, from the jobs' records) is reported beside its
CPU per job, which follows it. Writes bench/results/ab_<key or name>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import uvloop

from asyncinfer.v1 import job_service_pb2_grpc
from bench.system import e2e
from bench.system.common import ROOT, ProcessGroup, log, ratio, row, summarize, write_results
from bench.system.e2e import Burst, Stack, batch_burst, burst, mean_batch_size, run_one, system_cpu_ms_per_job

TITLES = {
    "batcher.work_batches": "the WorkerService stream, one message per item vs batches",
    "scheduler.hold_pulls_open": "an idle scheduler woken by queued notices vs pulls held open",
}


ROUND_TRIPS = 200


async def measure(stack: Stack, count: int, quiet_s: float = 0.0) -> tuple[Burst, Burst, float]:
    """The unary burst, the batch-API burst, and the p50 of back-to-back round trips in ms."""
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        for _ in range(20):  # warm-up; the first one also waits for the batcher's credits
            await run_one(stub, timeout_s=120)
        await asyncio.sleep(quiet_s)
        unary = await burst(stub, stack, count)
        batched = await batch_burst(stub, stack, count)
        trips = []
        for _ in range(ROUND_TRIPS):
            started = time.perf_counter()
            await run_one(stub)
            trips.append((time.perf_counter() - started) * 1e3)
    return unary, batched, statistics.median(trips)


@contextlib.contextmanager
def worktrees(revisions: list[str]) -> Iterator[list[Path]]:
    """A detached worktree of each revision, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="ab-") as tmp:
        paths = []
        try:
            for n, revision in enumerate(revisions):
                path = Path(tmp) / f"tree-{n}"
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), revision],
                    check=True,
                    capture_output=True,
                )
                paths.append(path)
            yield paths
        finally:
            for path in paths:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    chosen = parser.add_mutually_exclusive_group(required=True)
    chosen.add_argument("--setting", choices=sorted(TITLES))
    chosen.add_argument("--revisions", nargs=2, metavar=("A", "B"), help="two git revisions")
    parser.add_argument("--name", default="revisions", help="with --revisions: bench/results/ab_<name>")
    parser.add_argument("--title", default="", help="with --revisions: what the two revisions differ in")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst", type=int, default=3000)
    parser.add_argument("--quiet-first", type=float, default=0.0, metavar="S", help="seconds without a call first")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds of both setups first, not counted")
    parser.add_argument("--keyed", action="store_true", help="every submit with a fresh idempotency key (the SDK's)")
    args = parser.parse_args()
    e2e.KEYED_SUBMITS = args.keyed
    with contextlib.ExitStack() as stack_of_trees:
        if args.setting:
            section_name, key = args.setting.split(".")
            section, title = f"ab_{key}", TITLES[args.setting]
            setups: dict[str, dict[str, Any]] = {
                f"A: {args.setting} = false": {section_name: {key: False}},
                f"B: {args.setting} = true": {section_name: {key: True}},
            }
        else:
            trees = stack_of_trees.enter_context(worktrees(args.revisions))
            section, title = f"ab_{args.name}", args.title or " vs ".join(args.revisions)
            if args.keyed:
                title += " (every submit with an idempotency key of its own, as the SDK's)"
            setups = {
                f"{ab}: {revision}": {"source": tree}
                for ab, revision, tree in zip("AB", args.revisions, trees, strict=True)
            }
        found = run_rounds(setups, args.rounds, args.burst, args.quiet_first, args.warmup_rounds)
        report(section, title, found, args.rounds, args.burst, args.quiet_first, args.warmup_rounds)


def run_rounds(
    setups: dict[str, dict[str, Any]], rounds: int, count: int, quiet_s: float = 0.0, warmup_rounds: int = 0
) -> dict[str, list[tuple[Burst, Burst, float]]]:
    """Each setup once per round, A first in odd rounds and B first in even ones; the first
    `warmup_rounds` rounds are not counted (a run's first minute is its slowest, which would count
    against whichever setup goes first). Always A then B biased the figures against B: an A/A run
    of one revision read B/A 0.91 for the unary burst and 1.09 for its CPU per job (session 32,
    bench/results/ab_session32_aa.md)."""
    found: dict[str, list[tuple[Burst, Burst, float]]] = {name: [] for name in setups}
    with ProcessGroup() as group, asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        for round_number in range(1 - warmup_rounds, rounds + 1):
            in_order = list(enumerate(setups.items()))
            for n, (name, options) in in_order if round_number % 2 else in_order[::-1]:
                stack = Stack(group, name=f"nats-{round_number + warmup_rounds}-{n}", **options)
                unary, batched, trip_ms = runner.run(measure(stack, count, quiet_s))
                stack.stop_services()
                if round_number > 0:
                    found[name].append((unary, batched, trip_ms))
                log(
                    f"round {round_number if round_number > 0 else 'warm-up (not counted)'}, {name}: unary {unary.collected_rate:.0f}/s, batch APIs "
                    f"{batched.collected_rate:.0f}/s; CPU per job {system_cpu_ms_per_job([unary], count)[0]:.2f} / "
                    f"{system_cpu_ms_per_job([batched], count)[0]:.2f} ms; batcher CPU per job, unary "
                    f"{unary.cpu_s['batcher'] / count * 1e3:.3f} ms at {mean_batch_size(unary):.1f} jobs a batch "
                    f"(batch APIs {mean_batch_size(batched):.1f}); round trip p50 {trip_ms:.2f} ms"
                )
    return found


def report(
    section: str,
    title: str,
    found: dict[str, list[tuple[Burst, Burst, float]]],
    rounds: int,
    count: int,
    quiet_s: float = 0.0,
    warmup_rounds: int = 0,
) -> None:
    rows = []
    medians: dict[str, dict[str, float]] = {}
    for name, triples in found.items():
        unary = [u for u, _, _ in triples]
        batched = [b for _, b, _ in triples]
        figures = {
            "round trip back to back (SubmitJob -> WatchJob terminal) p50, ms": [t for _, _, t in triples],
            "unary burst, completed jobs/s": [b.collected_rate for b in unary],
            "batch-API burst, completed jobs/s": [b.collected_rate for b in batched],
            "CPU per job, unary burst (4 processes), ms": system_cpu_ms_per_job(unary, count),
            "CPU per job, batch-API burst (4 processes), ms": system_cpu_ms_per_job(batched, count),
            "gateway CPU per job, unary burst, ms": [b.cpu_s["gateway"] / count * 1e3 for b in unary],
            "scheduler CPU per job, unary burst, ms": [b.cpu_s["scheduler"] / count * 1e3 for b in unary],
            "batcher CPU per job, unary burst, ms": [b.cpu_s["batcher"] / count * 1e3 for b in unary],
            "nats-server CPU per job, unary burst, ms": [b.cpu_s["nats-server"] / count * 1e3 for b in unary],
            "batcher's mean batch size, unary burst, jobs a batch": [mean_batch_size(b) for b in unary],
            "batcher's mean batch size, batch-API burst, jobs a batch": [mean_batch_size(b) for b in batched],
        }
        medians[name] = {}
        for label, values in figures.items():
            unit = "ms" if "ms" in label else "jobs a batch" if "batch size" in label else "jobs/s"
            rows.append(row(f"{name}: {label}", values, unit))
            medians[name][label] = float(summarize(values)["value"])
    a, b = (medians[name] for name in found)
    ratios = [
        ratio(f"B / A: {label}", b[label] / a[label], "for the decision", None)
        for label in a
        if a[label] == a[label] and a[label] > 0
    ]
    notes = [
        f"{rounds} rounds, each a fresh stack per setup (nats-server, gateway, scheduler, batcher as processes), "
        f"A then B in odd rounds, B then A in even ones"
        + (f", after {warmup_rounds} uncounted round(s) of both" if warmup_rounds else "")
        + "; per stack 20 warm-up jobs, "
        + (f"then {quiet_s:g} s without a call (the gateway's watch feed stops), " if quiet_s else "")
        + f"a unary burst of {count} (64 in flight, then GetJob per job), "
        f"a batch-API burst of the same size, then {ROUND_TRIPS} round trips one after another (SubmitJob, then "
        "WatchJob to the terminal state). The no-op model makes every figure the system's own cost.",
        "The batcher's mean batch size is jobs over batches (each batch once), from the size of the batch each job "
        "ran in (its record's batch.batch_size): the batcher's CPU per job follows it (0.12 ms a job at 9.6 jobs a "
        "batch, 0.07-0.10 ms at 17-22, either revision: bench/results/batcher_cpu_per_job_s32.md), and it follows "
        "timing, so read the batcher's CPU per job beside it.",
    ]
    write_results(section, f"A/B: {title}", rows, ratios, notes)
    log(f"wrote bench/results/{section}.md")


if __name__ == "__main__":
    main()
