"""A chaos soak: the whole stack as processes, a mixed workload, and seeded kills at random moments.

Not a CI test. One nats-server; 2 gateways, 2 schedulers and 2 batchers (batcher i dispatched by
scheduler i), each its own `asyncinfer <service> --config <file>` process; the demo model and a slow
one (0.3 s a batch), max_attempts 5. For `--duration-s` seconds a modest workload runs (unary
SubmitJob with priorities, some with idempotency keys and resubmitted; SubmitJobs of a few jobs;
CancelJob of some slow ones; a WatchJobs of a label; a small file batch now and then) while a
`random.Random(seed)` picks, every few seconds, a service to kill -9, SIGTERM, or SIGSTOP for a few
seconds, and restarts it after a random delay (a scheduler now and then never: its peer returns its
jobs). Then everything that should run is up again, the workload stops, and the soak waits (bounded)
for every job to end and checks:

- every job the jobs bucket ever held reached exactly one terminal state (every write of the bucket
  is watched from before the first submission: two terminal writes of one key is a finding);
- a job whose CancelJob answered CANCELLING or CANCELED ends CANCELED;
- an idempotent resubmission answered the job ID of the first;
- every file batch ends COMPLETED with every record once in its output;
- nothing SUCCEEDED ran more attempts than max_attempts;
- no service exited but those the soak stopped, and no log holds a traceback or "exited 70".

The bucket's watch (an ordered consumer) is remade after each reconnect (--nats-chaos) from the
stream sequence after the last write it delivered, so it sees every write the bucket still holds. The
bucket keeps one write a key: a write replaced before the watch's consumer got to it is never seen
(~1 in 800 on the shared 2-core machine, bench/results/soak_session39.md; never a key's last write).
The summary counts them (`watch_missed`, `watch_gaps`): while that is 0 the checks saw every write.

It prints a summary (jobs, kills, restarts, the longest a job went without a write, findings) and
exits 1 when there is a finding. The logs stay in --workdir (a temporary folder by default, kept
when there is a finding).

    .venv/bin/python -m bench.soak --seed 1 --duration-s 180
    .venv/bin/python -m bench.soak --seed 7 --duration-s 180 --nats-chaos   # the nats-server too
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from asyncinfer.codecs.record import decode_record
from asyncinfer.config import Config, render_default_config
from asyncinfer.embedded_nats import NatsServerProcess, free_port
from asyncinfer.jobs import JobRecord, JobState
from asyncinfer.nats import KV_OP, DeliverPolicy, JetStreamContext, Msg, api
from asyncinfer.nats.connection import connect, connection_changes
from asyncinfer.v1 import (
    batch_service_pb2,
    batch_service_pb2_grpc,
    job_pb2,
    job_service_pb2,
    job_service_pb2_grpc,
    tensor_pb2,
)

BIN = Path(sys.executable).parent
MAX_ATTEMPTS = 5
ACK_WAIT_S = 3.0
SLOW_MODEL = "slow"
WATCH_LABEL = {"soak-watch": "yes"}
BATCH_RECORDS = 64
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# The rest of the stack keeps a scheduler with every batcher's work: the batcher of a scheduler left
# down keeps knocking at it, the other batcher runs the jobs.
KINDS = ("gateway", "scheduler", "batcher")
PRIORITIES = (job_pb2.PRIORITY_HIGH, job_pb2.PRIORITY_NORMAL, job_pb2.PRIORITY_LOW, job_pb2.PRIORITY_UNSPECIFIED)
GRACEFUL_STOP_S = 20.0
FIRST_CONNECT_WAIT_S = 120.0


@dataclass
class Findings:
    lines: list[str] = field(default_factory=list)

    def add(self, line: str) -> None:
        print(f"FINDING: {line}", flush=True)
        self.lines.append(line)


class Service:
    """One service process, restartable on the same port; every run's exit is recorded."""

    def __init__(self, kind: str, index: int, config_file: Path, log_dir: Path, port: int) -> None:
        self.kind = kind
        self.name = f"{kind}-{index}"
        self.port = port
        self._config_file = config_file
        self._log_dir = log_dir
        self.process: asyncio.subprocess.Process | None = None
        self.starts = 0
        self.stopped_by_us = False  # the current run's end was ours (a signal the soak sent)
        self.paused = False
        self.ready = False  # printed its "serving on" line: the chaos may pick it
        self.left_down = False
        # (log file, exit code, whether the soak ended it) of every run that has ended.
        self.runs: list[tuple[Path, int | None, bool]] = []
        self._drain: asyncio.Task[None] | None = None

    def log_path(self) -> Path:
        return self._log_dir / f"{self.name}-{self.starts}.log"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self) -> None:
        self.starts += 1
        self.stopped_by_us = False
        self.ready = False
        with self.log_path().open("w") as log:
            self.process = await asyncio.create_subprocess_exec(
                str(BIN / "asyncinfer"),
                self.kind,
                "--config",
                str(self._config_file),
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
            )
        assert self.process.stdout is not None
        line = (await asyncio.wait_for(self.process.stdout.readline(), 60)).decode()
        if f"serving on 127.0.0.1:{self.port}" not in line:
            raise RuntimeError(f"{self.name} did not start: {line!r}; its log {self.log_path()}")
        self._drain = asyncio.create_task(self._read_rest(self.process.stdout))
        self.ready = True

    async def _read_rest(self, stdout: asyncio.StreamReader) -> None:
        while await stdout.readline():  # a full pipe would block the service
            pass

    async def signal(self, signum: int) -> None:
        assert self.process is not None
        if signum in (signal.SIGKILL, signal.SIGTERM):
            self.stopped_by_us = True
            self.ready = False
        self.process.send_signal(signum)
        self.paused = signum == signal.SIGSTOP

    async def ended(self, findings: Findings, timeout_s: float = GRACEFUL_STOP_S) -> None:
        """Waits for the run to end (bounded: then kill -9, a finding) and records its exit."""
        assert self.process is not None
        try:
            code: int | None = await asyncio.wait_for(self.process.wait(), timeout_s)
        except TimeoutError:
            findings.add(f"{self.name} (run {self.starts}) did not exit within {timeout_s:.0f} s of SIGTERM")
            self.process.kill()
            code = await self.process.wait()
        await self._end_drain()
        self.runs.append((self.log_path(), code, self.stopped_by_us))

    async def _end_drain(self) -> None:
        if self._drain is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drain, 5)
            self._drain.cancel()
            await asyncio.gather(self._drain, return_exceptions=True)
            self._drain = None

    async def close(self) -> None:
        """The soak's end: a run still going is ended (kill -9) and counted as the soak's."""
        if self.process is None:
            return
        if self.running:
            self.stopped_by_us = True
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGCONT)
                self.process.kill()
            await self.ended(Findings(), 10)
        elif not self.runs or self.runs[-1][0] != self.log_path():
            await self.ended(Findings(), 1)


