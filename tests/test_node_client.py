"""Other languages: a Node.js client built only from protos/ (@grpc/grpc-js + @grpc/proto-loader,
no generated code) opens a label watch and waits for its headers, submits a job (seen QUEUED by the
label watch), watches it to SUCCEEDED and reads the output from a running stack."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from asyncinfer.config import DEMO_MODEL, Config
from services.batcher.models import demo
from tests.stack import StartStack

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "tests" / "node" / "client.mjs"
NODE_DEPS = ("@grpc/grpc-js", "@grpc/proto-loader")
NO_NODE = "Node.js (node and npm) is not installed: `make test` installs it (or: sudo apt-get install -y nodejs npm)"


@pytest.fixture(scope="module")
def node() -> str:
    """The node binary, with the client's npm packages installed (from the root package.json).
    Without Node.js the test fails (it skipped, and a skipped test passed for a run that checked
    nothing): `make test` installs it (the Makefile's node_modules stamp, as root)."""
    node_bin, npm_bin = shutil.which("node"), shutil.which("npm")
    assert node_bin is not None, NO_NODE
    assert npm_bin is not None, NO_NODE
    if not all((ROOT / "node_modules" / dep / "package.json").exists() for dep in NODE_DEPS):
        # The lock file pins them; `make test` installs them already (package.json changed -> npm install).
        subprocess.run(
            [npm_bin, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=ROOT, check=True, timeout=600
        )
    return node_bin


async def read_event(stream: asyncio.StreamReader) -> dict[str, Any]:
    line = await stream.readline()
    assert line, "the Node client ended early"
    event: dict[str, Any] = json.loads(line)
    assert event["event"] != "error", f"the Node client failed: {event}"
    return event


async def test_node_client_submits_watches_and_reads_the_output(
    node: str, config: Config, start_stack: StartStack
) -> None:
    # The demo model held at the gate while it runs: the jobs bucket keeps one write a key, so a
    # watch that has not read RUNNING yet when the job ends gets the latest (SUCCEEDED); the job
    # ends only once the Node client's watch said RUNNING.
    gated = DEMO_MODEL.model_copy(update={"loader": "services.batcher.models.demo:build_gated_model", "warm_up": False})
    idle_stack = await start_stack(config.replace(models=[gated.model_dump()]), batcher=False)
    rows = [[1.0, 2.0, 3.0, 4.0], [0.5, 0.0, -2.0, 10.0]]
    process = await asyncio.create_subprocess_exec(
        node,
        str(CLIENT),
        idle_stack.address,
        json.dumps(rows),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    demo.GATE.clear()
    try:
        assert process.stderr is not None
        try:
            async with asyncio.timeout(60):
                # Session 29: a label watch's headers come once it listens (before: with its first
                # message, which here waits for the submit: the client waited for ever).
                ready = await read_event(process.stderr)
                assert ready == {"event": "label_watch_ready", "header": ["1"]}
                submitted = await read_event(process.stderr)
                assert submitted["event"] == "submitted"
                assert submitted["state"] == "JOB_STATE_QUEUED"
                labelled = await read_event(process.stderr)
                assert labelled == {
                    "event": "label_watch_first",
                    "job_id": submitted["job_id"],
                    "state": "JOB_STATE_QUEUED",
                }
                first = await read_event(process.stderr)
                assert first == {**first, "event": "update", "state": "JOB_STATE_QUEUED"}
                # Only now can the job run: the Node client must follow it through the watch.
                await idle_stack.start_batcher()
                running = await read_event(process.stderr)
                assert running == {**running, "event": "update", "state": "JOB_STATE_RUNNING"}
                demo.GATE.set()
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
        demo.GATE.set()
        if process.returncode is None:
            process.kill()
            await process.wait()
