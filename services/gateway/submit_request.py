"""A submit request as the domain sees it (`SubmitRequest`, converted from protobuf by
convert.py) and its checks against the configuration and the model's signature. Apart from the
enqueue (submit.py) because they are pure, no NATS: the idempotent submitter runs them to refuse
an invalid inline request before it claims a key, the submitter on every request it accepts
(after reading an upload, whose inputs are only known then).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from asyncinfer.config import Config, ModelConfig
from asyncinfer.errors import AsyncInferError, FieldViolation, InvalidArgument, Unimplemented
from asyncinfer.jobs import RESERVED_LABEL_PREFIX, BlobRef, CallbackSpec, Priority
from asyncinfer.tensors import ModelSignature, Tensor, specs_summary, validate_inputs
from services.gateway.model_catalog import ModelCatalog

MAX_LABELS = 16
MAX_LABEL_KEY_BYTES = 63
MAX_LABEL_VALUE_BYTES = 256
MAX_IDEMPOTENCY_KEY_BYTES = 256


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    """A SubmitJob request as the domain sees it. Times are Unix seconds; None means unset (the
    configured default applies)."""

    model_name: str
    model_version: str = ""
    inputs: tuple[Tensor, ...] = ()
    input_ref: str = ""
    # What input_ref names, once the submitter has read it (its inputs are then dropped).
    input_blob: BlobRef | None = None
    priority: Priority = Priority.NORMAL
    idempotency_key: str = ""
    deadline: float | None = None
    # The queue TTL as given (the deadline is derived from it): what a repeated submit compares.
    queue_ttl_s: float | None = None
    execution_timeout_s: float | None = None
    result_retention_s: float | None = None
    max_attempts: int = 0  # 0: the model's default
    labels: Mapping[str, str] = field(default_factory=dict)
    callback: CallbackSpec | None = None
    # The submit span's W3C traceparent when the gateway traces jobs (asyncinfer.tracing): not
    # what the caller asked for, so a repeated submit's fingerprint leaves it out.
    traceparent: str = ""


def check_request_size(size_bytes: int, limit_bytes: int) -> None:
    if size_bytes > limit_bytes:
        message = (
            f"the request is {size_bytes} bytes, over the limit of {limit_bytes} bytes "
            "(gateway.max_request_bytes); send large inputs with UploadInput and pass its input_ref"
        )
        raise InvalidArgument(message, [FieldViolation("inputs", message)], reason="REQUEST_TOO_LARGE")


def resolve_model(config: Config, name: str, version: str, catalog: ModelCatalog | None = None) -> ModelConfig:
    """The version a submit runs on (empty: the model's default now), from the catalog (the
    configuration and the registered versions), or from the configuration alone."""
    return (catalog or ModelCatalog(config)).resolve(name, version)


def label_violations(labels: Mapping[str, str], *, selector: bool = False) -> list[FieldViolation]:
    """What is wrong with labels a job or batch is given, or (`selector`) a label selector of
    ListJobs or WatchJobs: the same limits, and a selector may name the reserved keys (a batch's
    chunk jobs are found by theirs). A selector that no label can match was taken (a WatchJobs on
    an empty key held a watch for ever)."""
    violations: list[FieldViolation] = []
    if len(labels) > MAX_LABELS:
        violations.append(FieldViolation("labels", f"at most {MAX_LABELS} labels, got {len(labels)}"))
    for key, value in labels.items():
        if not key or len(key.encode()) > MAX_LABEL_KEY_BYTES:
            violations.append(FieldViolation(f"labels[{key[:64]!r}]", f"label keys are 1-{MAX_LABEL_KEY_BYTES} bytes"))
        elif key.startswith(RESERVED_LABEL_PREFIX) and not selector:
            violations.append(
                FieldViolation(
                    f"labels[{key[:64]!r}]",
                    f"label keys starting with {RESERVED_LABEL_PREFIX!r} are reserved for the labels the system sets",
                )
            )
        if len(value.encode()) > MAX_LABEL_VALUE_BYTES:
            violations.append(
                FieldViolation(f"labels[{key[:64]!r}]", f"label values are at most {MAX_LABEL_VALUE_BYTES} bytes")
            )
    return violations


def _option_violations(request: SubmitRequest, config: Config, now: float) -> list[FieldViolation]:
    violations: list[FieldViolation] = []
    if request.deadline is not None and request.deadline <= now:
        violations.append(FieldViolation("deadline", "the deadline has already passed"))
    if request.execution_timeout_s is not None and request.execution_timeout_s <= 0:
        violations.append(FieldViolation("execution_timeout", "must be positive"))
    retention = request.result_retention_s
    limit = config.gateway.max_result_retention_s
    if retention is not None and retention <= 0:
        violations.append(FieldViolation("result_retention", "must be positive"))
    elif retention is not None and retention > limit:
        violations.append(FieldViolation("result_retention", f"at most {limit:.0f} s (gateway.max_result_retention_s)"))
    # max_attempts is checked against the model's limit (validate_submit): a negative one was named twice.
    if request.callback is not None:
        violations += callback_url_violations(request.callback.url)
    return violations


def callback_url_violations(url: str) -> list[FieldViolation]:
    """The form check of a callback URL (a job's or a batch's); its addresses are checked later
    (services.gateway.callbacks.check_callback)."""
    try:
        parts = urlsplit(url)
        absolute = parts.scheme in ("https", "http") and bool(parts.hostname)
    except ValueError:  # e.g. an unclosed IPv6 bracket
        absolute = False
    return [] if absolute else [FieldViolation("callback.url", "must be an absolute https (or http) URL")]


def validate_submit(
    request: SubmitRequest,
    config: Config,
    *,
    now: float,
    catalog: ModelCatalog | None = None,
    resolved: tuple[ModelConfig, ModelSignature] | None = None,
) -> ModelConfig:
    """The model version the request is validated against (the one it names, or the default
    now); raises NotFound, Unimplemented or InvalidArgument (with every violation found).
    `resolved`: that version and its signature, when the caller has them already."""
    if resolved is None:
        model = resolve_model(config, request.model_name, request.model_version, catalog)
        signature = model.signature
    else:
        model, signature = resolved
    if request.input_ref and request.input_blob is None:
        raise Unimplemented("input_ref needs the claim-check store, which this gateway has not set up")
    violations = _option_violations(request, config, now) + label_violations(request.labels)
    if len(request.idempotency_key.encode()) > MAX_IDEMPOTENCY_KEY_BYTES:
        violations.append(FieldViolation("idempotency_key", f"at most {MAX_IDEMPOTENCY_KEY_BYTES} bytes (UTF-8)"))
    if request.max_attempts < 0 or request.max_attempts > model.max_attempts_limit:
        violations.append(
            FieldViolation(
                "max_attempts",
                f"must be between 1 and the model's limit {model.max_attempts_limit} (0: the model's default "
                f"{model.max_attempts}), got {request.max_attempts}",
            )
        )
    if not request.inputs and request.input_ref:
        violations.append(FieldViolation("input_ref", "the upload holds no inputs"))
    elif not request.inputs:
        takes = f" ({specs_summary(signature.inputs)})" if signature.inputs else ""
        violations.append(FieldViolation("inputs", f"give the model's inputs{takes}, or an input_ref"))
    else:
        violations += validate_inputs(request.inputs, signature, max_batch_size=model.max_batch_size)
    if violations:
        first = violations[0]
        raise InvalidArgument(f"invalid request: {first.field}: {first.description}", violations)
    return model


def validate_each(
    requests: Sequence[SubmitRequest], config: Config, *, now: float, catalog: ModelCatalog | None = None
) -> list[ModelConfig | AsyncInferError]:
    """`validate_submit` for each request of a SubmitJobs message: its model version, or the
    error it would have raised, in order (one invalid request does not fail the others). Each
    (model, version) named is resolved once for the message, with its signature: resolving
    copies the model's configuration, about half of what validating a small request costs."""
    catalog = catalog or ModelCatalog(config)
    resolved: dict[tuple[str, str], tuple[ModelConfig, ModelSignature] | AsyncInferError] = {}
    checked: list[ModelConfig | AsyncInferError] = []
    for request in requests:
        named = (request.model_name, request.model_version)
        model = resolved.get(named)
        if model is None:
            try:
                found = resolve_model(config, request.model_name, request.model_version, catalog)
                model = resolved[named] = (found, found.signature)
            except AsyncInferError as error:
                model = resolved[named] = error
        if isinstance(model, AsyncInferError):
            checked.append(model)
            continue
        try:
            checked.append(validate_submit(request, config, now=now, catalog=catalog, resolved=model))
        except AsyncInferError as error:
            checked.append(error)
    return checked