@dataclass
class History:
    """Every write of the jobs bucket, in order: (monotonic time, record) per key."""

    writes: dict[str, list[tuple[float, JobRecord]]] = field(default_factory=dict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    resumed: int = 0  # the watch remade after a reconnect
    remade: asyncio.Event = field(default_factory=asyncio.Event)  # set at the first remake
    written: asyncio.Event = field(default_factory=asyncio.Event)  # set at each write (a waiter clears it)
    missed: int = 0  # stream sequences the watch never delivered (writes replaced while it was away)
    gaps: list[tuple[float, int]] = field(default_factory=list)  # (wall time, sequences skipped) of each gap

    def last(self, key: str) -> JobRecord | None:
        records = self.writes.get(key)
        return records[-1][1] if records else None

    def open_keys(self) -> list[str]:
        return [key for key, records in self.writes.items() if not records[-1][1].state.is_terminal]


@dataclass
class Workload:
    accepted: set[str] = field(default_factory=set)  # job IDs
    idempotent: dict[str, set[str]] = field(default_factory=dict)  # key -> job IDs answered
    cancels: dict[str, str] = field(default_factory=dict)  # job ID -> the state CancelJob answered
    batches: list[str] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)
    watched_changes: int = 0
    calls: int = 0


def soak_config(nats_url: str, ports: dict[str, int], index: int, log_level: str = "info") -> Config:
    config = Config()
    demo = {**config.models[0].model_dump(), "max_attempts": MAX_ATTEMPTS}
    slow = {**demo, "name": SLOW_MODEL, "loader": "services.batcher.models.demo:build_slow_model"}
    return config.replace(
        # As the Kubernetes configuration (deploy/k8s/generate_config.py): a service restarted while
        # the nats-server is away waits for it. The default (0) gives up after 3 tries (exit 69), as
        # `up` and the CLI want; a supervisor then starts it again (the soak's `back` as well).
        nats={"url": nats_url, "first_connect_wait_s": FIRST_CONNECT_WAIT_S},
        gateway={"port": ports[f"gateway-{index}"], "metrics_port": 0},
        scheduler={
            "port": ports[f"scheduler-{index}"],
            "metrics_port": 0,
            "ack_wait_s": ACK_WAIT_S,
            "lease_renew_interval_s": 1.0,
            "poll_interval_ms": 50.0,
            "queue_stats_interval_s": 1.0,
            "inline_result_max_bytes": 512,
        },
        batcher={
            "port": ports[f"batcher-{index}"],
            "metrics_port": 0,
            "scheduler_address": f"127.0.0.1:{ports[f'scheduler-{index}']}",
            "reconnect_delay_s": 0.2,
            "shutdown_grace_s": 1.0,
        },
        batches={"chunk_records": 16, "chunks_in_flight": 2, "drive_interval_s": 0.2, "adopt_interval_s": 0.5},
        logging={"level": log_level, "format": "json"},
        models=[demo, slow],
    )


