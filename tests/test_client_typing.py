"""The SDK types plain lists and arrays of another dtype by the model's signature (ListModels,
fetched once per client), as the CLI does; an explicit Tensor is sent as it is (issue 18)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import aio as triton

from asyncinfer.client import (
    AsyncClient,
    Client,
    InvalidArgumentError,
    Job,
    JobError,
    JobRequest,
    NotFoundError,
)
from asyncinfer.client._convert import signature_refused
from asyncinfer.config import DEMO_MODEL, Config, ModelVersionConfig, TensorSpecConfig
from asyncinfer.errors import FieldViolation
from asyncinfer.tensors import Tensor, typed_as, untyped_reason
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc
from tests.stack import Stack, StartStack, ThreadedStack
from tests.test_model_hot_updates import load_config_json, until, version_table
from tests.test_model_versions import demo, with_models
from tests.test_runtime_models import NEW_MODEL, NEW_MODEL_TABLE


@pytest.fixture
def threaded_full_stack(config: Config) -> Iterator[ThreadedStack]:
    """The whole stack on its own loop in a thread: the test itself is synchronous."""
    with ThreadedStack(config) as running:
        yield running


def _count_list_models(client: AsyncClient) -> list[int]:
    """Counts the ListModels calls the client's stub makes."""
    calls = [0]
    stub = client._stub
    original = stub.ListModels

    def counting(*args: Any, **options: Any) -> Any:
        calls[0] += 1
        return original(*args, **options)

    stub.ListModels = counting  # type: ignore[method-assign]
    return calls


def test_sync_run_takes_a_plain_list(threaded_full_stack: ThreadedStack) -> None:
    with Client(threaded_full_stack.stack.address) as client:
        outputs = client.run("demo", {"x": [[1, 2, 3, 4]]}, timeout_s=30)
        np.testing.assert_array_equal(outputs["y"], np.array([[3, 5, 7, 9]], np.float32))
        assert outputs["y"].dtype == np.float32
        floats = client.run("demo", {"x": [[0.5, 1, 2, 3]]}, timeout_s=30)
        np.testing.assert_array_equal(floats["y"], np.array([[2, 3, 5, 7]], np.float32))


async def test_float64_and_int_arrays_are_typed_and_computed(stack: Stack) -> None:
    async with AsyncClient(stack.address) as client:
        x64 = np.array([[1.5, 2, 3, 4], [0, 0, 0, -1]], dtype=np.float64)
        outputs = await client.run("demo", {"x": x64}, timeout_s=30)
        np.testing.assert_array_equal(outputs["y"], (2 * x64 + 1).astype(np.float32))
        ints = await client.run("demo", {"x": np.arange(4, dtype=np.int64).reshape(1, 4)}, timeout_s=30)
        np.testing.assert_array_equal(ints["y"], np.array([[1, 3, 5, 7]], np.float32))


async def test_explicit_tensors_and_unsafe_values_are_still_refused(stack: Stack) -> None:
    async with AsyncClient(stack.address) as client:
        with pytest.raises(InvalidArgumentError, match="FP32"):
            await client.submit("demo", [Tensor.from_numpy("x", np.ones((1, 4), np.int64))])
        with pytest.raises(InvalidArgumentError, match="FP32"):
            await client.submit("demo", {"x": [["a", "b", "c", "d"]]})  # strings are no numbers
        with pytest.raises(InvalidArgumentError, match="FP32"):
            await client.submit("demo", {"x": [[True, False, True, False]]})  # nor are booleans


async def test_the_signature_is_fetched_once_for_many_submits(stack: Stack) -> None:
    async with AsyncClient(stack.address) as client:
        calls = _count_list_models(client)
        jobs = [await client.submit("demo", {"x": [[i, 1, 2, 3]]}) for i in range(5)]
        results = [
            r async for r in client.bulk(JobRequest(model="demo", inputs={"x": [[i, 0, 0, 0]]}) for i in range(20))
        ]
        assert all(r.error is None and r.job is not None for r in results), [r.error for r in results if r.error]
        assert calls == [1]
        done = await client.wait_jobs(jobs, timeout_s=30)
        assert all(isinstance(job, Job) and job.succeeded for job in done.values())

        # A model the gateway does not list is asked about once more, then left alone.
        for _ in range(3):
            with pytest.raises(NotFoundError):
                await client.submit("no-such-model", {"x": [[1, 2, 3, 4]]})
        assert calls == [2]
        # Tensors and input references need no signature.
        await client.submit("demo", [Tensor.from_numpy("x", np.ones((1, 4), np.float32))])
        assert calls == [2]


