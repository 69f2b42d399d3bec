"""The SDK's protobuf edge: requests built from `JobRequest`s, `Job`s read from messages."""

from __future__ import annotations

import math
import numbers
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, TypeVar

import grpc
import numpy as np
import numpy.typing as npt
from google.protobuf import duration_pb2, timestamp_pb2

from asyncinfer.client._enums import from_proto, name_from_proto, optional_from_proto, to_proto
from asyncinfer.client.types import (
    BatchInfo,
    BlobRef,
    Callback,
    CallbackDelivery,
    CallbackDeliveryState,
    CallbackEvent,
    Inputs,
    Job,
    JobError,
    JobProgress,
    JobRequest,
    ModelInfo,
    ModelVersion,
    QueuePosition,
    WaitingReason,
)
from asyncinfer.errors import FieldViolation
from asyncinfer.jobs import JobState, Priority
from asyncinfer.tensor_codec import decode_tensor, to_input_proto
from asyncinfer.tensors import Tensor, TensorSpec, booleans_misplaced, specs_summary, untyped_reason
from asyncinfer.v1 import error_pb2, job_pb2, job_service_pb2

C = TypeVar("C")


def named(value: str, choices: Mapping[str, C], what: str) -> C:
    """The choice `value` names, in any case ("high", "HIGH"); ValueError listing them otherwise,
    TypeError for no str (an int raised AttributeError: "'int' object has no attribute 'upper'")."""
    if not isinstance(value, str):
        raise TypeError(
            f"{what} is a name, one of {', '.join(sorted(choices))} (any case), got {a_kind(value)} {value!r}"
        )
    try:
        return choices[value.upper()]
    except KeyError:
        raise ValueError(f"unknown {what} {value!r}; one of {', '.join(sorted(choices))}") from None


def _time(message: Any, name: str) -> datetime | None:
    if not message.HasField(name):
        return None
    stamp: timestamp_pb2.Timestamp = getattr(message, name)
    return datetime.fromtimestamp(stamp.ToNanoseconds() / 1e9, tz=UTC)


def _seconds(message: Any, name: str) -> float | None:
    if not message.HasField(name):
        return None
    duration: duration_pb2.Duration = getattr(message, name)
    return duration.seconds + duration.nanos / 1e9


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration


def tensors_to_arrays(messages: Iterable[Any], field: str) -> dict[str, npt.NDArray[np.generic]]:
    arrays: dict[str, npt.NDArray[np.generic]] = {}
    for index, message in enumerate(messages):
        tensor = decode_tensor(message, f"{field}[{index}]", message.raw_contents or None)
        arrays[tensor.name] = tensor.to_numpy()
    return arrays


def error_from_proto(status: error_pb2.ErrorStatus) -> JobError:
    try:
        code = next(c for c in grpc.StatusCode if c.value[0] == status.code)
    except StopIteration:
        code = grpc.StatusCode.UNKNOWN
    return JobError(
        code=code,
        reason=status.reason,
        message=status.message,
        violations=tuple(FieldViolation(v.field, v.description) for v in status.field_violations),
        retriable=status.retriable,
        retry_after_s=status.retry_after.ToNanoseconds() / 1e9 if status.HasField("retry_after") else None,
    )


def _blob(message: job_pb2.BlobRef) -> BlobRef:
    return BlobRef(ref=message.ref, size_bytes=message.size_bytes, sha256=message.sha256)


def _delivery(message: job_pb2.CallbackDelivery) -> CallbackDelivery:
    return CallbackDelivery(
        webhook_id=message.webhook_id,
        event=optional_from_proto(CallbackEvent, job_pb2.CallbackEvent, message.event, "CALLBACK_EVENT_"),
        state=optional_from_proto(
            CallbackDeliveryState, job_pb2.CallbackDeliveryState, message.state, "CALLBACK_DELIVERY_STATE_"
        ),
        attempts=message.attempts,
        last_attempt_time=_time(message, "last_attempt_time"),
        last_status_code=message.last_status_code,
        last_error=message.last_error,
        next_attempt_time=_time(message, "next_attempt_time"),
    )


