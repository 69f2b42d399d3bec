"""Results stored for attempts no record will name: deleted now rather than at their expiry.

A batcher with claim_check_io stores an attempt's outputs as `out/<job_id>.<attempt>` before it
answers (asyncinfer.blob_meta.attempt_result_ref), kept for the job's result retention (an hour by
default). An answer the scheduler drops or refuses left that object counted against its tenant
until then. It is deleted, best-effort, only where no record can ever name it:

- an attempt that timed out here (its RUNNING write was this scheduler's: the attempt number is
  its own, and its answer is dropped);
- an attempt fenced off by a newer attempt of the job held here (the record moved past it, and
  lifecycle refuses an older attempt's end);
- a refused answer naming an older attempt's object of the same job (the same reason);
- the result of an attempt whose job a cancel ended CANCELED as it was stored (the batcher's, or the
  scheduler's own out/<job_id>: a CANCELED record never names a result and is not replayed).

Never an early order whose RUNNING write was lost (another scheduler may own that attempt
number, its result stored under the same name), an input, another job's object or the
scheduler's own out/<job_id> but a cancelled job's.
"""

from __future__ import annotations

import structlog

from asyncinfer.blob_meta import attempt_of_result_ref, attempt_result_ref
from asyncinfer.errors import AsyncInferError
from asyncinfer.jobs import BlobRef
from asyncinfer.log_throttle import RepeatedLines
from services.scheduler.blobs import ClaimCheckIO
from services.scheduler.owned_tasks import OwnedTasks

log = structlog.get_logger("asyncinfer.scheduler.jobs")


def own_attempts_result(job_id: str, attempt: int, ref: BlobRef | None) -> str | None:
    """The object an answer of (job_id, attempt) names, when it is that attempt's own."""
    if ref is None or ref.ref != attempt_result_ref(job_id, attempt):
        return None
    return ref.ref


def older_attempts_result(job_id: str, attempt_held: int, ref: BlobRef) -> str | None:
    """The object a refused answer names, when it is an attempt's of the job older than the one held."""
    named = attempt_of_result_ref(job_id, ref.ref)
    if named is None or named >= attempt_held:
        return None
    return ref.ref


class StaleResults:
    """Deletes stale results in owned tasks; a failure is only logged (the sweep removes the
    object at its expiry, as before)."""

    def __init__(self, claim_check: ClaimCheckIO | None, tasks: OwnedTasks) -> None:
        self._claim_check = claim_check
        self._tasks = tasks
        # Once per interval per why and reason (the rest at debug): with the object store down,
        # every dropped or refused answer's delete failed, a line each.
        self._failure_lines = RepeatedLines()

    def delete(self, tenant: str, job_id: str, ref: str | None, *, why: str) -> None:
        if ref is None or self._claim_check is None:
            return
        self._tasks.spawn(self._delete(self._claim_check, tenant, job_id, ref, why))

    async def _delete(self, claim_check: ClaimCheckIO, tenant: str, job_id: str, ref: str, why: str) -> None:
        try:
            deleted = await claim_check.delete_result(tenant, ref)
        except AsyncInferError as exc:
            self._failure_lines.say(
                log,
                "info",
                "stale_result_not_deleted",
                kind=(why, exc.reason),
                job_id=job_id,
                ref=ref,
                why=why,
                error=exc.message,
            )
            return
        log.debug("stale_result_deleted", job_id=job_id, ref=ref, why=why, found=deleted)
