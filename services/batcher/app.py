"""The batcher service: loads the configured models, runs the batching engine, serves the KServe
v2 API, and takes work from the scheduler when one is configured."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2_grpc

from asyncinfer.access import AccessGuard, KeyRing, require_keys_beyond_loopback
from asyncinfer.cert_expiry import CertificateExpiry, watch_certificates
from asyncinfer.config import Config, ModelConfig, load_config
from asyncinfer.errors import AsyncInferError, ConfigError, FailedPrecondition
from asyncinfer.grpc_keepalive import Keepalive
from asyncinfer.grpc_server import GrpcServer
from asyncinfer.metrics import MetricsServer
from asyncinfer.runner import EXIT_MODEL_HUNG
from asyncinfer.supervision import Supervisor, failure_logged
from asyncinfer.tls import serving_certificates
from asyncinfer.tracing import Tracing
from asyncinfer.worker_stream import WORK_MESSAGE_HEADROOM_BYTES, work_message_bytes
from services.batcher.backends.loading import cuda_present, torch_threads_for
from services.batcher.batch_timeouts import HungBatch, HungWatch
from services.batcher.claim_checks import ClaimChecks
from services.batcher.engine import BatchingEngine
from services.batcher.kserve import SERVICE_NAME, KServeServicer
from services.batcher.metrics import BatcherMetrics
from services.batcher.model_control import ModelControl
from services.batcher.work_session import UPDATES_MESSAGE_BYTES
from services.batcher.worker_client import WorkerClient, WorkerSecurity

log = structlog.get_logger("asyncinfer.batcher")

# How long the last answers may take to leave once the grace is spent (the abandoned orders').
ANSWERS_AFTER_GRACE_S = 1.0

# KServe's liveness and readiness probes stay open, like grpc health; every other method (ModelInfer
# above all: it runs outside every quota) takes a key of role ops once API keys are configured.
OPEN_METHODS = (f"/{SERVICE_NAME}/ServerLive", f"/{SERVICE_NAME}/ServerReady")

# What anyone who reached a batcher with no key could do (require_keys_beyond_loopback).
BATCHER_EXPOSES = "run its models, and load new ones (a loader names any code the batcher will run)"


def model_health_name(model: str, version: str = "") -> str:
    """The gRPC health service name of a model (its default version: "") or of one version."""
    return f"{model}/{version}" if version else model


class BatcherApp:
    def __init__(
        self, config: Config, *, config_path: Path | None = None, cuda_available: Callable[[], bool] = cuda_present
    ) -> None:
        """`config_path`: the file `reload` reads again (on SIGHUP, when given). `cuda_available`:
        whether this machine has a CUDA device (for the torch threads; tests pass their own)."""
        self.config = config
        self.config_path = config_path
        self.batcher_id = config.batcher.batcher_id or f"{socket.gethostname()}-{os.getpid()}"
        self.registry = CollectorRegistry()
        self.metrics = BatcherMetrics(self.registry)
        self.supervisor = Supervisor("batcher")
        self.certificates: CertificateExpiry | None = None  # its TLS certificates' expiry, once started
        self.tracing = Tracing.start(config.tracing, service="batcher")
        exit_after_s = config.batcher.exit_after_overrun_s
        hung = HungWatch(after_s=exit_after_s, on_hung=self._model_hung) if exit_after_s > 0 else None
        self.engine = BatchingEngine(metrics=self.metrics, supervisor=self.supervisor, tracing=self.tracing, hung=hung)
        self.port = 0
        self.metrics_port = 0
        self._cuda_available = cuda_available
        self.models = ModelControl(self.engine, config.batcher, repository=self._repository)
        # Model name -> why it failed to load; those models answer UNAVAILABLE with the reason.
        self.load_failures: dict[str, str] = {}
        self._reloads: set[asyncio.Task[None]] = set()
        self._health_updates: set[asyncio.Task[None]] = set()
        # The (model, version) the ready gauge has a series of, and those given a health status
        # (the same, once the server serves: a name goes with its series).
        self._ready_series: set[tuple[str, str]] = set()
        self._health_names: set[tuple[str, str]] = set()
        self._sighup = False
        self._server: GrpcServer | None = None
        self._metrics_server: MetricsServer | None = None
        self._worker: WorkerClient | None = None
        self._claim_checks: ClaimChecks | None = None
        self._started = False
        self._stopped = False

    async def start(self) -> None:
        """Loads every model, then serves. A model that fails to load does not stop the others:
        health turns NOT_SERVING, ServerReady false, and that model answers UNAVAILABLE with the
        reason. Any other failure undoes what was started and re-raises."""
        if self._started:
            return
        self._started = True
        try:
            await self._start()
        except BaseException:
            await self.stop(grace_s=0)
            raise

    async def _start(self) -> None:
        batcher = self.config.batcher
        require_keys_beyond_loopback(
            "batcher", batcher.host, self.config.gateway.api_keys, BATCHER_EXPOSES, tls=bool(batcher.tls_cert_file)
        )
        # TLS files and the work stream's key are read before any model loads: a bad path fails at once.
        tls = serving_certificates("batcher", batcher)
        worker_security = WorkerSecurity.from_config(batcher) if batcher.scheduler_address else None
        self.certificates = watch_certificates(
            self.config,
            "batcher",
            self.registry,
            self.supervisor,
            follow=(tls, worker_security.tls if worker_security else None),
        )
        # In a thread: whether CUDA is there imports torch and asks the driver (1.4 s on this
        # machine without a GPU, 1.7-3.5 s measured on GPU hosts), and in `up` the gateway and the
        # scheduler already serve on this loop. Decided before any model loads, which uses it.
        cores = len(os.sched_getaffinity(0))
        threads = await asyncio.to_thread(
            torch_threads_for, batcher, self.config.models, cores, cuda_available=self._cuda_available
        )
        self.models.use_torch_threads(threads)
        await self.models.load_at_start(self.config.models)
        for model in self.config.models:
            if model.steps:
                continue
            reasons = [r for (name, _v), r in self.models.failures.items() if name == model.name]
            if reasons:
                self.load_failures[model.name] = reasons[0]
        for model in self.config.models:
            if model.steps:
                self._add_pipeline(model)
        self._readiness_changed()
        await self.engine.start()

        servicer = KServeServicer(self.engine, self.load_failures, self.models, self._repository)
        self._server = GrpcServer(
            host=batcher.host,
            port=batcher.port,
            add_servicers=lambda server: service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server),
            service_names=[SERVICE_NAME],
            rpc_metrics=self.metrics.rpc,
            credentials=tls.credentials if tls else None,
            guard=AccessGuard(KeyRing(self.config.gateway.api_keys), {SERVICE_NAME: "ops"}, OPEN_METHODS),
            keepalive=Keepalive(batcher.keepalive_s),
        )
        await self._server.start()
        self.port = self._server.port
        if self.load_failures:
            # Like Triton's strict readiness: not ready while a configured model is missing, but
            # the models that loaded keep serving.
            await self._server.set_serving(False)
        await self._set_models_health(self._readiness())
        self.engine.add_reachable_listener(self._reachable_changed)

        self._metrics_server = MetricsServer(self.registry, batcher.host, batcher.metrics_port)
        await asyncio.to_thread(self._metrics_server.start)
        self.metrics_port = self._metrics_server.port

        if batcher.scheduler_address and worker_security is not None:
            if batcher.claim_check_io:
                self._claim_checks = await ClaimChecks.connect(self.config, self.batcher_id)
                self.certificates.follow(self._claim_checks.certificates)
            self._worker = WorkerClient(
                address=batcher.scheduler_address,
                batcher_id=self.batcher_id,
                engine=self.engine,
                reconnect_delay_s=batcher.reconnect_delay_s,
                keepalive=Keepalive(batcher.keepalive_s),
                work_batches=batcher.work_batches,
                supervisor=self.supervisor,
                security=worker_security,
                progress_interval_s=batcher.progress_interval_ms / 1000,
                progress_max_bytes=batcher.progress_max_bytes,
                models=self.models,
                claim_checks=self._claim_checks,
                max_result_bytes=work_message_bytes(self.config) - UPDATES_MESSAGE_BYTES - WORK_MESSAGE_HEADROOM_BYTES,
            )
            await self._worker.start()
        self.models.on_change(self._models_changed)
        if self.config_path is not None and threading.current_thread() is threading.main_thread():
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_sighup)
            self._sighup = True
        log.info(
            "batcher_started",
            batcher_id=self.batcher_id,
            port=self.port,
            metrics_port=self.metrics_port,
            models=self.engine.model_names,
            scheduler=batcher.scheduler_address or None,
            failed_models=self.load_failures or None,
        )

    def _reachable_changed(self) -> None:
        """A model's Triton went out of reach or answers again: while one is out of reach, the
        server's health is NOT_SERVING (as for a model that failed to load, Triton's strict
        readiness), and that version's ready gauge and health say so; its other versions, and the
        model's own series and health while its default version serves, stay ready (they take work)."""
        self._readiness_changed()
        if self._stopped:
            return
        if self._worker is not None:
            self._worker.reachable_changed()  # the scheduler drops the version's credits here

    def _models_changed(self, loading: Sequence[ModelConfig]) -> None:
        """Versions loaded or unloaded (a reload, KServe's repository API, the scheduler's model
        controls): their readiness, then the announce to the scheduler."""
        self._readiness_changed()
        if self._worker is not None:
            self._worker.models_changed(loading)

    def _readiness(self) -> dict[tuple[str, str], bool]:
        """(model, version) -> whether it serves here now (engine.version_ready): each version
        loaded or failed to load, and with version "" the model as a request naming no version
        finds it (its default version). Per version, as Triton and KServe's ModelReady answer: one
        version's outage (its Triton out of reach) leaves the others, and the model, ready."""
        ready: dict[tuple[str, str], bool] = {}
        for name, version in self.models.failures:
            ready[(name, version)] = ready[(name, "")] = False
        for model in self.config.models:  # a pipeline whose steps are not served here
            if model.steps and model.name in self.load_failures:
                ready[(model.name, model.version)] = ready[(model.name, "")] = False
        for name in self.engine.model_names:
            for version in self.engine.versions(name):
                ready[(name, version)] = self.engine.version_ready(name, version)
            ready[(name, "")] = self.engine.version_ready(name)
        return ready

    def _readiness_changed(self) -> None:
        """The ready gauge now (a version no longer loaded loses its series), and the models'
        health (service `<model>`, and `<model>/<version>` per version) once the server serves."""
        ready = self._readiness()
        for model, version in self._ready_series - ready.keys():
            self.metrics.forget_model_ready(model, version)
        for (model, version), serves in ready.items():
            self.metrics.set_model_ready(model, version, serves)
        self._ready_series = set(ready)
        if self._stopped or self._server is None:
            return
        server = self._server

        async def update() -> None:
            # Read when it runs, and it runs to its end without suspending (the health servicer's
            # set and clear never wait: asyncinfer.health_service), so the updates end in the order
            # of their changes and the last one's health stands; no lock is needed. Should an
            # update ever suspend, the earlier one could finish last with a stale readiness
            # (test_batcher_kserve's test of a health update that does not suspend).
            await server.set_serving(not self.load_failures and not self.engine.unreachable_models())
            await self._set_models_health(self._readiness())

        task = asyncio.create_task(update(), name="batcher-health")
        self._health_updates.add(task)  # awaited by stop
        task.add_done_callback(self._health_updates.discard)
        task.add_done_callback(failure_logged)

    async def _set_models_health(self, ready: dict[tuple[str, str], bool]) -> None:
        """gRPC health per model (`<model>`: its default version) and version (`<model>/<version>`;
        model names and versions hold no "/" and no ".", so they meet no service's name), one name
        per ready gauge series. A version no longer loaded nor failed (unloaded, or dropped from the
        file), and a model with none left, loses its name as it loses its series: it answers as a
        name never served here (Check NOT_FOUND, Watch SERVICE_UNKNOWN). It stayed NOT_SERVING for
        good, so the names of every version ever served piled up."""
        if self._server is None:
            return
        for model, version in self._health_names - ready.keys():
            await self._server.forget_serving_of(model_health_name(model, version))
        for (model, version), serves in ready.items():
            await self._server.set_serving_of(model_health_name(model, version), serves)
        self._health_names = set(ready)

    def _model_hung(self, batch: HungBatch) -> None:
        """A model call that does not return: no thread can be stopped, so the process stops (as
        Celery's hard time limit ends its worker) and its supervisor starts a fresh one. Its other
        models' batches get the grace; what waits goes back to the queue; the hung batch's jobs were
        answered TIMED_OUT at their timeout."""
        log.error(
            "batcher_exiting_model_hung",
            model=batch.model,
            items=batch.items,
            running_s=batch.running_s,
            past_timeout_s=batch.past_timeout_s,
            exit_code=EXIT_MODEL_HUNG,
            stack=batch.stack,
            hint="its model call has not returned past batcher.exit_after_overrun_s; the batcher stops and exits "
            f"{EXIT_MODEL_HUNG} for its supervisor to start it afresh",
        )
        self.supervisor.request_stop(
            f"model {batch.model!r}: a batch computing {batch.past_timeout_s:g} s past its jobs' execution timeouts",
            EXIT_MODEL_HUNG,
        )

    def _add_pipeline(self, model: ModelConfig) -> None:
        """A pipeline serves when every model of its steps loaded here; else it is a load failure
        that names them. A function step that cannot be imported is one too."""
        missing = [step.model for step in model.steps if step.model and not self.engine.has_model(step.model)]
        try:
            if missing:
                raise ConfigError(f"pipeline {model.name!r}: its step models {missing} are not served here")
            self.engine.add_pipeline(model)
        except ConfigError as exc:
            log.error("model_load_failed", model=model.name, reason=exc.message)
            self.load_failures[model.name] = exc.message
            return
        log.info("pipeline_added", model=model.name, steps=[step.label for step in model.steps])

    def _repository(self) -> tuple[ModelConfig, ...]:
        """The models the configuration file declares now (re-read: the file is the model
        repository, as Triton's is its folder). A file made invalid since is the caller's to fix,
        not an internal error: FAILED_PRECONDITION, saying that what serves goes on serving."""
        if self.config_path is None:
            return self.config.models
        try:
            return load_config(self.config_path).models
        except ConfigError as exc:
            raise FailedPrecondition(
                f"the batcher's file {str(self.config_path)!r} (its model repository) is invalid now; "
                f"what was loaded goes on serving: {exc.message}",
                reason="MODEL_REPOSITORY_INVALID",
            ) from None

    async def reload(self) -> None:
        """Reads the configuration file again and makes the models served what it declares:
        new versions loaded (and warmed up) before they take work, changed ones replaced, those
        no longer declared unloaded once what they hold has finished (model_control.py).
        Pipelines are fixed at start-up: a reload leaves them (and their step models) as they are."""
        if self.config_path is None:
            return
        try:
            config = load_config(self.config_path)
        except AsyncInferError as exc:
            log.error("reload_failed", reason=exc.message, path=str(self.config_path))
            return
        declared = {model.name: list(model.version_configs()) for model in config.models if not model.steps}
        fixed = {step.model for model in self.config.models for step in model.steps} | {
            model.name for model in self.config.models if model.steps
        }
        # With the models that failed to load: one the file no longer declares is forgotten.
        failed = [name for name, _version in self.models.failures]
        names = [n for n in dict.fromkeys([*declared, *self.engine.model_names, *failed]) if n not in fixed]
        log.info("reload_started", path=str(self.config_path), models=names)
        for name in names:
            await self.models.apply(name, declared.get(name, []))
        # A pipeline's failure is its own (fixed at start, as the pipeline is), never the model set's.
        pipelines = {model.name for model in self.config.models if model.steps}
        kept = {name: reason for name, reason in self.load_failures.items() if name in pipelines}
        self.load_failures.clear()
        self.load_failures.update(kept)
        for (name, _version), reason in self.models.failures.items():
            self.load_failures.setdefault(name, reason)
        # Read again now that the failures are: a version the file dropped after it failed to load
        # is forgotten without a change to what is served (no _models_changed), and the health
        # updates the reload's changes started read the failures from before it.
        self._readiness_changed()
        log.info("reload_done", models={n: self.engine.versions(n) for n in self.engine.model_names})

    def _on_sighup(self) -> None:
        if self._stopped:
            return
        task = asyncio.create_task(self.reload(), name="batcher-reload")
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)
        task.add_done_callback(failure_logged)

    async def scheduler_connected(self, timeout_s: float) -> bool:
        """Waits up to timeout_s for the work stream's first welcome from the scheduler; whether it
        came (True at once without a scheduler_address: there is nothing to wait for)."""
        if self._worker is None:
            return True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._worker.connected.wait()
        return self._worker.connected.is_set()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stops offering credits, stops the server (running calls get the grace period),
        finishes in-flight batches within the grace period and fails the rest, sends the
        scheduler the answers it is owed and closes the work stream, then releases the models.
        The grace is the caller's or `batcher.shutdown_grace_s`, whichever is shorter (the
        process runner gives every service the same bound). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        grace_s = min(grace_s, self.config.batcher.shutdown_grace_s)
        if self._sighup:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        for task in list(self._reloads):
            task.cancel()
        await asyncio.gather(*self._reloads, *self._health_updates, return_exceptions=True)
        self.supervisor.begin_stop()
        deadline = asyncio.get_running_loop().time() + grace_s
        if self._worker is not None:
            self._worker.stop_granting()
        if self._server is not None:
            # The engine is stopped concurrently so queued calls fail fast instead of using the
            # whole grace period.
            await asyncio.gather(self._server.stop(grace_s), self.engine.stop(grace_s))
        else:
            await self.engine.stop(grace_s)
        if self._worker is not None:
            # Every item has resolved by now; send the answers and close the stream. A moment
            # even when the grace is spent: the orders abandoned at its end are answered too.
            left_s = deadline - asyncio.get_running_loop().time()
            await self._worker.stop(max(left_s, ANSWERS_AFTER_GRACE_S))
        await self.supervisor.stop()  # the loops not ended above (none, unless one hangs)
        if self._claim_checks is not None:  # after the work stream: its last results stored their outputs
            await self._claim_checks.close()
        if self._metrics_server is not None:
            await asyncio.to_thread(self._metrics_server.stop)
        await asyncio.to_thread(self.tracing.shutdown)  # flushes the spans not yet exported
        await self.models.close()
        log.info("batcher_stopped", batcher_id=self.batcher_id)
