"""The remote backend: batches go to a Triton Inference Server through `tritonclient.grpc.aio`.

At start-up it checks that the server and the model are ready and that the model's metadata
matches the configured signature (names, datatypes, shapes). Each batch is one ModelInfer; the
batch's items all get Triton's error, mapped to ours: UNAVAILABLE and NOT_FOUND (server or model
gone) -> Unavailable (retriable), DEADLINE_EXCEEDED -> DeadlineExceeded, RESOURCE_EXHAUSTED ->
ResourceExhausted, anything else -> ModelError with Triton's message.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tritonclient.grpc.aio as triton
from tritonclient.utils import InferenceServerException

from asyncinfer.config import ModelConfig
from asyncinfer.errors import AsyncInferError, ConfigError, DeadlineExceeded, ModelError, ResourceExhausted, Unavailable
from services.batcher.backends import Arrays, ModelBackend, check_outputs


def map_triton_error(model_name: str, error: InferenceServerException) -> AsyncInferError:
    status = str(error.status() or "")
    message = f"triton model {model_name!r}: {error.message() or error}"
    if status.endswith(("UNAVAILABLE", "NOT_FOUND")):
        return Unavailable(message, reason="TRITON_UNAVAILABLE")
    if status.endswith("DEADLINE_EXCEEDED"):
        return DeadlineExceeded(message)
    if status.endswith("RESOURCE_EXHAUSTED"):
        return ResourceExhausted(message, reason="TRITON_RESOURCE_EXHAUSTED", retry_after_s=0.1)
    return ModelError(message)


class TritonBackend(ModelBackend):
    runs_async = True

    def __init__(self, model: ModelConfig) -> None:
        super().__init__(model.name, model.signature)
        self.url = model.triton_url
        self.remote_name = model.triton_model_name or model.name
        self.remote_version = model.triton_model_version
        self._timeout_s = model.default_execution_timeout_s
        self._client: triton.InferenceServerClient | None = None

    async def start(self) -> None:
        self._client = triton.InferenceServerClient(self.url)
        where = f"triton model {self.remote_name!r} at {self.url}"
        try:
            if not await self._client.is_server_ready(client_timeout=self._timeout_s):
                raise ConfigError(f"{where}: the server is not ready")
            if not await self._client.is_model_ready(self.remote_name, self.remote_version):
                raise ConfigError(f"{where}: the model is not ready")
            metadata = await self._client.get_model_metadata(self.remote_name, self.remote_version, as_json=True)
        except InferenceServerException as exc:
            raise ConfigError(f"{where}: {exc.message() or exc}") from None
        self._check_metadata(where, metadata)

    def _check_metadata(self, where: str, metadata: dict[str, Any]) -> None:
        for kind, specs in (("inputs", self._signature.inputs), ("outputs", self._signature.outputs)):
            remote = {t["name"]: t for t in metadata.get(kind, [])}
            for spec in specs:
                found = remote.get(spec.name)
                if found is None:
                    raise ConfigError(f"{where}: it has no {kind[:-1]} {spec.name!r} (it has {sorted(remote)})")
                shape = tuple(int(d) for d in found.get("shape", []))
                if found["datatype"] != spec.datatype or len(shape) != len(spec.shape):
                    raise ConfigError(
                        f"{where}: {kind[:-1]} {spec.name!r} is {found['datatype']} {list(shape)}, "
                        f"configured {spec.datatype} {list(spec.shape)}"
                    )
                if any(r != -1 and c != -1 and r != c for r, c in zip(shape[1:], spec.shape[1:], strict=True)):
                    raise ConfigError(
                        f"{where}: {kind[:-1]} {spec.name!r} has shape {list(shape)}, configured {list(spec.shape)}"
                    )

    async def infer_batch_async(self, inputs: Arrays) -> Arrays:
        if self._client is None:
            raise Unavailable(f"triton model {self.name!r} is not connected", reason="TRITON_UNAVAILABLE")
        requests = []
        for spec in self._signature.inputs:
            array = inputs[spec.name]
            infer_input = triton.InferInput(spec.name, list(array.shape), spec.datatype)
            infer_input.set_data_from_numpy(array)
            requests.append(infer_input)
        wanted = [triton.InferRequestedOutput(spec.name) for spec in self._signature.outputs]
        try:
            result = await self._client.infer(
                self.remote_name,
                requests,
                model_version=self.remote_version,
                outputs=wanted,
                client_timeout=self._timeout_s,
            )
        except InferenceServerException as exc:
            raise map_triton_error(self.name, exc) from None
        outputs: Arrays = {}
        for spec in self._signature.outputs:
            array = result.as_numpy(spec.name)
            if array is None:
                raise ModelError(f"triton model {self.name!r} returned no output {spec.name!r}")
            outputs[spec.name] = np.asarray(array)
        check_outputs(self.name, outputs, self._signature)
        return outputs

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()