def job_request(rng: random.Random, model: str, **fields: object) -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([rng.random() for _ in range(4)])
    return job_service_pb2.SubmitJobRequest(
        model_name=model,
        inputs=[x],
        priority=rng.choice(PRIORITIES),
        **fields,  # type: ignore[arg-type]
    )


class Client:
    """Calls through a random gateway, again on UNAVAILABLE (a gateway down) within a deadline."""

    def __init__(self, ports: list[int], rng: random.Random, workload: Workload) -> None:
        self._channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for port in ports]
        self._rng = rng
        self._workload = workload

    def jobs(self) -> job_service_pb2_grpc.JobServiceStub:
        return job_service_pb2_grpc.JobServiceStub(self._rng.choice(self._channels))  # type: ignore[no-untyped-call]

    def batches(self) -> batch_service_pb2_grpc.BatchServiceStub:
        return batch_service_pb2_grpc.BatchServiceStub(self._rng.choice(self._channels))  # type: ignore[no-untyped-call]

    async def retrying(self, call, *, safe: bool, give_up_s: float = 30.0):  # type: ignore[no-untyped-def]
        """`call(stub)` until an answer; a DEADLINE_EXCEEDED of a call that is not safe to repeat
        (it may have happened) is not tried again: None."""
        give_up_at = time.monotonic() + give_up_s
        while True:
            self._workload.calls += 1
            try:
                return await call()
            except grpc.aio.AioRpcError as error:
                self._workload.refused[error.code().name] += 1
                if error.code() not in RETRYABLE or time.monotonic() > give_up_at:
                    raise
                if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not safe:
                    return None
                await asyncio.sleep(0.1)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close(None)


async def watch_jobs_bucket(nats_url: str, history: History) -> None:
    """Every write of the jobs bucket into `history`, in stream order, through an ordered consumer
    remade after each reconnect from the stream sequence after the last one it delivered (a
    nats-server killed and started again loses the consumer, and nats-py's remake of it may not come
    before the writes made meanwhile are gone). The bucket keeps one write a key, so a write replaced
    before the consumer delivered it (the watch away, or behind) is gone, and counted
    (`History.missed`: the sequences the watch skipped)."""
    config = Config().replace(nats={"url": nats_url})
    nc = await connect(config.nats, name="soak-watch")
    stream, prefix = f"KV_{config.nats.jobs_bucket}", f"$KV.{config.nats.jobs_bucket}."
    last_seq = 0

    async def on_write(msg: Msg) -> None:
        nonlocal last_seq
        seq = msg.metadata.sequence.stream
        if seq <= last_seq:  # the consumer before a remake, or nats-py's own remake, again
            return
        if seq > last_seq + 1:
            history.missed += seq - last_seq - 1
            history.gaps.append((time.time(), seq - last_seq - 1))
        last_seq = seq
        if not msg.data or KV_OP in (msg.headers or {}):
            return
        key = msg.subject.removeprefix(prefix)
        history.writes.setdefault(key, []).append((time.monotonic(), decode_record(msg.data)))
        history.written.set()

    async def subscribe() -> JetStreamContext.PushSubscription:
        while True:  # the bucket exists once a gateway or scheduler has started; after a restart,
            try:  # JetStream answers a little after the connection is back
                return await js.subscribe(
                    prefix + ">",
                    stream=stream,
                    cb=on_write,
                    ordered_consumer=True,
                    deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                    config=api.ConsumerConfig(opt_start_seq=last_seq + 1),
                    idle_heartbeat=1.0,
                )
            except Exception:
                await asyncio.sleep(0.1)

    try:
        js = nc.jetstream()
        changes = connection_changes(nc)
        subscription = await subscribe()
        history.ready.set()
        stale = False
        while True:
            changed = changes.next()
            if stale and nc.is_connected:
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()
                subscription = await subscribe()
                history.resumed += 1
                history.remade.set()
                stale = False
                continue
            await changed.wait()
            stale = True
    finally:
        await nc.close()


