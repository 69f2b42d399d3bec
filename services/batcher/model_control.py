"""Loading, replacing and unloading model versions while the batcher serves (hot updates): the
KServe repository API (kserve_repository.py), a reload of the configuration file (SIGHUP) and the
scheduler's model controls all come here.

`apply(name, versions)` makes the versions a model serves exactly `versions` (Triton's
load_model with a config: the loaded versions become the ones it declares):
- a new version is announced LOADING, loaded (in a thread), started and warmed up with one
  batch of made-up inputs before the engine gives it work, then announced READY;
- a loaded version whose configuration changed is replaced the same way: the new one takes every
  item from the moment it is ready, the old one finishes what it holds (in the background);
- a version no longer declared is announced gone first (the scheduler stops sending it orders),
  then retired: what it holds finishes on it (in the background), then its backend is closed.
A replaced or retired version gets `batcher.retire_grace_s` to finish, or longer for what computes
within its own deadline (a job's execution timeout): what it still holds then with no deadline of its
own (a KServe call whose model call has not returned), or waiting, is answered UNAVAILABLE
MODEL_VERSION_RETIRED, and it is closed once the rest has ended (engine.finish_retiring).
`apply` returns once the change is in effect for new work; `drained` waits for the old ones.
A version that fails to load or warm up is reported UNAVAILABLE with the reason (`failures`) and
the rest go on; the version it would have replaced keeps serving, and no version is unloaded by
that change. One change at a time per
batcher (a lock), so that two reloads never race on the same version.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import structlog
from pydantic import ValidationError

from asyncinfer.config import BatcherConfig, ModelConfig, default_version_config
from asyncinfer.errors import (
    AsyncInferError,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    ModelError,
    NotFound,
    Unavailable,
)
from asyncinfer.jobs import NAME_PATTERN, NAME_RULE
from asyncinfer.pipelines import PipelineMismatch, check_pipeline
from asyncinfer.supervision import failure_logged
from asyncinfer.tensors import NUMPY_DTYPES
from services.batcher.backends import Arrays, ModelBackend
from services.batcher.backends.loading import load_backend
from services.batcher.engine import BatchingEngine
from services.batcher.model_queue import ModelQueue
from services.batcher.pipeline import STEP_MISMATCH

# While a model loads, a line this often says which it is and how long it has taken.
STILL_LOADING_EVERY_S = 10.0

log = structlog.get_logger("asyncinfer.batcher.models")

Announce = Callable[[Sequence[ModelConfig]], None]
# The model tables the repository (the configuration file) declares now.
Repository = Callable[[], Sequence[ModelConfig]]


def warm_up_inputs(config: ModelConfig) -> Arrays:
    """One row of each input, every variable dimension 1: zeros, or a short text for BYTES."""
    arrays: Arrays = {}
    for spec in config.signature.inputs:
        shape = tuple(1 if d == -1 else d for d in spec.shape)
        shape = (1, *shape[1:])
        if spec.datatype == "BYTES":
            arrays[spec.name] = np.full(shape, b"warm up", dtype=object)
        else:
            arrays[spec.name] = np.zeros(shape, dtype=NUMPY_DTYPES[spec.datatype])
    return arrays


async def warm_up(config: ModelConfig, backend: ModelBackend) -> None:
    """Runs one batch through the backend (the first batch pays for lazy initialisation, kernel
    selection, a remote model's first call), so that the first job does not."""
    inputs = warm_up_inputs(config)
    try:
        if backend.runs_async:
            await backend.infer_batch_async(inputs)
        else:
            await asyncio.to_thread(backend.infer_batch, inputs)
    except ModelError as exc:
        # Made-up inputs are not every model's (a model may refuse zeros): the model answered,
        # which is what warming up is for. Triton fails the load instead, on warm-up samples the
        # model's author gives; ours are not the author's.
        log.warning("model_warm_up_refused", model=config.name, version=config.version, error=exc.message)


def _reason(exc: BaseException) -> str:
    return exc.message if isinstance(exc, AsyncInferError) else f"{type(exc).__name__}: {exc}"


class ModelControl:
    def __init__(
        self,
        engine: BatchingEngine,
        batcher: BatcherConfig,
        *,
        linger_s: float = 1.0,
        repository: Repository | None = None,
    ) -> None:
        """`repository`: the model tables the configuration file declares now (re-read per call)."""
        self._repository = repository
        self._engine = engine
        self._batcher = batcher
        self._linger_s = linger_s
        self._lock = asyncio.Lock()
        self._backends: dict[tuple[str, str], ModelBackend] = {}
        self.loading: dict[tuple[str, str], ModelConfig] = {}
        # (model, version) -> why it is not served (failed to load or to warm up).
        self.failures: dict[tuple[str, str], str] = {}
        self._announce: Announce = lambda _loading: None
        self._draining: set[asyncio.Task[None]] = set()

    def use_torch_threads(self, threads: int) -> None:
        """The torch intra-op threads every load from now on sets (loading.torch_threads_for, which
        the batcher decides at start, before its first load)."""
        self._batcher = self._batcher.model_copy(update={"torch_threads": threads})

    def on_change(self, announce: Announce) -> None:
        """`announce(loading)` is called after every change to what is served (or loading)."""
        self._announce = announce

    def _changed(self) -> None:
        self._announce(list(self.loading.values()))

    @property
    def backends(self) -> list[ModelBackend]:
        return list(self._backends.values())

    # --- load_model / unload_model (KServe's repository API, the scheduler's model controls) ----

    def declared(self, name: str) -> list[ModelConfig]:
        for model in self._repository() if self._repository is not None else ():
            if model.name == name:
                return list(model.version_configs())
        return []

    def versions_to_load(self, name: str, override: dict[str, Any] | None) -> list[ModelConfig]:
        """The versions a load makes the model serve: the repository's (override None), or the
        override's model table laid over the repository's table (or the default version served
        now), its `versions` and `default_version` replaced."""
        declared = self.declared(name)
        if override is None:
            if not declared:
                raise NotFound(f"the repository declares no model {name!r}", reason="MODEL_NOT_FOUND")
            return declared
        if declared:
            base = declared[0].model_dump()
        elif self._engine.has_model(name):
            base = self._engine.model_config(name).model_dump()
        else:
            base = {}
        data = {**base, "versions": (), "default_version": "", **override, "name": name}
        try:
            model = ModelConfig.model_validate(data)
        except ValidationError as exc:
            violations = [
                FieldViolation(f"config.{'.'.join(str(p) for p in e['loc'])}", e["msg"])
                for e in exc.errors(include_url=False)
            ]
            raise InvalidArgument(f"invalid model config: {violations[0].description}", violations) from None
        if model.steps:
            # Loaded as a model it had no loader: UNAVAILABLE MODEL_LOAD_FAILED "ValueError: Empty
            # module name", retriable, and the failure announced as the version's for good.
            raise InvalidArgument(
                "a pipeline cannot be loaded while the batcher runs: declare it in the batcher's file and restart",
                [FieldViolation("config.steps", "pipelines are fixed when the batcher starts")],
                reason="PIPELINE_FIXED",
            )
        return list(model.version_configs())

    async def load_model(self, name: str, override: dict[str, Any] | None = None) -> None:
        """Loads the model's versions (see versions_to_load); Unavailable when one did not load."""
        if not NAME_PATTERN.match(name):
            raise InvalidArgument(f"invalid model name {name[:64]!r}", [FieldViolation("model_name", NAME_RULE)])
        failed = await self.apply(name, self.versions_to_load(name, override))
        if failed:
            detail = "; ".join(f"version {v}: {r}" for v, r in failed.items())
            raise Unavailable(f"model {name!r} did not load: {detail}", reason="MODEL_LOAD_FAILED")

    async def unload_model(self, name: str, version: str = "") -> None:
        """Unloads the model (or one version of it); NotFound when it is not loaded here."""
        served = self._engine.versions(name)
        failed = {v for n, v in self.failures if n == name}
        if not (served or failed) or (version and version not in served and version not in failed):
            # Capped as other messages cap what a caller typed (a name or version is at most 64).
            which = f"model {name[:64]!r}" + (f" version {version[:64]!r}" if version else "")
            raise NotFound(f"{which} is not loaded here", reason="MODEL_NOT_FOUND")
        keep = [self._engine.model_config(name, v) for v in served if version and v != version]
        # A version that failed to load is unloaded too, as Triton unloads an unavailable model: its
        # failure was kept and announced (jobs pinned to it waiting MODEL_LOAD_FAILED, RepositoryIndex
        # UNAVAILABLE) while this answered NOT_FOUND "not loaded here".
        forgotten = {(name, v) for v in failed if not version or v == version}
        await self.apply(name, keep)
        if forgotten:
            async with self._lock:
                for key in forgotten:
                    self.failures.pop(key, None)
                self._changed()

    async def load(self, config: ModelConfig) -> ModelBackend | None:
        """The version's backend, loaded, started and warmed up; None (and the reason in
        `failures`) when it cannot serve."""
        key = (config.name, config.version)
        backend: ModelBackend | None = None
        started = time.monotonic()
        log.info("model_loading", model=config.name, version=config.version, backend=config.backend)
        try:
            backend = await self._load_saying_so(config, started)
            await backend.start()
            if config.warm_up:
                await warm_up(config, backend)
        except Exception as exc:
            reason = _reason(exc)
            log.error("model_load_failed", model=config.name, version=config.version, reason=reason)
            self.failures[key] = reason
            if backend is not None:
                await backend.aclose()
            return None
        self.failures.pop(key, None)
        log.info(
            "model_loaded",
            model=config.name,
            version=config.version,
            backend=config.backend,
            load_s=round(time.monotonic() - started, 2),
        )
        return backend

    async def _load_saying_so(self, config: ModelConfig, started: float) -> ModelBackend:
        """load_backend in a thread, with a line every STILL_LOADING_EVERY_S while it runs: a
        loader that takes minutes (or never returns) left `up` and the batcher silent, and every
        model after it waiting, with nothing that named it."""
        loading = asyncio.ensure_future(asyncio.to_thread(load_backend, config, self._batcher))
        try:
            while True:
                done, _ = await asyncio.wait({loading}, timeout=STILL_LOADING_EVERY_S)
                if done:
                    return loading.result()
                log.info(
                    "model_still_loading",
                    model=config.name,
                    version=config.version,
                    waited_s=round(time.monotonic() - started),
                )
        finally:
            loading.cancel()  # a thread cannot be stopped; nothing waits for it any more

    async def load_at_start(self, models: Iterable[ModelConfig]) -> None:
        """Loads every declared version before the engine starts (nothing is announced yet)."""
        for model in models:
            if model.steps:
                continue  # a pipeline: its step models are loaded, the app adds it (engine.add_pipeline)
            for config in model.version_configs():
                backend = await self.load(config)
                if backend is not None:
                    self._backends[(config.name, config.version)] = backend
                    self._engine.add_model(config, backend)

    def _refuse_unserving_a_pipeline(self, model_name: str, versions: Sequence[ModelConfig]) -> None:
        """Pipelines are fixed at start-up (a reload leaves them too): a pipeline cannot be loaded
        or unloaded, nor its step model unloaded. The pipeline was still announced once its step
        model had gone, and each of its jobs failed MODEL_ERROR "model 'm' is not served here",
        attempt after attempt, where an unloaded model's jobs wait."""
        if self._engine.pipeline(model_name) is not None or any(c.steps for c in versions):
            raise FailedPrecondition(
                f"model {model_name!r} is a pipeline: pipelines are fixed when the batcher starts",
                reason="PIPELINE_FIXED",
                metadata={"model": model_name},
            )
        using = self._engine.pipelines_using(model_name)
        if using and not versions:
            raise FailedPrecondition(
                f"model {model_name!r} runs steps of the pipelines {using} served here: it cannot be unloaded "
                "(pipelines are fixed when the batcher starts); load the versions it should serve instead",
                reason="MODEL_IN_PIPELINE",
                metadata={"model": model_name, "pipelines": ",".join(using)},
            )

    def _refuse_a_step_model_that_no_longer_fits(self, model_name: str, versions: Sequence[ModelConfig]) -> None:
        """A pipeline's steps run on their model's default version: the one `versions` would make
        the default must still fit each pipeline using the model (its neighbours' tensors), as the
        configuration's check at start-up (asyncinfer.pipelines) required of the model's table. A
        version whose inputs or outputs changed was loaded, and every job of the pipeline then
        failed at that step (FAILED_PRECONDITION PIPELINE_STEP_MISMATCH)."""
        using = self._engine.pipelines_using(model_name)
        if not using or not versions:
            return
        default = default_version_config(versions)
        for pipeline_name in using:
            runner = self._engine.pipeline(pipeline_name)
            assert runner is not None
            steps = {step.model for step in runner.config.steps if step.model}
            models = {name: default if name == model_name else self._engine.model_config(name) for name in steps}
            try:
                check_pipeline(runner.config, models)
            except PipelineMismatch as mismatch:
                raise FailedPrecondition(
                    f"model {model_name!r} version {default.version!r} does not fit pipeline {pipeline_name!r}, "
                    f"whose steps run on its default version: {mismatch}",
                    reason=STEP_MISMATCH,
                    metadata={
                        "model": model_name,
                        "version": default.version,
                        "pipeline": pipeline_name,
                        "tensor": mismatch.tensor,
                    },
                ) from None

    async def apply(self, model_name: str, versions: Sequence[ModelConfig]) -> dict[str, str]:
        """Makes the model's versions exactly `versions` (empty: unloads the model); refused
        (FailedPrecondition) for a pipeline, for a pipeline's step model left with none, or for one
        whose default version would no longer fit a pipeline's wiring. Returns the versions this
        call failed to load, with why, read under the lock: `failures` read after it may already
        hold another call's (two loads at once reported each other's failures)."""
        self._refuse_unserving_a_pipeline(model_name, versions)
        async with self._lock:
            # Under the lock: it reads the other step models' versions, which a load beside it changes.
            self._refuse_a_step_model_that_no_longer_fits(model_name, versions)
            wanted = {c.version: c for c in versions}
            changes = [
                c
                for c in versions
                if c.version not in self._engine.versions(model_name)
                or self._engine.model_config(model_name, c.version) != c
                or (model_name, c.version) in self.failures
            ]
            for config in changes:
                self.loading[(model_name, config.version)] = config
            if changes:
                self._changed()
            await asyncio.gather(*(self._load_one(c) for c in changes))
            failed = {
                c.version: self.failures[key] for c in changes if (key := (model_name, c.version)) in self.failures
            }
            if failed:
                # Like Triton, a load that fails leaves what served serving: nothing is unloaded.
                return failed
            for version in self._engine.versions(model_name):
                if version not in wanted:
                    await self._unload_one(model_name, version)
            for key in [k for k in self.failures if k[0] == model_name and k[1] not in wanted]:
                del self.failures[key]
            return {}

    async def _load_one(self, config: ModelConfig) -> None:
        key = (config.name, config.version)
        try:
            backend = await self.load(config)
        finally:
            self.loading.pop(key, None)
        if backend is None:
            self._changed()
            return
        if not self._engine.takes_models:
            # Loaded after the batcher began to stop (a KServe load in its grace, a model control
            # the work stream still carried): reported failed, its backend closed, nothing served.
            # It reached add_model on a stopped engine, which left the version registered with no
            # batch former and its thread pool never shut down, and the call failed with the
            # supervisor's RuntimeError.
            reason = "the batcher is stopping"
            log.warning("model_load_abandoned", model=config.name, version=config.version, reason=reason)
            self.failures[key] = reason
            await backend.aclose()
            self._changed()
            return
        if config.version in self._engine.versions(config.name):
            old = self._backends.get(key)
            self._backends[key] = backend
            # The new one takes every item from now on; the old one finishes what it holds.
            queue = self._engine.withdraw(config.name, config.version)
            self._engine.add_model(config, backend)
            self._changed()
            log.info("model_version_replaced", model=config.name, version=config.version)
            self._drain_in_background(queue, old)
            return
        self._backends[key] = backend
        self._engine.add_model(config, backend)
        self._changed()

    async def _unload_one(self, model_name: str, version: str) -> None:
        backend = self._backends.pop((model_name, version), None)
        # Withdrawn first and announced, so that the scheduler sends it nothing more while what
        # it holds finishes.
        queue = self._engine.withdraw(model_name, version)
        self._changed()
        log.info("model_unloading", model=model_name, version=version)
        self._drain_in_background(queue, backend)

    def _drain_in_background(self, queue: ModelQueue, backend: ModelBackend | None) -> None:
        """What a withdrawn version holds finishes on it, then its backend is closed: a task this
        object owns (`drained` waits for them, `close` ends them)."""

        async def drain() -> None:
            try:
                await self._engine.finish_retiring(queue, linger_s=self._linger_s, grace_s=self._batcher.retire_grace_s)
                log.info("model_unloaded", model=queue.name, version=queue.config.version)
            finally:  # also when the batcher stops first
                if backend is not None:
                    await backend.aclose()

        task = asyncio.create_task(drain(), name=f"drain-{queue.name}-{queue.config.version}")
        task.add_done_callback(failure_logged)
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    async def drained(self) -> None:
        """Returns once every withdrawn version has finished what it held and is closed."""
        while self._draining:
            await asyncio.gather(*self._draining, return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._draining):
            task.cancel()
        await asyncio.gather(*self._draining, return_exceptions=True)
        for backend in self._backends.values():
            await backend.aclose()
        self._backends.clear()
