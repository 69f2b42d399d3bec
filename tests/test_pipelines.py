"""Pipelines end to end, on real NATS, the real gRPC servers and the real batcher (tests/stack.py):
many concurrent pipeline jobs whose steps batch together across jobs (a step's batch holds items
of several jobs, seen in the batcher's batch-size metrics and in the job records), each job one
job (one record, QUEUED -> RUNNING -> SUCCEEDED) with the last step's mapped outputs and the share
of its steps done as progress; a failing step fails its job with the step named; a cancel reaches
a job whose step waits in its model's queue; the gateway validates a submit against the pipeline's
inputs; a pipeline whose step model did not load does not serve. On an engine alone: a job's
deadline applies to its first step; a reporting step's progress is folded into the pipeline's; and
the document embedder pipeline (chunk -> minilm-l6 -> pool) against minilm-l6-doc."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import numpy as np
import pytest
from structlog.testing import capture_logs

from asyncinfer.config import DEMO_MODEL, ModelConfig
from asyncinfer.tensor_codec import decode_tensors
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import job_pb2, job_service_pb2, tensor_pb2
from services.batcher.models.demo import FAILING_MODEL_MESSAGE, GATE
from tests.progress_models import RELEASE, STARTED, STOPPED
from tests.stack import Stack, StartStack

pytestmark = pytest.mark.timeout(180)

GATED = DEMO_MODEL.model_copy(
    update={"name": "gated", "loader": "services.batcher.models.demo:build_gated_model", "max_batch_size": 64}
)
FAILING = DEMO_MODEL.model_copy(
    update={"name": "failing", "loader": "services.batcher.models.demo:build_failing_model", "max_attempts": 1}
)
# y = 2(2x + 1) + 1 = 4x + 3: the gated demo model, then the demo model.
TWICE = ModelConfig.model_validate(
    {
        "name": "twice",
        "max_queue_size": 256,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}],
        "steps": [
            {"model": "gated", "inputs": {"x": "x"}, "outputs": {"y": "once"}},
            {"model": "demo", "inputs": {"x": "once"}, "outputs": {"y": "y"}},
        ],
    }
)
BROKEN = TWICE.model_copy(
    update={
        "name": "broken",
        "max_attempts": 1,
        "steps": (TWICE.steps[0], TWICE.steps[1].model_copy(update={"model": "failing", "name": "second"})),
    }
)
JOBS = 24


def x_request(model: str, value: float) -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([value, value + 1, value + 2, value + 3])
    return job_service_pb2.SubmitJobRequest(model_name=model, inputs=[x])


async def until(condition: Any, what: str, timeout_s: float = 60.0) -> None:
    """Polls `condition()` until it holds, bounded (the engine's state changes on this loop, and
    it has no event to wait on from outside)."""
    give_up_at = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < give_up_at, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.01)


async def watch(
    stack: Stack,
    job_id: str,
    seen: list[job_service_pb2.WatchJobResponse] | None = None,
    running: asyncio.Event | None = None,
) -> list[job_service_pb2.WatchJobResponse]:
    """Every change a WatchJob of the job hears, into `seen`; `running` is set once one said RUNNING."""
    seen = [] if seen is None else seen
    async for response in stack.jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=job_id)):
        seen.append(response)
        if running is not None and response.job.state == job_pb2.JOB_STATE_RUNNING:
            running.set()
    return seen


def batch_rows(stack: Stack, model: str) -> tuple[float, float]:
    """The batcher's histogram of rows per batch of `model`: (batches, rows)."""
    assert stack.batcher is not None
    registry = stack.batcher.registry
    count = registry.get_sample_value("asyncinfer_batch_size_count", {"model": model}) or 0.0
    total = registry.get_sample_value("asyncinfer_batch_size_sum", {"model": model}) or 0.0
    return count, total


@pytest.fixture
async def gated_stack(config: Any, start_stack: StartStack) -> Any:
    GATE.set()
    stack = await start_stack(
        config.replace(models=(DEMO_MODEL, GATED, FAILING, TWICE, BROKEN), batcher={"progress_interval_ms": 0.0})
    )
    try:
        yield stack
    finally:
        GATE.set()