def test_typed_as_converts_only_what_loses_nothing() -> None:
    assert typed_as([[1, 2]], "FP32").dtype == np.float32  # type: ignore[union-attr]
    assert typed_as(np.ones(2), "FP16").dtype == np.float16  # type: ignore[union-attr]
    assert typed_as([3, -4], "INT32").dtype == np.int32  # type: ignore[union-attr]
    assert typed_as(np.array([7], np.int32), "INT64").dtype == np.int64  # type: ignore[union-attr]
    assert typed_as([True], "BOOL").dtype == np.bool_  # type: ignore[union-attr]
    assert typed_as(["a", "b"], "BYTES") is not None
    assert typed_as([1.5], "INT64") is None
    assert typed_as([2**40], "INT32") is None
    assert typed_as([-1], "UINT8") is None
    assert typed_as([True], "FP32") is None
    assert typed_as(["a"], "FP32") is None
    assert typed_as([[1, 2], [3]], "FP32") is None  # ragged: not an array
    # Past the type's range the value is lost (1e300 as FP32 is inf): left for the gateway to refuse.
    assert typed_as([[1e300, 2.0]], "FP32") is None
    assert typed_as([70000], "FP16") is None
    assert typed_as([float("inf"), 1.0], "FP32") is not None, "an infinity given is kept"
    assert typed_as([[3.4e38]], "FP32") is not None
    # No texts at all: numpy makes [] float64, which the gateway named as the wrong datatype
    # instead of the real problem (no item); typed as text, the gateway says that.
    empty = typed_as([], "BYTES")
    assert empty is not None
    assert (empty.shape, empty.dtype.kind) == ((0,), "S")


@pytest.mark.unit
def test_untyped_reason_says_why_typed_as_declined() -> None:
    def reason(value: Any, datatype: str) -> str | None:
        return untyped_reason(np.asarray(value), datatype)

    assert reason([[1e300, 2.0]], "FP32") == "has 1e+300, past FP32's range (±3.4028235e+38)"
    assert reason([70000], "FP16") == "has 70000, past FP16's range (±65504)"
    assert reason([3, 2**40], "INT32") == "has 1099511627776, past INT32's range (-2147483648 to 2147483647)"
    assert reason([-1], "UINT8") == "has -1, past UINT8's range (0 to 255)"
    assert reason([1.5], "INT64") == "has 1.5, not a whole number: INT64 takes whole numbers"
    # A numpy array's dtype was chosen: how to convert it, not how to write a value.
    floats = np.array([[1.0, 2.0]])
    assert untyped_reason(floats, "INT64", floats) == (
        "is float64: INT64 takes integers (convert it with .astype(np.int64), which drops fractions, where that is meant)"
    )
    # The first value written as a float, where the SDK has the values as given ([1, 2.0] is [1.0, 2.0] to numpy).
    written = [[1, 2.0]]
    assert untyped_reason(np.asarray(written), "INT64", written) == (
        "has 2.0, a float: INT64 takes integers (write 2, not 2.0)"
    )
    assert reason(np.ones(2, np.float32), "UINT8") == "has 1.0, a float: UINT8 takes integers (write 1, not 1.0)"
    assert reason([2**70], "FP32") == "holds no one numpy type (integers past 64 bits, or items of mixed types)"
    assert reason([True], "FP32") == "is bool, not numbers"
    assert reason(["a"], "FP32") == "is text, not numbers"
    assert reason([1, 0], "BOOL") == "is int64, not booleans (True or False)"
    assert reason([1.0], "BYTES") == "is float64, not text (str or bytes)"
    # Typed, or left for the gateway to judge without a reason the SDK knows better.
    for value, datatype in (([1.0], "FP32"), ([1], "INT8"), (["a"], "BYTES"), ([b"a", "b"], "BYTES"), ([1.0], "BF16")):
        assert reason(value, datatype) is None, (value, datatype)


