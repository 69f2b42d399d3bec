"""The SDK's errors: one root, `AsyncInferClientError`, with a subclass per family of gRPC codes.

Each carries the status `code`, the stable `reason` from the server's `google.rpc.ErrorInfo`
(e.g. MODEL_NOT_FOUND, JOB_NOT_FOUND, QUEUE_FULL; the code's name when the server sent none),
`violations` from `google.rpc.BadRequest`, and `retry_after_s` from `google.rpc.RetryInfo`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import grpc

from asyncinfer.client._enums import unknown_number
from asyncinfer.client.types import Job
from asyncinfer.errors import FieldViolation
from asyncinfer.grpc_errors import status_details, unpack_details

__all__ = [
    "AlreadyExistsError",
    "AsyncInferClientError",
    "CancelledError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "JobFailedError",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "from_rpc_error",
    "name_lookup_failed",
    "no_such_host",
    "unsaid_violations",
    "with_connection_hint",
    "with_earlier_hint",
]


def code_and_reason(code: str, reason: str) -> str:
    """`CODE REASON`, or the code alone where the reason only repeats it (INVALID_ARGUMENT's) or is empty."""
    return code if reason in ("", code) else f"{code} {reason}"


def unsaid_violations(message: str, violations: tuple[FieldViolation, ...]) -> tuple[FieldViolation, ...]:
    """The violations `message` does not say already, each for a line of its own after it (the SDK's
    error text, the CLI's report). The gateway's message names its first violation, `field:
    description`, or is itself the violation's description where that names the field (a refused
    page token: `invalid page_token: not a token from ListJobs`, field page_token); either was said
    again after it."""
    return tuple(
        v
        for v in violations
        if f"{v.field}: {v.description}" not in message and not (v.description in message and v.field in message)
    )


class AsyncInferClientError(Exception):
    """Root of every error the SDK raises."""

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode = grpc.StatusCode.UNKNOWN,
        reason: str = "",
        violations: tuple[FieldViolation, ...] = (),
        retry_after_s: float | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason or code.name
        self.violations = violations
        self.retry_after_s = retry_after_s
        self.metadata: dict[str, str] = dict(metadata or {})
        # What to check, where gRPC's text names no cause (with_connection_hint); not part of `message`.
        self.hint: str | None = None

    def __str__(self) -> str:
        text = f"{code_and_reason(self.code.name, self.reason)}: {self.message}"
        for violation in unsaid_violations(self.message, self.violations):  # each said once
            text += f"\n  {violation.field}: {violation.description}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class InvalidArgumentError(AsyncInferClientError):
    """The request is wrong (INVALID_ARGUMENT, OUT_OF_RANGE); see `violations`."""


class NotFoundError(AsyncInferClientError):
    """No such model or job (or its retention passed: reason JOB_RETENTION_PASSED)."""


class AlreadyExistsError(AsyncInferClientError):
    """It exists already (ALREADY_EXISTS). An idempotency key sent with another request than its
    first (reason IDEMPOTENCY_KEY_REUSED): `metadata["job_id"]` (a batch's: `metadata["batch_id"]`)
    is the one holding the key; `get` it, or submit the other request under a new key."""


class FailedPreconditionError(AsyncInferClientError):
    """The system is not in a state to do it (FAILED_PRECONDITION, ABORTED)."""


class UnauthenticatedError(AsyncInferClientError):
    pass


class PermissionDeniedError(AsyncInferClientError):
    pass


class ResourceExhaustedError(AsyncInferClientError):
    """Over a queue limit or quota; try again after `retry_after_s`."""


class UnavailableError(AsyncInferClientError):
    """The gateway (or what it depends on) cannot be reached; retried by the SDK until its budget ends."""


class DeadlineExceededError(AsyncInferClientError):
    """The call's timeout passed before it completed."""


class CancelledError(AsyncInferClientError):
    """The call was cancelled (not the job: a canceled job is a Job in state CANCELED)."""


class UnimplementedError(AsyncInferClientError):
    """The server does not offer this call (an older gateway)."""


class InternalError(AsyncInferClientError):
    """A server bug or an unknown failure (INTERNAL, UNKNOWN, DATA_LOSS)."""


def ended_at(what: str, state: enum.Enum) -> InternalError:
    """A watch the gateway ended at a state the SDK cannot call terminal: one newer than the SDK (the
    gateway ends a watch only at the end of what it watches), named as the SDK reads it."""
    newer = " (newer than this SDK: upgrade it)" if unknown_number(state) is not None else ""
    return InternalError(f"the watch of {what} ended at state {state}{newer}")


class JobFailedError(AsyncInferClientError):
    """The job ended in a state other than SUCCEEDED (raised by `run`); `job` is its record and
    `code`/`reason`/`violations` are those of the job's error."""

    def __init__(self, job: Job) -> None:
        error = job.error
        super().__init__(
            f"job {job.job_id} ended {job.state.value}" + (f": {error.message}" if error else ""),
            code=error.code if error else grpc.StatusCode.UNKNOWN,
            reason=error.reason if error else job.state.value,
            violations=error.violations if error else (),
        )
        self.job = job


_BY_CODE: dict[grpc.StatusCode, type[AsyncInferClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.ABORTED: FailedPreconditionError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
}


def error_class(code: grpc.StatusCode) -> type[AsyncInferClientError]:
    return _BY_CODE.get(code, InternalError)


def make_error(
    code: grpc.StatusCode,
    message: str,
    *,
    reason: str = "",
    violations: tuple[FieldViolation, ...] = (),
    retry_after_s: float | None = None,
    metadata: Mapping[str, str] | None = None,
) -> AsyncInferClientError:
    return error_class(code)(
        message, code=code, reason=reason, violations=violations, retry_after_s=retry_after_s, metadata=metadata
    )


# The reason given to gRPC's "Received message larger than max" (no ErrorInfo of the gateway's).
MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"


# `asyncinfer up --dev-tls`'s CA, relative to where `up` ran (the CLI's hint names it too).
DEV_CA = ".asyncinfer/tls/ca.pem"


# gRPC's text for a failed name lookup: its resolver's now ("errors resolving HOST:PORT: ..."), and
# before grpcio 1.60 or so ("DNS resolution failed for HOST:PORT: ...").
_NAME_LOOKUP_FAILED = ("errors resolving ", "DNS resolution failed")
# ... where DNS answered that no such name exists: c-ares's (gRPC's default resolver), getaddrinfo's
# (GRPC_DNS_RESOLVER=native) on Linux and on macOS. Not a DNS server that did not answer, which
# another try may get past ("Temporary failure in name resolution", "Timeout while contacting").
_NO_SUCH_NAME = (
    "Domain name not found",
    "Name or service not known",
    "No address associated with hostname",
    "nodename nor servname provided",
)
NO_SUCH_HOST_HINT = "no host has that name: is it spelled right?"
NAME_LOOKUP_HINT = "the host name could not be looked up: is DNS reachable from here?"


def name_lookup_failed(error: AsyncInferClientError) -> bool:
    return error.code is grpc.StatusCode.UNAVAILABLE and any(text in error.message for text in _NAME_LOOKUP_FAILED)


def no_such_host(error: AsyncInferClientError) -> bool:
    """DNS said the address's host name does not exist: no try of the same address can connect."""
    return name_lookup_failed(error) and any(text in error.message for text in _NO_SUCH_NAME)


# gRPC's text where the server closed the connection: a plaintext channel to a TLS server, and a TLS
# channel without a client certificate to a server that requires one (mutual TLS). A Python gRPC
# server cannot ask for a certificate without requiring one, and TLS 1.3 ends the client's side of
# the handshake before the server has checked the client's: the server's refusal reaches the client
# as a closed socket, not as a handshake error. Only the client knows it sent no certificate.
SOCKET_CLOSED = "Socket closed"


def with_connection_hint(
    error: AsyncInferClientError, *, tls: bool, client_cert: bool | None = None
) -> AsyncInferClientError:
    """`error` with a `hint`, a sentence on what to check, where gRPC's own text names no cause: a host
    name that does not resolve ("errors resolving ...: [field:hostname lookup error:...]"), a plaintext
    channel to a TLS server ("Socket closed"), a TLS channel without a client certificate
    (`client_cert` False; None: not known, no hint) to a server that may require one (the same
    "Socket closed"), a TLS channel to a plaintext one (or with the wrong CA: "Handshake
    failed"). Other errors are returned as they are."""
    if error.code is not grpc.StatusCode.UNAVAILABLE:
        return error
    if no_such_host(error):
        hint = NO_SUCH_HOST_HINT
    elif name_lookup_failed(error):
        hint = NAME_LOOKUP_HINT
    elif not tls and SOCKET_CLOSED in error.message:
        hint = f"if the server is on TLS, give tls_ca_file= (`asyncinfer up --dev-tls`'s CA: {DEV_CA})"
    elif tls and client_cert is False and SOCKET_CLOSED in error.message:
        hint = (
            "the server closed the connection after the TLS handshake: if it requires client certificates "
            "(mutual TLS: its tls_client_ca_file), give tls_cert_file= and tls_key_file= (a certificate its CA signed)"
        )
    elif tls and "handshake failed" in error.message.lower():
        hint = "the TLS handshake failed: is the server on TLS, and did tls_ca_file's CA sign its certificate?"
    else:
        return error
    error.hint = hint
    return error


def with_earlier_hint(
    error: AsyncInferClientError, earlier: AsyncInferClientError | None, *, tls: bool, client_cert: bool | None = None
) -> AsyncInferClientError:
    """`error`, a DEADLINE_EXCEEDED that ended a call whose attempt before was retried for
    `earlier`, with `earlier`'s hint ("earlier tries: no host has that name: is it spelled
    right?"): a name DNS says does not exist, tried until the deadline, whose last try waited
    on DNS asked again (a slow resolver, a pod's search domains) ended "Deadline Exceeded" with
    no word of the name. Other errors, and one with a hint of its own, are returned as they are."""
    if error.code is not grpc.StatusCode.DEADLINE_EXCEEDED or error.hint or earlier is None:
        return error
    hint = with_connection_hint(earlier, tls=tls, client_cert=client_cert).hint
    if hint:
        error.hint = f"earlier tries: {hint}"
    return error


def from_rpc_error(error: grpc.RpcError) -> AsyncInferClientError:
    """The typed error for a failed call, with the details of its rich status."""
    code: grpc.StatusCode = error.code()
    message: str = error.details() or ""
    reason = ""
    metadata: dict[str, str] = {}
    violations: tuple[FieldViolation, ...] = ()
    retry_after_s: float | None = None
    try:
        status = status_details(error)
    except ValueError:  # a status whose details disagree with its code: keep the plain code
        status = None
    if status is not None:
        details = unpack_details(status)
        if (info := details.get("ErrorInfo")) is not None:
            reason = info.reason
            metadata = dict(info.metadata)
        if (bad := details.get("BadRequest")) is not None:
            violations = tuple(FieldViolation(v.field, v.description) for v in bad.field_violations)
        if (retry := details.get("RetryInfo")) is not None:
            retry_after_s = retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and not reason and "larger than max" in message:
        # gRPC's own transport limit (the gateway's max message size): sending it again cannot help.
        reason = MESSAGE_TOO_LARGE
        message += "; send large inputs with upload() or upload_inputs() and submit(input_ref=...)"
    return make_error(
        code, message, reason=reason, violations=violations, retry_after_s=retry_after_s, metadata=metadata
    )
