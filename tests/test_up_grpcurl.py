"""The README's path, for real: `asyncinfer up` as a subprocess (embedded nats-server, gateway,
scheduler, batcher), driven with the real grpcurl binary; then Ctrl-C, and a second `up` on the
same store still knows the job.

`up` runs in a session of its own, and Ctrl-C is a SIGINT to its process group, as a terminal sends
it. Its stderr (JSON lines: it is not a terminal) is kept in a file, for the tests that read it."""

from __future__ import annotations

import base64
import itertools
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from asyncinfer.embedded_nats import free_port, pid_alive

BIN = Path(sys.executable).parent
GRPCURL = str(BIN / "grpcurl")
SUBMIT_BODY = json.dumps(
    {
        "model_name": "demo",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "contents": {"fp32_contents": [1, 2, 3, 4]}}],
    }
)
DOC_SUBMIT_BODY = json.dumps(
    {
        "model_name": "minilm-l6-doc",
        "inputs": [
            {
                "name": "text",
                "datatype": "BYTES",
                "shape": [1],
                "contents": {"bytes_contents": [base64.b64encode(b"A long document. " * 200).decode()]},
            }
        ],
    }
)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@dataclass
class UpProcess:
    """A running `asyncinfer up` (not tests/stack.py's in-process stack): the process, what it
    printed up to its banner, the addresses it serves and the rest of its output as it comes."""

    process: subprocess.Popen[str]
    banner: str
    gateway: str
    scheduler: str
    batcher: str
    metrics: int
    lines: queue.Queue[str | None]
    stderr: Path

    def logs(self) -> list[dict[str, object]]:
        """Its log lines so far, each a JSON object (a line that is not one fails the test)."""
        return [json.loads(line) for line in self.stderr.read_text().splitlines() if line.strip()]

    def nats_pid(self) -> int:
        """The process ID of its embedded nats-server (it logs it once started)."""
        started = [entry for entry in self.logs() if entry["event"] == "nats_server_started"]
        assert len(started) == 1, started
        pid = started[0]["pid"]
        assert isinstance(pid, int)
        return pid

    def rest_of_output(self) -> str:
        """What it printed after the banner, up to its exit."""
        out: list[str] = []
        while (line := self.lines.get(timeout=30)) is not None:
            out.append(line)
        return "".join(out)