def job_from_proto(message: job_pb2.Job, progress: job_service_pb2.JobProgress | None = None) -> Job:
    queue = None
    if message.HasField("queue"):
        queue = QueuePosition(
            position=message.queue.position,
            estimated_start_time=_time(message.queue, "estimated_start_time"),
            waiting_reason=optional_from_proto(
                WaitingReason, job_pb2.WaitingReason, message.queue.waiting_reason, "WAITING_REASON_"
            ),
        )
    batch = None
    if message.HasField("batch"):
        batch = BatchInfo(
            batcher_id=message.batch.batcher_id,
            batch_size=message.batch.batch_size,
            compute_duration_s=_seconds(message.batch, "compute_duration"),
        )
    callback = None
    if message.HasField("callback"):
        events = (
            optional_from_proto(CallbackEvent, job_pb2.CallbackEvent, e, "CALLBACK_EVENT_")
            for e in message.callback.events
        )
        callback = Callback(url=message.callback.url, events=tuple(e for e in events if e is not None))
    job_progress = None
    # `progress` is passed only where the message has it set (HasField): a report of fraction 0,
    # no message and no outputs is all defaults, and is still a report (a model saying it started).
    if progress is not None:
        job_progress = JobProgress(
            fraction=progress.fraction if progress.fraction >= 0 else None,
            message=progress.message,
            partial_outputs=tensors_to_arrays(progress.partial_outputs, "progress.partial_outputs"),
        )
    return Job(
        job_id=message.job_id,
        model_name=message.model_name,
        model_version=message.model_version,
        state=from_proto(JobState, job_pb2.JobState, message.state, "JOB_STATE_"),
        # UNSPECIFIED is the API's default, NORMAL.
        priority=optional_from_proto(Priority, job_pb2.Priority, message.priority, "PRIORITY_") or Priority.NORMAL,
        attempt=message.attempt,
        max_attempts=message.max_attempts,
        revision=message.revision,
        labels=dict(message.labels),
        idempotency_key=message.idempotency_key,
        create_time=_time(message, "create_time"),
        start_time=_time(message, "start_time"),
        end_time=_time(message, "end_time"),
        update_time=_time(message, "update_time"),
        queue_duration_s=_seconds(message, "queue_duration"),
        run_duration_s=_seconds(message, "run_duration"),
        deadline=_time(message, "deadline"),
        execution_timeout_s=_seconds(message, "execution_timeout"),
        result_retention_s=_seconds(message, "result_retention"),
        expire_time=_time(message, "expire_time"),
        queue=queue,
        batch=batch,
        error=error_from_proto(message.error) if message.HasField("error") else None,
        last_error=error_from_proto(message.last_error) if message.HasField("last_error") else None,
        outputs=tensors_to_arrays(message.outputs, "outputs"),
        result_ref=_blob(message.result_ref) if message.HasField("result_ref") else None,
        input_ref=_blob(message.input_ref) if message.HasField("input_ref") else None,
        callback=callback,
        callback_deliveries=tuple(_delivery(d) for d in message.callback_deliveries),
        progress=job_progress,
        batcher_id=message.batcher_id,
        trace_id=message.trace_id,
        trace_sampled=message.trace_sampled if message.HasField("trace_sampled") else True,
        given_back_attempts=message.given_back_attempts,
        dead_letter_sequence=message.dead_letter_sequence,
    )


def _kind(value: object) -> str:
    """`value`'s type as a reader knows it: "numpy.ndarray", "torch.Tensor", "list"."""
    kind = type(value)
    module = kind.__module__.split(".")[0]
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def a_kind(value: object) -> str:
    """`value`'s type with its article: "a str", "an int", "a numpy.ndarray"."""
    kind = _kind(value)
    return f"{'an' if kind[0].lower() in 'aeiou' else 'a'} {kind}"