async def submit_one(client: Client, rng: random.Random, workload: Workload, findings: Findings) -> None:
    model = SLOW_MODEL if rng.random() < 0.4 else "demo"
    labels = WATCH_LABEL if rng.random() < 0.2 else {}
    if rng.random() < 0.2:
        key = f"soak-{uuid.uuid4().hex[:12]}"
        request = job_request(rng, model, idempotency_key=key, labels=labels)
        for _ in range(2 if rng.random() < 0.7 else 1):  # resubmitted, through a random gateway
            answer = await client.retrying(lambda r=request: client.jobs().SubmitJob(r, timeout=10), safe=True)
            workload.idempotent.setdefault(key, set()).add(answer.job.job_id)
            workload.accepted.add(answer.job.job_id)
            await asyncio.sleep(rng.uniform(0, 2))
        return
    request = job_request(rng, model, labels=labels)
    answer = await client.retrying(lambda: client.jobs().SubmitJob(request, timeout=10), safe=False)
    if answer is None:
        return
    job_id = answer.job.job_id
    workload.accepted.add(job_id)
    if model == SLOW_MODEL and rng.random() < 0.25:
        await asyncio.sleep(rng.uniform(0, 1.5))
        cancel = job_service_pb2.CancelJobRequest(job_id=job_id, reason="soak")
        try:
            got = await client.retrying(lambda: client.jobs().CancelJob(cancel, timeout=10), safe=True)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.FAILED_PRECONDITION:  # it had ended already
                findings.add(f"CancelJob {job_id}: {error.code().name} {error.details()}")
            return
        workload.cancels[job_id] = job_pb2.JobState.Name(got.job.state)


async def submit_several(client: Client, rng: random.Random, workload: Workload) -> None:
    jobs = [job_request(rng, rng.choice(("demo", SLOW_MODEL))) for _ in range(rng.randint(2, 5))]

    async def once() -> list[str]:
        async def requests() -> AsyncIterator[job_service_pb2.SubmitJobsRequest]:
            for i, job in enumerate(jobs):
                yield job_service_pb2.SubmitJobsRequest(job=job, correlation_id=str(i))

        ids = []
        async for answer in client.jobs().SubmitJobs(requests(), timeout=15):
            items = list(answer.answers) or [answer]
            ids += [item.job.job_id for item in items if item.job.job_id]
        return ids

    # Not repeated on a gateway's loss mid-stream: a repeat makes new jobs, and those answered are kept.
    with contextlib.suppress(grpc.aio.AioRpcError):
        workload.accepted.update(await client.retrying(once, safe=False) or [])


async def file_batch(client: Client, rng: random.Random, workload: Workload) -> None:
    records = [{"custom_id": f"r{i}", "inputs": {"x": [[i, 1.0, 2.0, 3.0]]}} for i in range(BATCH_RECORDS)]
    data = "".join(json.dumps(r) + "\n" for r in records).encode()

    async def upload() -> str:
        async def pieces() -> AsyncIterator[job_service_pb2.UploadInputRequest]:
            yield job_service_pb2.UploadInputRequest(metadata=job_service_pb2.UploadInputMetadata(size_bytes=len(data)))
            yield job_service_pb2.UploadInputRequest(chunk=data)

        return (await client.jobs().UploadInput(pieces(), timeout=15)).ref.ref

    ref = await client.retrying(upload, safe=True)
    key = f"soak-batch-{uuid.uuid4().hex[:8]}"
    request = batch_service_pb2.CreateBatchRequest(model_name="demo", input_ref=ref, idempotency_key=key)
    created = await client.retrying(lambda: client.batches().CreateBatch(request, timeout=15), safe=True)
    workload.batches.append(created.batch.batch_id)