async def test_a_pinned_version_is_typed_by_its_own_signature(config: Config, start_stack: StartStack) -> None:
    """A [[models.versions]] entry may take other inputs than the model's default, and the gateway
    validates a pinned submit against the pinned version's; the SDK typed every submit by the
    default's (ListModels' model fields), so `[[1, 2, 3, 4]]` pinned to a version taking INT64 was
    sent as FP32 and refused "input 'x' must be INT64, got 'FP32'", though sent as given it fits."""
    demo = config.models[0]
    versioned = demo.model_copy(
        update={
            "default_version": "1",
            "versions": (
                ModelVersionConfig(version="2", inputs=(TensorSpecConfig(name="x", datatype="INT64", shape=(-1, 4)),)),
            ),
        }
    )
    stack = await start_stack(config.replace(models=[versioned.model_dump()]), batcher=False)
    async with AsyncClient(stack.address) as client:
        pinned = await client.submit("demo", {"x": [[1, 2, 3, 4]]}, model_version="2")
        default = await client.submit("demo", {"x": [[1, 2, 3, 4]]})
        [result] = [r async for r in client.bulk([JobRequest("demo", {"x": np.ones((1, 4))}, model_version="1")])]
        with pytest.raises(InvalidArgumentError) as raised:
            await client.submit("demo", {"x": [[1.5, 2, 3, 4]]}, model_version="2")
        # A whole float too, as the CLI's -i and a JSONL batch line refuse it, naming the value.
        with pytest.raises(InvalidArgumentError) as whole:
            await client.submit("demo", {"x": [[2.0, 2, 3, 4]]}, model_version="2")
        with pytest.raises(InvalidArgumentError) as array:  # an array: how to convert it
            await client.submit("demo", {"x": np.ones((1, 4))}, model_version="2")
    assert (pinned.model_version, default.model_version) == ("2", "")
    assert result.error is None, result.error
    assert [v.description for v in raised.value.violations] == [
        "input 'x' must be INT64, got 'FP64': the SDK did not convert it, as it has 1.5, not a whole number: "
        "INT64 takes whole numbers; model 'demo' takes x: INT64 of shape [-1, 4]"
    ]
    assert [v.description for v in whole.value.violations] == [
        "input 'x' must be INT64, got 'FP64': the SDK did not convert it, as it has 2.0, a float: INT64 takes "
        "integers (write 2, not 2.0); model 'demo' takes x: INT64 of shape [-1, 4]"
    ]
    assert [v.description for v in array.value.violations] == [
        "input 'x' must be INT64, got 'FP64': the SDK did not convert it, as it is float64: INT64 takes integers "
        "(convert it with .astype(np.int64), which drops fractions, where that is meant); model 'demo' takes x: "
        "INT64 of shape [-1, 4]"
    ]


@pytest.mark.unit
def test_what_refusals_drop_a_models_cached_signature() -> None:
    """An input's datatype or shape: what the SDK types by the signature. Not a refusal the
    signature has no part in (an unknown model is asked about once more, then left alone)."""
    for field in ("inputs[0].datatype", "inputs[12].shape"):
        assert signature_refused([FieldViolation("labels", "d"), FieldViolation(field, "d")]), field
    for field in ("inputs", "inputs[0].name", "labels", "model_name", "inputs[0].datatypes"):
        assert not signature_refused([FieldViolation(field, "d")]), field
    assert not signature_refused([])


def version_taking(version: str, datatype: str) -> dict[str, Any]:
    """A load_model version table whose `x` is `datatype` (the demo model's loader)."""
    return {
        **version_table(version, DEMO_MODEL.loader),
        "inputs": [{"name": "x", "datatype": datatype, "shape": [-1, 4]}],
    }


async def test_a_hot_update_of_a_models_inputs_types_its_submits_by_the_new_signature_after_one_refusal(
    config: Config, start_stack: StartStack
) -> None:
    """The SDK asked ListModels for a model's signature once per client: after a hot update changed
    the model's inputs (the default version now one taking INT64, then FP64) a long-lived client
    typed every submit and bulk item by the old signature, each refused ("input 'x' must be INT64,
    got 'FP32'"), and a model it had asked for before it was loaded was sent untyped for good
    (floats as FP64, "must be FP32, got 'FP64'"). A refusal of an input's datatype or shape now
    drops what the client cached of the model: one refusal, and its next submit asks again."""
    stack = await start_stack(with_models(config, demo(versions=("1",))))
    assert stack.batcher is not None
    kserve = triton.InferenceServerClient(f"127.0.0.1:{stack.batcher.port}")
    ints = {"x": [[1, 2, 3, 4]]}

    async def default_takes(model: str, datatype: str) -> bool:
        listed = {m.name: m for m in (await stack.jobs.ListModels(job_service_pb2.ListModelsRequest())).models}
        return model in listed and [spec.datatype for spec in listed[model].inputs] == [datatype]

    def descriptions(error: InvalidArgumentError | JobError | None) -> list[str]:
        assert error is not None
        return [v.description for v in error.violations]

    try:
        async with AsyncClient(stack.address) as client:
            await client.submit("demo", ints)  # its signature cached: x FP32
            with pytest.raises(NotFoundError):
                await client.submit(NEW_MODEL, {"x": [[1.5, 2, 3, 4]]})

            # A model loaded after the client asked for it: sent untyped once, refused, then typed.
            await kserve.load_model(NEW_MODEL, config=NEW_MODEL_TABLE)
            await until(lambda: default_takes(NEW_MODEL, "FP32"))
            with pytest.raises(InvalidArgumentError) as raised:
                await client.submit(NEW_MODEL, {"x": [[1.5, 2, 3, 4]]})
            assert descriptions(raised.value) == ["input 'x' must be FP32, got 'FP64'"]
            await client.submit(NEW_MODEL, {"x": [[1.5, 2, 3, 4]]})

            # The default becomes a version taking INT64: one bulk item refused, the next typed anew.
            await kserve.load_model(
                "demo", config=load_config_json(version_table("1", DEMO_MODEL.loader), version_taking("2", "INT64"))
            )
            await until(lambda: default_takes("demo", "INT64"))
            [refused] = [r async for r in client.bulk([JobRequest("demo", ints)])]
            assert descriptions(refused.error) == ["input 'x' must be INT64, got 'FP32'"]
            [accepted] = [r async for r in client.bulk([JobRequest("demo", ints)])]
            assert accepted.error is None, accepted.error

            # Then one taking FP64: one submit refused, the next typed anew.
            await kserve.load_model(
                "demo",
                config=load_config_json(
                    version_table("1", DEMO_MODEL.loader), version_taking("2", "INT64"), version_taking("3", "FP64")
                ),
            )
            await until(lambda: default_takes("demo", "FP64"))
            with pytest.raises(InvalidArgumentError) as raised:
                await client.submit("demo", ints)
            assert descriptions(raised.value) == ["input 'x' must be FP64, got 'INT64'"]
            await client.submit("demo", ints)
            await client.submit("demo", ints, model_version="2")  # the versions' signatures were asked again too
    finally:
        await kserve.close()


