"""The batcher's KServe v2 API driven by tritonclient, against a real BatcherApp with the demo
model: liveness, readiness, metadata, inference, errors, health and metrics."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as triton
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs
from tritonclient.utils import InferenceServerException

from asyncinfer.config import DEMO_MODEL, Config, ModelConfig, ModelVersionConfig, load_config, render_default_config
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.grpc_server import LIVENESS_SERVICE
from services.batcher.app import BatcherApp
from tests.test_batcher_triton import ready_gauge


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
async def app() -> AsyncIterator[BatcherApp]:
    config = Config().replace(
        batcher={"port": 0, "metrics_port": free_port(), "scheduler_address": None},
        logging={"level": "warning", "format": "console"},
    )
    batcher = BatcherApp(config)
    await batcher.start()
    try:
        yield batcher
    finally:
        await batcher.stop(grace_s=1.0)


@pytest.fixture
async def client(app: BatcherApp) -> AsyncIterator[triton.InferenceServerClient]:
    client = triton.InferenceServerClient(f"127.0.0.1:{app.port}")
    try:
        yield client
    finally:
        await client.close()


async def test_server_and_model_readiness(client: triton.InferenceServerClient) -> None:
    assert await client.is_server_live()
    assert await client.is_server_ready()
    assert await client.is_model_ready("demo")
    assert await client.is_model_ready("demo", "1")
    assert not await client.is_model_ready("demo", "7")
    assert not await client.is_model_ready("nope")
    server = await client.get_server_metadata(as_json=True)
    assert server["name"] == "asyncinfer-batcher"


async def test_model_metadata_describes_the_signature(client: triton.InferenceServerClient) -> None:
    meta = await client.get_model_metadata("demo", as_json=True)
    assert meta["name"] == "demo"
    assert meta["versions"] == ["1"]
    assert meta["platform"] == "pytorch_libtorch"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "4"]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": ["-1", "4"]}]


async def test_infer_returns_2x_plus_1(client: triton.InferenceServerClient) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    infer_input = triton.InferInput("x", [2, 4], "FP32")
    infer_input.set_data_from_numpy(x)
    result = await client.infer("demo", [infer_input], request_id="req-1")
    y = result.as_numpy("y")
    assert y is not None
    np.testing.assert_array_equal(y, 2 * x + 1)
    response = result.get_response()
    assert response.id == "req-1"
    assert response.model_name == "demo"
    assert response.model_version == "1"


async def test_concurrent_infers_share_batches(client: triton.InferenceServerClient) -> None:
    async def one(value: float) -> float:
        infer_input = triton.InferInput("x", [1, 4], "FP32")
        infer_input.set_data_from_numpy(np.full((1, 4), value, dtype=np.float32))
        result = await client.infer("demo", [infer_input], outputs=[triton.InferRequestedOutput("y")])
        y = result.as_numpy("y")
        assert y is not None
        return float(y[0, 0])

    values = [float(v) for v in range(16)]
    assert await asyncio.gather(*(one(v) for v in values)) == [2 * v + 1 for v in values]


async def test_unknown_model_is_not_found(client: triton.InferenceServerClient) -> None:
    infer_input = triton.InferInput("x", [1, 4], "FP32")
    infer_input.set_data_from_numpy(np.zeros((1, 4), dtype=np.float32))
    with pytest.raises(InferenceServerException) as info:
        await client.infer("nope", [infer_input])
    assert info.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as info:
        await client.get_model_metadata("nope")
    assert info.value.status() == "StatusCode.NOT_FOUND"


async def test_bad_inputs_are_invalid_argument(client: triton.InferenceServerClient) -> None:
    wrong_shape = triton.InferInput("x", [1, 3], "FP32")
    wrong_shape.set_data_from_numpy(np.zeros((1, 3), dtype=np.float32))
    with pytest.raises(InferenceServerException) as info:
        await client.infer("demo", [wrong_shape])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "inputs[0].shape" in (info.value.message() or "")

    good = triton.InferInput("x", [1, 4], "FP32")
    good.set_data_from_numpy(np.zeros((1, 4), dtype=np.float32))
    with pytest.raises(InferenceServerException) as info:
        await client.infer("demo", [good], outputs=[triton.InferRequestedOutput("z")])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"


async def test_typed_contents_are_accepted(app: BatcherApp, caplog: pytest.LogCaptureFixture) -> None:
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="demo", id="typed")
        tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
        tensor.contents.fp32_contents.extend([1.0, 2.0, 3.0, 4.0])
        response = await stub.ModelInfer(request)
        assert response.id == "typed"
        y = np.frombuffer(response.raw_output_contents[0], dtype="<f4")
        assert y.tolist() == [3.0, 5.0, 7.0, 9.0]
        # KServe's methods it does not implement: UNIMPLEMENTED with ErrorInfo, no traceback
        # (each logged one at error level, and said "Unexpected <class 'NotImplementedError'>").
        with caplog.at_level(logging.ERROR):
            for call in (
                stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name="demo")),
                stub.SystemSharedMemoryStatus(service_pb2.SystemSharedMemoryStatusRequest()),
                stub.TraceSetting(service_pb2.TraceSettingRequest()),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
                status = status_details(info.value)
                assert status is not None
                assert unpack_details(status)["ErrorInfo"].reason == "UNIMPLEMENTED"
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_health_is_serving_and_metrics_are_exported(
    app: BatcherApp, client: triton.InferenceServerClient
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

    infer_input = triton.InferInput("x", [3, 4], "FP32")
    infer_input.set_data_from_numpy(np.ones((3, 4), dtype=np.float32))
    await client.infer("demo", [infer_input])
    assert app.metrics_port > 0
    url = f"http://127.0.0.1:{app.metrics_port}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    assert 'asyncinfer_batch_size_sum{model="demo"} 3.0' in body
    assert 'asyncinfer_batcher_items_total{model="demo",outcome="OK"} 1.0' in body
    assert 'asyncinfer_batch_compute_seconds_count{model="demo"} 1.0' in body
    assert 'asyncinfer_batcher_queue_depth{model="demo"} 0.0' in body


async def test_a_starting_batcher_asks_for_cuda_off_the_event_loop() -> None:
    """In `up` the gateway and the scheduler serve on the loop a batcher starts on. The batcher's
    question whether CUDA is there (it imports torch and asks the driver: 1.4 s on a 2-core host
    without a GPU, 1.7-3.5 s measured on GPU hosts) ran on that loop, and every call to them
    waited. Here the question is slow on purpose, until a server on the same loop has answered a
    health check."""
    config = Config().replace(batcher={"port": 0, "metrics_port": 0, "scheduler_address": None}, models=[DEMO_MODEL])
    serving = BatcherApp(config)
    await serving.start()
    asked, answered = threading.Event(), threading.Event()
    waits: list[bool] = []

    def slow_cuda_check() -> bool:
        asked.set()
        waits.append(answered.wait(timeout=10))  # a bound on a hang: the old code held the loop this long
        return False

    starting = BatcherApp(config, cuda_available=slow_cuda_check)
    start = asyncio.create_task(starting.start())
    try:
        assert await asyncio.to_thread(asked.wait, 10)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{serving.port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        answered.set()
        await start
        assert waits == [True]  # it was still asking when the health check was answered
        assert starting.port > 0
    finally:
        answered.set()
        await start
        await starting.stop(grace_s=0)
        await serving.stop(grace_s=0)


async def test_a_model_that_cannot_load_leaves_the_others_serving() -> None:
    broken = DEMO_MODEL.model_copy(update={"name": "broken", "loader": "services.batcher.models.demo:build_nothing"})
    config = Config().replace(
        batcher={"port": 0, "metrics_port": 0, "scheduler_address": None}, models=[DEMO_MODEL, broken]
    )
    batcher = BatcherApp(config)
    await batcher.start()
    try:
        assert "build_nothing" in batcher.load_failures["broken"]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{batcher.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            # Not ready, but alive: a liveness probe does not restart the models that serve.
            reply = await health.Check(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            # Each model's health (service: its name; its version's, name/version) says which serves.
            for service, status in (("demo", "SERVING"), ("demo/1", "SERVING"), ("broken", "NOT_SERVING")):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status) == status, service
        client = triton.InferenceServerClient(f"127.0.0.1:{batcher.port}")
        try:
            assert not await client.is_server_ready()
            assert await client.is_model_ready("demo")
            assert not await client.is_model_ready("broken")
            infer_input = triton.InferInput("x", [1, 4], "FP32")
            infer_input.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
            result = await client.infer("demo", [infer_input])
            assert result.as_numpy("y") is not None
            with pytest.raises(InferenceServerException) as info:
                await client.infer("broken", [infer_input])
            assert info.value.status() == "StatusCode.UNAVAILABLE"
            assert "failed to load" in (info.value.message() or "")
            assert "build_nothing" in (info.value.message() or "")
        finally:
            await client.close()
        assert ready_gauge(batcher) == {("broken", "1"): 0, ("broken", ""): 0, ("demo", "1"): 1, ("demo", ""): 1}
    finally:
        await batcher.stop(grace_s=1.0)


async def test_a_reload_that_drops_a_version_that_failed_to_load_makes_the_batcher_ready(tmp_path: Path) -> None:
    """A reload whose file no longer declares the version that failed to load forgets its failure,
    but the batcher's readiness was read from it before: the version's ready gauge series (0, which
    AsyncinferModelNotReady fires on) stayed, and the server's health and ServerReady stayed
    NOT_SERVING, until some later change happened to recompute them. After the reload they say
    what the batcher serves now: the version's series gone, the server ready."""
    file = tmp_path / "batcher.toml"
    settings = {"port": 0, "metrics_port": 0, "scheduler_address": None}
    broken_v2 = ModelVersionConfig(version="2", loader="services.batcher.models.demo:build_nothing")
    config = Config().replace(batcher=settings, models=[DEMO_MODEL.model_copy(update={"versions": (broken_v2,)})])
    file.write_text(render_default_config(config))
    batcher = BatcherApp(load_config(file), config_path=file)
    await batcher.start()
    try:
        assert ready_gauge(batcher)[("demo", "2")] == 0
        async with grpc.aio.insecure_channel(f"127.0.0.1:{batcher.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert await health_of(health, "") == "NOT_SERVING"
            file.write_text(render_default_config(Config().replace(batcher=settings, models=[DEMO_MODEL])))
            await batcher.reload()
            await asyncio.gather(*batcher._health_updates)  # the updates the reload started
            assert batcher.load_failures == {}
            assert ready_gauge(batcher) == {("demo", "1"): 1, ("demo", ""): 1}
            assert [await health_of(health, s) for s in ("", "demo", "demo/1", "demo/2")] == [
                "SERVING",
                "SERVING",
                "SERVING",
                "NOT_FOUND",  # no longer declared: unknown, as a name never served here
            ]
        client = triton.InferenceServerClient(f"127.0.0.1:{batcher.port}")
        try:
            assert await client.is_server_ready()
        finally:
            await client.close()
    finally:
        await batcher.stop(grace_s=1.0)


async def test_a_reload_that_drops_a_model_that_failed_to_load_forgets_it(tmp_path: Path) -> None:
    """A model none of whose versions loaded, then dropped from the file: the reload applied only the
    models the file declares and those served, so its failure was never forgotten: its ready series
    stayed at 0 (AsyncinferModelNotReady firing for a model no longer declared) and the server
    NOT_SERVING for good. After the reload it is gone and the batcher ready."""
    file = tmp_path / "batcher.toml"
    settings = {"port": 0, "metrics_port": 0, "scheduler_address": None}
    broken = DEMO_MODEL.model_copy(update={"name": "broken", "loader": "services.batcher.models.demo:build_nothing"})
    file.write_text(render_default_config(Config().replace(batcher=settings, models=[DEMO_MODEL, broken])))
    batcher = BatcherApp(load_config(file), config_path=file)
    await batcher.start()
    try:
        assert ready_gauge(batcher)[("broken", "1")] == 0
        file.write_text(render_default_config(Config().replace(batcher=settings, models=[DEMO_MODEL])))
        await batcher.reload()
        await asyncio.gather(*batcher._health_updates)  # the updates the reload started
        assert batcher.load_failures == {}
        assert batcher.models.failures == {}
        assert ready_gauge(batcher) == {("demo", "1"): 1, ("demo", ""): 1}
        client = triton.InferenceServerClient(f"127.0.0.1:{batcher.port}")
        try:
            assert await client.is_server_ready()
            assert not await client.is_model_ready("broken")
        finally:
            await client.close()
    finally:
        await batcher.stop(grace_s=1.0)


async def health_of(health: health_pb2_grpc.HealthStub, service: str) -> str:
    """A health Check's status by name; NOT_FOUND for a service the server does not know."""
    try:
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
    except grpc.aio.AioRpcError as error:
        return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def test_a_model_and_a_version_a_reload_removes_lose_their_health_names_and_ready_series(
    tmp_path: Path,
) -> None:
    """A reload that drops version 2 of demo and the model `other`: their health names answered
    NOT_SERVING for good (every name a batcher ever served piled up, and a watcher of one waited on
    it). Now they answer as names never served (Check NOT_FOUND; Watch SERVICE_UNKNOWN, told to a
    watcher of each), and their ready gauge series are gone; a reload that declares version 2 again
    makes its watcher hear SERVING."""
    file = tmp_path / "batcher.toml"
    settings = {"port": 0, "metrics_port": 0, "scheduler_address": None}
    two = DEMO_MODEL.model_copy(update={"versions": (ModelVersionConfig(version="2"),)})
    other = DEMO_MODEL.model_copy(update={"name": "other"})
    file.write_text(render_default_config(Config().replace(batcher=settings, models=[two, other])))
    batcher = BatcherApp(load_config(file), config_path=file)
    await batcher.start()
    serving = health_pb2.HealthCheckResponse.SERVING
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{batcher.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watches = {s: health.Watch(health_pb2.HealthCheckRequest(service=s)) for s in ("demo/2", "other")}
            assert [(await w.read()).status for w in watches.values()] == [serving, serving]

            file.write_text(render_default_config(Config().replace(batcher=settings, models=[DEMO_MODEL])))
            await batcher.reload()
            await asyncio.gather(*batcher._health_updates)  # the updates the reload started
            names = ("", "demo", "demo/1", "demo/2", "other", "other/1")
            assert {n: await health_of(health, n) for n in names} == {
                "": "SERVING",
                "demo": "SERVING",
                "demo/1": "SERVING",
                "demo/2": "NOT_FOUND",
                "other": "NOT_FOUND",
                "other/1": "NOT_FOUND",
            }
            told = {s: (await asyncio.wait_for(w.read(), 5.0)).status for s, w in watches.items()}
            unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            assert told == {"demo/2": unknown, "other": unknown}
            assert ready_gauge(batcher) == {("demo", "1"): 1, ("demo", ""): 1}

            file.write_text(render_default_config(Config().replace(batcher=settings, models=[two])))
            await batcher.reload()
            assert (await asyncio.wait_for(watches["demo/2"].read(), 5.0)).status == serving
            for watch in watches.values():
                watch.cancel()
    finally:
        await batcher.stop(grace_s=1.0)


async def test_a_pipeline_that_failed_at_start_stays_failed_through_a_reload(tmp_path: Path) -> None:
    """Pipelines are fixed at start (a reload leaves them): one whose step model failed to load is
    not served until a restart. A reload rebuilt load_failures from the model set's failures alone,
    which never hold a pipeline's: the pipeline was no longer named a failure (ServerReady, the
    server's health and its ready series then said it serves)."""
    file = tmp_path / "batcher.toml"
    settings = {"port": 0, "metrics_port": 0, "scheduler_address": None}
    broken = DEMO_MODEL.model_copy(update={"name": "broken", "loader": "services.batcher.models.demo:build_nothing"})
    piped = ModelConfig.model_validate(
        {
            "name": "piped",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}],
            "steps": [{"model": "broken", "inputs": {"x": "x"}, "outputs": {"y": "y"}}],
        }
    )
    models = [DEMO_MODEL, broken, piped]
    file.write_text(render_default_config(Config().replace(batcher=settings, models=models)))
    batcher = BatcherApp(load_config(file), config_path=file)
    await batcher.start()
    try:
        assert "piped" in batcher.load_failures
        await batcher.reload()  # the same file
        await asyncio.gather(*batcher._health_updates)  # the updates the reload started
        assert "piped" in batcher.load_failures
        assert ready_gauge(batcher)[("piped", "1")] == 0
        client = triton.InferenceServerClient(f"127.0.0.1:{batcher.port}")
        try:
            assert not await client.is_server_ready()
            assert not await client.is_model_ready("piped")
        finally:
            await client.close()
    finally:
        await batcher.stop(grace_s=1.0)


