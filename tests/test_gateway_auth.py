"""API keys on the gateway, against a real nats-server and real gRPC: keys map callers to tenants,
tenants see only their own jobs, and an open gateway refuses to bind beyond loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from asyncinfer.access import AccessGuard, KeyRing, UnguardedService, is_loopback
from asyncinfer.api_keys import hash_key
from asyncinfer.config import Config, load_config
from asyncinfer.errors import ConfigError
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.grpc_server import GrpcServer
from asyncinfer.ids import new_job_id
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc
from services.cli import main
from services.gateway.app import GatewayApp
from services.up.ports import check_up_exposure

if TYPE_CHECKING:
    from asyncinfer.v1.job_service_pb2_grpc import JobServiceAsyncStub as JobStub

ACME_KEY = "acme-secret-key"
GLOBEX_KEY = "globex-secret-key"


def submit_request() -> job_service_pb2.SubmitJobRequest:
    request = job_service_pb2.SubmitJobRequest(model_name="demo")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    tensor.contents.fp32_contents.extend([1.0, 2.0, 3.0, 4.0])
    return request


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def with_keys(config: Config) -> Config:
    return config.replace(
        gateway={
            "api_keys": [
                {"tenant": "acme", "sha256": hash_key(ACME_KEY), "name": "acme ci"},
                {"tenant": "globex", "sha256": hash_key(GLOBEX_KEY)},
            ]
        }
    )


async def serve(config: Config) -> AsyncIterator[JobStub]:
    app = GatewayApp(config)
    await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            yield job_service_pb2_grpc.JobServiceStub(channel)
    finally:
        await app.stop(grace_s=1)


@pytest.fixture
async def keyed(config: Config) -> AsyncIterator[JobStub]:
    async for stub in serve(with_keys(config)):
        yield stub


@pytest.fixture
async def open_gateway(config: Config) -> AsyncIterator[JobStub]:
    async for stub in serve(config):
        yield stub


def reason_of(error: grpc.aio.AioRpcError) -> str:
    status = status_details(error)
    assert status is not None
    return str(unpack_details(status)["ErrorInfo"].reason)


async def rpc_error(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


@pytest.mark.parametrize(
    "metadata",
    [(), bearer("not-a-key"), (("authorization", ACME_KEY),), bearer(""), bearer(hash_key(ACME_KEY))],
    ids=["missing", "wrong", "no-scheme", "empty", "the-digest-itself"],
)
async def test_a_missing_or_wrong_key_is_unauthenticated(keyed: JobStub, metadata: Any) -> None:
    for call in (
        keyed.SubmitJob(submit_request(), metadata=metadata),
        keyed.GetJob(job_service_pb2.GetJobRequest(job_id=new_job_id()), metadata=metadata),
        keyed.CancelJob(job_service_pb2.CancelJobRequest(job_id=new_job_id()), metadata=metadata),
    ):
        error = await rpc_error(call)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error
        assert reason_of(error) == "UNAUTHENTICATED"
    watch = keyed.WatchJob(job_service_pb2.WatchJobRequest(job_id=new_job_id()), metadata=metadata)
    error = await rpc_error(watch.read())
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED


OPS_KEY = "the-ops-key"
KEYLESS_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")


async def served_methods(channel: grpc.aio.Channel) -> list[MethodDescriptor]:
    """Every method of every service the gateway serves, as its reflection lists them (so a
    service or method added later is here without a change to the test), health and reflection aside."""
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    listed = await answers.read()
    answers.cancel()
    assert not isinstance(listed, type(grpc.aio.EOF))
    names = [service.name for service in listed.list_services_response.service]
    pool = descriptor_pool.Default()
    return [method for name in names if name not in KEYLESS_SERVICES for method in pool.FindServiceByName(name).methods]


async def call_with_an_empty_request(
    channel: grpc.aio.Channel, method: MethodDescriptor, metadata: Any
) -> grpc.StatusCode:
    """Calls the method with an empty message (bytes: any method takes them) and returns its code."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    try:
        if method.client_streaming and method.server_streaming:
            await channel.stream_stream(path)(iter([b""]), metadata=metadata, timeout=10).read()
        elif method.client_streaming:
            await channel.stream_unary(path)(iter([b""]), metadata=metadata, timeout=10)
        elif method.server_streaming:
            await channel.unary_stream(path)(b"", metadata=metadata, timeout=10).read()
        else:
            await channel.unary_unary(path)(b"", metadata=metadata, timeout=10)
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def test_every_gateway_method_needs_a_tenant_key(config: Config) -> None:
    """A guard over the gateway's whole API, enumerated from its services' descriptors: a method
    added later that forgot to ask for the caller's tenant would answer here without a key."""
    keyed_config = with_keys(config)
    keys = [entry.model_dump() for entry in keyed_config.gateway.api_keys]
    app = GatewayApp(keyed_config.replace(gateway={"api_keys": [*keys, {"role": "ops", "sha256": hash_key(OPS_KEY)}]}))
    await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            methods = await served_methods(channel)
            paths = {f"/{method.containing_service.full_name}/{method.name}" for method in methods}
            assert {"/asyncinfer.v1.JobService/SubmitJob", "/asyncinfer.v1.BatchService/CreateBatch"} <= paths
            assert "/asyncinfer.v1.JobService/UploadInput" in paths
            for metadata, expected in (
                ((), grpc.StatusCode.UNAUTHENTICATED),
                (bearer("not-a-key"), grpc.StatusCode.UNAUTHENTICATED),
                (bearer(OPS_KEY), grpc.StatusCode.PERMISSION_DENIED),
            ):
                answers = {
                    f"/{method.containing_service.full_name}/{method.name}": await call_with_an_empty_request(
                        channel, method, metadata
                    )
                    for method in methods
                }
                assert {path: code for path, code in answers.items() if code != expected} == {}, expected
            # Health and reflection stay open: probes and grpcurl carry no key.
            health = health_pb2_grpc.HealthStub(channel)
            checked = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert checked.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await app.stop(grace_s=1)


