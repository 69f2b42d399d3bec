"""The remote backend: batches go to a Triton Inference Server through `tritonclient.grpc.aio`.

At start-up it checks that the server and the model are ready, that the model's metadata matches
the configured signature (names, datatypes, shapes) and that Triton takes batches as large as the
configured max_batch_size; a server that cannot be reached or is not ready yet (started beside the
batcher) is waited for, up to `triton_outage_wait_s`. Each batch is one ModelInfer; the batch's
items all get Triton's error, mapped to ours: UNAVAILABLE and NOT_FOUND (server or model gone) ->
Unavailable (retriable), DEADLINE_EXCEEDED -> DeadlineExceeded, RESOURCE_EXHAUSTED ->
ResourceExhausted, anything else -> ModelError with Triton's message.

An outage (Unavailable): the backend turns unreachable (`reachable`, its listeners told), and the
model takes no work until Triton answers again (services/batcher/model_queue.py hands back what
waits, without spending attempts). The batch that met it is sent again, backing off, for up to
`triton_outage_wait_s`, but no later than its first item's execution timeout, then its items fail
UNREACHABLE_REASON (handed back too). Meanwhile a probe asks Triton whether the server and the model
are ready, backing off to MAX_RETRY_S, until they are. Each call's timeout is when the last of its
batch's items stops waiting (its execution timeout, from the batch's start), not the model's
default_execution_timeout_s: an item allowed longer had its call cut there, DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
import structlog
import tritonclient.grpc.aio as triton
from tritonclient.utils import InferenceServerException

from asyncinfer.config import ModelConfig
from asyncinfer.errors import AsyncInferError, ConfigError, DeadlineExceeded, ModelError, ResourceExhausted, Unavailable
from asyncinfer.supervision import failure_logged
from services.batcher.backends import (
    UNREACHABLE_REASON,
    Arrays,
    CallTimes,
    ModelBackend,
    ReachableListener,
    check_outputs,
)

log = structlog.get_logger("asyncinfer.batcher.triton")

T = TypeVar("T")

FIRST_RETRY_S = 0.2
MAX_RETRY_S = 2.0
# A batch meeting an outage gives up this long before its first item's execution timeout ends: its
# items are then handed back (their attempts kept) rather than timed out (a call of the retry may
# take a moment to fail).
HAND_BACK_BEFORE_S = 0.2
# The probe's readiness calls, each.
PROBE_TIMEOUT_S = 5.0


def map_triton_error(model_name: str, error: InferenceServerException) -> AsyncInferError:
    status = str(error.status() or "")
    message = f"triton model {model_name!r}: {error.message() or error}"
    if status.endswith(("UNAVAILABLE", "NOT_FOUND")):
        return Unavailable(message, reason=UNREACHABLE_REASON)
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
        # False from a call's Unavailable until a call or the probe gets through: said once per
        # outage, whatever number of batches meet it.
        self._reachable = True
        self._listeners: list[ReachableListener] = []
        self._serving = False  # started: an outage from now on starts the probe
        self._probe: asyncio.Task[None] | None = None

    @property
    def reachable(self) -> bool:
        return self._reachable

    def watch_reachable(self, listener: ReachableListener) -> None:
        self._listeners.append(listener)

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
                raise Unavailable(f"{where}: the server is not ready", reason=UNREACHABLE_REASON)

        try:
            await self._outlasting_outages(server_ready, self._outage_wait_s)
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
        self._serving = True

    async def _outlasting_outages(
        self, call: Callable[[], Awaitable[T]], wait_s: float, give_up_by: float | None = None
    ) -> T:
        """call(), again while it raises Unavailable (Triton restarting, a rolling update, a model
        being reloaded), backing off from FIRST_RETRY_S to MAX_RETRY_S, for up to wait_s from the
        first failure and no later than `give_up_by` (loop time); then that error."""
        loop = asyncio.get_running_loop()
        give_up_at: float | None = None
        delay = FIRST_RETRY_S
        while True:
            try:
                result = await call()
            except Unavailable as error:
                now = loop.time()
                self._out_of_reach(error, wait_s)
                if give_up_at is None:
                    give_up_at = now + wait_s if give_up_by is None else min(now + wait_s, give_up_by)
                if now + delay > give_up_at:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_S)
                continue
            self._in_reach()
            return result

    def _out_of_reach(self, error: Unavailable, wait_s: float) -> None:
        if not self._reachable:
            return
        self._reachable = False
        log.warning("triton_unreachable", model=self.name, url=self.url, error=error.message, waiting_s=wait_s)
        if self._serving and self._probe is None:
            # Owned here: cancelled and awaited by aclose; a bug in it is said at once.
            self._probe = asyncio.create_task(self._probe_until_reachable(), name=f"triton-probe-{self.name}")
            self._probe.add_done_callback(failure_logged)
        self._tell(reachable=False)

    def _in_reach(self) -> None:
        if self._reachable:
            return
        self._reachable = True
        log.info("triton_reachable_again", model=self.name, url=self.url)
        self._tell(reachable=True)

    def _tell(self, *, reachable: bool) -> None:
        for listener in list(self._listeners):
            try:
                listener(reachable)
            except Exception:
                log.exception("reachable_listener_failed", model=self.name)

    async def _probe_until_reachable(self) -> None:
        """While Triton is out of reach the model runs no batch that would find out when it is
        back: this asks whether the server and the model are ready, backing off from FIRST_RETRY_S
        to MAX_RETRY_S, until they are (or a batch's call got through first)."""
        delay = FIRST_RETRY_S
        try:
            while not self._reachable and (client := self._client) is not None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_S)
                if self._reachable:
                    break
                try:
                    ready = await client.is_server_ready(client_timeout=PROBE_TIMEOUT_S) and (
                        await client.is_model_ready(
                            self.remote_name, self.remote_version, client_timeout=PROBE_TIMEOUT_S
                        )
                    )
                except InferenceServerException:
                    continue
                if ready:
                    self._in_reach()
        finally:
            self._probe = None

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

    async def infer_batch_async(self, inputs: Arrays, times: CallTimes | None = None) -> Arrays:
        if self._client is None:
            raise Unavailable(f"triton model {self.name!r} is not connected", reason=UNREACHABLE_REASON)
        requests = []
        for spec in self._signature.inputs:
            array = inputs[spec.name]
            infer_input = triton.InferInput(spec.name, list(array.shape), spec.datatype)
            infer_input.set_data_from_numpy(array)
            requests.append(infer_input)
        wanted = [triton.InferRequestedOutput(spec.name) for spec in self._signature.outputs]
        client = self._client
        loop = asyncio.get_running_loop()
        call_ends = times.last_end if times is not None else None
        give_up_by = None
        if times is not None and times.first_end is not None:
            give_up_by = times.first_end - HAND_BACK_BEFORE_S

        async def infer() -> Any:
            timeout_s = self._timeout_s if call_ends is None else max(call_ends - loop.time(), 0.001)
            try:
                return await client.infer(
                    self.remote_name,
                    requests,
                    model_version=self.remote_version,
                    outputs=wanted,
                    client_timeout=timeout_s,
                )
            except InferenceServerException as exc:
                raise map_triton_error(self.name, exc) from None

        result = await self._outlasting_outages(infer, self._outage_wait_s, give_up_by)
        outputs: Arrays = {}
        for spec in self._signature.outputs:
            array = result.as_numpy(spec.name)
            if array is None:
                raise ModelError(f"triton model {self.name!r} returned no output {spec.name!r}")
            outputs[spec.name] = np.asarray(array)
        check_outputs(self.name, outputs, self._signature)
        return outputs

    async def aclose(self) -> None:
        self._serving = False
        if self._probe is not None:
            probe = self._probe
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()
