"""API key roles across the stack, against real servers: once keys are configured every API of every
service but health needs a key of its role (tenant: JobService, ops: OpsService and the batcher's
KServe API, batcher: WorkerService): UNAUTHENTICATED without one, PERMISSION_DENIED with another
role's, each with an ErrorInfo; the batcher connects with its key and jobs run; the CLI's ops
commands send an ops key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from asyncinfer.access import bearer_metadata
from asyncinfer.api_keys import hash_key
from asyncinfer.client import AsyncClient, PermissionDeniedError, UnauthenticatedError
from asyncinfer.config import Config
from asyncinfer.errors import ConfigError
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.v1 import ops_service_pb2, ops_service_pb2_grpc, worker_service_pb2, worker_service_pb2_grpc
from services.up.defaults import with_own_batcher_key
from tests.stack import StartStack, ThreadedStack

ROOT = Path(__file__).resolve().parent.parent
TENANT_KEY, OPS_KEY, BATCHER_KEY = "acme-tenant-key", "the-ops-key", "the-batcher-key"


def keyed(config: Config, tmp_path: Path) -> Config:
    """The stack's one key list, and the batcher's own key read from a file (a mounted Secret)."""
    key_file = tmp_path / "batcher-key"
    key_file.write_text(BATCHER_KEY + "\n")
    return config.replace(
        gateway={
            "api_keys": [
                {"tenant": "acme", "sha256": hash_key(TENANT_KEY)},
                {"role": "ops", "sha256": hash_key(OPS_KEY), "name": "console"},
                {"role": "batcher", "sha256": hash_key(BATCHER_KEY)},
            ]
        },
        batcher={"api_key_file": str(key_file)},
    )


async def _refused(call: Any, code: grpc.StatusCode, reason: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    assert refused.value.code() == code, refused.value.details()
    status = status_details(refused.value)
    assert status is not None
    assert unpack_details(status)["ErrorInfo"].reason == reason


async def test_each_role_against_each_service(config: Config, tmp_path: Path, start_stack: StartStack) -> None:
    stack = await start_stack(keyed(config, tmp_path))
    assert stack.batcher is not None
    # The batcher connected with its key of role batcher: a tenant's job runs.
    async with AsyncClient(stack.address, api_key=TENANT_KEY) as client:
        done = await client.wait(await client.submit("demo", {"x": np.ones((1, 4), np.float32)}), timeout_s=30)
        assert done.state.name == "SUCCEEDED"
    for key, error in (
        (None, UnauthenticatedError),
        (OPS_KEY, PermissionDeniedError),
        (BATCHER_KEY, PermissionDeniedError),
    ):
        async with AsyncClient(stack.address, api_key=key, timeout_s=5) as client:
            with pytest.raises(error):
                await client.models()
            if key is not None:  # a BatchService call is told about both of the gateway's services
                with pytest.raises(error) as refused:
                    await client.get_batch("0190b8e4-7c1a-7d3e-8f00-000000000000")
                assert refused.value.message.startswith(
                    "the gateway's JobService and BatchService: keys of role tenant only; this key's role is "
                ), refused.value.message

    batcher_address = f"127.0.0.1:{stack.batcher.port}"
    async with (
        grpc.aio.insecure_channel(stack.ops_address) as scheduler,
        grpc.aio.insecure_channel(batcher_address) as batcher,
    ):
        ops = ops_service_pb2_grpc.OpsServiceStub(scheduler)
        stats = ops_service_pb2.GetQueueStatsRequest()
        await _refused(ops.GetQueueStats(stats, timeout=5), grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
        for wrong in (TENANT_KEY, BATCHER_KEY):
            await _refused(
                ops.GetQueueStats(stats, timeout=5, metadata=bearer_metadata(wrong)),
                grpc.StatusCode.PERMISSION_DENIED,
                "WRONG_KEY_ROLE",
            )
        await _refused(
            ops.GetQueueStats(stats, timeout=5, metadata=bearer_metadata("made-up")),
            grpc.StatusCode.UNAUTHENTICATED,
            "UNAUTHENTICATED",
        )
        assert (await ops.GetQueueStats(stats, timeout=5, metadata=bearer_metadata(OPS_KEY))).models

        # A fake batcher: no key, or a tenant's or an operator's, gets no work stream.
        workers = worker_service_pb2_grpc.WorkerServiceStub(scheduler)
        hello = worker_service_pb2.ConnectRequest(hello=worker_service_pb2.WorkerHello(batcher_id="fake"))
        for key, code, reason in (
            (None, grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"),
            (TENANT_KEY, grpc.StatusCode.PERMISSION_DENIED, "WRONG_KEY_ROLE"),
            (OPS_KEY, grpc.StatusCode.PERMISSION_DENIED, "WRONG_KEY_ROLE"),
        ):
            call = workers.Connect(iter([hello]), timeout=5, metadata=bearer_metadata(key) or None)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in call:
                    pass
            assert refused.value.code() == code
            assert unpack_details(status_details(refused.value))["ErrorInfo"].reason == reason  # type: ignore[arg-type]

        # The batcher's KServe API: ModelInfer and the model reads take an ops key; liveness does not.
        kserve = service_pb2_grpc.GRPCInferenceServiceStub(batcher)
        metadata_request = service_pb2.ModelMetadataRequest(name="demo")
        await _refused(
            kserve.ModelMetadata(metadata_request, timeout=5), grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"
        )
        await _refused(
            kserve.ModelMetadata(metadata_request, timeout=5, metadata=bearer_metadata(TENANT_KEY)),
            grpc.StatusCode.PERMISSION_DENIED,
            "WRONG_KEY_ROLE",
        )
        infer = service_pb2.ModelInferRequest(model_name="demo")
        tensor = infer.inputs.add(name="x", datatype="FP32", shape=[1, 4])
        tensor.contents.fp32_contents.extend([1.0, 2.0, 3.0, 4.0])
        await _refused(kserve.ModelInfer(infer, timeout=5), grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
        answer = await kserve.ModelInfer(infer, timeout=10, metadata=bearer_metadata(OPS_KEY))
        assert answer.outputs[0].name == "y"
        assert (await kserve.ServerLive(service_pb2.ServerLiveRequest(), timeout=5)).live

        # Health needs no key, on every server.
        for channel in (scheduler, batcher, stack.channel):
            assert channel is not None
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_batcher_without_its_key_gets_no_work(config: Config, tmp_path: Path, start_stack: StartStack) -> None:
    keyless = keyed(config, tmp_path).replace(batcher={"api_key_file": None, "api_key": "not-a-batcher-key"})
    stack = await start_stack(keyless)
    assert stack.batcher is not None
    async with AsyncClient(stack.address, api_key=TENANT_KEY) as client:
        job = await client.submit("demo", {"x": np.ones((1, 4), np.float32)})
        assert (await client.get(job)).state.name == "QUEUED"
    assert not stack.scheduler.batchers.sessions


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_the_cli_ops_commands_send_an_ops_key_and_never_the_tenant_key(config: Config, tmp_path: Path) -> None:
    """--api-key is a tenant's key for the gateway: dlq, queue and stats do not send it to the
    scheduler (which takes keys of role ops alone) when --ops-key is not given."""
    with ThreadedStack(keyed(config, tmp_path), batcher=False) as running:
        where = ("--scheduler", running.stack.ops_address)
        for api_key in ((), ("--api-key", TENANT_KEY), ("--api-key", OPS_KEY)):
            refused = _cli("stats", "--once", *where, *api_key)
            assert refused.returncode == 7, refused.stderr
            # No key reached the scheduler (a tenant key sent was PERMISSION_DENIED WRONG_KEY_ROLE).
            assert "error: UNAUTHENTICATED: missing API key" in refused.stderr, refused.stderr
            assert "send --ops-key (env ASYNCINFER_OPS_KEY)" in refused.stderr, refused.stderr
        shown = _cli("stats", "--once", *where, "--api-key", TENANT_KEY, "--ops-key", OPS_KEY)
        assert shown.returncode == 0, shown.stderr
        assert "demo" in shown.stdout
        wrong = _cli("stats", "--once", *where, "--ops-key", TENANT_KEY)
        assert wrong.returncode == 7
        assert "PERMISSION_DENIED WRONG_KEY_ROLE" in wrong.stderr, wrong.stderr


@pytest.mark.unit
def test_key_roles_are_validated() -> None:
    digest = hash_key("k")
    with pytest.raises(ValueError, match="needs its tenant"):
        Config().replace(gateway={"api_keys": [{"sha256": digest}]})
    with pytest.raises(ValueError, match="leave tenant out"):
        Config().replace(gateway={"api_keys": [{"role": "ops", "tenant": "acme", "sha256": digest}]})


@pytest.mark.unit
def test_up_makes_a_key_for_its_own_batcher() -> None:
    given = Config().replace(gateway={"api_keys": [{"tenant": "acme", "sha256": hash_key(TENANT_KEY)}]})
    config = with_own_batcher_key(given)
    assert config.batcher.api_key
    (own,) = [key for key in config.gateway.api_keys if key.role == "batcher"]
    assert own.sha256 == hash_key(config.batcher.api_key)


@pytest.mark.unit
def test_a_secret_is_inline_or_in_a_file(tmp_path: Path) -> None:
    from asyncinfer.tls import read_secret

    path = tmp_path / "secret"
    path.write_text("s3cret\n")
    assert read_secret(None, str(path), "batcher.api_key") == "s3cret"
    assert read_secret("inline", None, "batcher.api_key") == "inline"
    with pytest.raises(ConfigError, match="both set"):
        read_secret("inline", str(path), "batcher.api_key")
    with pytest.raises(ConfigError, match=r"batcher\.api_key_file: cannot read"):
        read_secret(None, str(tmp_path / "missing"), "batcher.api_key")
