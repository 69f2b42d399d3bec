"""Crash safety with real processes: nats-server, gateway, scheduler and batcher each in its own
process. 2,000 jobs are submitted through the gateway while the batcher, then the scheduler, then
the gateway are killed with SIGKILL and restarted. Every accepted job must end exactly once, in
SUCCEEDED, with exactly one result commit, and every acceptance must be backed by a durably queued
job.

Result commits are counted from the jobs bucket's own history: a KV watch started before the first
submission sees every stored write of every record, in order (an ordered consumer on the bucket's
stream), so a job whose SUCCEEDED record was written twice would show two SUCCEEDED writes.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from asyncinfer.codecs.record import decode_record
from asyncinfer.config import Config, render_default_config
from asyncinfer.embedded_nats import NatsServerProcess, free_port
from asyncinfer.jobs import JobState
from asyncinfer.nats.connection import connect
from asyncinfer.v1 import job_service_pb2, job_service_pb2_grpc, tensor_pb2
from tests.processes import Service, until
from tests.waits import WAIT_S

JOBS = 2000
SUBMITTERS = 8
ACK_WAIT_S = 3.0
# About 100 submissions/s in all: 2,000 take ~20 s, long enough for three kills and restarts.
SUBMIT_PAUSE_S = 0.07
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400), pytest.mark.nats_fallback]


@dataclass
class History:
    """What the jobs bucket saw: per key, the states written in order, and when SUCCEEDED ones were."""

    states: dict[str, list[JobState]] = field(default_factory=dict)
    succeeded_at: list[float] = field(default_factory=list)

    def succeeded_after(self, t: float) -> float | None:
        return next((s for s in self.succeeded_at if s > t), None)

    def terminal(self, key: str) -> bool:
        states = self.states.get(key)
        return states is not None and bool(states) and states[-1].is_terminal


@dataclass
class Submissions:
    accepted: dict[str, str] = field(default_factory=dict)  # job_id -> tenant key
    accepted_at: list[float] = field(default_factory=list)
    unavailable: int = 0
    issued: int = 0


def crash_config(nats_url: str, ports: dict[str, int]) -> Config:
    config = Config()
    # 0.3 s per batch of up to 32: about 200 jobs/s, below the submission rate, so jobs pile up in
    # flight (in the batcher's queue and batches) and every kill catches some.
    model = {
        **config.models[0].model_dump(),
        "loader": "services.batcher.models.demo:build_slow_model",
        "max_attempts": 5,
    }
    return config.replace(
        nats={"url": nats_url},
        gateway={"port": ports["gateway"], "metrics_port": 0},
        scheduler={
            "port": ports["scheduler"],
            "metrics_port": 0,
            "ack_wait_s": ACK_WAIT_S,
            "lease_renew_interval_s": 1.0,
            "poll_interval_ms": 50.0,
            "queue_stats_interval_s": 0.5,
        },
        batcher={
            "port": ports["batcher"],
            "metrics_port": 0,
            "scheduler_address": f"127.0.0.1:{ports['scheduler']}",
            "reconnect_delay_s": 0.2,
            "shutdown_grace_s": 1.0,
        },
        logging={"level": "warning", "format": "json"},
        models=[model],
    )


async def watch_jobs(nats_url: str, history: History, ready: asyncio.Event) -> None:
    config = Config().replace(nats={"url": nats_url})
    nc = await connect(config.nats, name="crash-test-watch")
    try:
        js = nc.jetstream()
        while True:  # the bucket exists once the gateway or scheduler has started
            try:
                kv = await js.key_value(config.nats.jobs_bucket)
                break
            except Exception:
                await asyncio.sleep(0.05)
        watcher = await kv.watchall()
        ready.set()
        async for entry in watcher:
            if entry is None or entry.value is None:
                continue
            state = decode_record(entry.value).state
            history.states.setdefault(entry.key, []).append(state)
            if state == JobState.SUCCEEDED:
                history.succeeded_at.append(time.monotonic())
    finally:
        await nc.close()


async def submit_all(gateway_port: int, submissions: Submissions, counter: list[int]) -> None:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([1, 2, 3, 4])
    request = job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[x])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway_port}") as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        while counter[0] < JOBS:
            counter[0] += 1
            while True:
                submissions.issued += 1
                try:
                    response = await stub.SubmitJob(request, timeout=10)
                except grpc.aio.AioRpcError as error:
                    if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise
                    submissions.unavailable += 1
                    await asyncio.sleep(0.05)  # the gateway is restarting: try again shortly
                    continue
                submissions.accepted[response.job.job_id] = f"default.{response.job.job_id}"
                submissions.accepted_at.append(time.monotonic())
                break
            await asyncio.sleep(SUBMIT_PAUSE_S)  # a modest, steady rate: the kills land mid-submission


async def test_kill_batcher_scheduler_gateway_nothing_lost_nothing_twice(
    nats_server: NatsServerProcess, tmp_path: Path
) -> None:
    ports = {name: free_port() for name in ("gateway", "scheduler", "batcher")}
    config_file = tmp_path / "asyncinfer.toml"
    config_file.write_text(render_default_config(crash_config(nats_server.url, ports)))
    services = {name: Service(name, config_file, tmp_path, ports[name]) for name in ports}
    history, submissions = History(), Submissions()
    ready = asyncio.Event()
    watch = asyncio.create_task(watch_jobs(nats_server.url, history, ready))
    submitters: list[asyncio.Task[None]] = []
    leases_back: asyncio.Task[None] | None = None
    figures: dict[str, float] = {}
    began = time.monotonic()
    try:
        for name in ("gateway", "scheduler", "batcher"):
            await services[name].start()
        await asyncio.wait_for(ready.wait(), WAIT_S)
        counter = [0]
        submitters = [
            asyncio.create_task(submit_all(ports["gateway"], submissions, counter)) for _ in range(SUBMITTERS)
        ]

        async def accepted(count: int) -> None:
            while len(submissions.accepted) < count:
                if any(t.done() for t in submitters) and counter[0] < JOBS:
                    await asyncio.gather(*submitters)  # a submitter failed: raise its error
                await asyncio.sleep(0.01)

        async def succeeded_since(t: float) -> float:
            await until(lambda: history.succeeded_after(t) is not None, WAIT_S)
            return history.succeeded_after(t) or 0.0

        def running() -> int:
            return sum(1 for states in history.states.values() if states[-1] == JobState.RUNNING)

        # 1. The batcher dies mid-run (work orders in its queue and batches), and comes back.
        await accepted(400)
        killed = time.monotonic()
        running_at_batcher_kill = running()
        services["batcher"].kill()
        await services["batcher"].start()
        figures["batcher_restart_s"] = time.monotonic() - killed
        figures["batcher_recovery_s"] = await succeeded_since(time.monotonic()) - killed

        # 2. The scheduler dies with jobs in flight (leases held), and comes back; it returns its
        # predecessor's jobs at once (services.scheduler.lease_reclaim), not after ack_wait.
        await accepted(900)
        killed = time.monotonic()
        running_at_scheduler_kill = running()
        services["scheduler"].kill()
        await services["scheduler"].start()
        figures["scheduler_restart_s"] = time.monotonic() - killed
        figures["scheduler_recovery_s"] = await succeeded_since(time.monotonic()) - killed
        stranded = [k for k, states in history.states.items() if states[-1] == JobState.RUNNING]

        async def stranded_done(killed: float) -> None:
            await until(lambda: all(history.terminal(key) for key in stranded), WAIT_S)
            figures["scheduler_leases_back_s"] = time.monotonic() - killed

        leases_back = asyncio.create_task(stranded_done(killed))

        # 3. The gateway dies mid-submission; the clients retry until it is back.
        await accepted(1400)
        killed = time.monotonic()
        assert counter[0] < JOBS, "submission ended before the gateway kill: slow it down"
        services["gateway"].kill()
        await services["gateway"].start()
        await until(lambda: bool(submissions.accepted_at) and submissions.accepted_at[-1] > killed, WAIT_S)
        figures["gateway_recovery_s"] = submissions.accepted_at[-1] - killed

        await asyncio.wait_for(asyncio.gather(*submitters), 60)

        await until(lambda: all(history.terminal(key) for key in submissions.accepted.values()), 60)
        await asyncio.wait_for(leases_back, WAIT_S)
        figures["total_s"] = time.monotonic() - began
    finally:
        last = Counter(states[-1].value for states in history.states.values())
        print(
            f"crash test phase {figures}, progress: accepted {len(submissions.accepted)}, records by state {dict(last)}"
        )
        background = [*submitters, *([leases_back] if leases_back is not None else [])]
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        for service in services.values():
            service.stop()
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)

    keys = list(submissions.accepted.values())
    assert len(keys) == JOBS
    # Every acceptance is a job that was durably queued: its record exists and it ran.
    assert all(key in history.states for key in keys)
    final = Counter(history.states[key][-1] for key in keys)
    assert final == {JobState.SUCCEEDED: JOBS}, final
    # Exactly one terminal state and one result commit per job, over every record in the bucket.
    commits = {key: states.count(JobState.SUCCEEDED) for key, states in history.states.items()}
    assert max(commits.values()) == 1
    terminal_writes = {key: sum(s.is_terminal for s in states) for key, states in history.states.items()}
    assert max(terminal_writes[key] for key in keys) == 1
    attempts_spent = Counter(states.count(JobState.RUNNING) for key, states in history.states.items() if key in keys)
    unaccepted = set(history.states) - set(keys)
    print(
        f"crash: {JOBS} accepted, all SUCCEEDED once. kill -9 batcher ({running_at_batcher_kill} RUNNING): "
        f"restarted in {figures['batcher_restart_s']:.2f} s, results again {figures['batcher_recovery_s']:.2f} s "
        f"after the kill; kill -9 scheduler ({running_at_scheduler_kill} RUNNING): restarted in "
        f"{figures['scheduler_restart_s']:.2f} s, results again {figures['scheduler_recovery_s']:.2f} s after, "
        f"its stranded jobs all done {figures['scheduler_leases_back_s']:.2f} s after (ack_wait {ACK_WAIT_S:g} s); "
        f"kill -9 gateway: accepting again {figures['gateway_recovery_s']:.2f} s after; "
        f"{submissions.unavailable} submits retried; "
        f"runs per job {dict(sorted(attempts_spent.items()))}; records not acknowledged to the client "
        f"{len(unaccepted)}; total {figures['total_s']:.1f} s"
    )
