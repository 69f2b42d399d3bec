"""The batcher's translations between work-stream messages and its engine: a WorkOrder into an
engine submit, the engine's models into the hello, an error into the ErrorStatus a WorkResult
carries. Plain functions, so a session calls them once per order with no extra layer between."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import structlog

from asyncinfer.blob_files import ObjectsDirectoryNotSet
from asyncinfer.config import ModelConfig
from asyncinfer.error_bounds import bounded_metadata
from asyncinfer.errors import (
    AsyncInferError,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from asyncinfer.jobs import Priority
from asyncinfer.model_json import parse_model_json
from asyncinfer.tensor_codec import decode_tensors
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import error_pb2, job_pb2, job_service_pb2, worker_service_pb2
from services.batcher.backends import UNREACHABLE_REASON
from services.batcher.batch_compute import MODEL_STUCK_REASON, RunTimedOut
from services.batcher.chunk_items import ChunkItem
from services.batcher.engine import (
    SHUTDOWN_REASON,
    VERSION_NOT_SERVED_REASON,
    VERSION_RETIRED_REASON,
    BatchingEngine,
    PendingItem,
)
from services.batcher.model_control import ModelControl
from services.batcher.progress import ItemProgress

log = structlog.get_logger("asyncinfer.batcher.work_messages")

# Failures that the same order would meet again on any attempt (not ObjectsDirectoryNotSet, a
# FailedPrecondition of this batcher's configuration: a batcher with the directory reads the input).
# A run timed out is not retried by a batcher's say: its scheduler applies the model's timeout_action.
_NOT_RETRIABLE = (InvalidArgument, NotFound, FailedPrecondition, DeadlineExceeded, Cancelled, RunTimedOut)

ORDER_PRIORITIES = {
    job_pb2.PRIORITY_HIGH: Priority.HIGH,
    job_pb2.PRIORITY_NORMAL: Priority.NORMAL,
    job_pb2.PRIORITY_LOW: Priority.LOW,
}


def error_status(error: AsyncInferError) -> error_pb2.ErrorStatus:
    violations = error.violations if isinstance(error, InvalidArgument) else ()
    return error_pb2.ErrorStatus(
        code=error.code.value[0],
        reason=error.reason,
        message=error.message,
        field_violations=[error_pb2.FieldViolation(field=v.field, description=v.description) for v in violations],
        retriable=not isinstance(error, _NOT_RETRIABLE) or isinstance(error, ObjectsDirectoryNotSet),
        metadata=bounded_metadata(error.metadata),
    )


def is_shutdown(error: AsyncInferError) -> bool:
    """The engine refused or dropped the item before it ran because it is stopping, or because its
    model is stuck (every batch past its timeouts), or abandoned it because its version was retired
    (replaced or unloaded) and still held it, waiting or computing with no deadline of its own,
    when batcher.retire_grace_s ended: not the job's fault, so its attempt is given back."""
    return isinstance(error, Unavailable) and error.reason in (
        SHUTDOWN_REASON,
        MODEL_STUCK_REASON,
        VERSION_RETIRED_REASON,
    )


def is_out_of_reach(error: AsyncInferError) -> bool:
    """The model's remote server (Triton) could not be reached: the item was handed back unrun
    while it waited, or its batch outlasted the outage wait. Not the job's fault: answered dropped,
    its attempt given back; the batcher takes no work for the model until the server answers, so
    the job waits queued (or runs on another batcher). It was a failed attempt, retried with
    backoff: a Triton down for two minutes dead-lettered jobs of 3 attempts."""
    return isinstance(error, Unavailable) and error.reason == UNREACHABLE_REASON


def is_handed_back(error: AsyncInferError) -> bool:
    """A refusal of an order at submit that is not the job's: the engine stops or the model is
    stuck (is_shutdown), or the order names a model or version this batcher does not serve now.
    The scheduler routes by what batchers announce, so the order left before it heard this one's
    change (an unload more than its 1-s linger earlier, a load not finished). Answered dropped:
    back to the queue with its attempt given back, routed to a batcher that serves it, or waiting
    for one. It was a failed attempt: a rollout that unloaded v1 could spend a job's attempts."""
    if is_shutdown(error) or is_out_of_reach(error):
        return True
    if isinstance(error, Unavailable):
        return error.reason == VERSION_NOT_SERVED_REASON
    return isinstance(error, NotFound) and error.reason == "MODEL_NOT_FOUND"


def served_models(engine: BatchingEngine, loading: Iterable[ModelConfig] = ()) -> list[worker_service_pb2.ServedModel]:
    """Every version the engine serves (READY; LOADING while its Triton is out of reach, or a
    pipeline's while a step's is: the scheduler then sends it no orders here, and drops the
    model's credits once none of its versions is READY, so that a job handed back is not sent
    straight back to be refused again), then those `loading` (LOADING: no work yet)."""

    def served(
        config: ModelConfig, state: job_service_pb2.ModelVersionState.ValueType
    ) -> worker_service_pb2.ServedModel:
        signature = config.signature
        return worker_service_pb2.ServedModel(
            model_name=config.name,
            model_version=config.version,
            max_batch_size=config.max_batch_size,
            inputs=[
                job_service_pb2.TensorSpec(name=t.name, datatype=t.datatype, shape=t.shape) for t in signature.inputs
            ],
            outputs=[
                job_service_pb2.TensorSpec(name=t.name, datatype=t.datatype, shape=t.shape) for t in signature.outputs
            ],
            state=state,
        )

    out_of_reach, unreachable = engine.out_of_reach(), engine.unreachable_versions()
    models = [
        served(
            engine.model_config(name, version),
            job_service_pb2.MODEL_VERSION_STATE_LOADING
            if name in out_of_reach or (name, version) in unreachable
            else job_service_pb2.MODEL_VERSION_STATE_READY,
        )
        for name in engine.model_names
        for version in engine.versions(name)
    ]
    models += [served(config, job_service_pb2.MODEL_VERSION_STATE_LOADING) for config in loading]
    return models


