"""The errors the system itself writes into job records (as `error` or `last_error`): one
constructor each, so a reason string is spelled in one place.

A reason is part of the public contract (clients branch on it), so these never change meaning.
"""

from __future__ import annotations

import grpc

from asyncinfer.jobs import JobError, JobRecord, JobState

# Reasons written by the lifecycle (see asyncinfer/lifecycle.py).
# An EXPIRED job's reason, whoever expired it (a dispatch, a reader, the scheduler's deadline
# sweep, a batcher's drop).
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
# What a gateway's read wrote instead before the one reason: still in records written then (kept
# for their retention). A reader that branches on an expiry's reason takes both (EXPIRED_REASONS).
QUEUE_DEADLINE_EXCEEDED = "QUEUE_DEADLINE_EXCEEDED"
EXPIRED_REASONS = frozenset({DEADLINE_EXCEEDED, QUEUE_DEADLINE_EXCEEDED})
CANCELED_BY_USER = "CANCELED_BY_USER"
LEASE_EXPIRED = "LEASE_EXPIRED"
WORKER_LOST = "WORKER_LOST"
DROPPED = "DROPPED"
EXECUTION_TIMEOUT = "EXECUTION_TIMEOUT"
RESULT_TOO_LARGE = "RESULT_TOO_LARGE"
MAX_ATTEMPTS = "MAX_ATTEMPTS"
SCHEDULER_STOPPING = "SCHEDULER_STOPPING"
# Written by the gateway: a keyed job withdrawn before it could run (services/gateway/idempotency.py).
IDEMPOTENCY_SUPERSEDED = "IDEMPOTENCY_SUPERSEDED"  # a duplicate took its key over while its submit stalled
NOT_ACCEPTED = "NOT_ACCEPTED"  # its submit failed and freed its key; a publish of it may still land
WITHDRAWAL_REASONS = frozenset({IDEMPOTENCY_SUPERSEDED, NOT_ACCEPTED})

MAX_CANCEL_REASON_CHARS = 512


def job_error(code: grpc.StatusCode, reason: str, message: str, *, retriable: bool = False) -> JobError:
    return JobError(code=code.value[0], reason=reason, message=message, retriable=retriable)


def deadline_passed(before: str) -> JobError:
    """`before`: "started" (found at dispatch) or "ran" (the batcher dropped it unrun)."""
    return job_error(
        grpc.StatusCode.DEADLINE_EXCEEDED, DEADLINE_EXCEEDED, f"the job's deadline passed before it {before}"
    )


def canceled_by_user(reason: str) -> JobError:
    message = "canceled by the user"
    if reason:
        message += f": {reason[:MAX_CANCEL_REASON_CHARS]}"
    return job_error(grpc.StatusCode.CANCELLED, CANCELED_BY_USER, message)


def lease_expired(attempt: int) -> JobError:
    return job_error(
        grpc.StatusCode.UNAVAILABLE,
        LEASE_EXPIRED,
        f"attempt {attempt} was not renewed in time (its scheduler stopped or lost NATS)",
        retriable=True,
    )


def superseded(successor: str, stalled_s: float) -> JobError:
    """A keyed job whose submit stalled past its claim's bound: a duplicate took the key over as
    `successor` (the key's job, unless that submit lost the key in turn)."""
    return job_error(
        grpc.StatusCode.ABORTED,
        IDEMPOTENCY_SUPERSEDED,
        f"its submit stalled for over {stalled_s:g} s after claiming its idempotency key, and a duplicate "
        f"submit took the key over as job {successor}; this job never ran: a submit with the key returns "
        "the key's job",
    )


def not_accepted() -> JobError:
    """A keyed job whose submit failed after publishing may have begun (NATS unanswered): it frees
    its key for a retry, and this record keeps a late publish of it from running too."""
    return job_error(
        grpc.StatusCode.ABORTED,
        NOT_ACCEPTED,
        "its submit failed (its caller was told so) and freed its idempotency key; this job never ran",
    )