async def test_steps_of_many_jobs_batch_together(gated_stack: Stack) -> None:
    stack = gated_stack
    assert stack.batcher is not None
    engine = stack.batcher.engine
    runner = engine.pipeline("twice")
    assert runner is not None
    GATE.clear()  # the first step's first batch computes until the gate opens: the rest queue behind it
    jobs = [(await stack.jobs.SubmitJob(x_request("twice", float(i)))).job for i in range(JOBS)]
    assert {job.state for job in jobs} == {job_pb2.JOB_STATE_QUEUED}
    # The last job's watch hears it RUNNING before the gate opens: begun later, on a loaded
    # machine (CI, session 34), its first answer was already the job's SUCCEEDED.
    seen: list[job_service_pb2.WatchJobResponse] = []
    running = asyncio.Event()
    watched = asyncio.create_task(watch(stack, jobs[-1].job_id, seen, running))
    # Every job is running in the batcher, and most wait in the first step's queue.
    await until(lambda: runner.held == JOBS and engine.queue_depth("gated") >= JOBS // 2, "jobs queued in the step")
    await asyncio.wait_for(running.wait(), 60)
    GATE.set()
    await asyncio.wait_for(watched, 60)

    answers = [await stack.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=job.job_id)) for job in jobs]
    records = [answer.job for answer in answers]
    for i, record in enumerate(records):
        assert record.state == job_pb2.JOB_STATE_SUCCEEDED, record
        (y,) = decode_tensors(record.outputs)
        assert y.name == "y"
        np.testing.assert_allclose(y.to_numpy(), 4 * np.array([[i, i + 1, i + 2, i + 3]], dtype=np.float32) + 3)
    # A batch of the first step held items of several jobs (one row each): the one after the gate
    # opened took every job waiting then.
    batches, rows = batch_rows(stack, "gated")
    assert rows == JOBS
    assert batches < JOBS / 2, batches
    # The pipeline's own jobs are counted by outcome, as a model's (a dashboard's items panel).
    items = stack.batcher.registry.get_sample_value(
        "asyncinfer_batcher_items_total", {"model": "twice", "outcome": "OK"}
    )
    assert items == JOBS
    # ... and so did the second step's, which the first step's batch handed its items to at once:
    # the records carry the last step's batch.
    assert max(record.batch.batch_size for record in records) > 1
    # One job, one record: QUEUED, RUNNING, progress as steps are done, SUCCEEDED.
    states = [r.job.state for r in seen]
    assert states[-1] == job_pb2.JOB_STATE_SUCCEEDED
    assert job_pb2.JOB_STATE_RUNNING in states
    fractions = [r.progress.fraction for r in seen if r.HasField("progress")]
    assert fractions == sorted(fractions), fractions
    assert fractions[-1] == 1.0
    assert set(fractions) <= {0.0, 0.5, 1.0}
    assert answers[-1].progress.message == "2 of 2 steps done"


async def test_a_failing_step_fails_the_job_with_the_step_named(gated_stack: Stack) -> None:
    stack = gated_stack
    job = (await stack.jobs.SubmitJob(x_request("broken", 1.0))).job
    seen = await asyncio.wait_for(watch(stack, job.job_id), 60)
    final = seen[-1].job
    assert final.state == job_pb2.JOB_STATE_FAILED
    assert final.error.reason == "MODEL_ERROR"
    assert "pipeline 'broken' step 2 (second)" in final.error.message
    assert FAILING_MODEL_MESSAGE in final.error.message