class NoListModelsGateway(job_service_pb2_grpc.JobServiceServicer):
    """A gateway too old for ListModels: it records the datatypes submitted."""

    def __init__(self) -> None:
        self.list_models_calls = 0
        self.datatypes: list[str] = []

    async def ListModels(self, request: Any, context: Any) -> Any:
        self.list_models_calls += 1
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no ListModels here")

    async def SubmitJob(self, request: Any, context: Any) -> Any:
        self.datatypes.extend(t.datatype for t in request.inputs)
        response = job_service_pb2.SubmitJobResponse()
        response.job.job_id = f"job-{len(self.datatypes)}"
        response.job.state = job_pb2.JOB_STATE_QUEUED
        return response


async def test_a_gateway_without_list_models_gets_the_inputs_as_before() -> None:
    gateway = NoListModelsGateway()
    server = grpc.aio.server()
    job_service_pb2_grpc.add_JobServiceServicer_to_server(gateway, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            await client.submit("demo", {"x": [[1, 2, 3, 4]]})
            await client.submit("demo", {"x": np.ones((1, 4))})
            await client.submit("other", {"x": [[1.5]]})
    finally:
        await server.stop(0)
    assert gateway.datatypes == ["INT64", "FP64", "FP64"]
    assert gateway.list_models_calls == 1, "asked once, never again"


class StalledListModelsGateway(job_service_pb2_grpc.JobServiceServicer):
    """A gateway whose ListModels never answers (its model catalogue stalled); SubmitJob answers
    and records how much of the call's deadline was left when it came."""

    def __init__(self) -> None:
        self.submit_time_remaining: list[float] = []

    async def ListModels(self, request: Any, context: Any) -> Any:
        await asyncio.Event().wait()  # until the caller's deadline cancels it

    async def SubmitJob(self, request: Any, context: Any) -> Any:
        self.submit_time_remaining.append(context.time_remaining())
        response = job_service_pb2.SubmitJobResponse()
        response.job.job_id = "job-1"
        response.job.state = job_pb2.JOB_STATE_QUEUED
        return response


async def test_a_submit_typed_by_a_stalled_list_models_keeps_within_its_timeout() -> None:
    """Typing asked ListModels with the submit's whole timeout_s, and the SubmitJob then had a
    whole timeout_s of its own: a submit given 4 s took 8 against a stalled gateway. The submit's
    one deadline now covers both (typing gets at most half of it and is then skipped)."""
    gateway = StalledListModelsGateway()
    server = grpc.aio.server()
    job_service_pb2_grpc.add_JobServiceServicer_to_server(gateway, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    timeout_s = 4.0
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            job = await client.submit("demo", {"x": [[1, 2, 3, 4]]}, timeout_s=timeout_s)
    finally:
        await server.stop(0)
    assert job.job_id == "job-1", "submitted with the inputs as given"
    [remaining] = gateway.submit_time_remaining
    # Half of it at most (gRPC's deadline header rounds up a little); before, all of it again.
    assert remaining < timeout_s * 0.75, f"SubmitJob had {remaining:.2f} s of a {timeout_s} s submit left"
