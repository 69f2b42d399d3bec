"""Issue 17: a scheduler killed with SIGKILL while it holds jobs, restarted on the same port, returns
them at once: its RUNNING records name it (`dispatched_by`) and the delivery it held
(`lease_subject`), so the new process naks them rather than leaving them to AckWait (12 s here).
Every stranded job runs again before AckWait could have redelivered it, and ends once, SUCCEEDED."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from asyncinfer.config import Config, render_default_config
from asyncinfer.embedded_nats import NatsServerProcess, free_port
from asyncinfer.jobs import JobState
from asyncinfer.nats.connection import connect
from asyncinfer.v1 import job_service_pb2, job_service_pb2_grpc, tensor_pb2
from tests.kv_helpers import JobWrites
from tests.processes import Service, until
from tests.test_crash import crash_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

JOBS = 300
# Long enough that a restart on a loaded machine (1-3 s) returns the stranded jobs well before it,
# short enough for the jobs that AckWait alone can return: those the killed process had pulled but
# not yet marked RUNNING (nothing names them); with 30 s a run that killed it with one took 38 s.
ACK_WAIT_S = 12.0


async def test_a_restarted_scheduler_returns_the_jobs_its_killed_predecessor_held(
    nats_server: NatsServerProcess, tmp_path: Path
) -> None:
    ports = {name: free_port() for name in ("gateway", "scheduler", "batcher")}
    config = crash_config(nats_server.url, ports).replace(
        scheduler={"ack_wait_s": ACK_WAIT_S},
        logging={"level": "info", "format": "json"},  # the reclaim's lease_returned lines
    )
    config_file = tmp_path / "asyncinfer.toml"
    config_file.write_text(render_default_config(config))
    services = {name: Service(name, config_file, tmp_path, ports[name]) for name in ports}
    nc = await connect(Config().replace(nats={"url": nats_server.url}).nats, name="restart-test")
    jobs_bucket = JobWrites(nc, config.nats.jobs_bucket)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{ports['gateway']}")
    try:
        for name in ("gateway", "scheduler", "batcher"):
            await services[name].start()
        await jobs_bucket.start()  # the bucket exists now
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
        x.contents.fp32_contents.extend([1, 2, 3, 4])
        request = job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[x])
        jobs = [(await stub.SubmitJob(request, timeout=10)).job.job_id for _ in range(JOBS)]
        await until(lambda: len(jobs_bucket.keys_in(JobState.RUNNING)) >= 32, 30)
        killed = time.monotonic()
        services["scheduler"].kill()
        stranded = jobs_bucket.keys_in(JobState.RUNNING)
        await services["scheduler"].start()
        restarted = time.monotonic() - killed
        # A hang guard under AckWait: only the new process's naks can run them again by then.
        await until(lambda: jobs_bucket.all_ran_again(stranded, killed), ACK_WAIT_S - 2)
        slowest = jobs_bucket.slowest_again(stranded, killed)
        keys = [f"default.{job_id}" for job_id in jobs]
        await until(lambda: jobs_bucket.all_terminal(keys), 60)
    finally:
        await channel.close(None)
        for service in services.values():
            service.stop()
        await jobs_bucket.stop()
        await nc.close()
    print(
        f"scheduler restart: {len(stranded)} RUNNING at the kill, restarted in {restarted:.2f} s, "
        f"the slowest ran again {slowest:.2f} s after the kill (ack_wait {ACK_WAIT_S:g} s)"
    )
    # Run again by the new process's naks (a lease_returned line each), not by AckWait's
    # redelivery (its leases renewed every second: ~11 s after the kill at the soonest).
    lines = (tmp_path / "scheduler-2.log").read_text().splitlines()
    returned = {entry["job_id"] for entry in map(json.loads, lines) if entry.get("event") == "lease_returned"}
    assert {key.partition(".")[2] for key in stranded} <= returned
    assert slowest < ACK_WAIT_S
    final = Counter(record.state for key in keys if (record := jobs_bucket.latest(key)) is not None)
    assert final == {JobState.SUCCEEDED: JOBS}, final
    assert max(sum(record.state.is_terminal for _, record in jobs_bucket.writes[key]) for key in keys) == 1
    assert all(max(record.attempt for _, record in jobs_bucket.writes[key]) == 2 for key in stranded)


@pytest.mark.unit
def test_a_lease_is_matched_to_its_message_by_stream_sequence() -> None:
    from asyncinfer.jobs import JobRecord, Priority
    from services.scheduler.lease_reclaim import LeaseReclaimer

    def held(lease: str, state: JobState = JobState.RUNNING) -> JobRecord:
        return JobRecord(
            job_id="j", tenant="t", model_name="demo", model_version="1", state=state, priority=Priority.NORMAL,
            create_time=0.0, update_time=0.0, max_attempts=3, result_retention_s=1.0, attempt=1,
            dispatched_by="h:1/r", lease_subject=lease,
        )  # fmt: skip

    v1 = "$JS.ACK.WORK.work-demo-normal.1.42.40.1700000000000000000.3"
    v2 = "$JS.ACK.hub.ACCOUNTHASH.WORK.work-demo-normal.1.42.40.1700000000000000000.3.abc"
    assert LeaseReclaimer._holds(held(v1), 42)
    assert LeaseReclaimer._holds(held(v2), 42)
    assert LeaseReclaimer._holds(held(v1, JobState.CANCELLING), 42)
    assert not LeaseReclaimer._holds(held(v1), 43)
    assert not LeaseReclaimer._holds(held(v1, JobState.QUEUED), 42)
    assert not LeaseReclaimer._holds(held(""), 42)


def test_a_scheduler_start_up_that_hangs_honours_sigterm(tmp_path: Path) -> None:
    """Start-up steps honour a stop signal: a "NATS" that accepts and never answers keeps the
    scheduler connecting; SIGTERM ends it at once, exit status 0."""
    import signal
    import socket
    import subprocess
    import sys

    config_file = tmp_path / "scheduler.toml"
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        config_file.write_text(
            f'[nats]\nurl = "nats://127.0.0.1:{silent.getsockname()[1]}"\nconnect_timeout_s = 60.0\n'
            "[scheduler]\nport = 0\nmetrics_port = 0\n"
        )
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "scheduler", "--config", str(config_file)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        )
        try:
            silent.settimeout(30.0)
            silent.accept()[0].close()  # connecting: start-up is under way
            process.send_signal(signal.SIGTERM)
            # A hang guard: ignoring the signal, it would go on connecting for connect_timeout_s (60 s).
            process.communicate(timeout=30.0)
        finally:
            process.kill()
    assert process.returncode == 0
