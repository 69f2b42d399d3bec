"""A/B for issue 14, item 4: batchers pulling from JetStream themselves (B, the prototype in
bench/system/direct_pull.py) against today's stack (A: gateway -> JetStream -> scheduler ->
WorkerService stream -> batcher), in one run on one machine, alternated round by round so that a
busy moment spreads over both.

    .venv/bin/python -m bench.system.direct_pull_ab [--rounds 3] [--burst 3000] [--light 300]
    .venv/bin/python -m bench.system.direct_pull_ab --smoke      # 1 round, 300 jobs: checks the script

Per stack (a fresh nats-server each): 20 warm-up jobs, the e2e section's unary burst (SubmitJob
with 64 in flight, then GetJob per job), its batch-API burst (SubmitJobs of 100 jobs per message,
then one WatchJobs), then `--light` jobs one at a time (SubmitJob -> WatchJob terminal). CPU per job
per process from /proc over each burst.

- A: nats-server, gateway, scheduler, batcher: the shipped services, their defaults.
- B: nats-server, gateway, scheduler as the control plane only (no batcher connects to it, so it
  pulls nothing; it still runs the webhook feed over every record write, the queue snapshots and
  the queued-notice subscription), and the direct-pull batcher. B's AckWait is `--ack-wait-s`
  (default 4 s) with in-progress acks every `--renew-s` (default 1 s): the lease a direct-pull
  design needs so that a killed batcher's jobs run elsewhere within 5 s, priced into B's figures.

`--checks` adds, after the rounds, B's guarantees exercised: cancel of running jobs, a paused
queue, and two direct-pull batchers with one killed (SIGKILL) mid-burst (how long its jobs took to
start again on the other).

Writes bench/results/direct_pull.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from typing import Any

import grpc
import uvloop

from asyncinfer.config import render_default_config
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc, ops_service_pb2, ops_service_pb2_grpc
from bench.system.common import (
    PYTHON,
    Child,
    ProcessGroup,
    bench_config,
    free_port,
    grpc_serving,
    load_average,
    log,
    percentile,
    ratio,
    row,
    summarize,
    write_results,
)
from bench.system.direct_pull import SLOW_BATCH_S, SLOWER_BATCH_S
from bench.system.e2e import (
    JOBS_PER_SUBMIT_MESSAGE,
    SUBMIT_CONCURRENCY,
    TERMINAL,
    Burst,
    Measured,
    Stack,
    batch_burst,
    burst,
    light_load,
    run_one,
    seconds,
    submit_request,
    system_cpu_ms_per_job,
)
from bench.system.noop_model import noop_model_config

SECTION = "direct_pull"
A_NAME = "A: today (scheduler in the data path)"
B_NAME = "B: batchers pull from JetStream"
PROCESSES = ("gateway", "scheduler", "batcher", "nats-server")
# What beats A by more than this, with every guarantee kept, is adopted (issue 14, item 4).
ADOPT_ABOVE = 1.20
# The kill check's victim dies once this many of its jobs were seen RUNNING.
KILL_AFTER_RUNNING = 20
WATCH_OPEN_S = 0.5
PAUSE_SETTLE_S = 0.5
PAUSED_FOR_S = 1.0
CANCEL_CHECK_JOBS = 200


class DirectStack(Stack):
    """nats-server + gateway + scheduler (control plane only) + direct-pull batcher(s), each its
    own process; `batcher` is the first direct-pull process (its CPU is the batcher's)."""

    def __init__(
        self,
        group: ProcessGroup,
        *,
        name: str,
        ack_wait_s: float,
        renew_s: float,
        batchers: int = 1,
        model: dict[str, Any] | None = None,
    ) -> None:
        self.group = group
        self.nats = group.nats(name)
        self.config = bench_config(
            self.nats.url,
            models=[noop_model_config(**(model or {}))],
            batcher={"torch_threads": 1},
            scheduler={"ack_wait_s": ack_wait_s, "lease_renew_interval_s": renew_s},
        )
        self.gateway = group.service("gateway", self.config)
        self.scheduler = group.service("scheduler", self.config)
        self.pullers = [self._puller(f"{name}-direct-pull-{i}") for i in range(batchers)]
        self.batcher = self.pullers[0]

    def _puller(self, label: str) -> Child:
        port = free_port()
        config = self.config.replace(batcher={"port": port, "scheduler_address": "", "batcher_id": label})
        path = self.group.tmp / f"{label}.toml"
        path.write_text(render_default_config(config))
        return self.group.command(
            label,
            [PYTHON, "-m", "bench.system.direct_pull", "--config", str(path)],
            ready=lambda c: grpc_serving(c.address),
            port=port,
        )

    def stop_services(self) -> None:
        for child in [*reversed(self.pullers), self.scheduler, self.gateway]:
            self.group.stop(child, timeout_s=30)


async def measure(stack: Stack, count: int, light: int) -> tuple[Burst, Burst, list[float]]:
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        for _ in range(20):  # warm-up; the first one also waits for the batcher
            await run_one(stub, timeout_s=120)
        unary = await burst(stub, stack, count)
        batched = await batch_burst(stub, stack, count)
        out = Measured()
        await light_load(stub, light, out)
    return unary, batched, out.end_to_end_ms[-1]


async def kill_check(stack: DirectStack, count: int) -> dict[str, float]:
    """A batch-API burst (labelled, watched by label from before the first submit) on two
    direct-pull batchers; the first is killed (SIGKILL) once KILL_AFTER_RUNNING of its jobs were
    seen RUNNING, so it dies holding work. Reported: how many jobs had an attempt cut by the kill
    (they end with attempt 2), how long after the kill the slowest of them started again (its
    latest attempt's start_time), and how many jobs ended other than SUCCEEDED, or not at all."""
    request = submit_request()
    request.labels["bench"] = "kill-check"
    victim = stack.pullers[0]
    killed_at = 0.0
    finals: dict[str, job_pb2.Job] = {}
    submitted: list[str] = []
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        for _ in range(20):
            await run_one(stub, timeout_s=120)
        watch = stub.WatchJobs(job_service_pb2.WatchJobsRequest(labels={"bench": "kill-check"}), timeout=60)
        # The stream answers only with changes: give the gateway a moment to open its watch.
        await asyncio.sleep(WATCH_OPEN_S)

        async def messages() -> Any:
            for first in range(0, count, JOBS_PER_SUBMIT_MESSAGE):
                size = min(JOBS_PER_SUBMIT_MESSAGE, count - first)
                yield job_service_pb2.SubmitJobsRequest(
                    items=[job_service_pb2.SubmitJobsItem(job=request, correlation_id=str(i)) for i in range(size)]
                )

        async def submit() -> None:
            async for response in stub.SubmitJobs(messages()):
                submitted.extend(a.job.job_id for a in response.answers if a.HasField("job"))

        submitting = asyncio.create_task(submit())
        running_on_victim: set[str] = set()
        async for response in watch:
            for change in response.changes:
                job = change.job
                if job.state == job_pb2.JOB_STATE_RUNNING and job.batcher_id == victim.name:
                    running_on_victim.add(job.job_id)
                if job.state in TERMINAL:
                    finals[change.job_id] = job
            if not killed_at and len(running_on_victim) >= KILL_AFTER_RUNNING:
                os.kill(victim.pid, signal.SIGKILL)
                killed_at = time.time()
                log(f"kill check: killed {victim.name} after {len(finals)} jobs had ended")
            if submitting.done() and len(finals) >= len(submitted):
                break
        watch.cancel()
        await submitting
    again = [seconds(j.start_time) - killed_at for j in finals.values() if j.attempt >= 2]
    return {
        "kill: jobs whose attempt the kill cut (they ran again)": float(len(again)),
        "kill: slowest of them, kill -> started again, s": max(again) if again else float("nan"),
        "kill: last job's end after the kill, s": max(seconds(j.end_time) for j in finals.values()) - killed_at,
        "kill: jobs not SUCCEEDED": float(sum(1 for j in finals.values() if j.state != job_pb2.JOB_STATE_SUCCEEDED)),
        "kill: jobs without a terminal state": float(len(submitted) - len(finals)),
    }


async def cancel_and_pause_check(stack: DirectStack, count: int) -> dict[str, float]:
    """On one direct-pull batcher with the slowed model. Cancel: `count` jobs submitted in one
    go (they are pulled and written RUNNING at once, then wait their turn in the engine), then
    the last half cancelled at once; reported: how many were RUNNING when cancelled, how many of
    those ended CANCELED (the rest had a result first), and the slowest cancel -> CANCELED.
    Pause: the queue paused through the control plane's OpsService, jobs submitted, and how many
    started while it was paused; then resumed, and how long until all had ended."""
    request = submit_request()
    found: dict[str, float] = {}
    async with (
        grpc.aio.insecure_channel(stack.gateway.address) as channel,
        grpc.aio.insecure_channel(stack.scheduler.address) as ops_channel,
    ):
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        ops = ops_service_pb2_grpc.OpsServiceStub(ops_channel)
        for _ in range(20):
            await run_one(stub, timeout_s=120)

        async def submit_all(n: int) -> list[str]:
            items = [job_service_pb2.SubmitJobsItem(job=request, correlation_id=str(i)) for i in range(n)]

            async def messages() -> Any:
                for first in range(0, n, JOBS_PER_SUBMIT_MESSAGE):
                    yield job_service_pb2.SubmitJobsRequest(items=items[first : first + JOBS_PER_SUBMIT_MESSAGE])

            return [a.job.job_id async for r in stub.SubmitJobs(messages()) for a in r.answers if a.HasField("job")]

        async def finals_of(job_ids: list[str]) -> dict[str, job_pb2.Job]:
            finals: dict[str, job_pb2.Job] = {}
            async for response in stub.WatchJobs(job_service_pb2.WatchJobsRequest(job_ids=job_ids), timeout=120):
                for change in response.changes:
                    if change.HasField("job") and change.job.state in TERMINAL:
                        finals[change.job_id] = change.job
            return finals

        job_ids = await submit_all(count)
        cancelled_at: dict[str, float] = {}
        running: set[str] = set()

        async def cancel(job_id: str) -> None:
            try:
                answer = await stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id, reason="bench"))
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.FAILED_PRECONDITION:  # it had ended already
                    raise
                return
            cancelled_at[job_id] = time.time()
            if answer.job.state == job_pb2.JOB_STATE_CANCELLING:
                running.add(job_id)

        await asyncio.gather(*(cancel(job_id) for job_id in job_ids[count // 2 :]))
        finals = await finals_of(job_ids)
        ended = [finals[j] for j in running if j in finals]
        canceled = [j for j in ended if j.state == job_pb2.JOB_STATE_CANCELED]
        found["cancel: jobs RUNNING when cancelled"] = float(len(running))
        found["cancel: of those, ended CANCELED"] = float(len(canceled))
        found["cancel: of those, ended otherwise (a result came first)"] = float(len(ended) - len(canceled))
        found["cancel: slowest cancel -> CANCELED, s"] = max(
            (seconds(j.end_time) - cancelled_at[j.job_id] for j in canceled), default=float("nan")
        )

        await ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name="noop"))
        await asyncio.sleep(PAUSE_SETTLE_S)  # the pause reaches the batcher's watch of the queues bucket
        paused_ids = await submit_all(JOBS_PER_SUBMIT_MESSAGE)
        await asyncio.sleep(PAUSED_FOR_S)
        records = await stub.GetJobs(job_service_pb2.GetJobsRequest(job_ids=paused_ids))
        found["pause: jobs started while paused"] = float(
            sum(1 for r in records.results if r.job.state != job_pb2.JOB_STATE_QUEUED)
        )
        resumed_at = time.time()
        await ops.ResumeQueue(ops_service_pb2.ResumeQueueRequest(model_name="noop"))
        paused_finals = await finals_of(paused_ids)
        found["pause: resume -> the last job ended, s"] = max(seconds(j.end_time) for j in paused_finals.values()) - (
            resumed_at
        )
    return found


def cpu_ms(bursts: list[Burst], process: str, count: int) -> list[float]:
    return [b.cpu_s.get(process, 0.0) / count * 1e3 for b in bursts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst", type=int, default=3000)
    parser.add_argument("--light", type=int, default=300, help="jobs one at a time, per stack")
    parser.add_argument("--ack-wait-s", type=float, default=4.0, help="B's AckWait")
    parser.add_argument("--renew-s", type=float, default=1.0, help="B's in-progress ack interval")
    parser.add_argument(
        "--checks",
        action="store_true",
        help="also B's guarantee checks: a batcher killed mid-burst, cancel of running jobs, pause",
    )
    parser.add_argument("--smoke", action="store_true", help="1 round, 300 jobs, 30 light: checks the script")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.burst, args.light = 1, 300, 30
    found: dict[str, list[tuple[Burst, Burst, list[float]]]] = {A_NAME: [], B_NAME: []}
    loads = [load_average()[0]]
    checks: dict[str, float] = {}
    with ProcessGroup() as group, asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        for round_number in range(1, args.rounds + 1):
            for name in (A_NAME, B_NAME):
                stack: Stack
                if name == A_NAME:
                    stack = Stack(group, name=f"nats-{round_number}-a")
                else:
                    stack = DirectStack(
                        group, name=f"nats-{round_number}-b", ack_wait_s=args.ack_wait_s, renew_s=args.renew_s
                    )
                unary, batched, light = runner.run(measure(stack, args.burst, args.light))
                stack.stop_services()
                found[name].append((unary, batched, light))
                loads.append(load_average()[0])
                log(
                    f"round {round_number}, {name}: unary {unary.collected_rate:.0f}/s, batch APIs "
                    f"{batched.collected_rate:.0f}/s, light p50 {percentile(light, 50):.2f} ms; CPU per job "
                    f"{system_cpu_ms_per_job([unary], args.burst)[0]:.2f} / "
                    f"{system_cpu_ms_per_job([batched], args.burst)[0]:.2f} ms; failed {unary.failed}+{batched.failed}"
                )
        if args.checks:
            slow = {"loader": "bench.system.direct_pull:build_slow"}
            stack = DirectStack(group, name="nats-cancel", ack_wait_s=args.ack_wait_s, renew_s=args.renew_s, model=slow)
            checks.update(runner.run(cancel_and_pause_check(stack, CANCEL_CHECK_JOBS)))
            stack.stop_services()
            stack = DirectStack(
                group,
                name="nats-kill",
                ack_wait_s=args.ack_wait_s,
                renew_s=args.renew_s,
                batchers=2,
                model=slow,
            )
            checks.update(runner.run(kill_check(stack, args.burst)))
            stack.stop_services()
            log("checks: " + ", ".join(f"{k} {v:.2f}" for k, v in checks.items()))
    report(found, args, loads, checks)


def report(
    found: dict[str, list[tuple[Burst, Burst, list[float]]]],
    args: argparse.Namespace,
    loads: list[float],
    checks: dict[str, float],
) -> None:
    n = args.burst
    rows = []
    medians: dict[str, dict[str, float]] = {}
    for name, runs in found.items():
        unary = [u for u, _, _ in runs]
        batched = [b for _, b, _ in runs]
        figures = {
            "unary burst, completed jobs/s": [b.collected_rate for b in unary],
            "batch-API burst, completed jobs/s": [b.collected_rate for b in batched],
            "light load, round trip p50 (SubmitJob -> WatchJob terminal), ms": [percentile(s, 50) for _, _, s in runs],
            "light load, round trip p99, ms": [percentile(s, 99) for _, _, s in runs],
            "CPU per job, unary burst (4 processes), ms": system_cpu_ms_per_job(unary, n),
            "CPU per job, batch-API burst (4 processes), ms": system_cpu_ms_per_job(batched, n),
            **{f"{p} CPU per job, unary burst, ms": cpu_ms(unary, p, n) for p in PROCESSES},
            **{f"{p} CPU per job, batch-API burst, ms": cpu_ms(batched, p, n) for p in PROCESSES},
            "jobs not SUCCEEDED (both bursts)": [float(u.failed + b.failed) for u, b, _ in runs],
        }
        medians[name] = {}
        for label, values in figures.items():
            unit = "ms" if label.endswith("ms") else "jobs" if label.startswith("jobs") else "jobs/s"
            rows.append(row(f"{name}: {label}", values, unit))
            medians[name][label] = float(summarize(values)["value"])
    for label, value in checks.items():
        unit = "s" if label.endswith(", s") else "jobs"
        rows.append(row(f"B's checks: {label}", [value], unit))
    a, b = medians[A_NAME], medians[B_NAME]
    ratios = []
    for label in ("unary burst, completed jobs/s", "batch-API burst, completed jobs/s"):
        value = b[label] / a[label]
        ratios.append(ratio(f"B / A: {label}", value, f"> {ADOPT_ABOVE:.2f} to adopt", value > ADOPT_ABOVE))
    for label in (
        "light load, round trip p50 (SubmitJob -> WatchJob terminal), ms",
        "CPU per job, unary burst (4 processes), ms",
        "CPU per job, batch-API burst (4 processes), ms",
    ):
        ratios.append(ratio(f"B / A: {label}", b[label] / a[label], "for the decision (lower is better)", None))
    notes = [
        f"{args.rounds} round(s), A then B in each, a fresh stack (nats-server included) per setup and round; per "
        f"stack 20 warm-up jobs, a unary burst of {n} ({SUBMIT_CONCURRENCY} in flight, then GetJob per job), a "
        f"batch-API burst of {n} (SubmitJobs of {JOBS_PER_SUBMIT_MESSAGE} per message, then one WatchJobs) and "
        f"{args.light} jobs one at a time. The no-op model (bench/system/noop_model.py, max batch 32, delay 2 ms, "
        "torch 1 thread) makes every figure the system's own cost.",
        "A runs the shipped services with their defaults (AckWait 30 s, renewals every 10 s: a killed batcher's "
        "jobs are re-queued at once when its WorkerService stream drops). B's scheduler is the control plane only "
        "(no batcher connects; it pulls nothing but still follows every record write for webhooks, writes queue "
        f"snapshots and hears queued notices); B's AckWait is {args.ack_wait_s:g} s with in-progress acks every "
        f"{args.renew_s:g} s, the lease a direct-pull batcher needs for a killed batcher's jobs to run elsewhere "
        "within 5 s. 'batcher' in B is the direct-pull process (bench/system/direct_pull.py).",
        "B is a prototype that skips dead letters, retries, execution timeouts, claim-check inputs and large "
        "results, the tenants' queued counters and drain (none of which runs on a no-op burst's path), so its "
        "gain is an upper bound of what a full direct-pull batcher would measure.",
        "Load average (1 min) before the run and after each stack: " + ", ".join(f"{v:.2f}" for v in loads) + ".",
    ]
    if checks:
        notes.append(
            "B's checks (--checks), each on a fresh B stack with the no-op model slowed so that work is held when "
            f"it matters. Cancel ({SLOWER_BATCH_S * 1e3:.0f} ms per batch): "
            f"{CANCEL_CHECK_JOBS} jobs submitted, the last half cancelled at once (the batcher hears the cancel "
            "notices itself and drops a held item not yet started; the Drop, or the Finish of one that ran, "
            "writes CANCELED on the CANCELLING record). Pause: PauseQueue on the control plane's OpsService, "
            f"{JOBS_PER_SUBMIT_MESSAGE} jobs submitted, {PAUSED_FOR_S:g} s later how many started, then "
            f"ResumeQueue. Kill ({SLOW_BATCH_S * 1e3:.0f} ms per batch): two direct-pull batchers, a batch-API burst, the first killed with SIGKILL "
            f"once {KILL_AFTER_RUNNING} of its jobs were seen RUNNING; its jobs come back when their AckWait "
            "lapses (nothing renews them) and the other batcher's RUNNING compare-and-set takes the record over "
            "(attempt 2)."
        )
    write_results(
        SECTION,
        "A/B: batchers pulling from JetStream themselves vs the scheduler in the data path",
        rows,
        ratios,
        notes,
        quick=args.smoke,
    )
    log(f"wrote bench/results/{SECTION}.md")


if __name__ == "__main__":
    main()