async def workload_loop(
    client: Client, rng: random.Random, workload: Workload, findings: Findings, stop: asyncio.Event, rate: float
) -> None:
    """About `rate` jobs a second, each call its own owned task."""
    tasks: set[asyncio.Task[None]] = set()
    next_batch = time.monotonic() + rng.uniform(5, 15)

    async def guarded(coro) -> None:  # type: ignore[no-untyped-def]
        try:
            await coro
        except grpc.aio.AioRpcError as error:
            if error.code() not in RETRYABLE:
                findings.add(f"workload call: {error.code().name} {error.details()}")
        except Exception as error:  # a finding, not the soak's end
            findings.add(f"workload call raised {error!r}")

    while not stop.is_set():
        if len(tasks) < 400:  # bounded: a stack that stops answering does not pile up calls here
            roll = rng.random()
            coro = submit_several(client, rng, workload) if roll < 0.1 else submit_one(client, rng, workload, findings)
            task = asyncio.create_task(guarded(coro))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            if time.monotonic() > next_batch and sum(1 for _ in workload.batches) < 20:
                next_batch = time.monotonic() + rng.uniform(20, 40)
                batch = asyncio.create_task(guarded(file_batch(client, rng, workload)))
                tasks.add(batch)
                batch.add_done_callback(tasks.discard)
        await asyncio.sleep(rng.expovariate(rate / 1.3))  # SubmitJobs averages ~3.5 jobs
    await asyncio.gather(*tasks, return_exceptions=True)


async def label_watch(client: Client, workload: Workload, findings: Findings, stop: asyncio.Event) -> None:
    """A WatchJobs of a label, opened again whenever its gateway goes."""
    while not stop.is_set():
        try:
            stream = client.jobs().WatchJobs(job_service_pb2.WatchJobsRequest(labels=WATCH_LABEL))
            async for update in stream:
                workload.watched_changes += len(update.changes)
        except grpc.aio.AioRpcError as error:
            if error.code() not in (*RETRYABLE, grpc.StatusCode.CANCELLED):
                findings.add(f"WatchJobs ended {error.code().name}: {error.details()}")
        await asyncio.sleep(0.5)


@dataclass
class ChaosCounts:
    actions: Counter[str] = field(default_factory=Counter)
    restarts: int = 0
    left_down: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)


async def chaos(
    services: dict[str, Service],
    rng: random.Random,
    counts: ChaosCounts,
    findings: Findings,
    stop: asyncio.Event,
    nats: NatsServerProcess | None,
) -> None:
    """Every few seconds a random service of a kind whose other one is up: kill -9, SIGTERM or SIGSTOP;
    with `nats`, now and then the nats-server itself (kill -9 and a start on the same store, or SIGSTOP)."""
    started = time.monotonic()
    pending: set[asyncio.Task[None]] = set()
    nats_back: asyncio.Task[None] | None = None

    async def nats_again(server: NatsServerProcess, after_s: float, how: str) -> None:
        await asyncio.sleep(after_s)
        assert server.process is not None
        if how == "stop":
            server.process.send_signal(signal.SIGCONT)
            return
        try:
            await asyncio.to_thread(server.start, 30.0)
        except Exception as error:  # a finding, the soak goes on
            findings.add(f"nats-server did not start again: {error}")
            return
        counts.restarts += 1

    async def back(service: Service, after_s: float, how: str) -> None:
        await asyncio.sleep(after_s)
        if how == "stop":
            await service.signal(signal.SIGCONT)
            service.paused = False
            return
        await service.ended(findings)
        for _ in range(30):  # as a supervisor would, while NATS is away (a service exits then: start_failed)
            try:
                await service.start()
            except Exception as error:  # a finding, the soak goes on
                if "cannot connect to NATS" in service.log_path().read_text(errors="replace"):
                    await service.ended(findings)
                    service.runs[-1] = (*service.runs[-1][:2], True)  # NATS's absence, which the chaos made
                    await asyncio.sleep(1.0)
                    continue
                findings.add(f"{service.name} did not start again: {error}")
                return
            counts.restarts += 1
            return
        findings.add(f"{service.name} did not start again in 30 tries: NATS away")

    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.uniform(2.0, 6.0))
        if stop.is_set():
            break
        if nats is not None and (nats_back is None or nats_back.done()) and rng.random() < 0.12:
            how = rng.choice(("kill", "stop"))
            assert nats.process is not None
            if how == "kill":
                await asyncio.to_thread(nats.kill)
            else:
                nats.process.send_signal(signal.SIGSTOP)
            counts.actions[f"{how} nats"] += 1
            counts.log.append(
                f"{time.monotonic() - started:7.1f}s {time.strftime('%H:%M:%S', time.gmtime())} {how} nats-server"
            )
            nats_back = asyncio.create_task(nats_again(nats, rng.uniform(1.0, 4.0), how))
            continue
        kind = rng.choice(KINDS)
        pair = [service for service in services.values() if service.kind == kind]
        up = [service for service in pair if service.ready and service.running and not service.paused]
        if len(up) < len(pair):
            continue  # never both of a kind at once
        victim = rng.choice(up)
        how = rng.choices(("kill", "term", "stop"), weights=(6, 2, 2))[0]
        signum = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}[how]
        await victim.signal(signum)
        counts.actions[f"{how} {kind}"] += 1
        counts.log.append(
            f"{time.monotonic() - started:7.1f}s {time.strftime('%H:%M:%S', time.gmtime())} {how} {victim.name} (run {victim.starts})"
        )
        if kind == "scheduler" and how == "kill" and not counts.left_down and rng.random() < 0.25:
            victim.left_down = True  # never started again: its peer returns its jobs
            counts.left_down.append(victim.name)
            await victim.ended(findings)
            continue
        task = asyncio.create_task(back(victim, rng.uniform(0.5, 5.0), how))
        pending.add(task)
        task.add_done_callback(pending.discard)
    await asyncio.gather(*pending, *([nats_back] if nats_back else []))


