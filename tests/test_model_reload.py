"""A reload of the configuration file (SIGHUP) hot-updates a batcher's models (issue 16, item 2):
a batcher process (`asyncinfer batcher --config FILE`, its own process so that the signal is
real) against an in-process gateway and scheduler. The file gains version 2: after SIGHUP it is
loaded and warmed up, registered, and runs jobs pinned to it, while version 1 keeps serving; the
file loses version 1: after the next SIGHUP only version 2 serves. The process never restarts."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from asyncinfer.client import AsyncClient
from asyncinfer.config import Config, render_default_config
from asyncinfer.v1 import job_service_pb2
from tests.stack import StartStack
from tests.test_model_hot_updates import listed_versions, until
from tests.test_model_versions import EXPECTED, X, demo, with_models
from tests.waits import START_S

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 60.0


def spawn_batcher(file: Path, log_path: Path) -> subprocess.Popen[str]:
    with log_path.open("w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "services.cli", "batcher", "--config", str(file)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )


@pytest.fixture
async def batcher_process() -> AsyncIterator[list[subprocess.Popen[str]]]:
    """Stops the batchers started, waiting on a thread: the stack's scheduler runs on this event
    loop, and must answer a batcher's half-close for it to exit before its grace runs out."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.terminate()
            try:
                await asyncio.to_thread(process.wait, timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                await asyncio.to_thread(process.wait, timeout=10)
        if process.stdout is not None:
            process.stdout.close()


async def test_sighup_reloads_the_models_the_file_declares(
    config: Config, start_stack: StartStack, tmp_path: Path, batcher_process: list[subprocess.Popen[str]]
) -> None:
    stack = await start_stack(with_models(config, demo(versions=("1",))), batcher=False)
    file = tmp_path / "batcher.toml"

    def write(*versions: str) -> None:
        batcher_config = with_models(config, demo(versions=versions)).replace(
            batcher={"scheduler_address": stack.ops_address, "batcher_id": "reloaded", "shutdown_grace_s": 1.0}
        )
        file.write_text(render_default_config(batcher_config))

    write("1")
    process = await asyncio.to_thread(spawn_batcher, file, tmp_path / "batcher.log")
    batcher_process.append(process)
    assert process.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), START_S)
    assert "serving on" in line, (tmp_path / "batcher.log").read_text()[-3000:]

    async def serves(*versions: str) -> bool:
        listed = await listed_versions(stack)
        ready = {v for v, (state, batchers) in listed.items() if state == job_service_pb2.MODEL_VERSION_STATE_READY}
        return ready == set(versions)

    await until(lambda: serves("1"))
    write("1", "2")
    process.send_signal(signal.SIGHUP)
    await until(lambda: serves("1", "2"))
    async with AsyncClient(stack.address) as client:
        for version in ("1", "2"):
            done = await client.wait(await client.submit("demo", {"x": X}, model_version=version), timeout_s=WAIT_S)
            assert done.succeeded
            assert done.batcher_id == "reloaded"
            np.testing.assert_allclose(done.outputs["y"], EXPECTED[version])

        write("2")
        process.send_signal(signal.SIGHUP)
        await until(lambda: serves("2"))
        done = await client.wait(await client.submit("demo", {"x": X}), timeout_s=WAIT_S)
        assert done.model_version == "2"
        np.testing.assert_allclose(done.outputs["y"], EXPECTED["2"])
    assert process.poll() is None  # the same process all along
