"""ListModels on a real gateway: every configured model with its signature and job defaults, so
a client can build valid inputs without the server's configuration; only for authenticated
callers when keys are configured."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from asyncinfer.config import Config
from asyncinfer.contract import model_version_key
from asyncinfer.declarations import ensure_jobs_bucket
from asyncinfer.model_registry import (
    MARKER_TTL_S,
    READY,
    RegisteredVersion,
    batcher_token,
    encode_registered,
    ensure_models_bucket,
)
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.kv import KvBucket, kv_put_with_ttl
from asyncinfer.nats.streams import ensure_kv_bucket
from asyncinfer.v1 import job_service_pb2
from services.gateway import job_service
from services.gateway.model_catalog import ModelCatalog
from tests.processes import until
from tests.test_gateway_auth import ACME_KEY, bearer, serve, with_keys
from tests.test_gateway_list import two_models


async def test_every_model_with_its_signature_and_defaults(config: Config) -> None:
    config = two_models(config)
    async for stub in serve(config):
        answer = await stub.ListModels(job_service_pb2.ListModelsRequest())
        assert [m.name for m in answer.models] == [m.name for m in config.models] == ["demo", "other"]
        demo, configured = answer.models[0], config.models[0]
        assert demo.version == configured.version
        assert [(t.name, t.datatype, list(t.shape)) for t in demo.inputs] == [
            (t.name, t.datatype, list(t.shape)) for t in configured.signature.inputs
        ]
        assert [(t.name, t.datatype, list(t.shape)) for t in demo.outputs] == [
            (t.name, t.datatype, list(t.shape)) for t in configured.signature.outputs
        ]
        assert demo.max_batch_size == configured.max_batch_size
        assert demo.default_max_attempts == configured.max_attempts
        assert demo.max_attempts_limit == configured.max_attempts_limit
        assert demo.default_execution_timeout.ToNanoseconds() == round(configured.default_execution_timeout_s * 1e9)
        # What it says is what SubmitJob accepts: an input built from it alone is valid.
        request = job_service_pb2.SubmitJobRequest(model_name=demo.name, model_version=demo.version)
        for spec in demo.inputs:
            shape = [1 if d == -1 else d for d in spec.shape]
            size = 1
            for d in shape:
                size *= d
            tensor = request.inputs.add(name=spec.name, datatype=spec.datatype, shape=shape)
            assert spec.datatype == "FP32"  # the demo model's; the test builds FP32 contents
            tensor.contents.fp32_contents.extend([0.5] * size)
        accepted = await stub.SubmitJob(request)
        assert accepted.job.model_name == "demo"


async def test_a_listing_is_made_again_only_once_the_registry_changed(
    config: Config, nc: NatsClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ListModels made its answer at every call (~9 ms on the event loop for 300 models served by
    12 batchers). It is kept until the model catalog changes; a batcher that registers the version
    is in the next listing."""
    made = 0
    real = job_service.models_to_proto

    def counted(listings: Any) -> job_service_pb2.ListModelsResponse:
        nonlocal made
        made += 1
        return real(listings)

    monkeypatch.setattr(job_service, "models_to_proto", counted)
    async for stub in serve(config):
        first = await stub.ListModels(job_service_pb2.ListModelsRequest())
        again = await stub.ListModels(job_service_pb2.ListModelsRequest())
        assert again == first
        assert made == 1
        (version,) = first.models[0].versions
        assert version.state == job_service_pb2.MODEL_VERSION_STATE_UNAVAILABLE
        js = nc.jetstream()
        bucket = KvBucket(name=config.nats.models_bucket, kv=await js.key_value(config.nats.models_bucket), js=js)
        entry = RegisteredVersion("demo", "1", "b1", READY, 8, config.models[0].signature, updated_at=time.time())
        await kv_put_with_ttl(
            bucket, model_version_key("demo", "1", batcher_token("b1")), encode_registered(entry), ttl_s=60
        )

        deadline = time.monotonic() + 5.0
        while True:  # each listing asked anew until the registration shows
            answer = await stub.ListModels(job_service_pb2.ListModelsRequest())
            (version,) = answer.models[0].versions
            if version.state == job_service_pb2.MODEL_VERSION_STATE_READY:
                break
            assert time.monotonic() < deadline, "the registered version never showed in ListModels"
            await asyncio.sleep(0.01)
        assert list(version.batchers) == ["b1"]
        assert made == 2


async def test_keys_are_required_when_configured(config: Config) -> None:
    async for stub in serve(with_keys(config)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListModels(job_service_pb2.ListModelsRequest())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answer = await stub.ListModels(job_service_pb2.ListModelsRequest(), metadata=bearer(ACME_KEY))
        assert [m.name for m in answer.models] == [m.name for m in config.models]


async def test_a_registry_entry_its_ttl_removes_leaves_the_gateways_catalog(config: Config, nc: NatsClient) -> None:
    """The scheduler that wrote a batcher's entry died: the entry's TTL removes it, and the
    server's delete marker tells the gateways. The bucket had no markers, so a dead batcher's
    versions stayed READY in every gateway for good (a first-hour pass, session 25: its jobs were
    accepted and waited NO_WORKER). A bucket made by the release before gets them at start."""
    js = nc.jetstream()
    await ensure_kv_bucket(js, config.nats, bucket=config.nats.models_bucket, description="as a release before made it")
    await ensure_models_bucket(js, config.nats)
    info = await js.stream_info(f"KV_{config.nats.models_bucket}")
    assert info.config.subject_delete_marker_ttl == MARKER_TTL_S
    catalog = ModelCatalog(config, js)
    await catalog.start()
    try:
        bucket = KvBucket(name=config.nats.models_bucket, kv=await js.key_value(config.nats.models_bucket), js=js)
        entry = RegisteredVersion("demo", "1", "gone", READY, 8, None, updated_at=time.time())
        key = model_version_key("demo", "1", batcher_token("gone"))
        await kv_put_with_ttl(bucket, key, encode_registered(entry), ttl_s=1)
        await until(lambda: [e.batcher_id for e in catalog.registered("demo")] == ["gone"], timeout_s=5.0)
        await until(lambda: catalog.registered("demo") == [], timeout_s=10.0)
    finally:
        await catalog.stop()


async def test_a_changed_marker_ttl_is_applied_to_the_jobs_bucket_that_exists(config: Config, nc: NatsClient) -> None:
    """nats.expired_job_marker_ttl_s was read only when the bucket was made: lowered later (its
    markers held several times the live records' bytes, a soak pass found), it changed nothing."""
    js = nc.jetstream()
    await ensure_jobs_bucket(js, config.nats)
    await ensure_jobs_bucket(js, config.nats.model_copy(update={"expired_job_marker_ttl_s": 600.0}))
    info = await js.stream_info(f"KV_{config.nats.jobs_bucket}")
    assert info.config.subject_delete_marker_ttl == 600.0
