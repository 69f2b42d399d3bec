"""The remote backend: batches go to a Triton Inference Server through `tritonclient.grpc.aio`.

At start-up it checks that the server and the model are ready, that the model's metadata matches
the configured signature (names, datatypes, shapes) and that Triton takes batches as large as the
configured max_batch_size; a server that cannot be reached or is not ready yet (started beside the
batcher) is waited for, up to `triton_outage_wait_s`. Each batch is one ModelInfer; the batch's
items all get Triton's error, mapped to ours: UNAVAILABLE and NOT_FOUND (server or model gone) ->
Unavailable (retriable), DEADLINE_EXCEEDED -> DeadlineExceeded, RESOURCE_EXHAUSTED ->
ResourceExhausted, anything else -> ModelError with Triton's message. A batch that meets
Unavailable is sent again, backing off, for up to `triton_outage_wait_s` before its items fail: a
Triton restart or rolling update would otherwise spend every queued job's attempts in a couple of
seconds (their retries' backoff is short), while the batch held here holds the model's slots, so
the rest of its jobs stay queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
import structlog
import tritonclient.grpc.aio as triton
from tritonclient.utils import InferenceServerException

from asyncinfer.config import ModelConfig
from asyncinfer.errors import AsyncInferError, ConfigError, DeadlineExceeded, ModelError, ResourceExhausted, Unavailable
from services.batcher.backends import Arrays, ModelBackend, check_outputs

log = structlog.get_logger("asyncinfer.batcher.triton")

T = TypeVar("T")

FIRST_RETRY_S = 0.2
MAX_RETRY_S = 2.0


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
        self._max_batch_size = model.max_batch_size
        self._outage_wait_s = model.triton_outage_wait_s
        self._client: triton.InferenceServerClient | None = None
        self._unreachable = False  # said once per outage, whatever number of batches meet it

    async def start(self) -> None:
        self._client = triton.InferenceServerClient(self.url)
        where = f"triton model {self.remote_name!r} at {self.url}"
        client = self._client

        async def server_ready() -> None:
            try:
                ready = await client.is_server_ready(client_timeout=self._timeout_s)
            except InferenceServerException as exc:
                raise map_triton_error(self.name, exc) from None
            if not ready:
                raise Unavailable(f"{where}: the server is not ready", reason="TRITON_UNAVAILABLE")

        try:
            await self._outlasting_outages(server_ready)
        except Unavailable as exc:
            raise ConfigError(f"{where}: {exc.message} (waited {self._outage_wait_s:g} s)") from None
        try:
            if not await client.is_model_ready(self.remote_name, self.remote_version):
                raise ConfigError(f"{where}: the model is not ready")
            metadata = await client.get_model_metadata(self.remote_name, self.remote_version, as_json=True)
            remote_config = await client.get_model_config(self.remote_name, self.remote_version, as_json=True)
        except InferenceServerException as exc:
            raise ConfigError(f"{where}: {exc.message() or exc}") from None
        self._check_metadata(where, metadata)
        remote_max = int(remote_config.get("config", {}).get("max_batch_size", 0) or 0)
        if not remote_max:
            self._check_unbatched(where, metadata)
        if remote_max and self._max_batch_size > remote_max:
            # Every batch of more rows would fail in Triton, with all its jobs.
            raise ConfigError(
                f"{where}: it takes batches of at most {remote_max} rows (its max_batch_size), "
                f"configured max_batch_size = {self._max_batch_size}: set it to {remote_max} or less"
            )

    async def _outlasting_outages(self, call: Callable[[], Awaitable[T]]) -> T:
        """call(), again while it raises Unavailable (Triton restarting, a rolling update, a model
        being reloaded), backing off from FIRST_RETRY_S to MAX_RETRY_S, for up to
        triton_outage_wait_s; then that error."""
        loop = asyncio.get_running_loop()
        give_up_at: float | None = None
        delay = FIRST_RETRY_S
        while True:
            try:
                result = await call()
            except Unavailable as error:
                now = loop.time()
                if give_up_at is None:
                    give_up_at = now + self._outage_wait_s
                    if not self._unreachable:
                        self._unreachable = True
                        log.warning(
                            "triton_unreachable",
                            model=self.name,
                            url=self.url,
                            error=error.message,
                            waiting_s=self._outage_wait_s,
                        )
                if now + delay > give_up_at:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_S)
                continue
            if self._unreachable:
                self._unreachable = False
                log.info("triton_reachable_again", model=self.name, url=self.url)
            return result

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

    def _check_unbatched(self, where: str, metadata: dict[str, Any]) -> None:
        """A model without Triton's batching (max_batch_size 0) takes its first dimension as
        declared: where that is fixed, a batch of more rows fails in Triton ("unexpected shape"),
        each of them bisected down to single calls (2n-1 calls a batch)."""
        for found in metadata.get("inputs", []):
            shape = [int(d) for d in found.get("shape", [])]
            if shape and shape[0] != -1 and self._max_batch_size > shape[0]:
                rows = shape[0]
                raise ConfigError(
                    f"{where}: it does not batch (its max_batch_size is 0) and input {found['name']!r} is {shape}: "
                    f"it takes {rows} row{'s' if rows != 1 else ''} per call, configured max_batch_size = "
                    f"{self._max_batch_size}: set max_batch_size to {rows}, or enable batching in Triton"
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
        client = self._client

        async def infer() -> Any:
            try:
                return await client.infer(
                    self.remote_name,
                    requests,
                    model_version=self.remote_version,
                    outputs=wanted,
                    client_timeout=self._timeout_s,
                )
            except InferenceServerException as exc:
                raise map_triton_error(self.name, exc) from None

        result = await self._outlasting_outages(infer)
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
