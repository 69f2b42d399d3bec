"""Each service in its own process against an external nats-server, configured by the file that
`asyncinfer config` prints plus environment overrides, as a deployment would run them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpc_health.v1.health_pb2_grpc import HealthStub
from tritonclient.grpc import service_pb2, service_pb2_grpc

from asyncinfer.embedded_nats import NatsServerProcess, free_port
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc, tensor_pb2
from tests.hanging_models import CRASH_VALUE, HANG_VALUE
from tests.processes import until

BIN = Path(sys.executable).parent
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    printed = subprocess.run([str(BIN / "asyncinfer"), "config"], capture_output=True, text=True, check=True)
    assert "[[models]]" in printed.stdout
    assert "# Port of the public JobService." in printed.stdout
    path = tmp_path / "asyncinfer.toml"
    path.write_text(printed.stdout)
    return path


@pytest.fixture
def services(
    nats_server: NatsServerProcess, config_file: Path, tmp_path: Path
) -> Iterator[dict[str, tuple[subprocess.Popen[str], int]]]:
    ports = {name: free_port() for name in ("gateway", "scheduler", "batcher")}
    env = {
        **os.environ,
        "ASYNCINFER_NATS__URL": nats_server.url,
        "ASYNCINFER_GATEWAY__PORT": str(ports["gateway"]),
        "ASYNCINFER_SCHEDULER__PORT": str(ports["scheduler"]),
        "ASYNCINFER_BATCHER__PORT": str(ports["batcher"]),
        "ASYNCINFER_BATCHER__SCHEDULER_ADDRESS": f"127.0.0.1:{ports['scheduler']}",
        "ASYNCINFER_GATEWAY__METRICS_PORT": "0",
        "ASYNCINFER_SCHEDULER__METRICS_PORT": "0",
        "ASYNCINFER_BATCHER__METRICS_PORT": "0",
    }
    running: dict[str, tuple[subprocess.Popen[str], int]] = {}
    try:
        for name in ("gateway", "scheduler", "batcher"):
            log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process below
            process = subprocess.Popen(
                [str(BIN / "asyncinfer"), name, "--config", str(config_file)],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
            )
            log.close()
            assert process.stdout is not None
            line = process.stdout.readline()  # printed once it serves
            assert f"serving on 127.0.0.1:{ports[name]}" in line, (line, (tmp_path / f"{name}.log").read_text())
            running[name] = (process, ports[name])
        yield running
    finally:
        for process, _port in running.values():
            if process.poll() is None:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()


async def test_three_processes_run_a_job_and_stop_cleanly(
    services: dict[str, tuple[subprocess.Popen[str], int]],
) -> None:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([0.5, 1, 1.5, 2])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{services['gateway'][1]}") as channel:
        jobs = job_service_pb2_grpc.JobServiceStub(channel)
        job = (await jobs.SubmitJob(job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[x]))).job
        last = None
        async for update in jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id)):
            last = update.job
    assert last is not None
    assert last.state == job_pb2.JOB_STATE_SUCCEEDED
    assert list(last.outputs[0].contents.fp32_contents) == [2.0, 3.0, 4.0, 5.0]

    # SIGTERM: each stops in order and exits 0 (batcher first, as a rolling deploy would).
    for name in ("batcher", "scheduler", "gateway"):
        process, _port = services[name]
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 30) == 0, name


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    # `asyncinfer config | head -1`: the reader is gone before the output is written. Unix tools
    # stop quietly with the SIGPIPE exit code; a Python traceback on stderr is what this prevents.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [str(BIN / "asyncinfer"), "config"], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60
        )
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr
    assert "Traceback" not in done.stderr


def run_scheduler(config_file: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`asyncinfer scheduler` run to its end (one that cannot start ends at once)."""
    return subprocess.run(
        [str(BIN / "asyncinfer"), "scheduler", "--config", str(config_file)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_a_service_whose_port_is_taken_says_so_in_one_line(config_file: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        env = {**os.environ, "ASYNCINFER_SCHEDULER__PORT": str(busy), "ASYNCINFER_SCHEDULER__METRICS_PORT": "0"}
        done = run_scheduler(config_file, env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [done.stderr.strip()]
    assert f"already in use: 127.0.0.1:{busy} (scheduler.port)" in done.stderr
    assert "ASYNCINFER_SCHEDULER__PORT=" in done.stderr
    assert done.stdout == ""


def test_a_service_that_cannot_reach_nats_exits_unavailable(config_file: Path) -> None:
    """Not the usage/configuration code 2: an orchestrator tells "NATS not up yet" (69, sysexits'
    EX_UNAVAILABLE, as `up` uses) from a mistake, and the log pipeline gets the cause as an event."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        env = {
            **os.environ,
            "ASYNCINFER_NATS__URL": f"nats://127.0.0.1:{port}",
            "ASYNCINFER_NATS__FIRST_CONNECT_WAIT_S": "0",  # 3 tries, not the default's 60 s wait
            "ASYNCINFER_SCHEDULER__PORT": "0",
            "ASYNCINFER_SCHEDULER__METRICS_PORT": "0",
        }
        done = run_scheduler(config_file, env)
    assert done.returncode == 69, done.stderr
    *events, last = done.stderr.splitlines()
    assert last == f"asyncinfer: cannot connect to NATS at nats://127.0.0.1:{port}: [Errno 111] Connection refused"
    failed = json.loads(events[-1])
    assert (failed["event"], failed["level"], failed["reason"]) == ("start_failed", "error", "UNAVAILABLE")


def start_before_nats(service: str, config_file: Path, tmp_path: Path) -> tuple[subprocess.Popen[str], int, int]:
    """`asyncinfer <service>` with the configuration `asyncinfer config` prints (nothing set about
    waiting), against a NATS port where nothing listens yet; its port, and NATS's."""
    nats_port, port = free_port(), free_port()
    env = {
        **os.environ,
        "ASYNCINFER_NATS__URL": f"nats://127.0.0.1:{nats_port}",
        f"ASYNCINFER_{service.upper()}__PORT": str(port),
        f"ASYNCINFER_{service.upper()}__METRICS_PORT": "0",
        "ASYNCINFER_LOGGING__LEVEL": "debug",  # each failed try: a debug nats_error after the first
    }
    log = open(tmp_path / f"{service}.log", "w")  # noqa: SIM115 - closed once the process has it
    try:
        process = subprocess.Popen(
            [str(BIN / "asyncinfer"), service, "--config", str(config_file)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
    finally:
        log.close()
    return process, port, nats_port


def tail(log: Path) -> str:
    return log.read_text()[-3000:]


def connect_events(log: Path) -> list[dict[str, object]]:
    """The service's log lines about its first connect: nats_waiting_for_server, nats_error."""
    events = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and event.get("event") in ("nats_waiting_for_server", "nats_error"):
                events.append(event)
    return events


async def past_the_tries_that_gave_up(process: subprocess.Popen[str], log: Path) -> list[dict[str, object]]:
    """Waits until the service has failed more tries than a first connect without a wait gets
    (it exited 69 then), or has exited; its connect events by then."""
    from asyncinfer.nats.connection import FIRST_CONNECT_ATTEMPTS

    await until(lambda: process.poll() is not None or len(connect_events(log)) > FIRST_CONNECT_ATTEMPTS, 60)
    assert process.poll() is None, (process.returncode, tail(log))
    return connect_events(log)


@pytest.mark.parametrize("service", ["gateway", "scheduler"])
async def test_a_service_started_before_nats_waits_for_it_and_serves(
    service: str, config_file: Path, tmp_path: Path
) -> None:
    """nats.first_connect_wait_s (60 s by default; it was 0): a service started while NATS is not up
    yet (systemd or compose start order, a NATS restart during a deploy) keeps trying it, saying so
    naming the URL, and serves once it answers. It exited 69 after 3 tries (~1.5 s)."""
    process, port, nats_port = start_before_nats(service, config_file, tmp_path)
    server = NatsServerProcess(store_dir=tmp_path / "nats", port=nats_port)
    try:
        said = await past_the_tries_that_gave_up(process, tmp_path / f"{service}.log")
        await asyncio.to_thread(server.start)
        assert process.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), 60)
        assert f"serving on 127.0.0.1:{port}" in line, (line, tail(tmp_path / f"{service}.log"))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await HealthStub(channel).Check(HealthCheckRequest(), timeout=10)
        assert reply.status == HealthCheckResponse.SERVING
        waiting = [event for event in said if event["event"] == "nats_waiting_for_server"]
        assert waiting, said
        assert waiting[0]["level"] == "warning", waiting
        assert waiting[0]["url"] == f"nats://127.0.0.1:{nats_port}", waiting
        assert waiting[0]["gives_up_after_s"] == 60.0, waiting
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
        server.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_a_stop_signal_while_waiting_for_nats_ends_the_service_cleanly(
    sig: signal.Signals, config_file: Path, tmp_path: Path
) -> None:
    """Waiting for a NATS that is not up yet (the default's 60 s) is a start-up step like any other:
    SIGTERM or Ctrl-C ends it, exit 0, not once the wait has run out (exit 69)."""
    process, _port, _nats_port = start_before_nats("gateway", config_file, tmp_path)
    try:
        await past_the_tries_that_gave_up(process, tmp_path / "gateway.log")
        process.send_signal(sig)
        # A hang guard below the wait (60 s): ignoring the signal, it would exit 69 once the wait ran out.
        assert await asyncio.to_thread(process.wait, 30) == 0, tail(tmp_path / "gateway.log")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def start_misbehaving_batcher(tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    """A batcher alone (no scheduler) serving tests/hanging_models.py's model as "hang"."""
    port = free_port()
    config = tmp_path / "hanging.toml"
    config.write_text(
        f"""
[batcher]
port = {port}
metrics_port = 0
scheduler_address = ""
shutdown_grace_s = 1.0

[[models]]
name = "hang"
loader = "tests.hanging_models:build_hanging_model"
warm_up = false
inputs = [{{ name = "x", datatype = "FP32", shape = [-1, 4] }}]
outputs = [{{ name = "y", datatype = "FP32", shape = [-1, 4] }}]
"""
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    process = subprocess.Popen(
        [str(BIN / "asyncinfer"), "batcher", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert f"serving on 127.0.0.1:{port}" in line, line
    return process, port


@contextlib.contextmanager
def infer_future(port: int, first_value: float) -> Iterator[grpc.Future]:
    """A ModelInfer of one row starting with `first_value`, in flight."""
    request = service_pb2.ModelInferRequest(model_name="hang")
    x = request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([first_value, 0, 0, 0])
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer.future(request)
        yield call
        call.cancel()


def test_a_batcher_whose_model_hangs_still_exits_when_stopped(tmp_path: Path) -> None:
    """The abandoned batch's compute thread never ends, and Python's exit joins every executor's
    threads: the batcher logged that it had stopped, and then never exited (nor did `up`)."""
    process, port = start_misbehaving_batcher(tmp_path)
    try:
        with infer_future(port, HANG_VALUE) as hanging:
            with pytest.raises(grpc.FutureTimeoutError):
                hanging.result(timeout=1.0)  # computing, for an hour
            process.send_signal(signal.SIGTERM)
            assert process.wait(30) == 0
        _, stderr = process.communicate()
        assert "exiting_without_threads" in stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_model_that_crashes_its_batcher_leaves_where_it_crashed(tmp_path: Path) -> None:
    """A segfault in a model (a native extension's bug) ended the batcher with nothing on stderr:
    nothing named the model or where it was. faulthandler prints every thread's stack."""
    process, port = start_misbehaving_batcher(tmp_path)
    try:
        with infer_future(port, CRASH_VALUE):
            assert process.wait(30) == -signal.SIGSEGV
        _, stderr = process.communicate()
        assert "Fatal Python error: Segmentation fault" in stderr
        assert "hanging_models.py" in stderr  # the model's own frame
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