async def test_a_health_update_runs_to_its_end_without_suspending() -> None:
    """Each change to what the batcher serves (a reload's, KServe's model controls, a Triton outage)
    starts a task that sets the models' health names from the readiness it reads when it runs. Two
    such tasks must not interleave: the earlier, its readiness read before the later change, would
    finish last and leave its stale names (grpc_health's servicer suspended a set while a Watch of
    the name wrote, and a lock kept the updates apart). The servicer used now never suspends
    (asyncinfer.health_service): each update runs to its end in one step, a Watch of a name open,
    so the updates end in the order of their changes without a lock. Should one ever suspend, this
    fails. Then version 2 is unloaded, and the Watch hears its name go."""
    demo = DEMO_MODEL.model_copy(update={"versions": (ModelVersionConfig(version="2"),)})
    batcher = BatcherApp(
        Config().replace(batcher={"port": 0, "metrics_port": 0, "scheduler_address": None}, models=[demo])
    )
    await batcher.start()
    try:
        while batcher._health_updates:  # the start's
            await asyncio.gather(*batcher._health_updates)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{batcher.port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="demo/2"))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            batcher._readiness_changed()
            batcher._readiness_changed()
            updates = set(batcher._health_updates)
            assert len(updates) == 2
            await asyncio.sleep(0)  # one step of each, in the order they were started
            assert all(update.done() for update in updates)
            await batcher.models.unload_model("demo", "2")
            gone = await asyncio.wait_for(watch.read(), 5.0)
            assert gone.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            watch.cancel()
    finally:
        await batcher.stop(grace_s=1.0)