async def test_a_cancel_reaches_a_job_whose_step_waits_in_its_models_queue(gated_stack: Stack) -> None:
    stack = gated_stack
    assert stack.batcher is not None
    engine = stack.batcher.engine
    GATE.clear()
    first = (await stack.jobs.SubmitJob(x_request("twice", 0.0))).job
    computing = GATED.max_queue_size - 1
    await until(
        lambda: engine.free_slots("gated") == computing and engine.queue_depth("gated") == 0, "the first job's step"
    )
    second = (await stack.jobs.SubmitJob(x_request("twice", 1.0))).job
    await until(lambda: engine.queue_depth("gated") == 1, "the second job's step queued")
    await stack.jobs.CancelJob(job_service_pb2.CancelJobRequest(job_id=second.job_id, reason="not needed"))
    canceled = await asyncio.wait_for(watch(stack, second.job_id), 60)
    assert canceled[-1].job.state == job_pb2.JOB_STATE_CANCELED
    await until(lambda: engine.queue_depth("gated") == 0, "the dropped step purged")
    GATE.set()
    done = await asyncio.wait_for(watch(stack, first.job_id), 60)
    assert done[-1].job.state == job_pb2.JOB_STATE_SUCCEEDED
    assert batch_rows(stack, "gated") == (1.0, 1.0)  # the canceled job's step never ran


async def test_a_cancel_of_a_pipeline_job_tells_the_step_model_computing_it(
    config: Any, start_stack: StartStack
) -> None:
    """A job cancelled while a step computes: its batch cannot drop the step's item, but a step
    model that reports progress is told (`progress.cancelled(row)`), as a model running a job of
    its own is, and stops; the later steps never run. The pipeline's item was dropped at the
    cancel, and its step's channel never heard it: the model computed on to its end."""
    STOPPED.clear()
    RELEASE.clear()
    until_cancelled = DEMO_MODEL.model_copy(
        update={"name": "until-cancelled", "loader": "tests.progress_models:build_until_cancelled_model"}
    )
    cancellable = TWICE.model_copy(
        update={
            "name": "cancellable",
            "steps": (TWICE.steps[0].model_copy(update={"model": "until-cancelled"}), TWICE.steps[1]),
        }
    )
    stack = await start_stack(
        config.replace(models=(DEMO_MODEL, until_cancelled, cancellable), batcher={"progress_interval_ms": 0.0})
    )
    try:
        job = (await stack.jobs.SubmitJob(x_request("cancellable", 1.0))).job
        final = None
        async for response in stack.jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id)):
            if response.progress.message.startswith("step 1 of 2: until-cancelled: step") and final is None:
                final = response.job  # the first step computes: cancel the job
                await stack.jobs.CancelJob(job_service_pb2.CancelJobRequest(job_id=job.job_id))
            if response.job.state in (job_pb2.JOB_STATE_CANCELED, job_pb2.JOB_STATE_SUCCEEDED):
                final = response.job
                break
        assert final is not None
        assert final.state == job_pb2.JOB_STATE_CANCELED
        told = await asyncio.to_thread(STOPPED.wait, 15)
        assert told, "the step's model was not told that its job was cancelled"
        assert batch_rows(stack, "demo") == (0.0, 0.0)  # the second step never ran
    finally:
        RELEASE.set()


UNTIL_CANCELLED = DEMO_MODEL.model_copy(
    update={"name": "until-cancelled", "loader": "tests.progress_models:build_until_cancelled_model"}
)
# y = 2(2x + 1) + 1: the until-cancelled model (computes until told), then the demo model.
CANCELLABLE = TWICE.model_copy(
    update={
        "name": "cancellable",
        "max_attempts": 1,
        "steps": (TWICE.steps[0].model_copy(update={"model": "until-cancelled"}), TWICE.steps[1]),
    }
)


def rows_request(model: str, rows: int, execution_timeout_ms: int = 0) -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[rows, 4])
    x.contents.fp32_contents.extend(float(i) for i in range(rows * 4))
    request = job_service_pb2.SubmitJobRequest(model_name=model, inputs=[x])
    if execution_timeout_ms:
        request.execution_timeout.FromMilliseconds(execution_timeout_ms)
    return request


async def until_terminal(stack: Stack, job_id: str, timeout_s: float) -> job_pb2.Job:
    """The job's terminal record, or an AssertionError after timeout_s (a hang guard)."""
    try:
        seen = await asyncio.wait_for(watch(stack, job_id), timeout_s)
    except TimeoutError:
        raise AssertionError(f"job {job_id} did not end within {timeout_s} s") from None
    return seen[-1].job