def load_failures(models: ModelControl | None) -> list[worker_service_pb2.ModelLoadFailure]:
    """The versions that failed to load or warm up here, with why (ListModels shows them)."""
    if models is None:
        return []
    return [
        worker_service_pb2.ModelLoadFailure(model_name=name, model_version=version, reason=reason[:1024])
        for (name, version), reason in sorted(models.failures.items())
    ]


def worker_hello(
    engine: BatchingEngine,
    batcher_id: str,
    *,
    takes_batches: bool,
    loading: Iterable[ModelConfig] = (),
    reads_claim_checks: bool = False,
    models: ModelControl | None = None,
) -> worker_service_pb2.WorkerHello:
    return worker_service_pb2.WorkerHello(
        batcher_id=batcher_id,
        models=served_models(engine, loading),
        takes_batches=takes_batches,
        reads_claim_checks=reads_claim_checks,
        load_failures=load_failures(models),
        times_out_runs=True,  # services.batcher.model_queue: from each batch's start
    )


def submit_order(
    engine: BatchingEngine,
    order: worker_service_pb2.WorkOrder,
    progress: ItemProgress | None = None,
    read_inputs: Sequence[Tensor] | None = None,
) -> PendingItem | ChunkItem:
    """The order's item in the engine (its progress reported to `progress`); `read_inputs`: its
    inputs as read from the claim-check store (services.batcher.claim_checks). Raises (NotFound,
    FailedPrecondition, the engine's own refusals) when it cannot run here."""
    if not engine.has_model(order.model_name) and not engine.has_model(order.model_name, order.model_version):
        raise NotFound(f"model {order.model_name!r} is not served here", reason="MODEL_NOT_FOUND")
    if order.input_ref and read_inputs is None:
        raise FailedPrecondition(
            "this batcher does not read claim-checked inputs (input_ref): batcher.claim_check_io is off",
            reason="INPUT_REF_UNSUPPORTED",
        )
    inputs = decode_tensors(order.inputs) if read_inputs is None else list(read_inputs)
    timeout_s = order.deadline.ToNanoseconds() / 1e9 - time.time() if order.HasField("deadline") else None
    max_rows = engine.model_config(order.model_name, order.model_version).max_batch_size
    run_timeout_s = order.execution_timeout.ToNanoseconds() / 1e9 if order.HasField("execution_timeout") else None
    if inputs and max_rows > 0 and inputs[0].batch_size > max_rows:
        # A batch's chunk (docs/BATCHES.md): the gateway checked each of its records.
        return engine.submit_chunk(
            order.model_name,
            inputs,
            timeout_s=timeout_s,
            priority=ORDER_PRIORITIES.get(order.priority, Priority.LOW),
            version=order.model_version,
            run_timeout_s=run_timeout_s,
        )
    return engine.submit(
        order.model_name,
        inputs,
        timeout_s=timeout_s,
        priority=ORDER_PRIORITIES.get(order.priority, Priority.NORMAL),
        progress=progress,
        version=order.model_version,
        credited=True,  # sent on a credit this batcher granted: its slot was promised
        run_timeout_s=run_timeout_s,
        run_alone=order.run_alone,
    )


async def run_control(
    models: ModelControl | None, control: worker_service_pb2.ModelControl
) -> worker_service_pb2.ConnectRequest:
    """Carries out a scheduler's model control (OpsService.LoadModel / UnloadModel) and answers it."""
    result = worker_service_pb2.ModelControlResult(request_id=control.request_id)
    try:
        if models is None:
            raise FailedPrecondition("this batcher has no model control", reason="MODEL_CONTROL_UNAVAILABLE")
        if control.action == worker_service_pb2.MODEL_CONTROL_ACTION_LOAD:
            override = parse_model_json(control.config_json, "config_json") if control.config_json else None
            await models.load_model(control.model_name, override)
        elif control.action == worker_service_pb2.MODEL_CONTROL_ACTION_UNLOAD:
            await models.unload_model(control.model_name, control.model_version)
        else:
            raise InvalidArgument("unknown model control action", [FieldViolation("action", "LOAD or UNLOAD")])
    except AsyncInferError as error:
        result.error.CopyFrom(error_status(error))
    except Exception as exc:
        # Answered whatever happened: an unanswered control held OpsService.LoadModel for its
        # whole timeout (120 s), then said CONTROL_TIMED_OUT.
        log.exception("model_control_failed", model=control.model_name)
        result.error.CopyFrom(error_status(AsyncInferError(f"the model control failed: {type(exc).__name__}: {exc}")))
    return worker_service_pb2.ConnectRequest(control_result=result)
