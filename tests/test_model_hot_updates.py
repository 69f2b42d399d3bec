"""Hot updates (issue 16, item 2) on the real stack: tritonclient's load_model / unload_model /
get_model_repository_index against the batcher's KServe API, with no service restarted; the
gateway learns a version it does not declare from the registry; a replaced version's in-flight
work finishes on the old backend; and 2,000 jobs run while v1 is replaced by v2, none failing,
each on the version it asked for (or the default at its dispatch, which its record names)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import aio as triton
from tritonclient.utils import InferenceServerException

from asyncinfer.client import AsyncClient, Job, NotFoundError
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.v1 import job_service_pb2, ops_service_pb2, ops_service_pb2_grpc
from services.batcher.app import BatcherApp
from services.batcher.models import demo as demo_models
from services.batcher.models.demo import GATE, GATE_ENTERED
from tests.hanging_models import LOAD_ENTERED, LOAD_RELEASE
from tests.stack import Stack, StartStack
from tests.test_model_versions import EXPECTED, V2_LOADER, X, demo, with_models

WAIT_S = 60.0
TOTAL_JOBS = 2000
IN_FLIGHT = 64


def version_table(version: str, loader: str) -> dict[str, Any]:
    return {"version": version, "loader": loader}


def load_config_json(*versions: dict[str, Any]) -> str:
    """A load_model config: the model's own table is the first version, the rest its `versions`."""
    first, *rest = versions
    return json.dumps({**first, "versions": rest})


async def listed_versions(stack: Stack) -> dict[str, tuple[int, tuple[str, ...]]]:
    answer = await stack.jobs.ListModels(job_service_pb2.ListModelsRequest())
    (model,) = answer.models
    return {v.version: (v.state, tuple(v.batchers)) for v in model.versions}


async def until(check: Callable[[], Any], timeout_s: float = WAIT_S) -> None:
    """Polls an async condition (the registry reaches the gateway through NATS: no event to await)."""
    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110 - a condition on other services' state, no event to await
            await asyncio.sleep(0.05)


async def ready(stack: Stack, version: str) -> bool:
    listed = await listed_versions(stack)
    return version in listed and listed[version][0] == job_service_pb2.MODEL_VERSION_STATE_READY


async def gone(stack: Stack, version: str) -> bool:
    listed = await listed_versions(stack)
    return version not in listed


@pytest.fixture
async def v1_stack(config: Config, start_stack: StartStack) -> Stack:
    """Gateway, scheduler and batcher that all declare only version 1 of the demo model."""
    return await start_stack(with_models(config, demo(versions=("1",))))


def kserve(stack: Stack) -> triton.InferenceServerClient:
    assert stack.batcher is not None
    return triton.InferenceServerClient(f"127.0.0.1:{stack.batcher.port}")


async def test_load_and_unload_a_version_through_tritonclient(v1_stack: Stack) -> None:
    stack = v1_stack
    client = kserve(stack)
    try:
        # Version 2 is in no file: loaded from load_model's config, beside version 1.
        await client.load_model(
            "demo", config=load_config_json(version_table("1", DEMO_MODEL.loader), version_table("2", V2_LOADER))
        )
        assert (await client.get_model_metadata("demo")).versions == ["1", "2"]
        assert await client.is_model_ready("demo", "2")
        index = {(m.name, m.version): m.state for m in (await client.get_model_repository_index()).models}
        assert index == {("demo", "1"): "READY", ("demo", "2"): "READY"}
        # The gateway learns it from the registry and accepts jobs pinned to it.
        await until(lambda: ready(stack, "2"))
        async with AsyncClient(stack.address) as jobs:
            done = await jobs.wait(await jobs.submit("demo", {"x": X}, model_version="2"), timeout_s=WAIT_S)
            assert done.succeeded
            np.testing.assert_allclose(done.outputs["y"], EXPECTED["2"])

            # Back to version 1 alone: version 2 is unloaded, and gone from the gateway.
            await client.load_model("demo", config=load_config_json(version_table("1", DEMO_MODEL.loader)))
            assert not await client.is_model_ready("demo", "2")
            await until(lambda: gone(stack, "2"))
            with pytest.raises(NotFoundError):
                await jobs.submit("demo", {"x": X}, model_version="2")

            # unload_model takes the whole model; load_model without a config reads the file again.
            await client.unload_model("demo")
            assert not await client.is_model_ready("demo")
            with pytest.raises(InferenceServerException):
                await client.get_model_metadata("demo")
            await client.load_model("demo")
            assert (await client.get_model_metadata("demo")).versions == ["1"]
            again = await jobs.wait(await jobs.submit("demo", {"x": X}), timeout_s=WAIT_S)
            assert again.succeeded
            np.testing.assert_allclose(again.outputs["y"], EXPECTED["1"])
    finally:
        await client.close()