async def check(
    history: History,
    workload: Workload,
    client: Client,
    services: dict[str, Service],
    findings: Findings,
    drain_s: float,
    nats_url: str,
) -> dict[str, object]:
    give_up_at = time.monotonic() + drain_s
    keys = {f"default.{job_id}" for job_id in workload.accepted}
    while time.monotonic() < give_up_at:
        if not history.open_keys() and all(history.last(key) is not None for key in keys):
            break
        await asyncio.sleep(0.5)
    for key in sorted(keys):
        if history.last(key) is None:
            findings.add(f"accepted job {key} never written to the jobs bucket")
    open_keys = history.open_keys()
    for key in open_keys[:20]:
        record = history.last(key)
        assert record is not None
        findings.add(
            f"{key} not terminal after the drain: {record.state.name} attempt {record.attempt}, "
            f"dispatched by {record.dispatched_by} at {record.lease_subject}; {await work_state(nats_url, record)}; "
            f"its writes: {writes_of(history, key)}"
        )
    if len(open_keys) > 20:
        findings.add(f"... and {len(open_keys) - 20} more not terminal")
    longest_gap, longest_key = 0.0, ""
    for key, records in history.writes.items():
        terminal = [record for _, record in records if record.state.is_terminal]
        if len(terminal) > 1:
            findings.add(f"{key} written terminal {len(terminal)} times: {[r.state.name for _, r in records]}")
        final = records[-1][1]
        if final.state == JobState.SUCCEEDED and final.attempt > final.max_attempts:
            findings.add(f"{key} SUCCEEDED at attempt {final.attempt} of max {final.max_attempts}")
        for (before, record), (after, _) in itertools.pairwise(records):
            if not record.state.is_terminal and after - before > longest_gap:
                longest_gap, longest_key = after - before, f"{key} in {record.state.name}"
    for job_id, answered in workload.cancels.items():
        final = history.last(f"default.{job_id}")
        if answered in ("JOB_STATE_CANCELLING", "JOB_STATE_CANCELED") and final and final.state != JobState.CANCELED:
            findings.add(f"{job_id}: CancelJob answered {answered}, the job ended {final.state.name}")
    for key, ids in workload.idempotent.items():
        if len(ids) > 1:
            findings.add(f"idempotency key {key} answered {len(ids)} job IDs: {sorted(ids)}")
    batch_states: Counter[str] = Counter()
    for batch_id in workload.batches:
        batch = await batch_ended(client, batch_id, give_up_at + 60)
        state = batch_service_pb2.BatchState.Name(batch.state) if batch else "UNKNOWN"
        batch_states[state] += 1
        if batch is None or batch.state != batch_service_pb2.BATCH_STATE_COMPLETED:
            findings.add(f"batch {batch_id} ended {state}: {batch.failure_message if batch else ''}")
            continue
        ids = await output_ids(client, batch_id)
        if Counter(ids) != Counter(f"r{i}" for i in range(BATCH_RECORDS)):
            twice = [i for i, n in Counter(ids).items() if n > 1]
            findings.add(f"batch {batch_id}: {len(ids)} output lines, twice {twice[:5]}")
    for service in services.values():
        for log, code, ours in service.runs:
            if not ours:
                findings.add(f"{service.name} exited {code} on its own: {log}\n{tail(log)}")
        for log in sorted(service._log_dir.glob(f"{service.name}-*.log")):
            text = log.read_text(errors="replace")
            if "Traceback" in text or "exited 70" in text or '"exit_code": 70' in text:
                findings.add(f"{log.name}: a traceback or exit 70 in its log:\n{traceback_excerpt(text)}")
    states = Counter(records[-1][1].state.name for records in history.writes.values())
    failed = Counter(
        (records[-1][1].error.reason if records[-1][1].error else "?")
        for records in history.writes.values()
        if records[-1][1].state == JobState.FAILED
    )
    return {
        "jobs": len(history.writes),
        "accepted": len(workload.accepted),
        "states": dict(states),
        "failed_reasons": dict(failed),
        "batches": dict(batch_states),
        "cancels": len(workload.cancels),
        "idempotent_keys": len(workload.idempotent),
        "watched_changes": workload.watched_changes,
        "watch_resumed": history.resumed,
        "watch_missed": history.missed,
        "watch_gaps": [f"{time.strftime('%H:%M:%S', time.gmtime(at))} {n}" for at, n in history.gaps[:20]],
        "longest_without_a_write_s": round(longest_gap, 1),
        "longest_without_a_write": longest_key,
        "refused": dict(workload.refused),
    }