async def test_an_unexpected_exception_in_a_step_fails_the_job_naming_the_step(
    config: Any, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every future resolves: a step raising what none of our error types is (a bug in the runner, a
    backend raising the unexpected) fails the job MODEL_ERROR naming the step, logged once with its
    traceback. The runner caught only its own types: the item's future never resolved, and the
    job waited out its execution timeout (60 s) with nothing said."""
    from services.batcher.pipeline import PipelineRunner

    submit = PipelineRunner._submit

    async def breaks_on_demo(self: PipelineRunner, model: str, *args: Any) -> Any:
        if model == "demo":
            raise RuntimeError("injected: a bug past the first step")
        return await submit(self, model, *args)

    monkeypatch.setattr(PipelineRunner, "_submit", breaks_on_demo)
    once = TWICE.model_copy(update={"name": "once", "max_attempts": 1})
    stack = await start_stack(config.replace(models=(DEMO_MODEL, GATED, once)))
    GATE.set()
    with capture_logs() as logs:
        job = (await stack.jobs.SubmitJob(x_request("once", 1.0))).job
        final = await until_terminal(stack, job.job_id, 20)
    assert final.state == job_pb2.JOB_STATE_FAILED
    assert final.error.reason == "MODEL_ERROR"
    assert "pipeline 'once' step 2 (demo)" in final.error.message
    assert "RuntimeError: injected: a bug past the first step" in final.error.message
    failed = [entry for entry in logs if entry["event"] == "pipeline_step_failed"]
    assert len(failed) == 1, failed
    assert failed[0]["step"] == "pipeline 'once' step 2 (demo)"
    assert isinstance(failed[0]["exc_info"], RuntimeError)


async def test_a_pipelines_execution_timeout_names_the_step_and_tells_its_model(
    config: Any, start_stack: StartStack
) -> None:
    """A pipeline job past its execution timeout: its error names the step that was running, and
    that step's model reads `progress.cancelled(row)`, as README promises of a job's timeout. It said
    only "attempt 1 ran longer than its execution timeout of 1 s" (the batcher's "still computing
    1 s after it arrived" went no further), and the step's model was never told (it computed on
    until the test released it)."""
    STARTED.clear()
    STOPPED.clear()
    RELEASE.clear()
    stack = await start_stack(
        config.replace(models=(DEMO_MODEL, UNTIL_CANCELLED, CANCELLABLE), batcher={"progress_interval_ms": 0.0})
    )
    try:
        job = (await stack.jobs.SubmitJob(rows_request("cancellable", 1, execution_timeout_ms=1000))).job
        final = await until_terminal(stack, job.job_id, 30)
        assert final.state == job_pb2.JOB_STATE_TIMED_OUT
        assert final.error.message == (
            "attempt 1 ran longer than its execution timeout of 1 s: "
            "pipeline 'cancellable' step 1 (until-cancelled) was running 1 s after the job arrived"
        )
        told = await asyncio.to_thread(STOPPED.wait, 15)
        assert told, "the step's model was not told that its job timed out"
        assert batch_rows(stack, "demo") == (0.0, 0.0)  # the second step never ran
    finally:
        RELEASE.set()


async def test_a_cancel_tells_a_step_run_as_several_items(config: Any, start_stack: StartStack) -> None:
    """A step of more rows than its model's max_batch_size runs as several items: each gets a
    channel whose parent is the pipeline item's, so a cancel reaches the part computing (the parts
    still queued are dropped). The parts had no channel: the model computed on (until the test
    released it)."""
    STARTED.clear()
    STOPPED.clear()
    RELEASE.clear()
    one_row = UNTIL_CANCELLED.model_copy(update={"max_batch_size": 1, "max_inflight_batches": 1})
    stack = await start_stack(
        config.replace(models=(DEMO_MODEL, one_row, CANCELLABLE), batcher={"progress_interval_ms": 0.0})
    )
    try:
        # The model's warm-up at load is no job's call: STARTED set by it sent the cancel while the
        # job was still queued, and no model computed to be told (1 in 5 runs under load).
        assert not STARTED.is_set(), "the model's warm-up counted as the job's call"
        job = (await stack.jobs.SubmitJob(rows_request("cancellable", 3))).job
        watched = asyncio.create_task(watch(stack, job.job_id))
        assert await asyncio.to_thread(STARTED.wait, 15), "the step's first part never computed"
        await stack.jobs.CancelJob(job_service_pb2.CancelJobRequest(job_id=job.job_id))
        seen = await asyncio.wait_for(watched, 30)
        assert seen[-1].job.state == job_pb2.JOB_STATE_CANCELED
        told = await asyncio.to_thread(STOPPED.wait, 15)
        assert told, "the model computing a part of the step was not told that its job was cancelled"
        assert batch_rows(stack, "demo") == (0.0, 0.0)  # the second step never ran
    finally:
        RELEASE.set()


async def test_the_gateway_validates_a_pipeline_submit_against_its_inputs(gated_stack: Stack) -> None:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 3])
    x.contents.fp32_contents.extend([1.0, 2.0, 3.0])
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await gated_stack.jobs.SubmitJob(job_service_pb2.SubmitJobRequest(model_name="twice", inputs=[x]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_pipelines_step_model_cannot_be_unloaded_and_its_jobs_still_run(gated_stack: Stack) -> None:
    """Pipelines are fixed at start-up: unloading a step model (or the pipeline) through the KServe
    repository API is refused FAILED_PRECONDITION naming the pipeline, and changes nothing. It was
    unloaded, the pipeline still announced, and each of its jobs failed MODEL_ERROR thrice."""
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from asyncinfer.client import AsyncClient
    from asyncinfer.grpc_errors import status_details, unpack_details

    assert gated_stack.batcher is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gated_stack.batcher.port}") as channel:
        kserve = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        refusals = {
            "demo": ("MODEL_IN_PIPELINE", {"model": "demo", "pipelines": "twice"}),
            "twice": ("PIPELINE_FIXED", {"model": "twice"}),
        }
        for name, (reason, metadata) in refusals.items():
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await kserve.RepositoryModelUnload(service_pb2.RepositoryModelUnloadRequest(model_name=name))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, name
            details = status_details(refused.value)
            assert details is not None
            info = unpack_details(details)["ErrorInfo"]
            assert (info.reason, dict(info.metadata)) == (reason, metadata)
            assert "twice" in refused.value.details()
        ready = await kserve.ModelReady(service_pb2.ModelReadyRequest(name="demo"))
        assert ready.ready, "the refused unload changed nothing"
    async with AsyncClient(gated_stack.address) as jobs:
        done = await jobs.wait(await jobs.submit("twice", {"x": np.ones((1, 4), np.float32)}), timeout_s=60.0)
    assert done.succeeded, done.error
    np.testing.assert_allclose(done.outputs["y"], np.full((1, 4), 7.0))


async def test_a_step_models_version_that_no_longer_fits_its_pipeline_is_refused(gated_stack: Stack) -> None:
    """A pipeline's steps run on their model's default version: a load that would make it one
    whose inputs no longer take its neighbour's tensor is refused FAILED_PRECONDITION naming the
    pipeline and the tensor, and changes nothing. It was loaded, and every job of the pipeline then
    failed at the step ("pipeline 'twice' step 2 (demo): invalid inputs ...")."""
    import json

    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from asyncinfer.client import AsyncClient
    from asyncinfer.grpc_errors import status_details, unpack_details

    assert gated_stack.batcher is not None
    wider = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}]}  # 'once' is [-1, 4]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gated_stack.batcher.port}") as channel:
        kserve = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.RepositoryModelLoadRequest(model_name="demo")
        request.parameters["config"].string_param = json.dumps(wider)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await kserve.RepositoryModelLoad(request)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = status_details(refused.value)
        assert details is not None
        info = unpack_details(details)["ErrorInfo"]
        assert (info.reason, dict(info.metadata)) == (
            "PIPELINE_STEP_MISMATCH",
            {"model": "demo", "version": "1", "pipeline": "twice", "tensor": "once"},
        )
        assert refused.value.details() == (
            "model 'demo' version '1' does not fit pipeline 'twice', whose steps run on its default version: "
            "pipeline 'twice' step 2 (demo): 'once' is FP32 [-1, 4], but 'demo' takes FP32 [-1, 8] as 'x'"
        )
    assert gated_stack.batcher.engine.model_config("demo").inputs[0].shape == (-1, 4), "nothing changed"
    async with AsyncClient(gated_stack.address) as jobs:
        done = await jobs.wait(await jobs.submit("twice", {"x": np.ones((1, 4), np.float32)}), timeout_s=60.0)
    assert done.succeeded, done.error
    np.testing.assert_allclose(done.outputs["y"], np.full((1, 4), 7.0))


async def test_ops_service_says_which_pipeline_and_tensor_a_refused_load_is_about(gated_stack: Stack) -> None:
    """The same refusal through OpsService.LoadModel carries the batcher's ErrorInfo metadata in
    the outcome's error, as KServe's caller gets it: ErrorStatus had no metadata, and the
    scheduler passed on the code, reason and message alone."""
    import json

    from asyncinfer.v1 import ops_service_pb2, ops_service_pb2_grpc

    stack = gated_stack
    await until(lambda: any(not s.closed for s in stack.scheduler.batchers.sessions), "the batcher connected")
    wider = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}]}  # 'once' is [-1, 4]
    async with grpc.aio.insecure_channel(stack.ops_address) as channel:
        ops = ops_service_pb2_grpc.OpsServiceStub(channel)
        loaded = await ops.LoadModel(ops_service_pb2.LoadModelRequest(model_name="demo", config_json=json.dumps(wider)))
    [outcome] = loaded.outcomes
    assert not outcome.ok
    assert (outcome.error.code, outcome.error.reason) == (
        grpc.StatusCode.FAILED_PRECONDITION.value[0],
        "PIPELINE_STEP_MISMATCH",
    )
    assert dict(outcome.error.metadata) == {"model": "demo", "version": "1", "pipeline": "twice", "tensor": "once"}
    assert not outcome.error.retriable


async def test_an_unload_that_would_make_a_step_models_default_unfit_is_refused() -> None:
    """The same check on an unload: demo serves 1 (its default_version, fitting the pipeline) and 2
    (a wider input); unloading 1 would make 2 the version the steps run on."""
    from asyncinfer.config import BatcherConfig, ModelVersionConfig, TensorSpecConfig
    from asyncinfer.errors import FailedPrecondition
    from services.batcher.engine import BatchingEngine
    from services.batcher.model_control import ModelControl

    wider = ModelVersionConfig(version="2", inputs=(TensorSpecConfig(name="x", datatype="FP32", shape=(-1, 8)),))
    demo = DEMO_MODEL.model_copy(update={"default_version": "1", "versions": (wider,)})
    once = TWICE.model_copy(
        update={"name": "once", "steps": (TWICE.steps[1].model_copy(update={"inputs": {"x": "x"}}),)}
    )
    engine = BatchingEngine()
    control = ModelControl(engine, BatcherConfig())
    await control.load_at_start([demo])
    engine.add_pipeline(once)
    await engine.start()
    try:
        with pytest.raises(FailedPrecondition) as refused:
            await control.unload_model("demo", "1")
        assert refused.value.metadata == {"model": "demo", "version": "2", "pipeline": "once", "tensor": "x"}
        assert engine.versions("demo") == ["1", "2"]
        (y,) = (await engine.infer("once", [Tensor.from_numpy("x", np.ones((1, 4), np.float32))])).outputs
        np.testing.assert_allclose(y.to_numpy(), np.full((1, 4), 3.0))  # still served, on version 1
    finally:
        await engine.stop(grace_s=1.0)
        await control.close()


async def test_the_document_pipeline_matches_minilm_l6_doc() -> None:
    """chunk -> minilm-l6 -> pool, straight through an engine, against minilm-l6-doc on the same
    documents; a document of more windows than minilm-l6's max_batch_size runs as several items."""
    from asyncinfer.config import MINILM_DOC_MODEL, MINILM_DOC_PIPELINE, MINILM_MODEL, BatcherConfig
    from services.batcher.backends.loading import load_backend
    from services.batcher.engine import BatchingEngine

    engine = BatchingEngine()
    minilm = MINILM_MODEL.model_copy(update={"max_batch_size": 4})  # a 9-window document: 3 items
    for model in (minilm, MINILM_DOC_MODEL):
        engine.add_model(model, await asyncio.to_thread(load_backend, model, BatcherConfig()))
    engine.add_pipeline(MINILM_DOC_PIPELINE)
    await engine.start()
    try:
        sentence = "Pipelines run each step through its own model's batching queue, unbelievably. "
        documents = [sentence * 150, "A short one.", "", sentence * 3]
        text = [Tensor.from_numpy("text", np.array([d.encode() for d in documents], dtype=np.object_))]
        piped, whole = await asyncio.gather(
            engine.infer("minilm-l6-doc-pipeline", text), engine.infer("minilm-l6-doc", text)
        )
        (a,), (b,) = piped.outputs, whole.outputs
        assert a.shape == b.shape == (4, 384)
        cosines = (a.to_numpy() * b.to_numpy()).sum(axis=1)  # both L2-normalised
        assert np.all(cosines > 0.999), cosines
        runner = engine.pipeline("minilm-l6-doc-pipeline")
        assert runner is not None
        assert runner.last_runs[1].batch_rows == 4
    finally:
        await engine.stop(grace_s=1.0)