@pytest.mark.unit
async def test_a_service_without_a_key_role_is_refused_at_registration() -> None:
    """With or without keys: a service added to a guarded server and not to its roles would be served open."""
    for api_keys in ((), with_keys(Config()).gateway.api_keys):
        guard = AccessGuard(KeyRing(api_keys), {"asyncinfer.v1.BatchService": "tenant"})

        def add_servicers(server: grpc.aio.Server) -> None:
            job_service_pb2_grpc.add_JobServiceServicer_to_server(job_service_pb2_grpc.JobServiceServicer(), server)

        with pytest.raises(UnguardedService, match=r"asyncinfer\.v1\.JobService has no API key role"):
            GrpcServer(host="127.0.0.1", port=0, add_servicers=add_servicers, service_names=(), guard=guard)


async def test_an_unauthenticated_poll_does_not_start_the_watch_feed(config: Config) -> None:
    """Polls keep the gateway's watch feed running (every job's changes read: a cost for clients
    that only submit), so only a caller with a key starts it."""
    app = GatewayApp(with_keys(config))
    await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = job_service_pb2_grpc.JobServiceStub(channel)
            for call in (
                stub.GetJob(job_service_pb2.GetJobRequest(job_id=new_job_id()), metadata=bearer("not-a-key")),
                stub.GetJobs(job_service_pb2.GetJobsRequest(job_ids=[new_job_id()]), metadata=bearer("not-a-key")),
            ):
                assert (await rpc_error(call)).code() == grpc.StatusCode.UNAUTHENTICATED
            assert app.watch_hub._feed_start is None
            job = (await stub.SubmitJob(submit_request(), metadata=bearer(ACME_KEY))).job
            await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job.job_id), metadata=bearer(ACME_KEY))
            assert app.watch_hub._feed_start is not None  # a poll with a key starts it
    finally:
        await app.stop(grace_s=1)


async def test_a_key_reaches_its_own_jobs_and_the_scheme_is_case_insensitive(keyed: JobStub) -> None:
    job = (await keyed.SubmitJob(submit_request(), metadata=bearer(ACME_KEY))).job
    got = await keyed.GetJob(
        job_service_pb2.GetJobRequest(job_id=job.job_id), metadata=(("authorization", f"bearer {ACME_KEY}"),)
    )
    assert got.job.job_id == job.job_id
    assert got.job.state == job_pb2.JOB_STATE_QUEUED


