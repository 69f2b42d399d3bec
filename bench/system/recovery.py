"""Recovery (issue 6, item 6): how long jobs stay stranded when a process dies with kill -9.

1. Batcher: two batchers connected to one scheduler, jobs in flight on both (a model that sleeps
   200 ms per batch of 8); kill -9 one batcher; time from the kill until every job that was on it
   is RUNNING again on the other (and until they have all SUCCEEDED).
2. Scheduler, restarted: kill -9 the scheduler with jobs in flight and more queued, start a new
   scheduler process on the same port at once: time to serving, to the batchers reconnecting, to
   the first dispatch, and until every job in flight at the kill is RUNNING again (its lease,
   ack_wait_s, has to lapse first).
3. Scheduler, taken over: a second scheduler (with its own batcher) already running on the same
   queues; kill -9 the first: time to the next dispatch anywhere, and until the dead scheduler's
   jobs are RUNNING again through the second one.

Times come from watching the job records' KV updates from the bench process. Each figure is the
median of 3 runs (--quick: 1).

    .venv/bin/python -m bench.system.recovery [--quick]

Writes bench/results/recovery.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import nats
import numpy as np

from asyncinfer.config import Config, ModelConfig, TensorSpecConfig
from asyncinfer.embedded_nats import free_port
from asyncinfer.jobs import JobState
from asyncinfer.v1 import job_service_pb2, job_service_pb2_grpc, tensor_pb2
from bench.system.backlog_tools import RecordUpdate, RecordWatch, Results, services_config, wait_batchers
from bench.system.common import Child, ProcessGroup
from bench.system.recovery_models import SLEEP_S

MODEL = "sleepy"
MAX_BATCH = 8
CREDITS = 32  # max_queue_size: the jobs one batcher holds
ACK_WAIT_S = 2.0
LEASE_RENEW_S = 0.5
TIMEOUT_S = 60.0


def sleepy_model() -> ModelConfig:
    return ModelConfig(
        name=MODEL,
        loader="bench.system.recovery_models:build_sleep_model",
        max_batch_size=MAX_BATCH,
        max_queue_delay_ms=2.0,
        max_queue_size=CREDITS,
        inputs=(TensorSpecConfig(name="x", datatype="FP32", shape=(-1, 4)),),
        outputs=(TensorSpecConfig(name="y", datatype="FP32", shape=(-1, 4)),),
    )


def request() -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.raw_contents = np.arange(4, dtype="<f4").tobytes()
    return job_service_pb2.SubmitJobRequest(model_name=MODEL, inputs=[x])


async def submit(address: str, count: int) -> list[str]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        answers = await asyncio.gather(*(stub.SubmitJob(request(), timeout=10) for _ in range(count)))
    return [a.job.job_id for a in answers]


class Jobs:
    """The job records of one run, as the bench saw them change."""

    def __init__(self, watch: RecordWatch, ids: list[str]) -> None:
        self.ids = set(ids)
        self.history: dict[str, list[RecordUpdate]] = {i: [] for i in ids}
        for update in watch.updates:
            if update.record.job_id in self.ids:
                self.history[update.record.job_id].append(update)
        watch.listen(self._add)

    def _add(self, update: RecordUpdate) -> None:
        if update.record.job_id in self.ids:
            self.history[update.record.job_id].append(update)

    def ever_running(self) -> int:
        return sum(1 for h in self.history.values() if any(u.record.state == JobState.RUNNING for u in h))

    def all_terminal(self) -> bool:
        return all(h and h[-1].record.state.is_terminal for h in self.history.values())

    def at(self, moment: float) -> dict[str, RecordUpdate]:
        """Each job's last update before `moment`."""
        out = {}
        for job_id, updates in self.history.items():
            before = [u for u in updates if u.at <= moment]
            if before:
                out[job_id] = before[-1]
        return out

    def after(self, job_id: str, moment: float) -> list[RecordUpdate]:
        return [u for u in self.history[job_id] if u.at > moment]

    def states(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for h in self.history.values():
            state = h[-1].record.state.value if h else "unseen"
            counts[state] = counts.get(state, 0) + 1
        return counts


async def until(condition: Callable[[], bool], timeout_s: float = TIMEOUT_S, what: str = "") -> float:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)
    return time.monotonic()


@dataclass
class Stranded:
    """Jobs in flight at a kill and when each ran again."""

    count: int
    rerun_s: list[float]  # kill -> RUNNING again (next attempt)
    done_s: list[float]  # kill -> SUCCEEDED
    detect_s: float = float("nan")  # kill -> the last of them back in the queue (batcher kill)


