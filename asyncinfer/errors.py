"""The one root exception of asyncinfer and its kinds.

Each kind carries the canonical gRPC code it maps to; `asyncinfer.grpc_errors` is the one place
that turns them into a gRPC status with `google.rpc` details. Domain code raises these and never
touches gRPC.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc


@dataclass(frozen=True, slots=True)
class FieldViolation:
    """One invalid field of a request (google.rpc.BadRequest.FieldViolation)."""

    field: str
    description: str


class AsyncInferError(Exception):
    """Root of every error asyncinfer raises on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    default_reason: str = "INTERNAL"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.metadata: dict[str, str] = dict(metadata or {})


class InvalidArgument(AsyncInferError):
    """The request is malformed; trying it again unchanged cannot succeed."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    default_reason = "INVALID_ARGUMENT"

    def __init__(
        self,
        message: str,
        violations: Iterable[FieldViolation] = (),
        *,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, reason=reason, metadata=metadata)
        self.violations: tuple[FieldViolation, ...] = tuple(violations)


class Unauthenticated(AsyncInferError):
    code = grpc.StatusCode.UNAUTHENTICATED
    default_reason = "UNAUTHENTICATED"


class PermissionDenied(AsyncInferError):
    code = grpc.StatusCode.PERMISSION_DENIED
    default_reason = "PERMISSION_DENIED"


class NotFound(AsyncInferError):
    code = grpc.StatusCode.NOT_FOUND
    default_reason = "NOT_FOUND"


def unknown_model(model_name: str, known: Iterable[str], known_as: str) -> NotFound:
    """NOT_FOUND MODEL_NOT_FOUND for a model nothing here knows, naming those that are, so that a
    typo is fixed from the message alone; `known_as` says whose they are ("the models served")."""
    names = ", ".join(sorted(known)) or "none"
    return NotFound(
        f"unknown model {model_name[:64]!r}; {known_as} are: {names}",
        reason="MODEL_NOT_FOUND",
        metadata={"model": model_name[:64], "known_models": names},
    )


class AlreadyExists(AsyncInferError):
    code = grpc.StatusCode.ALREADY_EXISTS
    default_reason = "ALREADY_EXISTS"


class FailedPrecondition(AsyncInferError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    default_reason = "FAILED_PRECONDITION"


class ResourceExhausted(AsyncInferError):
    """Over a limit; the caller should try again after `retry_after_s`."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_reason = "RESOURCE_EXHAUSTED"

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float = 1.0,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, reason=reason, metadata=metadata)
        self.retry_after_s = retry_after_s


class Unavailable(AsyncInferError):
    """A dependency (NATS, a batcher, Triton) cannot be reached; retrying may help."""

    code = grpc.StatusCode.UNAVAILABLE
    default_reason = "UNAVAILABLE"


class DeadlineExceeded(AsyncInferError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    default_reason = "DEADLINE_EXCEEDED"


class Cancelled(AsyncInferError):
    code = grpc.StatusCode.CANCELLED
    default_reason = "CANCELLED"


class Unimplemented(AsyncInferError):
    code = grpc.StatusCode.UNIMPLEMENTED
    default_reason = "UNIMPLEMENTED"


class ConfigError(AsyncInferError):
    """The configuration is invalid; raised at start-up, before anything is served."""

    default_reason = "INVALID_CONFIG"


class ModelError(AsyncInferError):
    """The model raised while computing a batch; only that batch's items fail."""

    code = grpc.StatusCode.INTERNAL
    default_reason = "MODEL_ERROR"