async def test_priority_parameter_is_read_like_triton(client: triton.InferenceServerClient, app: BatcherApp) -> None:
    infer_input = triton.InferInput("x", [1, 4], "FP32")
    infer_input.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    result = await client.infer("demo", [infer_input], priority=1, timeout=5_000_000)
    assert result.as_numpy("y") is not None
    from tritonclient.grpc import service_pb2

    from services.batcher.kserve import request_priority

    def with_priority(level: int) -> service_pb2.ModelInferRequest:
        request = service_pb2.ModelInferRequest(model_name="demo")
        request.parameters["priority"].uint64_param = level
        return request

    assert [request_priority(with_priority(n)).value for n in (0, 1, 2, 3, 9)] == [
        "NORMAL",
        "HIGH",
        "NORMAL",
        "LOW",
        "LOW",
    ]
    assert request_priority(service_pb2.ModelInferRequest()).value == "NORMAL"


async def test_model_config_reads_as_tritons_for_the_same_model(client: triton.InferenceServerClient) -> None:
    """perf_analyzer and clients that size their requests read it (it answered UNIMPLEMENTED)."""
    config = (await client.get_model_config("demo", as_json=True))["config"]
    assert config["name"] == "demo"
    assert config["max_batch_size"] == DEMO_MODEL.max_batch_size
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": ["4"]}]
    assert config["output"] == [{"name": "y", "data_type": "TYPE_FP32", "dims": ["4"]}]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == str(
        round(DEMO_MODEL.max_queue_delay_ms * 1000)
    )
    with pytest.raises(InferenceServerException, match="not served"):
        await client.get_model_config("nope")