def stranded(jobs: Jobs, killed_at: float, in_flight: dict[str, int]) -> Stranded:
    """For jobs RUNNING (attempt a) at the kill: when a later attempt went RUNNING, and SUCCEEDED."""
    rerun, done = [], []
    for job_id, attempt in in_flight.items():
        later = jobs.after(job_id, killed_at)
        again = next((u for u in later if u.record.state == JobState.RUNNING and u.record.attempt > attempt), None)
        if again is None:
            continue  # it finished on its first attempt: it was not on the dead process
        rerun.append(again.at - killed_at)
        end = next((u for u in later if u.record.state == JobState.SUCCEEDED), None)
        if end is not None:
            done.append(end.at - killed_at)
    return Stranded(len(rerun), rerun, done)


def running_at(jobs: Jobs, moment: float) -> dict[str, int]:
    return {i: u.record.attempt for i, u in jobs.at(moment).items() if u.record.state == JobState.RUNNING}


class Bench:
    def __init__(self, group: ProcessGroup, config: Config, watch: RecordWatch) -> None:
        self.group = group
        self.config = config
        self.watch = watch
        self.gateway_address = ""
        self.batchers_on_victim = 0  # batchers to wait for after a scheduler restart
        self.configs: dict[int, tuple[str, Config, str]] = {}  # pid -> (kind, config, label)
        self.counter = 0

    def batcher_config(self, name: str, scheduler: Child) -> Config:
        return self.config.replace(
            batcher={"port": free_port(), "batcher_id": name, "scheduler_address": scheduler.address}
        )

    async def start(self, kind: str, config: Config, label: str) -> Child:
        """A service process, started in a thread so that the record watch keeps its timestamps."""
        self.counter += 1
        child = await asyncio.to_thread(self.group.service, kind, config, label=f"{label}-{self.counter}")
        self.configs[child.pid] = (kind, config, label)
        return child

    async def restart(self, old: Child) -> Child:
        """The same service again: same config, same ports."""
        kind, config, label = self.configs[old.pid]
        return await self.start(kind, config, label)


# --- 1. batcher killed -----------------------------------------------------------------------


async def batcher_kill(bench: Bench, victim: Child, jobs_n: int) -> Stranded:
    ids = await submit(bench.gateway_address, jobs_n)
    jobs = Jobs(bench.watch, ids)
    await until(lambda: jobs.ever_running() == jobs_n, what="every job dispatched")
    killed_at = time.monotonic()
    victim.kill9()
    in_flight = running_at(jobs, killed_at)
    await until(jobs.all_terminal, what=f"every job finished ({jobs.states()})")
    result = stranded(jobs, killed_at, in_flight)
    lost = [
        u
        for i in in_flight
        for u in jobs.after(i, killed_at)
        if u.record.state == JobState.QUEUED and u.record.last_error and u.record.last_error.reason == "WORKER_LOST"
    ]
    result.detect_s = max((u.at - killed_at for u in lost), default=float("nan"))
    return result


# --- 2./3. scheduler killed ------------------------------------------------------------------


@dataclass
class SchedulerKill:
    stranded: Stranded
    first_dispatch_s: float
    restart_s: float = float("nan")
    reconnect_s: float = float("nan")


async def scheduler_kill(
    bench: Bench, victim: Child, jobs_n: int, in_flight_n: int, restart: bool
) -> tuple[SchedulerKill, Child]:
    ids = await submit(bench.gateway_address, jobs_n)
    jobs = Jobs(bench.watch, ids)
    await until(lambda: jobs.ever_running() >= in_flight_n, what=f"{in_flight_n} jobs dispatched")
    killed_at = time.monotonic()
    victim.kill9()
    in_flight = running_at(jobs, killed_at)

    def dispatched_since() -> bool:
        return any(u.record.state == JobState.RUNNING for i in jobs.ids for u in jobs.after(i, killed_at))

    first_dispatch = asyncio.create_task(until(dispatched_since, what="a dispatch after the kill"))
    restart_s = reconnect_s = float("nan")
    survivor = victim
    if restart:
        survivor = await bench.restart(victim)
        restart_s = time.monotonic() - killed_at
        await wait_batchers(survivor.address, MODEL, bench.batchers_on_victim)
        reconnect_s = time.monotonic() - killed_at
    first_s = await first_dispatch - killed_at
    await until(jobs.all_terminal, what=f"every job finished ({jobs.states()})")
    result = SchedulerKill(stranded(jobs, killed_at, in_flight), first_s, restart_s, reconnect_s)
    return result, survivor


