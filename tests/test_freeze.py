"""A laptop that sleeps: `asyncinfer up` and its nats-server frozen together (SIGSTOP to both, as a
suspend or a paused VM stops them) for longer than AckWait, the keepalives and some jobs' queue
deadlines, then resumed (SIGCONT). The stack carries on by itself: every job ends once (a job
whose lease lapsed during the freeze is adopted or run again, its result recorded once), the jobs
whose deadline passed while they were queued end EXPIRED without running, every webhook is
delivered under one webhook-id per job, an SDK client watching through the freeze sees each job
to its end, and the log holds no error and no warning repeated per job (session 28: 166 warnings
`live_attempt_redelivered` for 175 jobs in flight, before they were throttled)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from asyncinfer.client import AsyncClient, Job
from asyncinfer.codecs.record import decode_record
from asyncinfer.config import Config, render_default_config
from asyncinfer.embedded_nats import free_port
from asyncinfer.jobs import JobState
from asyncinfer.nats.connection import connect
from tests.hanging_models import SLOW_VALUE
from tests.test_up_grpcurl import close, start_up
from tests.waits import WAIT_S
from tests.webhook_receiver import Receiver, receiver, webhook_config

__all__ = ["receiver"]  # the fixture, used by name

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

FREEZE_S = 6.0
ACK_WAIT_S = 2.0
KEEPALIVE_S = 1.5
QUEUE_TTL_S = 3.0
JOBS = 20
SHORT_LIVED = 4
# A warning logged this many times or more in one freeze is one per job, not one per event.
REPEATED_WARNING = 5


def freeze_config(tmp_path: Path, ports: dict[str, int]) -> Config:
    config = Config()
    demo = config.models[0].model_dump()
    # 0.3 s per batch of up to 4, 8 at most in the batcher: the rest waits in the work stream.
    model = {
        **demo,
        "loader": "services.batcher.models.demo:build_slow_model",
        "max_batch_size": 4,
        "max_queue_size": 8,
    }
    # One job at a time, a row starting with SLOW_VALUE computing for 1.5 s: the jobs behind it
    # stay queued in the work stream until it ends.
    one_at_a_time = {
        **demo,
        "name": "one",
        "loader": "tests.hanging_models:build_hanging_model",
        "max_batch_size": 1,
        "max_queue_size": 1,
        "warm_up": False,
    }
    config = config.replace(
        embedded_nats={"port": ports["nats"], "monitor_port": 0, "store_dir": str(tmp_path / "data" / "nats")},
        nats={"ping_interval_s": 1.0},
        gateway={"port": ports["gateway"], "metrics_port": 0, "keepalive_s": KEEPALIVE_S},
        scheduler={
            "port": ports["scheduler"],
            "metrics_port": ports["metrics"],
            "ack_wait_s": ACK_WAIT_S,
            "lease_renew_interval_s": 0.5,
            "keepalive_s": KEEPALIVE_S,
            "poll_interval_ms": 50.0,
        },
        batcher={"port": ports["batcher"], "metrics_port": 0, "keepalive_s": KEEPALIVE_S, "reconnect_delay_s": 0.2},
        console={"port": 0},
        logging={"level": "info", "format": "json"},
        models=[model, one_at_a_time],
    )
    return webhook_config(config)


async def test_up_frozen_past_its_leases_and_deadlines_carries_on_by_itself(
    tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent.parent))  # `up` loads tests.hanging_models
    ports = {name: free_port() for name in ("nats", "gateway", "scheduler", "batcher", "metrics")}
    config = freeze_config(tmp_path, ports)
    (tmp_path / "asyncinfer.toml").write_text(render_default_config(config))
    up = await asyncio.to_thread(start_up, tmp_path / "asyncinfer.toml", ports, tmp_path)
    history: dict[str, list[JobState]] = {}
    changed = asyncio.Condition()
    background: list[asyncio.Task[None]] = []
    try:
        # The test's own connection pings rarely: the freeze does not make it reconnect.
        observer = config.replace(nats={"url": f"nats://127.0.0.1:{ports['nats']}", "ping_interval_s": 60.0})
        nc = await connect(observer.nats, name="freeze-test")
        try:
            watcher = await (await nc.jetstream().key_value(config.nats.jobs_bucket)).watchall()

            async def record_history() -> None:
                async for entry in watcher:
                    if entry is not None and entry.value is not None:
                        async with changed:
                            history.setdefault(entry.key, []).append(decode_record(entry.value).state)
                            changed.notify_all()

            background.append(asyncio.create_task(record_history()))
            x = {"x": np.ones((1, 4), np.float32)}
            async with AsyncClient(up.gateway, keepalive_s=KEEPALIVE_S) as client:
                jobs = [await client.submit("demo", x, callback=receiver.url(f"/{i}")) for i in range(JOBS)]
                slow = await client.submit("one", {"x": np.array([[SLOW_VALUE, 1, 1, 1]], np.float32)})
                seen: dict[str, list[Job]] = {}

                async def watch(job: Job) -> None:
                    async for snapshot in client.watch(job, timeout_s=60):
                        seen.setdefault(job.job_id, []).append(snapshot)

                def running(key: str) -> bool:
                    return key in history and history[key][-1] is JobState.RUNNING

                async with asyncio.timeout(WAIT_S), changed:
                    await changed.wait_for(lambda: running(f"default.{slow.job_id}"))
                # Queued behind it (it computes for 1.5 s), their deadline passing in the freeze.
                short = [await client.submit("one", x, queue_ttl_s=QUEUE_TTL_S) for _ in range(SHORT_LIVED)]
                watching = [asyncio.create_task(watch(job)) for job in (jobs[-1], short[0])]
                background += watching
                keys = [f"default.{job.job_id}" for job in [*jobs, slow, *short]]
                assert sum(running(key) for key in keys) >= 4  # jobs in the batcher's hands as it freezes
                nats_pid = up.nats_pid()
                os.killpg(up.process.pid, signal.SIGSTOP)
                os.kill(nats_pid, signal.SIGSTOP)
                try:
                    await asyncio.sleep(FREEZE_S)  # the scenario: asleep past every lease and keepalive
                finally:
                    os.kill(nats_pid, signal.SIGCONT)
                    os.killpg(up.process.pid, signal.SIGCONT)
                resumed = time.monotonic()

                def ended() -> bool:
                    return all(key in history and history[key][-1].is_terminal for key in keys)

                async with asyncio.timeout(WAIT_S):
                    async with changed:
                        await changed.wait_for(ended)
                    await asyncio.gather(*watching)
                    for i in range(JOBS):
                        await receiver.wait_for(f"/{i}", 1)
                print(f"freeze: every job ended {time.monotonic() - resumed:.1f} s after the resume")
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await nc.close()
    finally:
        close(up)

    assert Counter(history[f"default.{job.job_id}"][-1] for job in [*jobs, slow]) == {JobState.SUCCEEDED: JOBS + 1}
    # Past their deadline while queued: EXPIRED, never run.
    for job in short:
        assert history[f"default.{job.job_id}"] == [JobState.EXPIRED], history[f"default.{job.job_id}"]
    # One terminal write per job, whatever ran twice.
    assert all(sum(state.is_terminal for state in states) == 1 for states in history.values())
    # At least once, and under one webhook-id per job (a repeat is the same delivery).
    assert all(len({r.headers["webhook-id"] for r in receiver.at(f"/{i}")}) == 1 for i in range(JOBS))
    assert all(not isinstance(r.verified, Exception) for r in receiver.received)
    assert seen[jobs[-1].job_id][-1].state.value == "SUCCEEDED"
    assert seen[short[0].job_id][-1].state.value == "EXPIRED"
    logs = up.logs()
    assert not [entry for entry in logs if entry.get("level") in ("error", "critical")]
    warnings = Counter(entry["event"] for entry in logs if entry.get("level") == "warning")
    assert all(count < REPEATED_WARNING for count in warnings.values()), warnings