async def test_a_pipeline_whose_step_model_did_not_load_does_not_serve(config: Any) -> None:
    """The other models serve; the pipeline is a load failure that names its missing step model."""
    from services.batcher.app import BatcherApp

    broken_gated = GATED.model_copy(update={"loader": "services.batcher.models.demo:no_such_factory"})
    app = BatcherApp(config.replace(models=(DEMO_MODEL, broken_gated, TWICE)))
    await app.start()
    try:
        assert app.engine.has_model("demo")
        assert not app.engine.has_model("twice")
        assert "its step models ['gated'] are not served here" in app.load_failures["twice"]
    finally:
        await app.stop(grace_s=1.0)


@pytest.fixture
async def engine() -> Any:
    """An engine alone (no NATS): the gated, progress and demo models and two pipelines on them."""
    from asyncinfer.config import BatcherConfig
    from services.batcher.backends.loading import load_backend
    from services.batcher.engine import BatchingEngine

    progress = DEMO_MODEL.model_copy(
        update={"name": "progress", "loader": "services.batcher.models.demo:build_progress_model"}
    )
    reporting = TWICE.model_copy(
        update={"name": "reporting", "steps": (TWICE.steps[0].model_copy(update={"model": "progress"}), TWICE.steps[1])}
    )
    built = BatchingEngine()
    for model in (DEMO_MODEL, GATED, progress):
        built.add_model(model, await asyncio.to_thread(load_backend, model, BatcherConfig()))
    built.add_pipeline(TWICE)
    built.add_pipeline(reporting)
    GATE.set()
    await built.start()
    try:
        yield built
    finally:
        GATE.set()
        await built.stop(grace_s=1.0)