def writes_of(history: History, key: str) -> str:
    """A job's writes, each (UTC time, state, attempt, the dispatching instance's run, the delivery's
    number and stream sequence)."""
    now_monotonic, now = time.monotonic(), time.time()
    lines = []
    for at, record in history.writes.get(key, []):
        when = time.strftime("%H:%M:%S", time.gmtime(now - (now_monotonic - at)))
        delivery = ".".join(record.lease_subject.split(".")[4:6])
        lines.append(f"{when} {record.state.name} #{record.attempt} {record.dispatched_by[-6:]} {delivery}")
    return "; ".join(lines)


async def work_state(nats_url: str, record: JobRecord) -> str:
    """Where a stranded job's work message is: still in the WORK stream, and what its consumer holds."""
    config = Config().replace(nats={"url": nats_url})
    tokens = record.lease_subject.split(".")
    if len(tokens) < 7:
        return "no delivery named"
    consumer, seq = tokens[3], int(tokens[5])
    try:
        nc = await connect(config.nats, name="soak-work-state")
    except Exception as error:
        return f"NATS: {error!r}"
    try:
        js = nc.jetstream()
        try:
            await js.get_msg(config.nats.work_stream, seq)
            there = "its message is in the stream"
        except Exception as error:
            there = f"its message is not in the stream ({type(error).__name__})"
        info = await js.consumer_info(config.nats.work_stream, consumer)
        return (
            f"{there}; {consumer}: ack floor {info.ack_floor.stream_seq if info.ack_floor else None}, "
            f"delivered {info.delivered.stream_seq if info.delivered else None}, ack pending {info.num_ack_pending}, "
            f"redelivered {info.num_redelivered}, waiting {info.num_waiting}, pending {info.num_pending}"
        )
    except Exception as error:
        return f"NATS: {error!r}"
    finally:
        await nc.close()


async def batch_ended(client: Client, batch_id: str, give_up_at: float) -> batch_service_pb2.Batch | None:
    terminal = {
        batch_service_pb2.BATCH_STATE_COMPLETED,
        batch_service_pb2.BATCH_STATE_FAILED,
        batch_service_pb2.BATCH_STATE_EXPIRED,
        batch_service_pb2.BATCH_STATE_CANCELLED,
    }
    batch = None
    request = batch_service_pb2.GetBatchRequest(batch_id=batch_id)
    while time.monotonic() < give_up_at:
        batch = (await client.retrying(lambda: client.batches().GetBatch(request, timeout=10), safe=True)).batch
        if batch.state in terminal:
            return batch
        await asyncio.sleep(0.5)
    return batch


async def output_ids(client: Client, batch_id: str) -> list[str]:
    async def read() -> list[str]:
        data = bytearray()
        request = batch_service_pb2.ReadBatchFileRequest(batch_id=batch_id, file=batch_service_pb2.BATCH_FILE_OUTPUT)
        async for piece in client.batches().ReadBatchFile(request, timeout=30):
            data += piece.chunk
        return [json.loads(line)["custom_id"] for line in data.decode().splitlines() if line]

    result: list[str] = await client.retrying(read, safe=True)
    return result