async def test_another_tenants_job_is_not_found_like_an_unknown_one(keyed: JobStub) -> None:
    acme_job = (await keyed.SubmitJob(submit_request(), metadata=bearer(ACME_KEY))).job
    answers: dict[str, list[tuple[grpc.StatusCode, str, str]]] = {}
    for job_id in (acme_job.job_id, new_job_id()):
        errors = [
            await rpc_error(keyed.GetJob(job_service_pb2.GetJobRequest(job_id=job_id), metadata=bearer(GLOBEX_KEY))),
            await rpc_error(
                keyed.WatchJob(job_service_pb2.WatchJobRequest(job_id=job_id), metadata=bearer(GLOBEX_KEY)).read()
            ),
            await rpc_error(
                keyed.CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id), metadata=bearer(GLOBEX_KEY))
            ),
        ]
        answers[job_id] = [(e.code(), reason_of(e), (e.details() or "").replace(job_id, "<id>")) for e in errors]
    other_tenants, unknown = answers.values()
    assert other_tenants == unknown  # nothing tells another tenant's job from no job at all
    assert {(code, reason) for code, reason, _ in unknown} == {(grpc.StatusCode.NOT_FOUND, "JOB_NOT_FOUND")}
    # globex's attempts changed nothing: the job is still acme's and still queued.
    still = await keyed.GetJob(job_service_pb2.GetJobRequest(job_id=acme_job.job_id), metadata=bearer(ACME_KEY))
    assert still.job.state == job_pb2.JOB_STATE_QUEUED
    # And acme's own watch and cancel work.
    watch = keyed.WatchJob(job_service_pb2.WatchJobRequest(job_id=acme_job.job_id), metadata=bearer(ACME_KEY))
    assert (await watch.read()).job.state == job_pb2.JOB_STATE_QUEUED
    canceled = await keyed.CancelJob(
        job_service_pb2.CancelJobRequest(job_id=acme_job.job_id), metadata=bearer(ACME_KEY)
    )
    assert canceled.job.state == job_pb2.JOB_STATE_CANCELED
    watch.cancel()


async def test_without_keys_every_caller_is_the_default_tenant(open_gateway: JobStub, config: Config) -> None:
    assert config.gateway.api_keys == ()
    job = (await open_gateway.SubmitJob(submit_request())).job
    # A key sent to a gateway without keys is ignored, not refused.
    got = await open_gateway.GetJob(job_service_pb2.GetJobRequest(job_id=job.job_id), metadata=bearer("anything"))
    assert got.job.job_id == job.job_id


async def test_an_open_gateway_beyond_loopback_refuses_to_start(config: Config) -> None:
    app = GatewayApp(config.replace(gateway={"host": "0.0.0.0"}))
    with pytest.raises(ConfigError, match="beyond loopback, without API keys"):
        await app.start()
    assert app.port == 0  # refused before binding anything
    await app.stop()


async def test_an_open_scheduler_or_batcher_beyond_loopback_refuses_to_start(config: Config) -> None:
    """Their OpsService and KServe API are as open as the gateway's JobService without keys, and more:
    a model load runs any code its loader names (a security pass loaded os:abort remotely)."""
    from services.batcher.app import BatcherApp
    from services.scheduler.app import SchedulerApp

    scheduler = SchedulerApp(config.replace(scheduler={"host": "0.0.0.0"}))
    with pytest.raises(ConfigError, match=r"the scheduler would bind '0\.0\.0\.0', beyond loopback, without API keys"):
        await scheduler.start()
    assert scheduler.port == 0
    batcher = BatcherApp(config.replace(batcher={"host": "0.0.0.0", "scheduler_address": None}))
    with pytest.raises(ConfigError, match="load new ones"):
        await batcher.start()
    assert batcher.port == 0