def x_tensor(value: float) -> list[Tensor]:
    return [Tensor.from_numpy("x", np.array([[value, value + 1, value + 2, value + 3]], dtype=np.float32))]


async def test_a_jobs_deadline_applies_to_its_first_step(engine: Any) -> None:
    from asyncinfer.errors import DeadlineExceeded

    GATE.clear()
    first = engine.submit("twice", x_tensor(0.0))
    computing = GATED.max_queue_size - 1
    await until(lambda: engine.free_slots("gated") == computing and engine.queue_depth("gated") == 0, "first step")
    late = engine.submit("twice", x_tensor(1.0), timeout_s=0.2)
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(late.future, 30)  # it expired waiting in the first step's queue
    GATE.set()
    outcome = await asyncio.wait_for(first.future, 30)
    np.testing.assert_allclose(outcome.outputs[0].to_numpy(), [[3.0, 7.0, 11.0, 15.0]])


async def test_a_reporting_steps_progress_is_folded_into_the_pipelines(engine: Any) -> None:
    from services.batcher.progress import ItemProgress, ProgressUpdate

    updates: list[ProgressUpdate] = []
    channel = ItemProgress(updates.append, interval_s=0.0, max_bytes=0)
    item = engine.submit("reporting", x_tensor(1.0), progress=channel)
    await asyncio.wait_for(item.future, 60)
    channel.close()
    fractions = [u.fraction for u in updates]
    assert fractions == sorted(fractions), fractions
    assert fractions[-1] == 1.0
    inside = [u for u in updates if u.fraction is not None and 0.0 < u.fraction < 0.5]
    assert inside, "the first step's own progress shows as part of the pipeline's first half"
    assert all(u.message.startswith("step 1 of 2: progress: step ") for u in inside)
    assert updates[-1].message == "2 of 2 steps done"


