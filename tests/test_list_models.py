"""ListModels on a real gateway: every configured model with its signature and job defaults, so
a client can build valid inputs without the server's configuration; only for authenticated
callers when keys are configured."""

from __future__ import annotations

import grpc
import pytest

from asyncinfer.config import Config
from asyncinfer.v1 import job_service_pb2
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


async def test_keys_are_required_when_configured(config: Config) -> None:
    async for stub in serve(with_keys(config)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListModels(job_service_pb2.ListModelsRequest())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answer = await stub.ListModels(job_service_pb2.ListModelsRequest(), metadata=bearer(ACME_KEY))
        assert [m.name for m in answer.models] == [m.name for m in config.models]