@pytest.mark.unit
@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost"])
def test_loopback_addresses(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.unit
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.1", "example.com", ""])
def test_addresses_beyond_loopback(host: str) -> None:
    assert not is_loopback(host)


@pytest.mark.unit
def test_up_keeps_unauthenticated_ports_on_loopback() -> None:
    check_up_exposure(Config())
    keys = [{"tenant": "acme", "sha256": hash_key(ACME_KEY)}]
    tls = {"tls_cert_file": "server.pem", "tls_key_file": "server-key.pem"}
    check_up_exposure(Config().replace(gateway={"host": "0.0.0.0", "api_keys": keys, **tls}))
    # Keys alone are not enough beyond loopback: they would travel in cleartext (issue 17).
    with pytest.raises(ConfigError, match="stays on loopback without TLS"):
        check_up_exposure(Config().replace(gateway={"host": "0.0.0.0", "api_keys": keys}))
    with pytest.raises(ConfigError, match="without API keys"):
        check_up_exposure(Config().replace(gateway={"host": "0.0.0.0"}))
    for section in ("scheduler", "batcher", "embedded_nats"):
        with pytest.raises(ConfigError, match=f"{section}.host is '0.0.0.0'"):
            check_up_exposure(Config().replace(**{section: {"host": "0.0.0.0"}}))


@pytest.mark.unit
def test_api_keys_load_from_toml_and_are_validated(tmp_path: Any) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(f'[[gateway.api_keys]]\ntenant = "acme"\nsha256 = "{hash_key(ACME_KEY)}"\nname = "ci"\n')
    (key,) = load_config(path, environ={}).gateway.api_keys
    assert (key.tenant, key.sha256, key.name) == ("acme", hash_key(ACME_KEY), "ci")
    for bad, problem in (
        ('tenant = "acme"\nsha256 = "abc"', "64 lowercase hex"),
        (f'tenant = "a.b"\nsha256 = "{hash_key(ACME_KEY)}"', "tenant names"),
    ):
        path.write_text(f"[[gateway.api_keys]]\n{bad}\n")
        with pytest.raises(ConfigError, match=problem):
            load_config(path, environ={})
    twice = f'[[gateway.api_keys]]\ntenant = "a"\nsha256 = "{hash_key(ACME_KEY)}"\n' * 2
    path.write_text(twice)
    with pytest.raises(ConfigError, match="same key twice"):
        load_config(path, environ={})


@pytest.mark.unit
def test_hash_key_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hash-key", ACME_KEY]) == 0
    assert capsys.readouterr().out.strip() == hash_key(ACME_KEY)
    assert len(hash_key(ACME_KEY)) == 64


@pytest.mark.unit
def test_keys_from_environment() -> None:
    # ASYNCINFER_GATEWAY__API_KEYS takes JSON, like every list override.
    environ = {"ASYNCINFER_GATEWAY__API_KEYS": f'[{{"tenant": "acme", "sha256": "{hash_key(ACME_KEY)}"}}]'}
    loaded = load_config(None, environ=environ)
    assert loaded.gateway.api_keys[0].tenant == "acme"


@pytest.mark.unit
def test_keys_beyond_loopback_without_tls_are_warned_of() -> None:
    """A standalone service with keys and no certificate of its own serves them in cleartext unless
    TLS ends in front of it; it says so (it was silent)."""
    import structlog

    from asyncinfer.access import require_keys_beyond_loopback
    from asyncinfer.config import ApiKeyConfig

    keys = [ApiKeyConfig(role="ops", sha256="a" * 64)]
    with structlog.testing.capture_logs() as logs:
        require_keys_beyond_loopback("scheduler", "0.0.0.0", keys, "do things", tls=False)
        require_keys_beyond_loopback("scheduler", "0.0.0.0", keys, "do things", tls=True)
        require_keys_beyond_loopback("scheduler", "127.0.0.1", keys, "do things", tls=False)
    assert [entry["event"] for entry in logs] == ["api_keys_in_cleartext"]
    assert "scheduler.tls_cert_file" in logs[0]["hint"]
    with pytest.raises(ConfigError, match="without API keys: anyone who can reach it could do things"):
        require_keys_beyond_loopback("scheduler", "0.0.0.0", [], "do things", tls=True)


async def test_a_stream_refused_while_its_client_still_writes_says_why(config: Config) -> None:
    """A request stream the gateway refuses (a wrong key) while the client is still writing: grpc's
    aio client reported its failed write as INTERNAL "Internal error from Core", overwriting the
    status the gateway sent (grpc/grpc#36066), now and then (once in a CI run of this file's
    neighbour, test_gateway_bulk). The gateway reads what the client still sends before it answers."""
    app = GatewayApp(with_keys(config))
    await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = job_service_pb2_grpc.JobServiceStub(channel)
            many = [job_service_pb2.SubmitJobsRequest(correlation_id=str(i), job=submit_request()) for i in range(200)]

            async def requests() -> AsyncIterator[job_service_pb2.SubmitJobsRequest]:
                for request in many:
                    yield request

            async def chunks() -> AsyncIterator[job_service_pb2.UploadInputRequest]:
                yield job_service_pb2.UploadInputRequest(metadata=job_service_pb2.UploadInputMetadata())
                for _ in range(64):
                    yield job_service_pb2.UploadInputRequest(chunk=b"\0" * 65_536)

            codes = []
            for _ in range(10):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _answer in stub.SubmitJobs(requests(), metadata=bearer("not-a-key")):
                        pass
                codes.append(info.value.code())
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.UploadInput(chunks(), metadata=bearer("not-a-key"))
                codes.append(info.value.code())
            assert codes == [grpc.StatusCode.UNAUTHENTICATED] * len(codes), codes
    finally:
        await app.stop(grace_s=1)
