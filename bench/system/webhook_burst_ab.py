"""A/B of the webhook path through the whole system: a burst of jobs, each with a callback to one
local receiver (bench/webhook_post_bench.py's), against the stacks of two git revisions, alternated
round by round.

    .venv/bin/python -m bench.system.webhook_burst_ab --revisions REV_A REV_B --name NAME [--rounds 6] [--burst 1000]

Each round starts a fresh stack per revision (nats-server, gateway, scheduler, batcher as
processes, the no-op model; services from a worktree of the revision), submits `burst` jobs through
SubmitJobs with a callback to a receiver in this process (HTTP/1.1 on loopback: it reads the
request, answers 204 and closes), and times the first submit to the last webhook received. What
moves them is the scheduler's notifier (the record writes, a pull at a time) and sender (the
deliveries, up to webhooks.max_concurrent_per_origin to the one receiver). Writes
bench/results/ab_<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import uvloop

from asyncinfer.contract import WEBHOOK_FEED_CONSUMER, WEBHOOK_SENDER_CONSUMER, consumer_next_subject
from asyncinfer.nats import Msg
from asyncinfer.nats.connection import connect
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc
from asyncinfer.webhook_secrets import new_secret
from bench.system.ab import worktrees
from bench.system.common import ProcessGroup, log, ratio, row, summarize, write_results
from bench.system.e2e import JOBS_PER_SUBMIT_MESSAGE, Stack, run_one, submit_request
from bench.webhook_post_bench import serve

WEBHOOKS = {
    "secrets": [{"tenant": "default", "secret": new_secret()}],
    "allowed_networks": ["127.0.0.0/8"],
}
WARM_UP = 20


@dataclass
class Round:
    rate: float  # webhooks received a second, from the first submit to the last webhook
    last_after_jobs_s: float  # the last webhook, after the last job's end was seen by the submit
    cpu_ms: dict[str, float]  # per webhook, by process
    pulls: dict[str, int]  # pull requests during the burst, by webhook consumer


class Receiver:
    def __init__(self) -> None:
        self.count = 0
        self.wanted = 0
        self.all_came = asyncio.Event()
        self.port = 0

    async def start(self) -> None:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]

    def expect(self, wanted: int) -> None:
        self.count, self.wanted = 0, wanted
        self.all_came.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await serve(reader, writer)
        self.count += 1
        if self.count >= self.wanted:
            self.all_came.set()


async def burst(
    stub: job_service_pb2_grpc.JobServiceStub, request: job_service_pb2.SubmitJobRequest, count: int
) -> float:
    """Submits `count` jobs through SubmitJobs and watches them to their end; when they ended."""

    async def messages() -> AsyncIterator[job_service_pb2.SubmitJobsRequest]:
        for first in range(0, count, JOBS_PER_SUBMIT_MESSAGE):
            size = min(JOBS_PER_SUBMIT_MESSAGE, count - first)
            items = [job_service_pb2.SubmitJobsItem(job=request, correlation_id=str(first + i)) for i in range(size)]
            yield job_service_pb2.SubmitJobsRequest(items=items)

    job_ids = [a.job.job_id async for r in stub.SubmitJobs(messages()) for a in r.answers if a.HasField("job")]
    assert len(job_ids) == count, f"{count - len(job_ids)} submits refused"
    ended = 0
    async for response in stub.WatchJobs(job_service_pb2.WatchJobsRequest(job_ids=job_ids)):
        ended += sum(1 for c in response.changes if c.HasField("job") and c.job.state == job_pb2.JOB_STATE_SUCCEEDED)
    assert ended == count, f"{count - ended} jobs did not succeed"
    return time.perf_counter()


async def measure(stack: Stack, receiver: Receiver, count: int) -> Round:
    request = submit_request()
    request.callback.CopyFrom(job_pb2.Callback(url=f"http://127.0.0.1:{receiver.port}/hook"))
    pulls = dict.fromkeys((WEBHOOK_SENDER_CONSUMER, WEBHOOK_FEED_CONSUMER), 0)

    async def count_pull(msg: Msg) -> None:
        consumer = msg.subject.rsplit(".", 1)[-1]
        if consumer in pulls:
            pulls[consumer] += 1

    nc = await connect(stack.config.nats, name="bench-pulls-seen")
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        await run_one(stub, timeout_s=120)  # waits for the batcher's credits
        receiver.expect(WARM_UP)
        await burst(stub, request, WARM_UP)
        await asyncio.wait_for(receiver.all_came.wait(), 60)
        receiver.expect(count)
        seen = await nc.subscribe(consumer_next_subject("*", "*"), cb=count_pull)
        await nc.flush()
        cpu_before = stack.cpu()
        started = time.perf_counter()
        jobs_done = await burst(stub, request, count)
        await asyncio.wait_for(receiver.all_came.wait(), 300)
        done = time.perf_counter()
        cpu_after = stack.cpu()
        await nc.flush()
        await seen.unsubscribe()
    await nc.close()
    cpu_ms = {name: (cpu_after[name] - cpu_before[name]) / count * 1e3 for name in cpu_before}
    return Round(rate=count / (done - started), last_after_jobs_s=done - jobs_done, cpu_ms=cpu_ms, pulls=pulls)


def unit(label: str) -> str:
    if label.endswith("requests"):
        return "requests"
    return label.rsplit(", ", 1)[-1] if label.endswith((", ms", ", s")) else "/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--revisions", nargs=2, metavar=("A", "B"), required=True)
    parser.add_argument("--name", required=True, help="bench/results/ab_<name>")
    parser.add_argument("--title", default="")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--burst", type=int, default=1000)
    args = parser.parse_args()
    found: dict[str, list[Round]] = {}
    with worktrees(args.revisions) as trees, ProcessGroup() as group:
        setups = {f"{ab}: {rev}": tree for ab, rev, tree in zip("AB", args.revisions, trees, strict=True)}
        found = {name: [] for name in setups}
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            receiver = Receiver()
            runner.run(receiver.start())
            for number in range(1, args.rounds + 1):
                order = list(setups.items())
                if number % 2 == 0:  # A then B, then B then A: a drift over the run counts against neither
                    order.reverse()
                for n, (name, tree) in enumerate(order):
                    stack = Stack(group, name=f"nats-{number}-{n}", webhooks=WEBHOOKS, source=tree)
                    found[name].append(measured := runner.run(measure(stack, receiver, args.burst)))
                    stack.stop_services()
                    log(
                        f"round {number}, {name}: {measured.rate:.0f} webhooks/s, the last "
                        f"{measured.last_after_jobs_s:.2f} s after the jobs; scheduler CPU per webhook "
                        f"{measured.cpu_ms['scheduler']:.2f} ms, nats-server {measured.cpu_ms['nats-server']:.2f} ms; "
                        f"pull requests {measured.pulls}"
                    )
    rows = []
    medians: dict[str, dict[str, float]] = {}
    for name, rounds in found.items():
        figures = {
            "webhooks received a second (first submit to last webhook)": [r.rate for r in rounds],
            "the last webhook after the last job ended, s": [r.last_after_jobs_s for r in rounds],
            **{
                f"{process} CPU per webhook, ms": [r.cpu_ms[process] for r in rounds]
                for process in ("scheduler", "nats-server", "gateway", "batcher")
            },
            **{f"{consumer} pull requests": [r.pulls[consumer] for r in rounds] for consumer in rounds[0].pulls},
        }
        medians[name] = {}
        for label, values in figures.items():
            rows.append(row(f"{name}: {label}", values, unit(label)))
            medians[name][label] = float(summarize(values)["value"])
    a, b = medians.values()
    ratios = [ratio(f"B / A: {label}", b[label] / a[label], "for the decision", None) for label in a if a[label] > 0]
    notes = [
        f"{args.rounds} rounds, each a fresh stack per revision (A then B in odd rounds, B then A in even ones); per stack {WARM_UP} warm-up jobs with "
        f"callbacks, then {args.burst} jobs through SubmitJobs, each with a callback (job.completed) to one "
        "receiver in the benchmark's process on loopback (answers 204). Default webhook settings "
        "(max_concurrent_deliveries 32, max_concurrent_per_origin 8); CPU from /proc per process."
    ]
    section = f"ab_{args.name}"
    write_results(section, f"A/B, webhooks: {args.title or ' vs '.join(args.revisions)}", rows, ratios, notes)
    log(f"wrote bench/results/{section}.md")


if __name__ == "__main__":
    main()