def model_name_problem(model: object, call: str) -> str | None:
    """Why `model` is no model name, naming `call`'s order of arguments; None for a str. A swapped
    pair reached protobuf, whose TypeError ("bad argument type for built-in operation") named neither."""
    if isinstance(model, str):
        return None
    return f"model is the model's name (a str), got {a_kind(model)}: {call}"


def inputs_form_problem(inputs: object) -> str | None:
    """Why `inputs` is neither a mapping of input names to arrays nor a list of Tensors; None when
    it is one (its values are judged by the model's signature). An array or a list of arrays
    failed deep in the SDK ("'numpy.ndarray' object has no attribute 'name'")."""
    if inputs is None:
        return None
    if isinstance(inputs, Mapping):
        names = [name for name in inputs if not isinstance(name, str)]
        return None if not names else f"inputs maps input names (str) to arrays, got the key {names[0]!r}"
    if isinstance(inputs, list | tuple) and all(isinstance(item, Tensor) for item in inputs):
        return None
    return f"inputs maps each input's name to its array, got {a_kind(inputs)}"


def inputs_example(model: str, specs: Mapping[str, TensorSpec]) -> str:
    """How to give `model`'s inputs: with its signature where the gateway listed it ({} otherwise)."""
    if not specs:
        return "give {name: array} (client.models() lists each model's inputs)"
    mapping = ", ".join(f"{name!r}: array" for name in specs)
    return f"give {{{mapping}}} (model {model!r} takes {specs_summary(specs.values())})"