async def test_a_steps_partial_outputs_stay_out_of_the_pipelines_progress_without_a_warning(engine: Any) -> None:
    """A step model's partial outputs are not the pipeline's (its report carries the fraction and
    message): left out by design. Each job logged a warning that they were left out past
    max_bytes=0, a limit no one set: a line per job of a pipeline whose step reports outputs."""
    from services.batcher.progress import ItemProgress, ProgressUpdate

    updates: list[ProgressUpdate] = []
    with capture_logs() as logs:
        channels = [ItemProgress(updates.append, interval_s=0.0, max_bytes=1 << 20) for _ in range(3)]
        items = [engine.submit("reporting", x_tensor(float(i)), progress=channels[i]) for i in range(3)]
        await asyncio.wait_for(asyncio.gather(*(item.future for item in items)), 60)
    assert any(u.message.startswith("step 1 of 2: progress: step ") for u in updates)
    assert not any(u.outputs for u in updates)
    assert [entry for entry in logs if entry["event"] == "progress_outputs_left_out"] == []


def as_int64(arrays: dict[str, Any]) -> dict[str, Any]:
    """A function step whose output the next model (FP32) does not take."""
    return {"y": arrays["x"].astype(np.int64)}


def gives_another_name(arrays: dict[str, Any]) -> dict[str, Any]:
    return {"z": arrays["x"]}