async def test_a_bad_config_is_refused_and_what_runs_keeps_running(v1_stack: Stack) -> None:
    client = kserve(v1_stack)
    try:
        with pytest.raises(InferenceServerException, match="did not load"):
            await client.load_model("demo", config=load_config_json(version_table("1", "no.such.module:factory")))
        # The version it would have replaced still serves.
        assert await client.is_model_ready("demo", "1")
        with pytest.raises(InferenceServerException, match=r"INVALID_ARG|invalid"):
            await client.load_model("demo", config=json.dumps({"max_batch_size": 0}))
        # JSON that Python will not read (it escaped as UNKNOWN, with a traceback).
        for config, said in (("[" * 50_000 + "]" * 50_000, "nested too deeply"), ("1" * 5_000, "number too long")):
            with pytest.raises(InferenceServerException, match=f"INVALID_ARGUMENT.*{said}") as refused:
                await client.load_model("demo", config=config)
            assert "set_int_max_str_digits" not in str(refused.value)  # Python's advice, not the caller's
        assert await client.is_model_ready("demo", "1")
    finally:
        await client.close()


async def test_a_load_whose_config_is_a_pipeline_is_refused_invalid_argument(v1_stack: Stack) -> None:
    """Pipelines are fixed when the batcher starts. A load_model config with `steps` was loaded as a
    model with no loader: UNAVAILABLE MODEL_LOAD_FAILED ("ValueError: Empty module name"), which a
    caller retries, and the failure stayed in the repository index as the version's."""
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from asyncinfer.grpc_errors import status_details, unpack_details

    pipeline = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}],
        "steps": [{"model": "demo", "inputs": {"x": "x"}, "outputs": {"y": "y"}}],
    }
    assert v1_stack.batcher is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{v1_stack.batcher.port}") as channel:
        repository = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.RepositoryModelLoadRequest(model_name="piped")
        request.parameters["config"].string_param = json.dumps(pipeline)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await repository.RepositoryModelLoad(request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = status_details(refused.value)
        assert details is not None
        found = unpack_details(details)
        assert found["ErrorInfo"].reason == "PIPELINE_FIXED"
        assert [v.field for v in found["BadRequest"].field_violations] == ["config.steps"]
        index = await repository.RepositoryIndex(service_pb2.RepositoryIndexRequest())
        assert [(m.name, m.version, m.state) for m in index.models] == [("demo", "1", "READY")]


async def test_a_version_that_failed_to_load_can_be_unloaded(v1_stack: Stack) -> None:
    """As Triton unloads an unavailable model. Its failure was kept (RepositoryIndex UNAVAILABLE,
    announced to the scheduler as the version's load failure) while UnloadModel of that version
    answered NOT_FOUND "not loaded here"."""
    channel = grpc.aio.insecure_channel(v1_stack.ops_address)
    ops = ops_service_pb2_grpc.OpsServiceStub(channel)
    client = kserve(v1_stack)

    async def index() -> dict[tuple[str, str], str]:
        return {(m.name, m.version): m.state for m in (await client.get_model_repository_index()).models}

    try:
        await until(lambda: ready(v1_stack, "1"))  # the batcher is connected (its stream opens after its start)
        broken = load_config_json(version_table("1", DEMO_MODEL.loader), version_table("2", "no.such:factory"))
        loaded = await ops.LoadModel(ops_service_pb2.LoadModelRequest(model_name="demo", config_json=broken))
        assert [o.error.reason for o in loaded.outcomes] == ["MODEL_LOAD_FAILED"]
        assert await index() == {("demo", "1"): "READY", ("demo", "2"): "UNAVAILABLE"}

        unloaded = await ops.UnloadModel(ops_service_pb2.UnloadModelRequest(model_name="demo", model_version="2"))
        assert [(o.ok, o.error.reason) for o in unloaded.outcomes] == [(True, "")]
        assert await index() == {("demo", "1"): "READY"}
        assert await client.is_model_ready("demo", "1")
    finally:
        await client.close()
        await channel.close()


async def test_a_load_reports_its_own_failures_and_refusals_say_what_is_wrong(v1_stack: Stack) -> None:
    """A failed load names the versions it failed to load, read under the model control's lock: it
    read every failure kept for the model after the lock was released, so a load after a failed
    one reported the earlier load's version too. An unload of a version not loaded caps the
    version in its message (it was put there at full length), and load_model's refused name has a
    field violation that says what a name is (its description was empty)."""
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from asyncinfer.grpc_errors import status_details, unpack_details

    channel = grpc.aio.insecure_channel(v1_stack.ops_address)
    ops = ops_service_pb2_grpc.OpsServiceStub(channel)
    assert v1_stack.batcher is not None
    batcher = grpc.aio.insecure_channel(f"127.0.0.1:{v1_stack.batcher.port}")
    repository = service_pb2_grpc.GRPCInferenceServiceStub(batcher)

    async def load(config: str) -> str:
        request = service_pb2.RepositoryModelLoadRequest(model_name="demo")
        request.parameters["config"].string_param = config
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await repository.RepositoryModelLoad(request)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        return refused.value.details() or ""

    try:
        one = version_table("1", DEMO_MODEL.loader)
        first = await load(load_config_json(one, version_table("2", "no.such:two")))
        assert first.startswith("model 'demo' did not load: version 2: "), first
        second = await load(load_config_json(one, version_table("3", "no.such:three")))
        assert second.startswith("model 'demo' did not load: version 3: "), second
        assert "version 2" not in second, second

        await until(lambda: ready(v1_stack, "1"))  # the batcher is connected (its stream opens after its start)
        long_version = "9" * 5_000
        unloaded = await ops.UnloadModel(
            ops_service_pb2.UnloadModelRequest(model_name="demo", model_version=long_version)
        )
        [(reason, message)] = [(o.error.reason, o.error.message) for o in unloaded.outcomes]
        assert (reason, message) == ("MODEL_NOT_FOUND", f"model 'demo' version '{'9' * 64}' is not loaded here")

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await repository.RepositoryModelLoad(service_pb2.RepositoryModelLoadRequest(model_name="de mo"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = status_details(refused.value)
        assert details is not None
        [violation] = unpack_details(details)["BadRequest"].field_violations
        assert (violation.field, violation.description) == (
            "model_name",
            "1-64 letters, digits, '_' or '-', starting with a letter or digit",
        )
    finally:
        await batcher.close()
        await channel.close()


async def test_a_config_json_that_cannot_be_read_is_refused_at_once(v1_stack: Stack) -> None:
    """By the scheduler, before any batcher is asked: one nested 50,000 deep was forwarded, the
    batcher's control failed unanswered, and LoadModel waited its whole timeout (120 s) to say
    CONTROL_TIMED_OUT. A model_name that cannot be one says so (it said "model_name is required")."""
    channel = grpc.aio.insecure_channel(v1_stack.ops_address)
    ops = ops_service_pb2_grpc.OpsServiceStub(channel)
    try:
        for request, said in (
            (ops_service_pb2.LoadModelRequest(model_name="demo", config_json="[" * 50_000), "nested too deeply"),
            (ops_service_pb2.LoadModelRequest(model_name="demo", config_json="[1]"), "must be a JSON object"),
            (ops_service_pb2.LoadModelRequest(model_name="de mo"), "cannot be a model's name"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await asyncio.wait_for(ops.LoadModel(request), 10.0)
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert said in (refused.value.details() or "")
    finally:
        await channel.close()


@pytest.mark.timeout(300)
async def test_2000_jobs_while_v1_is_replaced_by_v2(v1_stack: Stack) -> None:
    """v1 serves; jobs flow (unpinned and pinned to v1); v2 is loaded beside it (warmed up before
    it takes work) and jobs pinned to v2 join; the jobs pinned to v1 stop coming and v1 is
    unloaded while the rest flow. No job fails, each ran on its version: the one it asked for, or
    the default at its dispatch, which its outputs confirm."""
    stack = v1_stack
    kserve_client = kserve(stack)
    submitted: list[tuple[str, Job]] = []  # (version asked for, job)
    phase = {"pinned": ["1"]}
    v1_asked = [0]  # submits pinned to v1 begun (some may still be on their way when the phase ends)
    stop = asyncio.Event()

    async with AsyncClient(stack.address) as client:

        async def submit_one(index: int) -> None:
            choices = ["", *phase["pinned"]]
            asked = choices[index % len(choices)]
            v1_asked[0] += asked == "1"
            job = await client.submit("demo", {"x": X}, model_version=asked)
            submitted.append((asked, job))

        async def produce() -> None:
            index = 0
            while index < TOTAL_JOBS and not stop.is_set():
                batch = range(index, min(index + IN_FLIGHT, TOTAL_JOBS))
                await asyncio.gather(*(submit_one(i) for i in batch))
                index = batch.stop

        producer = asyncio.create_task(produce())
        try:
            await until(lambda: asyncio.sleep(0, len(submitted) >= 300))
            await kserve_client.load_model(
                "demo", config=load_config_json(version_table("1", DEMO_MODEL.loader), version_table("2", V2_LOADER))
            )
            await until(lambda: ready(stack, "2"))
            phase["pinned"] = ["2"]  # v1 pins stop; v2 pins start

            def v1_submitted() -> list[Job]:
                return [job for asked, job in submitted if asked == "1"]

            await until(lambda: asyncio.sleep(0, len(v1_submitted()) == v1_asked[0]))
            pinned_v1 = v1_submitted()
            await client.wait_jobs(pinned_v1, timeout_s=WAIT_S)
            assert len(submitted) < TOTAL_JOBS, "the load finished before the swap: nothing tested under load"
            await kserve_client.load_model("demo", config=load_config_json(version_table("2", V2_LOADER)))
            await asyncio.wait_for(producer, WAIT_S)
        finally:
            stop.set()
            await asyncio.gather(producer, return_exceptions=True)
            await kserve_client.close()

        assert len(submitted) == TOTAL_JOBS
        done = await client.wait_jobs([job for _asked, job in submitted], timeout_s=WAIT_S)
        ran_on: dict[str, int] = {}
        for asked, job in submitted:
            finished = done[job.job_id]
            assert finished.succeeded, (finished.state, finished.error)
            assert finished.attempt == 1
            if asked:
                assert finished.model_version == asked
            np.testing.assert_allclose(finished.outputs["y"], EXPECTED[finished.model_version])
            key = f"{asked or 'default'}->{finished.model_version}"
            ran_on[key] = ran_on.get(key, 0) + 1
        # Unpinned jobs ran on v1 before v2 was ready and on v2 after; some of each.
        assert ran_on.get("default->1", 0) > 0
        assert ran_on.get("default->2", 0) > 0
        assert ran_on.get("1->1", 0) > 0
        assert ran_on.get("2->2", 0) > 0


async def test_a_replaced_version_finishes_its_in_flight_batch_on_the_old_model(
    config: Config, start_stack: StartStack
) -> None:
    """Version 1 is replaced (same version, new weights: the v2 factory) while a batch of it is
    computing: that batch ends with the old model's answer, every later job gets the new one."""
    gated = demo(versions=("1",)).model_copy(update={"loader": "services.batcher.models.demo:build_gated_model"})
    stack = await start_stack(with_models(config, gated))
    assert stack.batcher is not None
    kserve_client = kserve(stack)
    GATE.clear()
    try:
        async with AsyncClient(stack.address) as client:
            held = await client.submit("demo", {"x": X}, model_version="1")
            async for update in client.watch(held, timeout_s=WAIT_S):
                if update.state.value == "RUNNING":
                    break
            await kserve_client.load_model("demo", config=load_config_json(version_table("1", V2_LOADER)))
            after = await client.submit("demo", {"x": X}, model_version="1")
            after_done = await client.wait(after, timeout_s=WAIT_S)
            np.testing.assert_allclose(after_done.outputs["y"], EXPECTED["2"])  # the new weights
            assert (await client.get(held)).state.value == "RUNNING"  # still computing on the old model
            GATE.set()
            held_done = await client.wait(held, timeout_s=WAIT_S)
            assert held_done.succeeded
            assert held_done.attempt == 1
            np.testing.assert_allclose(held_done.outputs["y"], EXPECTED["1"])  # the old weights
            await stack.batcher.models.drained()
    finally:
        GATE.set()
        await kserve_client.close()


async def kserve_infer(client: triton.InferenceServerClient, version: str) -> np.ndarray[Any, Any]:
    """One KServe call with no deadline (no client timeout, no `timeout` parameter)."""
    infer_input = triton.InferInput("x", list(X.shape), "FP32")
    infer_input.set_data_from_numpy(X)
    result = await client.infer("demo", [infer_input], model_version=version)
    y = result.as_numpy("y")
    assert y is not None
    return y


async def test_a_replaced_versions_call_that_never_returns_is_answered_after_the_retire_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Version 1 is replaced while a KServe call (no deadline, so no execution timeout) is in a
    model call that does not return, and a second one waits behind it (one batch in flight): the
    old version's drain gives up at batcher.retire_grace_s, both calls are answered UNAVAILABLE,
    and the drain ends while the model's thread is still held. It polled for good before."""
    monkeypatch.setattr(demo_models, "GATE_TIMEOUT_S", None)  # held until the test sets GATE
    gated = demo(versions=("1",)).model_copy(
        update={"loader": "services.batcher.models.demo:build_gated_model", "max_inflight_batches": 1}
    )
    config = Config().replace(
        batcher={"port": 0, "metrics_port": 0, "scheduler_address": None, "retire_grace_s": 0.2},
        models=[gated.model_dump()],
        logging={"level": "warning", "format": "console"},
    )
    app = BatcherApp(config)
    await app.start()
    client = triton.InferenceServerClient(f"127.0.0.1:{app.port}")
    GATE.clear()
    GATE_ENTERED.clear()  # set by the warm-up at start
    calls: list[asyncio.Task[np.ndarray[Any, Any]]] = []
    try:
        calls.append(asyncio.create_task(kserve_infer(client, "1")))
        assert await asyncio.to_thread(GATE_ENTERED.wait, WAIT_S)  # in the model's call, held there
        calls.append(asyncio.create_task(kserve_infer(client, "1")))
        async with asyncio.timeout(WAIT_S):
            while app.engine.queue_depth("demo") < 1:  # noqa: ASYNC110 - the engine's queue has no event
                await asyncio.sleep(0.01)

        await client.load_model("demo", config=load_config_json(version_table("1", V2_LOADER)))
        async with asyncio.timeout(WAIT_S):
            await app.models.drained()
        assert not GATE.is_set()  # the old model's call has still not returned
        for call in calls:
            with pytest.raises(InferenceServerException) as answered:
                await call
            assert answered.value.status() == "StatusCode.UNAVAILABLE"
            assert "was replaced or unloaded" in str(answered.value.message())
        np.testing.assert_allclose(await kserve_infer(client, "1"), EXPECTED["2"])  # the new one serves
    finally:
        GATE.set()
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await client.close()
        await app.stop(grace_s=1.0)


async def gated_job_on_version_1(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch, *, execution_timeout_s: float
) -> tuple[Stack, AsyncClient, triton.InferenceServerClient, str]:
    """A stack serving the gated demo model as version 1 only, retire_grace_s 0.2, and a job of
    max_attempts 1 held in its model's call (released when the test sets GATE)."""
    monkeypatch.setattr(demo_models, "GATE_TIMEOUT_S", None)  # held until the test sets GATE
    gated = demo(versions=("1",)).model_copy(update={"loader": "services.batcher.models.demo:build_gated_model"})
    stack = await start_stack(with_models(config.replace(batcher={"retire_grace_s": 0.2}), gated))
    assert stack.batcher is not None
    GATE.clear()
    GATE_ENTERED.clear()  # set by the warm-up at start
    client = AsyncClient(stack.address)
    held = await client.submit("demo", {"x": X}, max_attempts=1, execution_timeout_s=execution_timeout_s)
    async for update in client.watch(held, timeout_s=WAIT_S):
        if update.state.value == "RUNNING":
            break
    assert await asyncio.to_thread(GATE_ENTERED.wait, WAIT_S)  # in version 1's model call
    return stack, client, kserve(stack), held.job_id


async def test_a_job_computing_past_the_retire_grace_within_its_execution_timeout_finishes_on_the_old_version(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Version 1 is replaced by version 2 while a job (execution timeout 60 s, max_attempts 1)
    computes on it: past batcher.retire_grace_s (0.2 s) the job goes on computing on version 1,
    whose grace lasts to its execution deadline, and succeeds there once. It was cut off at the
    grace, handed back and run again from scratch on version 2 (a second attempt), while version
    1's thread went on computing the answer dropped."""
    stack, client, kserve_client, job_id = await gated_job_on_version_1(
        config, start_stack, monkeypatch, execution_timeout_s=WAIT_S
    )
    assert stack.batcher is not None
    engine = stack.batcher.engine
    try:
        await kserve_client.load_model("demo", config=load_config_json(version_table("2", V2_LOADER)))
        assert engine.versions("demo") == ["2"]
        # Version 1's grace has passed: a version past it takes no more orders (before, it had left
        # the engine then).
        async with asyncio.timeout(WAIT_S):
            while engine.has_model("demo", "1"):  # noqa: ASYNC110 - the engine has no event for it
                await asyncio.sleep(0.01)
        assert (await client.get(job_id)).state.value == "RUNNING"
        GATE.set()  # the call returns, after the grace
        done = await client.wait(job_id, timeout_s=WAIT_S)
        assert done.succeeded, (done.state, done.error)
        np.testing.assert_allclose(done.outputs["y"], EXPECTED["1"])  # computed on version 1
        assert done.attempt == 1  # once: no attempt given back, none run again
        async with asyncio.timeout(WAIT_S):
            await stack.batcher.models.drained()
    finally:
        GATE.set()
        await client.close()
        await kserve_client.close()


async def test_a_job_in_a_retired_versions_call_that_never_returns_times_out_once_at_its_execution_timeout(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job (execution timeout 1 s, max_attempts 1) in a model call that never returns when
    version 1 is replaced: it is not cut off at batcher.retire_grace_s (0.2 s) but answered
    TIMED_OUT at its execution timeout, once, by the engine, as with no rollout, and that ends
    version 1's drain while the call is still held. It was handed back at the grace and run again
    on version 2."""
    stack, client, kserve_client, job_id = await gated_job_on_version_1(
        config, start_stack, monkeypatch, execution_timeout_s=1.0
    )
    assert stack.batcher is not None
    try:
        await kserve_client.load_model("demo", config=load_config_json(version_table("2", V2_LOADER)))
        done = await client.wait(job_id, timeout_s=WAIT_S)
        assert done.state.value == "TIMED_OUT", (done.state, done.error)
        assert done.error is not None
        assert done.error.reason == "EXECUTION_TIMEOUT", done.error
        assert done.attempt == 1
        async with asyncio.timeout(WAIT_S):
            await stack.batcher.models.drained()
        assert not GATE.is_set()  # the old model's call has still not returned
    finally:
        GATE.set()
        await client.close()
        await kserve_client.close()


async def test_a_load_that_ends_after_the_engine_stopped_is_refused_and_adds_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tritonclient load of version 2 whose loader is held until the batcher's engine has stopped
    (its shutdown grace lets the call finish): the load answers UNAVAILABLE MODEL_LOAD_FAILED "the
    batcher is stopping" and version 2 is not added. It reached add_model on the stopped engine: the
    supervisor refused its batch former (RuntimeError, the call failed UNKNOWN) after the version
    was registered, with a thread pool nothing would shut down."""
    config = Config().replace(
        batcher={"port": 0, "metrics_port": 0, "scheduler_address": None, "shutdown_grace_s": WAIT_S},
        models=[demo(versions=("1",)).model_dump()],
        logging={"level": "warning", "format": "console"},
    )
    app = BatcherApp(config)
    await app.start()
    engine_stopped = asyncio.Event()
    stop_engine = app.engine.stop

    async def stop_and_say_so(grace_s: float = 5.0) -> None:
        await stop_engine(grace_s)
        engine_stopped.set()

    monkeypatch.setattr(app.engine, "stop", stop_and_say_so)
    client = triton.InferenceServerClient(f"127.0.0.1:{app.port}")
    LOAD_RELEASE.clear()
    LOAD_ENTERED.clear()
    held = "tests.hanging_models:build_held_loading_model"
    load = asyncio.create_task(
        client.load_model(
            "demo", config=load_config_json(version_table("1", DEMO_MODEL.loader), version_table("2", held))
        )
    )
    stopping: asyncio.Task[None] | None = None
    try:
        assert await asyncio.to_thread(LOAD_ENTERED.wait, WAIT_S)  # version 2 is loading
        stopping = asyncio.create_task(app.stop(grace_s=WAIT_S))
        async with asyncio.timeout(WAIT_S):
            await engine_stopped.wait()
        LOAD_RELEASE.set()
        with pytest.raises(InferenceServerException) as refused:
            await load
        assert refused.value.status() == "StatusCode.UNAVAILABLE", refused.value
        assert "version 2: the batcher is stopping" in str(refused.value.message())
        await stopping
        assert app.engine.versions("demo") == ["1"]
        assert app.models.failures == {("demo", "2"): "the batcher is stopping"}
    finally:
        LOAD_RELEASE.set()
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
        await client.close()
        await app.stop(grace_s=1.0)


async def test_ops_service_loads_and_unloads_across_the_pool(
    config: Config, start_stack: StartStack, batchers: Callable[..., Any]
) -> None:
    """OpsService.LoadModel / UnloadModel reach every batcher connected to the scheduler."""
    stack = await start_stack(with_models(config, demo(versions=("1",))), batcher=False)
    pool = [await batchers(stack, name, demo(versions=("1",))) for name in ("pool-a", "pool-b")]
    channel = grpc.aio.insecure_channel(stack.ops_address)
    ops = ops_service_pb2_grpc.OpsServiceStub(channel)

    async def both_connected() -> bool:  # a batcher's stream opens after its start returns
        return (await listed_versions(stack)).get("1", (0, ()))[1] == ("pool-a", "pool-b")

    try:
        await until(both_connected)
        both = load_config_json(version_table("1", DEMO_MODEL.loader), version_table("2", V2_LOADER))
        loaded = await ops.LoadModel(ops_service_pb2.LoadModelRequest(model_name="demo", config_json=both))
        assert sorted((o.batcher_id, o.ok) for o in loaded.outcomes) == [("pool-a", True), ("pool-b", True)]

        # Each batcher's READY reaches the gateway on its own (the registry, through NATS): the
        # listing names both once the second's has come (CI, session 34: READY with pool-a alone).
        async def ready_on_both() -> bool:
            return await ready(stack, "2") and (await listed_versions(stack))["2"][1] == ("pool-a", "pool-b")

        await until(ready_on_both)
        async with AsyncClient(stack.address) as client:
            jobs = [await client.submit("demo", {"x": X}, model_version="2") for _ in range(20)]
            done = await client.wait_jobs(jobs, timeout_s=WAIT_S)
            assert all(d.succeeded and d.model_version == "2" for d in done.values())
            assert {d.batcher_id for d in done.values()} <= {"pool-a", "pool-b"}

        unloaded = await ops.UnloadModel(ops_service_pb2.UnloadModelRequest(model_name="demo", model_version="1"))
        assert all(o.ok for o in unloaded.outcomes)
        assert all(app.engine.versions("demo") == ["2"] for app in pool)

        async def v1_unavailable() -> bool:
            return (await listed_versions(stack))["1"][0] == job_service_pb2.MODEL_VERSION_STATE_UNAVAILABLE

        await until(v1_unavailable)

        refused = await ops.LoadModel(
            ops_service_pb2.LoadModelRequest(
                model_name="demo", config_json=json.dumps({"loader": "no.such:factory"}), batcher_ids=["pool-a"]
            )
        )
        (outcome,) = refused.outcomes
        assert not outcome.ok
        assert outcome.error.reason == "MODEL_LOAD_FAILED"
        assert pool[0].engine.versions("demo") == ["2"]  # what ran keeps running
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await ops.LoadModel(ops_service_pb2.LoadModelRequest(model_name="demo", batcher_ids=["nobody"]))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await channel.close()