async def test_a_repository_file_made_invalid_lists_what_serves_and_refuses_loads_clearly(tmp_path: Path) -> None:
    """The file is the repository: edited into an invalid one (before a SIGHUP that will refuse it),
    the index still lists what serves, and a load says FAILED_PRECONDITION (not INTERNAL)."""
    file = tmp_path / "batcher.toml"
    config = Config().replace(batcher={"port": 0, "metrics_port": 0, "scheduler_address": None})
    file.write_text(render_default_config(config))
    batcher = BatcherApp(load_config(file), config_path=file)
    await batcher.start()
    client = triton.InferenceServerClient(f"127.0.0.1:{batcher.port}")
    try:
        file.write_text(render_default_config(config).replace('name = "demo"', 'name = "not a name"', 1))
        index = await client.get_model_repository_index(as_json=True)
        assert {"name": "demo", "version": "1", "state": "READY"} in index["models"]
        with pytest.raises(InferenceServerException) as refused:
            await client.load_model("demo")
        assert refused.value.status() == "StatusCode.FAILED_PRECONDITION"
        assert "what was loaded goes on serving" in str(refused.value.message())
        assert await client.is_model_ready("demo")
    finally:
        await client.close()
        await batcher.stop(grace_s=1.0)


async def test_a_model_that_loads_slowly_says_so_while_it_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader that took minutes (or never returned) left the batcher and `up` silent, and every
    model after it waiting, with nothing that named it."""
    from services.batcher import model_control
    from tests.hanging_models import SLOW_LOAD_S

    monkeypatch.setattr(model_control, "STILL_LOADING_EVERY_S", 0.1)
    slow = DEMO_MODEL.model_copy(update={"name": "slow", "loader": "tests.hanging_models:build_slow_loading_model"})
    config = Config().replace(batcher={"port": 0, "metrics_port": 0, "scheduler_address": None}, models=[slow])
    batcher = BatcherApp(config)
    with capture_logs() as logs:
        await batcher.start()
    try:
        events = [(e["event"], e.get("model")) for e in logs if str(e["event"]).startswith("model_")]
        assert events[0] == ("model_loading", "slow")
        assert ("model_still_loading", "slow") in events
        (loaded,) = [e for e in logs if e["event"] == "model_loaded"]
        assert loaded["load_s"] >= SLOW_LOAD_S
    finally:
        await batcher.stop(grace_s=1)