def worker_lost(batcher_id: str, attempt: int) -> JobError:
    return job_error(
        grpc.StatusCode.UNAVAILABLE,
        WORKER_LOST,
        f"batcher {batcher_id} disconnected during attempt {attempt}",
        retriable=True,
    )


def dropped_unrun() -> JobError:
    return job_error(grpc.StatusCode.ABORTED, DROPPED, "the batcher dropped it before it ran", retriable=True)


def handed_back(in_a_row: int, free: int) -> JobError:
    """A batcher handed the job back unrun once more than `free` times in a row: it counts as an
    attempt (lifecycle.after_hand_back)."""
    return job_error(
        grpc.StatusCode.ABORTED,
        DROPPED,
        f"batchers handed it back unrun {in_a_row} times in a row (each past {free} counts as an attempt)",
        retriable=True,
    )


def scheduler_stopping() -> JobError:
    return job_error(
        grpc.StatusCode.UNAVAILABLE, SCHEDULER_STOPPING, "the scheduler stopped while it ran", retriable=True
    )


def execution_timeout(
    attempt: int, timeout_s: float, *, retriable: bool, backstop_s: float = 0.0, where: str = ""
) -> JobError:
    """`backstop_s`: the scheduler's timer ended it, this long past the timeout from dispatch,
    its batcher (one that times runs out itself) having said nothing. `where`: what was running,
    as its batcher said (a pipeline's step)."""
    message = f"attempt {attempt} ran longer than its execution timeout of {timeout_s:g} s"
    if where:
        message = f"{message}: {where}"
    if backstop_s > 0:
        message = (
            f"attempt {attempt} was not answered within its execution timeout of {timeout_s:g} s plus "
            f"{backstop_s:g} s from its dispatch (its batcher stopped answering)"
        )
    return job_error(grpc.StatusCode.DEADLINE_EXCEEDED, EXECUTION_TIMEOUT, message, retriable=retriable)


def result_too_large(size_bytes: int, limit_bytes: int) -> JobError:
    return job_error(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        RESULT_TOO_LARGE,
        f"the result is {size_bytes} bytes; results over {limit_bytes} bytes cannot be stored yet",
    )


def invalid_result(message: str) -> JobError:
    """A batcher's answer this scheduler cannot take (a batcher bug, not the caller's)."""
    return job_error(grpc.StatusCode.INTERNAL, "INVALID_RESULT", message)


# What `gave_up` puts after a dead-lettered job's last error: what a reader of the job (the console's
# job page) knows a dead-lettered job by, its record holding no other sign of it.
GAVE_UP_MARK = " (gave up after "


def gave_up_said(message: str) -> bool:
    """Whether a job's final error message is a give-up's: the job was dead-lettered."""
    return GAVE_UP_MARK in message


def gave_up(last_error: JobError | None, attempts: int, *, given_back: int = 0) -> JobError:
    """The final error of a dead-lettered job: its last error, marked final. `attempts`: those that
    counted against max_attempts; `given_back`: those that did not (shed, put back), said apart."""
    base = last_error or job_error(grpc.StatusCode.ABORTED, MAX_ATTEMPTS, "attempts spent")
    spent = f"{attempts} attempt{'s' if attempts != 1 else ''}"
    others = f", not counting {given_back} given back" if given_back else ""
    return JobError(
        code=base.code,
        reason=base.reason,
        message=f"{base.message}{GAVE_UP_MARK}{spent}{others})",
        violations=base.violations,
        retriable=False,
    )


def is_withdrawal(record: JobRecord) -> bool:
    """Whether `record` is a keyed job's withdrawal (services/gateway/idempotency.py): a fence
    that keeps a job no submit answered as accepted from running, not a job of its caller's."""
    return record.state is JobState.CANCELED and record.error is not None and record.error.reason in WITHDRAWAL_REASONS