def check_seconds(value: object, what: str, *, infinite: bool = False) -> None:
    """TypeError where `value` is no number of seconds for `what`, ValueError for NaN (and for inf
    unless `infinite`); a negative one is the gateway's to refuse, naming the field. A str reached
    arithmetic ("can't multiply sequence by non-int of type 'float'") and NaN protobuf's Duration
    ("cannot convert float NaN to integer"), neither naming the argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} is seconds (a number), got {a_kind(value)} {value!r}")
    if math.isnan(value) or (not infinite and math.isinf(value)):
        raise ValueError(f"{what} is seconds (a finite number), got {value}")


def check_options(request: JobRequest) -> None:
    """TypeError or ValueError, naming the argument and what to give, where a JobRequest's options
    (not its inputs) cannot be sent as they are. Before anything is sent, for submit, run and bulk."""
    for what in ("queue_ttl_s", "execution_timeout_s", "retention_s"):
        if (value := getattr(request, what)) is not None:
            check_seconds(value, what)
    if isinstance(request.max_attempts, bool) or not isinstance(request.max_attempts, numbers.Integral):
        raise TypeError(
            f"max_attempts is a whole number of attempts (0: the model's default), "
            f"got {a_kind(request.max_attempts)} {request.max_attempts!r}"
        )
    if request.deadline is not None and not isinstance(request.deadline, datetime):
        raise TypeError(
            "deadline is a timezone-aware datetime (e.g. datetime.now(UTC) + timedelta(minutes=5); or give "
            f"queue_ttl_s in seconds), got {a_kind(request.deadline)} {request.deadline!r}"
        )


# numpy's kinds a tensor carries: booleans, integers, floats, and text or objects (BYTES).
_TENSOR_KINDS = frozenset("biufOSU")


def _is_torch_tensor(value: object) -> bool:
    return type(value).__module__.split(".")[0] == "torch" and hasattr(value, "detach")


def input_array(name: str, value: object, model: str, spec: TensorSpec | None) -> npt.NDArray[Any]:
    """An input's value (an array, nested lists, a scalar, a torch tensor) as a numpy array.

    A torch tensor is taken as its values: one that requires grad (a model's output) or lives on
    a GPU made numpy raise torch's RuntimeError ("Can't call numpy() on Tensor that requires grad"),
    and a bfloat16 one its TypeError ("Got unsupported ScalarType BFloat16"); that is float32 now.
    ValueError, naming the input and what the model takes, where numpy makes no array of it (rows
    of different lengths: numpy's "setting an array element with a sequence") or one no tensor
    carries (complex numbers, dates: "numpy dtype complex64 has no KServe v2 datatype")."""
    takes = "" if spec is None else f"; model {model!r} takes {spec.summary()}"
    if _is_torch_tensor(value):
        tensor: Any = value  # torch is no dependency of the SDK's
        value = tensor = tensor.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":  # numpy has no bfloat16; float32 holds each value
            value = tensor.float()
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as error:
        if "inhomogeneous" in str(error):
            raise ValueError(
                f"input {name!r} is not a rectangular array: its rows are not all the same length{takes}"
            ) from None
        raise ValueError(f"input {name!r} is no array numpy can make ({error}){takes}") from None
    if array.dtype.kind not in _TENSOR_KINDS:
        raise ValueError(
            f"input {name!r} is {array.dtype}, which no tensor carries (booleans, integers, floats or text){takes}"
        )
    # numpy made [True, 2.5] a float array, sent as 1.0 and 2.5 (True and False alone are a BOOL
    # array, and numbers alone numbers, which the gateway refuses for an input of the other kind).
    if misplaced := booleans_misplaced(value, None, array):
        raise ValueError(f"input {name!r} {misplaced}{takes}")
    return array


# Inputs the SDK left as they were (typed_as declined them), by name: the datatype the signature
# it typed by gave, and why it declined, with the signature ("...; model 'demo' takes x: FP32 ...").
Declined = dict[str, tuple[str, str]]


def declined_input(
    name: str, array: npt.NDArray[Any], model: str, spec: TensorSpec, written: object = None
) -> tuple[str, str] | None:
    """What `Declined` keeps for an input `typed_as` left as it was; None where it typed it.
    `written`: the value as given (nested lists), for the value a refusal names."""
    reason = untyped_reason(array, spec.datatype, written)
    if reason is None:
        return None
    return spec.datatype, f"the SDK did not convert it, as it {reason}; model {model!r} takes {spec.summary()}"


_DATATYPE_FIELD = re.compile(r"inputs\[(\d+)\]\.datatype")


def explained(
    violations: tuple[FieldViolation, ...], names: list[str], declined: Declined
) -> tuple[FieldViolation, ...]:
    """The gateway's violations of a request whose inputs were `names` (in order), each one on the
    datatype of an input the SDK declined to convert followed by why: the gateway names only the
    dtype numpy gave ("input 'x' must be FP32, got 'FP64'" for a list holding 1e300). Left as they
    are where the gateway asks for another datatype than the signature the SDK typed by (a model
    updated since the SDK asked)."""
    if not declined:
        return violations
    result = []
    for violation in violations:
        match = _DATATYPE_FIELD.fullmatch(violation.field)
        index = int(match[1]) if match else len(names)
        found = declined.get(names[index]) if index < len(names) else None
        if found is not None and f"must be {found[0]}" in violation.description:
            violation = FieldViolation(violation.field, f"{violation.description}: {found[1]}")
        result.append(violation)
    return tuple(result)


_SIGNATURE_FIELD = re.compile(r"inputs\[\d+\]\.(datatype|shape)")


def signature_refused(violations: Iterable[FieldViolation]) -> bool:
    """Whether a refused submit says the SDK's cached signature of its model may be old: the
    gateway refused an input's datatype or shape, which the SDK typed by that signature (or left
    as given, for a model not listed when it asked). A hot update changes a model's inputs, or
    loads it, while a client runs; nothing else tells the client."""
    return any(_SIGNATURE_FIELD.fullmatch(v.field) for v in violations)


def input_tensors(inputs: Inputs) -> list[Tensor]:
    """Name -> array (or a `Tensor`, sent as it is under that name), or a list of Tensors."""
    if isinstance(inputs, Mapping):
        return [
            replace(value, name=name) if isinstance(value, Tensor) else Tensor.from_numpy(name, value)
            for name, value in inputs.items()
        ]
    return list(inputs)


def state_to_proto(state: JobState) -> job_pb2.JobState.ValueType:
    return job_pb2.JobState.ValueType(to_proto(state, job_pb2.JobState, "JOB_STATE_"))


def with_idempotency_key(request: JobRequest) -> JobRequest:
    """The request with a fresh idempotency key when it has none, so that retries are safe."""
    if request.idempotency_key:
        return request
    return replace(request, idempotency_key=str(uuid.uuid4()))


def submit_request_to_proto(request: JobRequest) -> job_service_pb2.SubmitJobRequest:
    check_options(request)
    if request.inputs is not None and request.input_ref:
        raise ValueError("give inputs or input_ref, not both")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in request.labels.items()):
        raise TypeError(f"labels map strings to strings, got {dict(request.labels)!r}")
    if request.deadline is not None and request.queue_ttl_s is not None:
        raise ValueError("give a deadline or a queue_ttl_s, not both")
    message = job_service_pb2.SubmitJobRequest(
        model_name=request.model,
        model_version=request.model_version,
        input_ref=request.input_ref,
        idempotency_key=request.idempotency_key,
        labels=dict(request.labels),
        max_attempts=request.max_attempts,
    )
    if request.inputs is not None:
        message.inputs.extend(to_input_proto(t) for t in input_tensors(request.inputs))
    if request.priority is not None:
        # A Priority (one a job read back names a newer number with, too) or its name in any case,
        # as submit takes it: a JobRequest's "high" was "'high' is not a valid Priority".
        priority = request.priority
        if not isinstance(priority, Priority):
            priority = named(priority, {member.value: member for member in Priority}, "priority")
        message.priority = job_pb2.Priority.ValueType(to_proto(priority, job_pb2.Priority, "PRIORITY_"))
    if request.deadline is not None:
        if request.deadline.tzinfo is None:
            raise ValueError("deadline must be timezone-aware (e.g. datetime.now(UTC) + ...)")
        message.deadline.FromDatetime(request.deadline.astimezone(UTC))
    if request.queue_ttl_s is not None:
        message.queue_ttl.CopyFrom(_duration(request.queue_ttl_s))
    if request.execution_timeout_s is not None:
        message.execution_timeout.CopyFrom(_duration(request.execution_timeout_s))
    if request.retention_s is not None:
        message.result_retention.CopyFrom(_duration(request.retention_s))
    if request.callback is not None:
        message.callback.url = request.callback.url
        message.callback.events.extend(
            job_pb2.CallbackEvent.ValueType(to_proto(CallbackEvent(e), job_pb2.CallbackEvent, "CALLBACK_EVENT_"))
            for e in request.callback.events
        )
    return message


def duration_to_proto(seconds: float) -> duration_pb2.Duration:
    return _duration(seconds)


def models_from_proto(message: job_service_pb2.ListModelsResponse) -> list[ModelInfo]:
    def specs(tensors: Iterable[job_service_pb2.TensorSpec]) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(t.name, t.datatype, tuple(t.shape)) for t in tensors)

    return [
        ModelInfo(
            name=m.name,
            version=m.version,
            inputs=specs(m.inputs),
            outputs=specs(m.outputs),
            max_batch_size=m.max_batch_size,
            default_max_attempts=m.default_max_attempts,
            max_attempts_limit=m.max_attempts_limit,
            default_execution_timeout_s=_seconds(m, "default_execution_timeout"),
            versions=tuple(
                ModelVersion(
                    version=v.version,
                    state=name_from_proto(job_service_pb2.ModelVersionState, v.state, "MODEL_VERSION_STATE_"),
                    reason=v.reason,
                    batchers=tuple(v.batchers),
                    inputs=specs(v.inputs),
                    outputs=specs(v.outputs),
                    max_batch_size=v.max_batch_size,
                )
                for v in m.versions
            ),
        )
        for m in message.models
    ]