def tail(log: Path, lines: int = 8) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def traceback_excerpt(text: str) -> str:
    at = text.find("Traceback")
    if at < 0:
        at = max(0, text.find("exit"))
    return text[max(0, at - 300) : at + 2500]


async def soak(
    seed: int,
    duration_s: float,
    rate: float,
    drain_s: float,
    workdir: Path,
    nats_chaos: bool,
    nats_trace: bool = False,
    log_level: str = "info",
) -> int:
    findings = Findings()
    # -DV: every protocol operation the server receives and sends (payloads too) into nats.log.
    trace = ("-DV",) if nats_trace else ()
    nats = NatsServerProcess(store_dir=workdir / "nats", log_file=workdir / "nats.log", extra_args=trace)
    nats.start()
    ports = {f"{kind}-{i}": free_port() for kind in KINDS for i in (1, 2)}
    services: dict[str, Service] = {}
    for i in (1, 2):
        config_file = workdir / f"asyncinfer-{i}.toml"
        config_file.write_text(render_default_config(soak_config(nats.url, ports, i, log_level)))
        for kind in KINDS:
            services[f"{kind}-{i}"] = Service(kind, i, config_file, workdir, ports[f"{kind}-{i}"])
    history, workload, counts = History(), Workload(), ChaosCounts()
    client = Client([ports["gateway-1"], ports["gateway-2"]], random.Random(seed + 1), workload)
    stop_work, stop_chaos = asyncio.Event(), asyncio.Event()
    watcher = asyncio.create_task(watch_jobs_bucket(nats.url, history))
    tasks: list[asyncio.Task[None]] = []
    summary: dict[str, object] = {}
    began = time.monotonic()
    try:
        for name in ("gateway-1", "gateway-2", "scheduler-1", "scheduler-2", "batcher-1", "batcher-2"):
            await services[name].start()
        await asyncio.wait_for(history.ready.wait(), 30)
        tasks = [
            asyncio.create_task(workload_loop(client, random.Random(seed + 2), workload, findings, stop_work, rate)),
            asyncio.create_task(label_watch(client, workload, findings, stop_work)),
            asyncio.create_task(
                chaos(services, random.Random(seed + 3), counts, findings, stop_chaos, nats if nats_chaos else None)
            ),
        ]
        await asyncio.sleep(duration_s)
        stop_chaos.set()
        await tasks[2]  # every victim back (or left down)
        for service in services.values():
            if service.paused:
                await service.signal(signal.SIGCONT)
                service.paused = False
        await asyncio.sleep(5)  # a little work after the last restart
        stop_work.set()
        tasks[1].cancel()  # the label's watch waits on the stream
        await asyncio.gather(tasks[1], return_exceptions=True)
        await asyncio.wait_for(tasks[0], 60)
        summary = await check(history, workload, client, services, findings, drain_s, nats.url)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        for service in services.values():
            await service.close()
        nats.stop()
    summary.update(
        seed=seed,
        duration_s=duration_s,
        wall_s=round(time.monotonic() - began),
        chaos=dict(counts.actions),
        kills=sum(counts.actions.values()),
        restarts=counts.restarts,
        left_down=counts.left_down,
        findings=len(findings.lines),
    )
    print("\n".join(counts.log))
    print(json.dumps(summary, indent=1))
    for line in findings.lines:
        print(f"- {line.splitlines()[0]}")
    return 1 if findings.lines else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration-s", type=float, default=180.0)
    parser.add_argument("--rate", type=float, default=30.0, help="jobs a second, about")
    parser.add_argument("--drain-s", type=float, default=120.0, help="longest wait for every job to end")
    parser.add_argument("--nats-chaos", action="store_true", help="kill -9 and SIGSTOP the nats-server too")
    parser.add_argument(
        "--nats-trace", action="store_true", help="the nats-server traces every protocol operation into nats.log"
    )
    parser.add_argument("--log-level", default="info", help="the services' logging.level (debug for every line)")
    parser.add_argument("--workdir", type=Path, default=None, help="logs and the NATS store (kept)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix=f"soak-{args.seed}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    code = asyncio.run(
        soak(
            args.seed,
            args.duration_s,
            args.rate,
            args.drain_s,
            workdir,
            args.nats_chaos,
            args.nats_trace,
            args.log_level,
        )
    )
    if code == 0 and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"logs: {workdir}")
    os._exit(code)  # grpc's threads can hold a plain exit


if __name__ == "__main__":
    main()
