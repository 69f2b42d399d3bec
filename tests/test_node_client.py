"""Other languages: a Node.js client built only from protos/ (@grpc/grpc-js + @grpc/proto-loader,
no generated code) submits a job, watches it to SUCCEEDED and reads the output from a running stack."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from asyncinfer.config import Config
from services.batcher.app import BatcherApp
from services.gateway.app import GatewayApp
from services.scheduler.app import SchedulerApp

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "tests" / "node" / "client.mjs"
NODE_DEPS = ("@grpc/grpc-js", "@grpc/proto-loader")


@pytest.fixture(scope="module")
def node() -> str:
    """The node binary, with the client's npm packages installed (from the root package.json)."""
    node_bin, npm_bin = shutil.which("node"), shutil.which("npm")
    if node_bin is None or npm_bin is None:
        pytest.skip("Node.js (node and npm) is not installed")
    if not all((ROOT / "node_modules" / dep / "package.json").exists() for dep in NODE_DEPS):
        # The lock file pins them; `make test` installs them already (package.json changed -> npm install).
        subprocess.run(
            [npm_bin, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=ROOT, check=True, timeout=600
        )
    return node_bin


@pytest.fixture
async def gateway_and_scheduler(config: Config) -> AsyncIterator[tuple[GatewayApp, SchedulerApp]]:
    gateway = GatewayApp(config)
    scheduler = SchedulerApp(config)
    await gateway.start()
    await scheduler.start()
    try:
        yield gateway, scheduler
    finally:
        await scheduler.stop(2.0)
        await gateway.stop(2.0)


async def read_event(stream: asyncio.StreamReader) -> dict[str, Any]:
    line = await stream.readline()
    assert line, "the Node client ended early"
    event: dict[str, Any] = json.loads(line)
    assert event["event"] != "error", f"the Node client failed: {event}"
    return event


async def test_node_client_submits_watches_and_reads_the_output(
    node: str, config: Config, gateway_and_scheduler: tuple[GatewayApp, SchedulerApp]
) -> None:
    gateway, scheduler = gateway_and_scheduler
    rows = [[1.0, 2.0, 3.0, 4.0], [0.5, 0.0, -2.0, 10.0]]
    process = await asyncio.create_subprocess_exec(
        node,
        str(CLIENT),
        f"127.0.0.1:{gateway.port}",
        json.dumps(rows),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    batcher: BatcherApp | None = None
    try:
        assert process.stderr is not None
        try:
            async with asyncio.timeout(60):
                submitted = await read_event(process.stderr)
                assert submitted["event"] == "submitted"
                assert submitted["state"] == "JOB_STATE_QUEUED"
                first = await read_event(process.stderr)
                assert first == {**first, "event": "update", "state": "JOB_STATE_QUEUED"}
                # Only now can the job run: the Node client must follow it through the watch.
                batcher = BatcherApp(config.replace(batcher={"scheduler_address": f"127.0.0.1:{scheduler.port}"}))
                await batcher.start()
                stdout, stderr = await process.communicate()
        except TimeoutError:
            process.kill()
            _, stderr = await process.communicate()
            pytest.fail(f"the Node client did not finish within 60 s; its stderr:\n{stderr.decode()}")
        assert process.returncode == 0, stderr.decode()
        result = json.loads(stdout)
        assert result["job_id"] == submitted["job_id"]
        assert result["states"] == ["JOB_STATE_QUEUED", "JOB_STATE_RUNNING", "JOB_STATE_SUCCEEDED"]
        assert result["state"] == "JOB_STATE_SUCCEEDED"
        assert result["attempt"] == 1
        y = result["outputs"]["y"]
        assert y["datatype"] == "FP32"
        assert y["shape"] == [2, 4]
        assert y["data"] == [2 * v + 1 for row in rows for v in row]
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        if batcher is not None:
            await batcher.stop(2.0)
