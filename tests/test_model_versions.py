"""Model versions side by side (issue 16, item 1), on the real stack (NATS, gateway, scheduler and
real batchers): a job pinned to a version runs on it, a job that names none runs on the default at
its dispatch (and its record says which), jobs go only to batchers that serve their version, a job
pinned to a version nobody serves waits (QUEUED) until a batcher serves it, and ListModels shows
every version with its state and batchers.

The demo model's version 2 computes y = 3x + 1 (version 1: 2x + 1), so outputs say which ran."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from asyncinfer.client import AsyncClient, NotFoundError, WaitingReason
from asyncinfer.config import DEMO_MODEL, Config, ModelConfig
from asyncinfer.v1 import job_service_pb2
from tests.stack import Stack, StartStack

V2_LOADER = "services.batcher.models.demo:build_demo_v2_model"
X = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32)
EXPECTED = {"1": 2 * X + 1, "2": 3 * X + 1}
WAIT_S = 30.0


def demo(*, versions: tuple[str, ...] = ("1", "2"), default_version: str = "") -> ModelConfig:
    """The demo model with these versions (the first is the model's own table)."""
    extra = [{"version": v, "loader": V2_LOADER if v == "2" else DEMO_MODEL.loader} for v in versions[1:]]
    base = {**DEMO_MODEL.model_dump(), "version": versions[0], "default_version": default_version}
    if versions[0] == "2":
        base["loader"] = V2_LOADER
    return ModelConfig.model_validate({**base, "versions": extra})


def with_models(config: Config, *models: ModelConfig) -> Config:
    return config.replace(models=[m.model_dump() for m in models])


async def versions_listed(client: AsyncClient, stack: Stack) -> dict[str, tuple[int, tuple[str, ...]]]:
    answer = await stack.jobs.ListModels(job_service_pb2.ListModelsRequest())
    (model,) = answer.models
    return {v.version: (v.state, tuple(v.batchers)) for v in model.versions}


async def test_versions_side_by_side_pinned_and_default(config: Config, start_stack: StartStack) -> None:
    stack = await start_stack(with_models(config, demo()), batcher=False)
    await stack.start_batcher()
    async with AsyncClient(stack.address) as client:
        v1 = await client.submit("demo", {"x": X}, model_version="1")
        v2 = await client.submit("demo", {"x": X}, model_version="2")
        default = await client.submit("demo", {"x": X})
        assert default.model_version == ""  # chosen at dispatch, not at submit
        done = {name: await client.wait(job, timeout_s=WAIT_S) for name, job in [("1", v1), ("2", v2), ("d", default)]}
        for version in ("1", "2"):
            assert done[version].succeeded
            assert done[version].model_version == version
            np.testing.assert_allclose(done[version].outputs["y"], EXPECTED[version])
        # No default_version: the highest version served (Triton's latest policy).
        assert done["d"].model_version == "2"
        np.testing.assert_allclose(done["d"].outputs["y"], EXPECTED["2"])

        answer = await stack.jobs.ListModels(job_service_pb2.ListModelsRequest())
        (model,) = answer.models
        assert model.default_version == "2"
        assert [v.version for v in model.versions] == ["1", "2"]
        assert stack.batcher is not None
        for version in model.versions:
            assert version.state == job_service_pb2.MODEL_VERSION_STATE_READY
            assert list(version.batchers) == [stack.batcher.batcher_id]

        with pytest.raises(NotFoundError) as info:
            await client.submit("demo", {"x": X}, model_version="7")
        assert info.value.reason == "MODEL_VERSION_NOT_FOUND"


async def test_the_cli_pins_a_version_and_lists_every_version(config: Config, start_stack: StartStack) -> None:
    stack = await start_stack(with_models(config, demo()))

    async def cli(*args: str) -> tuple[int, str, str]:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "asyncinfer", *args, "--gateway", stack.address,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode is not None
        return process.returncode, out.decode(), err.decode()

    for version in ("1", "2"):
        code, out, err = await cli("submit", "demo", "-i", "x=[[1,2,3,4]]", "--version", version, "--wait", "--json")
        assert code == 0, err
        job = json.loads(out)
        assert job["model_version"] == version
        np.testing.assert_allclose(job["outputs"]["y"]["data"], EXPECTED[version])
    code, out, err = await cli("models")
    assert code == 0, err
    header, row = out.splitlines()
    assert header.split()[:3] == ["MODEL", "DEFAULT", "VERSIONS"]
    assert row.split()[:4] == ["demo", "2", "1,", "2"]  # the default, then every version served
    code, out, err = await cli("models", "--json")
    (model,) = json.loads(out)
    assert [(v["version"], v["state"]) for v in model["versions"]] == [("1", "READY"), ("2", "READY")]


async def test_configured_default_version(config: Config, start_stack: StartStack) -> None:
    stack = await start_stack(with_models(config, demo(default_version="1")))
    async with AsyncClient(stack.address) as client:
        done = await client.wait(await client.submit("demo", {"x": X}), timeout_s=WAIT_S)
        assert done.model_version == "1"
        np.testing.assert_allclose(done.outputs["y"], EXPECTED["1"])


async def test_an_unpinned_job_waiting_for_an_unserved_default_version_says_so(
    config: Config, start_stack: StartStack, batchers: Callable[..., Any]
) -> None:
    # default_version fixes where unpinned jobs run: with it unserved (unloaded in a rollout) they
    # wait, and the reason says so (it read "-", the job seeming about to start).
    stack = await start_stack(with_models(config, demo(default_version="2")), batcher=False)
    await batchers(stack, "only-v1", demo(versions=("1",)))
    async with AsyncClient(stack.address) as client:
        assert (await client.run("demo", {"x": X}, model_version="1", timeout_s=WAIT_S))["y"].tolist() == (
            EXPECTED["1"].tolist()
        )
        waiting = await client.get(await client.submit("demo", {"x": X}))
        assert waiting.state.value == "QUEUED"
        assert waiting.queue is not None
        assert waiting.queue.waiting_reason == WaitingReason.NO_VERSION


async def test_jobs_go_only_to_batchers_serving_their_version(
    config: Config, start_stack: StartStack, batchers: Callable[..., Any]
) -> None:
    stack = await start_stack(with_models(config, demo()), batcher=False)
    only_v1 = await batchers(stack, "only-v1", demo(versions=("1",)))
    only_v2 = await batchers(stack, "only-v2", demo(versions=("2",)))
    async with AsyncClient(stack.address) as client:
        jobs = [await client.submit("demo", {"x": X}, model_version=v) for v in ["1", "2"] * 20]
        done = await client.wait_jobs(jobs, timeout_s=WAIT_S)
        for job in jobs:
            finished = done[job.job_id]
            assert finished.succeeded, finished.error
            expected_batcher = only_v1.batcher_id if finished.model_version == "1" else only_v2.batcher_id
            assert finished.batcher_id == expected_batcher
            np.testing.assert_allclose(finished.outputs["y"], EXPECTED[finished.model_version])
        assert sorted(done[j.job_id].model_version for j in jobs) == ["1"] * 20 + ["2"] * 20


async def test_a_job_pinned_to_an_unserved_version_waits_for_a_batcher_serving_it(
    config: Config, start_stack: StartStack, batchers: Callable[..., Any]
) -> None:
    stack = await start_stack(with_models(config, demo()), batcher=False)
    await batchers(stack, "only-v1", demo(versions=("1",)))
    async with AsyncClient(stack.address) as client:
        waiting = await client.submit("demo", {"x": X}, model_version="2")
        # Jobs on v1 keep running meanwhile, and the v2 job stays queued, with no attempt spent.
        for _ in range(5):
            assert (await client.run("demo", {"x": X}, model_version="1", timeout_s=WAIT_S))["y"].tolist() == (
                EXPECTED["1"].tolist()
            )
        still = await client.get(waiting)
        assert still.state.value == "QUEUED"
        assert still.attempt == 0
        assert still.queue is not None
        assert still.queue.waiting_reason == WaitingReason.NO_VERSION
        listed = await versions_listed(client, stack)
        assert listed["2"] == (job_service_pb2.MODEL_VERSION_STATE_UNAVAILABLE, ())

        v2 = await batchers(stack, "v2-arrives", demo(versions=("2",)))
        done = await client.wait(waiting, timeout_s=WAIT_S)
        assert done.succeeded
        assert done.model_version == "2"
        assert done.batcher_id == v2.batcher_id
        assert done.attempt == 1