@pytest.mark.parametrize(
    ("steps", "says"),
    [
        (
            [
                {"function": "tests.test_pipelines:as_int64", "inputs": {"x": "x"}, "outputs": {"y": "mid"}},
                {"model": "demo", "inputs": {"x": "mid"}, "outputs": {"y": "y"}},
            ],
            "step 2 (demo): invalid inputs",
        ),
        (
            [{"function": "tests.test_pipelines:gives_another_name", "inputs": {"x": "x"}, "outputs": {"y": "y"}}],
            "gave no output 'y' (it gave ['z'])",
        ),
    ],
    ids=["wrong-datatype", "missing-output"],
)
async def test_a_step_that_does_not_fit_the_wiring_is_a_final_failed_precondition(
    steps: list[dict[str, Any]], says: str
) -> None:
    """The caller's input passed the pipeline's signature: a step refusing what an earlier step gave
    is the pipeline's configuration, not an invalid request, and no retry helps."""
    from asyncinfer.config import BatcherConfig
    from asyncinfer.errors import FailedPrecondition
    from services.batcher.backends.loading import load_backend
    from services.batcher.engine import BatchingEngine
    from services.batcher.work_messages import error_status

    miswired = ModelConfig.model_validate({**TWICE.model_dump(exclude={"steps"}), "name": "miswired", "steps": steps})
    built = BatchingEngine()
    built.add_model(DEMO_MODEL, await asyncio.to_thread(load_backend, DEMO_MODEL, BatcherConfig()))
    built.add_pipeline(miswired)
    await built.start()
    try:
        with pytest.raises(FailedPrecondition) as failed:
            await asyncio.wait_for(built.submit("miswired", x_tensor(1.0)).future, 30)
    finally:
        await built.stop(grace_s=1.0)
    assert failed.value.reason == "PIPELINE_STEP_MISMATCH"
    assert says in failed.value.message
    assert "pipeline 'miswired'" in failed.value.message
    assert not error_status(failed.value).retriable
