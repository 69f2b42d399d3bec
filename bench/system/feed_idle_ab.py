"""How long the gateway's watch feed should outlive the last poll (`gateway.watch_feed_idle_s`): both
sides of the trade-off, two settings alternated round by round.

    .venv/bin/python -m bench.system.feed_idle_ab [--settings 10,60] [--rounds 3] [--gap-s 15] [--quiet-s 20]

Each round, a fresh stack per setting (nats-server, gateway, scheduler, batcher as processes; the
no-op model), and on it, with no call that watches:
- a poller: a burst of 1,000 unary SubmitJobs (64 in flight), then GetJob for every job (the e2e
  section's collection), then `--gap-s` without a call, three times: the last two bursts' collection
  rate and gateway CPU per job (the first starts the feed in both);
- then a client that only submits (results by webhook, say): 3,000 unary SubmitJobs `--quiet-s` after
  the poller's last collection (longer than A's setting, shorter than B's: only B's feed still runs),
  its jobs/s (first submit to the last job ended) and the CPU per job of the four processes.
Writes bench/results/feed_idle_ab.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import grpc
import uvloop

from bench.system.common import ProcessGroup, log, write_results
from bench.system.e2e import Stack, collect_finals, submit_request, submit_unary
from bench.system.feed_ab import PROCESSES, WARM_UP_S, Stub, poll_to_end, rows_and_ratios

POLL_BURST = 1000
POLLS = 3
SUBMIT_ONLY = 3000


async def measure(stack: Stack, gap_s: float, quiet_s: float) -> dict[str, float]:
    found: dict[str, float] = {}
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = Stub(channel)
        for _ in range(20):
            await stub.SubmitJob(submit_request(), timeout=120)
        await asyncio.sleep(WARM_UP_S)
        rates, gateway_ms = [], []
        for number in range(POLLS):
            job_ids = await submit_unary(stub, POLL_BURST)
            cpu_before, started = stack.cpu(), time.perf_counter()
            await collect_finals(stub, job_ids)
            ended, cpu_after = time.perf_counter(), stack.cpu()
            if number:  # the first poll starts the feed in both
                rates.append(POLL_BURST / (ended - started))
                gateway_ms.append((cpu_after["gateway"] - cpu_before["gateway"]) / POLL_BURST * 1e3)
            if number < POLLS - 1:
                await asyncio.sleep(gap_s)
        found["poller: GetJob collection, jobs/s (bursts after a gap)"] = sum(rates) / len(rates)
        found["poller: gateway CPU per GetJob, ms"] = sum(gateway_ms) / len(gateway_ms)
        await asyncio.sleep(quiet_s)
        cpu_before, started = stack.cpu(), time.perf_counter()
        job_ids = await submit_unary(stub, SUBMIT_ONLY)
        await poll_to_end(stub, job_ids[-1], 0.01)
        ended, cpu_after = time.perf_counter(), stack.cpu()
        found["submit only, after the quiet: jobs/s"] = SUBMIT_ONLY / (ended - started)
        found["submit only, after the quiet: CPU per job, 4 processes, ms"] = (
            sum(cpu_after[p] - cpu_before[p] for p in PROCESSES) / SUBMIT_ONLY * 1e3
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="10,60", help="two values of gateway.watch_feed_idle_s, A and B")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap-s", type=float, default=15.0)
    parser.add_argument("--quiet-s", type=float, default=20.0)
    args = parser.parse_args()
    settings = [float(value) for value in args.settings.split(",")]
    results: dict[str, list[dict[str, float]]] = {}
    with ProcessGroup() as group, asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        for number in range(1, args.rounds + 1):
            for ab, idle_s in zip("AB", settings, strict=True):
                name = f"{ab}: watch_feed_idle_s = {idle_s:g}"
                stack = Stack(group, name=f"nats-{number}-{ab}", gateway={"watch_feed_idle_s": idle_s})
                found = runner.run(measure(stack, args.gap_s, args.quiet_s))
                stack.stop_services()
                results.setdefault(name, []).append(found)
                log(f"round {number}, {name}: " + "; ".join(f"{k} {v:.2f}" for k, v in found.items()))
    rows, ratios = rows_and_ratios(results)
    notes = [
        f"{args.rounds} rounds, a fresh stack per setting, A then B; gaps of {args.gap_s:g} s between the poller's "
        f"bursts, {args.quiet_s:g} s before the submit-only client. "
        + (__doc__ or "").split("\n\n")[2].replace("\n", " ")
    ]
    write_results("feed_idle_ab", "How long the watch feed outlives the last poll", rows, ratios, notes)
    log("wrote bench/results/feed_idle_ab.md")


if __name__ == "__main__":
    main()
