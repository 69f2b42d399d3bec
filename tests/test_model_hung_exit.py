"""A batcher whose model call does not return (tests/hanging_models.py) exits 75 once the batch has
computed batcher.exit_after_overrun_s past its jobs' execution timeouts, for its supervisor to start
a fresh one (here the test is the supervisor). The hung job ended TIMED_OUT at its timeout and does
not run again; the jobs of another model on that batcher are not lost: the one computing finishes
within the grace, the ones waiting go back to the queue and run on the fresh batcher."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.embedded_nats import free_port
from asyncinfer.runner import EXIT_MODEL_HUNG
from asyncinfer.v1 import job_pb2, job_service_pb2, tensor_pb2
from tests.hanging_models import HANG_VALUE, SLOW_VALUE
from tests.stack import StartStack

BIN = Path(sys.executable).parent
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
TERMINAL = {job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_TIMED_OUT}
LOADER = "tests.hanging_models:build_hanging_model"
HANG_MODEL = DEMO_MODEL.model_copy(
    update={"name": "hang", "loader": LOADER, "default_execution_timeout_s": 1.0, "max_inflight_batches": 1}
)
OTHER_MODEL = DEMO_MODEL.model_copy(
    update={"name": "other", "loader": LOADER, "default_execution_timeout_s": 10.0, "max_batch_size": 1}
)


def batcher_file(tmp_path: Path, scheduler: str) -> Path:
    path = tmp_path / "batcher.toml"
    models = ""
    for model in (HANG_MODEL, OTHER_MODEL):
        models += f"""
[[models]]
name = "{model.name}"
loader = "{LOADER}"
warm_up = false
max_queue_delay_ms = 0.0
max_batch_size = {model.max_batch_size}
max_inflight_batches = {model.max_inflight_batches}
default_execution_timeout_s = {model.default_execution_timeout_s}
inputs = [{{ name = "x", datatype = "FP32", shape = [-1, 4] }}]
outputs = [{{ name = "y", datatype = "FP32", shape = [-1, 4] }}]
"""
    path.write_text(
        f"""
[batcher]
port = {free_port()}
metrics_port = 0
scheduler_address = "{scheduler}"
shutdown_grace_s = 5.0
exit_after_overrun_s = 1.0
{models}"""
    )
    return path


def start_batcher(config_file: Path, log_file: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    with log_file.open("w") as log:
        process = subprocess.Popen(
            [str(BIN / "asyncinfer"), "batcher", "--config", str(config_file)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert "serving on" in line, (line, log_file.read_text())
    return process


def request(model: str, first: float) -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([first, 1.0, 1.0, 1.0])
    return job_service_pb2.SubmitJobRequest(model_name=model, inputs=[x])


async def test_a_batcher_whose_model_call_hangs_exits_75_and_a_fresh_one_takes_its_jobs(
    config: Config, start_stack: StartStack, tmp_path: Path
) -> None:
    stack = await start_stack(config.replace(models=[HANG_MODEL, OTHER_MODEL]), batcher=False)
    jobs = stack.jobs
    config_file = batcher_file(tmp_path, stack.ops_address)

    async def ended(job_id: str, timeout_s: float = 60.0) -> job_pb2.Job:
        deadline = time.monotonic() + timeout_s
        while (job := (await jobs.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job).state not in TERMINAL:
            assert time.monotonic() < deadline, job
            await asyncio.sleep(0.05)
        return job

    first = start_batcher(config_file, tmp_path / "first.log")
    fresh: subprocess.Popen[str] | None = None
    try:
        hung = (await jobs.SubmitJob(request("hang", HANG_VALUE))).job.job_id
        # Each computes 1.5 s, one at a time: one computes as the batcher stops, the others wait.
        others = [(await jobs.SubmitJob(request("other", SLOW_VALUE))).job.job_id for _ in range(3)]
        timed_out = await ended(hung, 10.0)
        assert timed_out.state == job_pb2.JOB_STATE_TIMED_OUT
        assert timed_out.error.reason == "EXECUTION_TIMEOUT"
        assert timed_out.error.message == "attempt 1 ran longer than its execution timeout of 1 s"

        code = await asyncio.to_thread(first.wait, 30.0)
        log = (tmp_path / "first.log").read_text()
        assert code == EXIT_MODEL_HUNG, log
        assert "batcher_exiting_model_hung" in log
        assert "hanging_models.py" in log  # the stack of the thread that does not return
        lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        abandoned = [line for line in lines if line["event"] == "work_order_abandoned_at_shutdown"]
        assert abandoned, "no job of the other model was waiting as the batcher stopped"
        # Only orders not started were given back (to run on the fresh batcher): the one computing
        # finished within the grace, the hung batch's job was answered already.
        assert all(line["started"] is False and line["model"] == "other" for line in abandoned), abandoned

        fresh = start_batcher(config_file, tmp_path / "fresh.log")  # as its supervisor restarts it
        done = [await ended(job_id) for job_id in others]
        assert [job.state for job in done] == [job_pb2.JOB_STATE_SUCCEEDED] * 3, done
        for job in done:
            assert list(job.outputs[0].raw_contents) or job.outputs[0].contents.fp32_contents, job
        again = (await jobs.GetJob(job_service_pb2.GetJobRequest(job_id=hung))).job
        assert (again.state, again.attempt) == (job_pb2.JOB_STATE_TIMED_OUT, 1)  # not run again
    finally:
        for process in (first, fresh):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
            if process is not None and process.stdout is not None:
                process.stdout.close()