# --- the run ---------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> Results:
    runs = 1 if args.quick else 3
    results = Results("recovery", "Recovery after kill -9: batcher and scheduler", quick=args.quick)
    with ProcessGroup() as group:
        nats_server = group.nats()
        config = services_config(
            nats_server.url,
            [sleepy_model()],
            scheduler={"ack_wait_s": ACK_WAIT_S, "lease_renew_interval_s": LEASE_RENEW_S},
        )
        nc = await nats.connect(nats_server.url)
        watch = RecordWatch(nc.jetstream())
        bench = Bench(group, config, watch)
        try:
            gateway = await bench.start("gateway", config, "gateway")
            bench.gateway_address = gateway.address
            scheduler = await bench.start("scheduler", config, "scheduler-1")
            await watch.start()
            await bench.start("batcher", bench.batcher_config("batcher-b", scheduler), "batcher-b")
            victim = await bench.start("batcher", bench.batcher_config("batcher-a", scheduler), "batcher-a")
            await wait_batchers(scheduler.address, MODEL, 2)
            await submit(gateway.address, 8)  # warm-up: models loaded, streams open
            await asyncio.sleep(1.0)

            # 1. a batcher dies; its jobs go to the other one
            print("1. kill -9 a batcher", flush=True)
            batcher_runs = []
            for run_index in range(runs):
                # Half the two batchers' credits: each holds about CREDITS / 2, so the survivor
                # has room for the dead one's jobs at once (the figure is the hand-over, not a wait
                # for capacity).
                outcome = await batcher_kill(bench, victim, CREDITS)
                batcher_runs.append(outcome)
                print(
                    f"  run {run_index + 1}: {outcome.count} jobs stranded, all RUNNING again after "
                    f"{max(outcome.rerun_s, default=float('nan')) * 1000:.0f} ms",
                    flush=True,
                )
                victim = await bench.start("batcher", bench.batcher_config("batcher-a", scheduler), "batcher-a")
                await wait_batchers(scheduler.address, MODEL, 2)

            # 2. the scheduler dies and is restarted at once
            print("2. kill -9 the scheduler, restart it", flush=True)
            bench.batchers_on_victim = 2
            restart_runs = []
            for run_index in range(runs):
                restarted, scheduler = await scheduler_kill(bench, scheduler, 3 * CREDITS, 2 * CREDITS, restart=True)
                restart_runs.append(restarted)
                print(
                    f"  run {run_index + 1}: serving after {restarted.restart_s * 1000:.0f} ms, first dispatch "
                    f"{restarted.first_dispatch_s * 1000:.0f} ms, {restarted.stranded.count} stranded jobs RUNNING "
                    f"again after {max(restarted.stranded.rerun_s, default=float('nan')) * 1000:.0f} ms",
                    flush=True,
                )
                await asyncio.sleep(0.5)

            # 3. a second scheduler (with its own batcher) takes over
            print("3. kill -9 one of two schedulers", flush=True)
            await asyncio.to_thread(group.stop, victim)
            bench.batchers_on_victim = 1
            second_config = config.replace(scheduler={"port": free_port()})
            second = await bench.start("scheduler", second_config, "scheduler-2")
            await bench.start("batcher", bench.batcher_config("batcher-c", second), "batcher-c")
            await wait_batchers(second.address, MODEL, 1)
            await wait_batchers(scheduler.address, MODEL, 1)
            takeover_runs = []
            for run_index in range(runs):
                taken, _ = await scheduler_kill(bench, scheduler, 3 * CREDITS, 2 * CREDITS, restart=False)
                takeover_runs.append(taken)
                print(
                    f"  run {run_index + 1}: first dispatch {taken.first_dispatch_s * 1000:.0f} ms, "
                    f"{taken.stranded.count} stranded jobs RUNNING again after "
                    f"{max(taken.stranded.rerun_s, default=float('nan')) * 1000:.0f} ms",
                    flush=True,
                )
                if run_index < runs - 1:
                    scheduler = await bench.restart(scheduler)
                    await wait_batchers(scheduler.address, MODEL, 1)
        finally:
            await watch.stop()
            await nc.close()

    ms = 1000.0
    results.row(
        "batcher kill: jobs stranded on the killed batcher",
        [r.count for r in batcher_runs],
        "jobs",
        f"of {CREDITS} in flight on two batchers with {CREDITS} credits each",
    )
    results.row(
        "batcher kill -> its jobs back in the queue (WORKER_LOST)",
        [r.detect_s * ms for r in batcher_runs],
        "ms",
        "the scheduler sees the work stream break",
    )
    results.row(
        "batcher kill -> all its jobs RUNNING again on the other batcher",
        [max(r.rerun_s) * ms for r in batcher_runs if r.rerun_s],
        "ms",
        "headline",
    )
    results.row(
        "batcher kill -> all its jobs SUCCEEDED",
        [max(r.done_s) * ms for r in batcher_runs if r.done_s],
        "ms",
        f"includes computing them ({SLEEP_S * 1000:.0f} ms per batch of {MAX_BATCH}) behind the other's own",
    )
    results.row(
        "scheduler restart: process serving again",
        [r.restart_s * ms for r in restart_runs],
        "ms",
        "kill -> new process's gRPC health SERVING",
    )
    results.row(
        "scheduler restart: batchers reconnected",
        [r.reconnect_s * ms for r in restart_runs],
        "ms",
        f"batcher reconnect_delay_s {config.batcher.reconnect_delay_s:g}",
    )
    results.row(
        "scheduler restart: kill -> dispatch resumed (first job RUNNING)",
        [r.first_dispatch_s * ms for r in restart_runs],
        "ms",
        "headline: queued jobs flow again",
    )
    results.row(
        "scheduler restart: kill -> every job in flight at the kill RUNNING again",
        [max(r.stranded.rerun_s) * ms for r in restart_runs if r.stranded.rerun_s],
        "ms",
        f"{np.median([r.stranded.count for r in restart_runs]):.0f} jobs; bounded by ack_wait_s {ACK_WAIT_S:g}",
    )
    results.row(
        "scheduler takeover: kill -> next dispatch (second scheduler)",
        [r.first_dispatch_s * ms for r in takeover_runs],
        "ms",
        "the second scheduler never stopped dispatching",
    )
    results.row(
        "scheduler takeover: kill -> the dead scheduler's jobs RUNNING again",
        [max(r.stranded.rerun_s) * ms for r in takeover_runs if r.stranded.rerun_s],
        "ms",
        f"{np.median([r.stranded.count for r in takeover_runs]):.0f} jobs; bounded by ack_wait_s {ACK_WAIT_S:g}",
    )
    results.note(
        f"Setup: nats-server, gateway, schedulers and batchers as separate processes on one machine; model "
        f"'{MODEL}' sleeps {SLEEP_S * 1000:.0f} ms per batch (max_batch_size {MAX_BATCH}, max_queue_size "
        f"{CREDITS} = credits per batcher). Bench config: scheduler ack_wait_s {ACK_WAIT_S:g} (default 30), "
        f"lease_renew_interval_s {LEASE_RENEW_S:g} (default 10), poll_interval_ms "
        f"{config.scheduler.poll_interval_ms:g}; batcher reconnect_delay_s {config.batcher.reconnect_delay_s:g}. "
        f"Median of {runs} run(s)."
    )
    results.note(
        "What bounds each figure: a killed batcher is noticed at once (its TCP connection resets, the work "
        "stream breaks, the scheduler re-queues its jobs with no delay), so that figure is a few NATS "
        "round trips and a dispatch. A killed scheduler's jobs stay leased until their lease lapses: "
        "JetStream redelivers an unacked message ack_wait_s after its last in-progress ack, which the "
        "scheduler sent every lease_renew_interval_s, so the stranded jobs run again between "
        "ack_wait_s - lease_renew_interval_s and ack_wait_s (+ one poll) after the kill, with the defaults "
        "20-30 s. Queued jobs are not held up that long: a restarted scheduler dispatches them as soon as "
        "it is serving (Python start-up and NATS declarations) and a batcher has reconnected: a batcher "
        "retries every reconnect_delay_s (fixed, no backoff from a shorter first try), so dispatch resumes at "
        "the first retry after the restart, and the in-flight jobs follow once both that and their lease "
        "have passed. A second scheduler never stops dispatching."
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one run of each: seconds")
    args = parser.parse_args()
    started = time.monotonic()
    results = asyncio.run(run(args))
    path = results.write()
    print(f"wrote {path} in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