def write_config(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    ports = {name: free_port() for name in ("nats", "gateway", "scheduler", "batcher", "metrics")}
    path = tmp_path / "asyncinfer.toml"
    path.write_text(
        f"""
[embedded_nats]
port = {ports["nats"]}
monitor_port = 0
store_dir = "{tmp_path / "data" / "nats"}"

[gateway]
port = {ports["gateway"]}
metrics_port = 0

[scheduler]
port = {ports["scheduler"]}
metrics_port = {ports["metrics"]}

[batcher]
port = {ports["batcher"]}
metrics_port = 0

[console]
port = 0
"""
    )
    return path, ports


_RUNS = itertools.count(1)
# Tries of start_on_free_ports: each port a free one when chosen, another test's process may bind it
# before `up` does (its ephemeral ports come from the same range; CI, 3 workers, once).
PORT_TRIES = 3


class PortTaken(AssertionError):
    """`up` refused to start: a port chosen free was taken before it bound it."""


def start_on_free_ports(folder: Path, *, args: tuple[str, ...] = ()) -> tuple[UpProcess, Path, dict[str, int]]:
    """`up` on ports free when chosen, chosen again if one was taken meanwhile: (its process, its
    configuration file, its ports)."""
    for attempt in range(1, PORT_TRIES + 1):
        config_path, ports = write_config(folder)
        try:
            return start_up(config_path, ports, folder, args=args), config_path, ports
        except PortTaken:
            if attempt == PORT_TRIES:
                raise
    raise AssertionError("unreachable")


def start_up(config_path: Path, ports: dict[str, int], cwd: Path, *, args: tuple[str, ...] = ()) -> UpProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stderr = cwd / f"up-{next(_RUNS)}.stderr"
    with stderr.open("w") as err:
        process = subprocess.Popen(
            [str(BIN / "asyncinfer"), "up", "--config", str(config_path), *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
            start_new_session=True,  # as a shell runs a foreground job: Ctrl-C reaches its group
        )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    pumping = threading.Thread(target=pump, daemon=True)
    pumping.start()

    def close_stdout() -> None:
        """Closed here, not left to a later test's GC (whose ResourceWarning fails that test)."""
        process.kill()
        process.wait()
        pumping.join(10)  # it reads to the end first
        process.stdout.close()  # type: ignore[union-attr]

    banner: list[str] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            code = process.wait()
            close_stdout()
            said = f"asyncinfer up exited early with {code}: {''.join(banner)}{stderr.read_text()}"
            if code == 2 and "already in use" in said:
                raise PortTaken(said)
            raise AssertionError(said)
        banner.append(line)
        if line.startswith("Ctrl-C"):
            break
    else:
        close_stdout()
        raise AssertionError("asyncinfer up did not print its banner in time")
    return UpProcess(
        process=process,
        banner="".join(banner),
        gateway=f"127.0.0.1:{ports['gateway']}",
        scheduler=f"127.0.0.1:{ports['scheduler']}",
        batcher=f"127.0.0.1:{ports['batcher']}",
        metrics=ports["metrics"],
        lines=lines,
        stderr=stderr,
    )


def ctrl_c(up: UpProcess) -> None:
    """What a terminal does on Ctrl-C: SIGINT to the foreground process group (up's)."""
    os.killpg(up.process.pid, signal.SIGINT)


def stop(up: UpProcess) -> int:
    ctrl_c(up)
    return up.process.wait(timeout=60)


def close(up: UpProcess) -> None:
    """Kills what is left: `up`, and its nats-server (in a session of its own, so not with it)."""
    nats_pids = [entry["pid"] for entry in _quiet_logs(up) if entry.get("event") == "nats_server_started"]
    if up.process.poll() is None:
        up.process.kill()
        up.process.wait()
    for pid in nats_pids:
        if isinstance(pid, int) and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    if up.process.stdout is not None:
        up.process.stdout.close()


def _quiet_logs(up: UpProcess) -> list[dict[str, object]]:
    found = []
    for line in up.stderr.read_text().splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


def grpcurl(*args: str, data: str | None = None) -> subprocess.CompletedProcess[str]:
    command = [GRPCURL, "-plaintext"]
    if data is not None:
        command += ["-d", data]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60, check=False)


def json_stream(text: str) -> list[dict[str, object]]:
    """grpcurl prints one pretty JSON object per streamed message."""
    decoder = json.JSONDecoder()
    objects, index = [], 0
    text = text.strip()
    while index < len(text):
        obj, end = decoder.raw_decode(text, index)
        objects.append(obj)
        index = end
        while index < len(text) and text[index].isspace():
            index += 1
    return objects


@pytest.fixture
def up_process(tmp_path: Path) -> Iterator[tuple[UpProcess, Path, dict[str, int]]]:
    running, config_path, ports = start_on_free_ports(tmp_path)
    try:
        yield running, config_path, ports
    finally:
        close(running)


def test_up_serves_a_job_through_grpcurl(up_process: tuple[UpProcess, Path, dict[str, int]], tmp_path: Path) -> None:
    up, config_path, ports = up_process
    assert up.gateway in up.banner
    assert "grpcurl -plaintext" in up.banner

    listed = grpcurl(up.gateway, "list")
    assert listed.returncode == 0, listed.stderr
    assert "asyncinfer.v1.JobService" in listed.stdout.split()
    assert "grpc.health.v1.Health" in listed.stdout.split()
    for address, service in (
        (up.scheduler, "asyncinfer.v1.OpsService"),
        (up.batcher, "inference.GRPCInferenceService"),
    ):
        assert service in grpcurl(address, "list").stdout.split()
    health = grpcurl(up.gateway, "grpc.health.v1.Health/Check", data='{"service": "asyncinfer.v1.JobService"}')
    assert json.loads(health.stdout)["status"] == "SERVING"

    # The grpcurl line the banner prints works verbatim.
    submit_line = next(line for line in up.banner.splitlines() if "JobService/SubmitJob" in line)
    submitted = subprocess.run(submit_line.strip(), shell=True, capture_output=True, text=True, timeout=60, check=False)
    assert submitted.returncode == 0, submitted.stderr
    job = json.loads(submitted.stdout)["job"]
    assert job["state"] == "JOB_STATE_QUEUED"
    job_id = job["job_id"]

    # On ports other than the CLI's defaults, the banner says how to point the CLI at them (a user
    # who ran a second `up` on other ports met the first stack, or nothing), and its line works verbatim.
    export_line = next(line for line in up.banner.splitlines() if "export ASYNCINFER_GATEWAY_ADDRESS=" in line)
    assert f"ASYNCINFER_GATEWAY_ADDRESS={up.gateway} ASYNCINFER_SCHEDULER_ADDRESS={up.scheduler}" in export_line
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")}
    cli = subprocess.run(
        ["bash", "-c", f"{export_line.strip()} && {BIN / 'asyncinfer'} get {job_id} --no-outputs"],
        env=clean_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert cli.returncode == 0, cli.stderr
    assert job_id in cli.stdout

    watched = grpcurl(up.gateway, "asyncinfer.v1.JobService/WatchJob", data=json.dumps({"job_id": job_id}))
    assert watched.returncode == 0, watched.stderr
    states = [m["job"]["state"] for m in json_stream(watched.stdout)]  # type: ignore[index]
    assert states[-1] == "JOB_STATE_SUCCEEDED"
    assert states == sorted(states, key=["JOB_STATE_QUEUED", "JOB_STATE_RUNNING", "JOB_STATE_SUCCEEDED"].index)

    # It embedded a sentence: one L2-normalised 384-dimensional embedding.
    got = grpcurl(up.gateway, "asyncinfer.v1.JobService/GetJob", data=json.dumps({"job_id": job_id}))
    record = json.loads(got.stdout)["job"]
    assert record["state"] == "JOB_STATE_SUCCEEDED"
    (embedding,) = record["outputs"]
    assert (embedding["name"], embedding["shape"]) == ("embedding", ["1", "384"])
    assert math.isclose(math.hypot(*embedding["contents"]["fp32_contents"]), 1.0, rel_tol=1e-4)

    # The default stack serves the sentence embedder, the document embedder and the demo model.
    served = json.loads(grpcurl(up.gateway, "asyncinfer.v1.JobService/ListModels", data="{}").stdout)
    assert {"minilm-l6", "minilm-l6-doc", "minilm-l6-doc-pipeline", "demo", "flaky"} <= {
        m["name"] for m in served["models"]
    }
    pipeline_body = DOC_SUBMIT_BODY.replace('"minilm-l6-doc"', '"minilm-l6-doc-pipeline"')
    for model, body in (
        ("minilm-l6-doc", DOC_SUBMIT_BODY),
        ("minilm-l6-doc-pipeline", pipeline_body),
        ("demo", SUBMIT_BODY),
    ):
        submitted = grpcurl(up.gateway, "asyncinfer.v1.JobService/SubmitJob", data=body)
        assert submitted.returncode == 0, (model, submitted.stderr)
        other = json.loads(submitted.stdout)["job"]["job_id"]
        watched = grpcurl(up.gateway, "asyncinfer.v1.JobService/WatchJob", data=json.dumps({"job_id": other}))
        assert json_stream(watched.stdout)[-1]["job"]["state"] == "JOB_STATE_SUCCEEDED", (model, watched.stdout)  # type: ignore[index]

    invalid = grpcurl(
        up.gateway,
        "asyncinfer.v1.JobService/SubmitJob",
        data=SUBMIT_BODY.replace("[1, 2, 3, 4]", "[1, 2, 3]"),
    )
    assert invalid.returncode != 0
    assert "InvalidArgument" in invalid.stderr
    unknown = grpcurl(up.gateway, "asyncinfer.v1.JobService/SubmitJob", data=SUBMIT_BODY.replace("demo", "nope"))
    assert "NotFound" in unknown.stderr

    stats = grpcurl(up.scheduler, "asyncinfer.v1.OpsService/GetQueueStats", data="{}")
    assert stats.returncode == 0, stats.stderr
    assert {m["model_name"] for m in json.loads(stats.stdout)["models"]} >= {"minilm-l6", "minilm-l6-doc", "demo"}

    with urllib.request.urlopen(f"http://127.0.0.1:{up.metrics}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert "asyncinfer_jobs_total" in metrics
    assert "asyncinfer_queue_depth" in metrics

    assert stop(up) == 0
    assert "asyncinfer stopped" in up.rest_of_output()

    # A second `up` on the same store still has the job.
    again = start_up(config_path, ports, tmp_path)
    try:
        kept = grpcurl(again.gateway, "asyncinfer.v1.JobService/GetJob", data=json.dumps({"job_id": job_id}))
        assert json.loads(kept.stdout)["job"]["state"] == "JOB_STATE_SUCCEEDED"
        assert stop(again) == 0
    finally:
        close(again)
