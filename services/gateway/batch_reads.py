"""The JobService's batch reads, GetJobs and WatchJobs: their bounds, the size budget of a GetJobs
answer, and the conversion of a batch of changes into one WatchJobs message. Functions the
servicer (job_service.py) calls with its own per-job reader and converter, passed in as bound
methods, so each job costs the same calls it did when these lived in the servicer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence

from asyncinfer.errors import AsyncInferError, FieldViolation, InvalidArgument, ResourceExhausted
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobRecord
from asyncinfer.v1 import job_pb2, job_service_pb2
from asyncinfer.v1.job_service_pb2 import JobProgress
from services.gateway.bulk import error_status
from services.gateway.progress_watch import progress_to_proto, record_progress
from services.gateway.submit_request import label_violations
from services.gateway.transitions import Expiry
from services.gateway.watch_hub import WatchHub
from services.gateway.watch_many import JobChange, watch_ids, watch_labels

# The most job IDs one GetJobs call may ask for: bounds the answer (a page of records with their
# inline outputs) like ListJobs' pages.
MAX_IDS_PER_READ = 1000
# The most job IDs one WatchJobs stream may watch.
MAX_IDS_PER_WATCH = 10_000

# (tenant, job ID) -> the job as it stands with the progress its record keeps, or why it cannot
# be read.
ReadJob = Callable[[str, str], Awaitable[tuple[job_pb2.Job, JobProgress | None] | AsyncInferError]]


async def get_jobs(
    job_ids: Sequence[str], tenant: str, read: ReadJob, *, budget_bytes: int
) -> job_service_pb2.GetJobsResponse:
    """The reads go out together (one NATS round trip for the lot, not one per job); an ID asked
    twice is read once. The answer stays within budget_bytes (the gRPC message limit a client has
    by default): once it is full, the remaining IDs are answered ANSWER_FULL (retriable: ask for
    them again); the first job always fits."""
    asked = list(job_ids)
    if len(asked) > MAX_IDS_PER_READ:
        raise InvalidArgument(
            f"at most {MAX_IDS_PER_READ} job IDs per GetJobs call; this one has {len(asked)}",
            [FieldViolation("job_ids", f"{len(asked)} IDs; at most {MAX_IDS_PER_READ}")],
        )
    unique = list(dict.fromkeys(asked))
    found = dict(zip(unique, await asyncio.gather(*(read(tenant, i) for i in unique)), strict=True))
    response = job_service_pb2.GetJobsResponse()
    budget = budget_bytes
    for job_id in asked:
        answer = found[job_id]
        result = job_service_pb2.GetJobsResult(job_id=job_id)
        if isinstance(answer, AsyncInferError):
            result.error.CopyFrom(error_status(answer))
        else:
            job, progress = answer
            size = job.ByteSize() + (progress.ByteSize() if progress is not None else 0)
            if response.results and size > budget:
                result.error.CopyFrom(error_status(_answer_full(job_id)))
            else:
                result.job.CopyFrom(job)
                if progress is not None:
                    result.progress.CopyFrom(progress)
                budget -= size
        response.results.append(result)
    return response


def _answer_full(job_id: str) -> ResourceExhausted:
    return ResourceExhausted(
        f"the GetJobs answer reached its size limit before job {job_id}; ask for it again",
        retry_after_s=0.0,
        reason="ANSWER_FULL",
        metadata={"job_id": job_id},
    )


def watched_changes(
    request: job_service_pb2.WatchJobsRequest,
    tenant: str,
    hub: WatchHub,
    records: JobStore,
    expiry: Expiry,
    *,
    listening: Callable[[], Awaitable[None]] | None = None,
) -> AsyncGenerator[list[JobChange], None]:
    """The batches of changes a WatchJobs request asks for (by IDs or by labels), once it is
    checked: the watch itself, with nothing between it and the servicer's loop. A label watch
    awaits `listening` once it hears every change (watch_many.watch_labels); a watch of IDs needs
    no such signal (it reads each job as it stands: its first message is the signal)."""
    job_ids, labels = list(request.job_ids), dict(request.labels)
    if bool(job_ids) == bool(labels):
        raise InvalidArgument(
            "WatchJobs takes job_ids or a label selector (labels), one of the two",
            [FieldViolation("job_ids" if job_ids else "labels", "give job IDs or labels, not both or neither")],
        )
    if len(job_ids) > MAX_IDS_PER_WATCH:
        raise InvalidArgument(
            f"at most {MAX_IDS_PER_WATCH} job IDs per WatchJobs call; this one has {len(job_ids)}",
            [FieldViolation("job_ids", f"{len(job_ids)} IDs; at most {MAX_IDS_PER_WATCH}")],
        )
    if violations := label_violations(labels, selector=True):
        raise InvalidArgument(f"invalid label selector: {violations[0].field}: {violations[0].description}", violations)
    if job_ids:
        return watch_ids(hub, records, expiry, tenant, job_ids)
    return watch_labels(hub, tenant, labels, listening)


def watch_jobs_responses(
    batch: Sequence[JobChange],
    watch_response: Callable[[JobRecord], job_service_pb2.WatchJobResponse],
    *,
    budget_bytes: int,
) -> list[job_service_pb2.WatchJobsResponse]:
    """The stream messages for a batch of changes, each within budget_bytes (as GetJobs' answer:
    the gRPC message limit a client has by default; a change alone may pass it). By count alone,
    the first message of a watch of 40 jobs with 240-KB outputs was 9.6 MB, over the gateway's own
    send limit, and the watch failed RESOURCE_EXHAUSTED on every retry. `watch_response` is the
    servicer's (shared with WatchJob: a record's converted message is cached for its watchers)."""
    responses = [job_service_pb2.WatchJobsResponse()]
    budget = budget_bytes
    for change in batch:
        message = responses[-1].changes.add(job_id=change.job_id)
        if change.record is not None:
            message.job.CopyFrom(watch_response(change.record).job)
            progress = record_progress(change.record)
            if progress is not None:
                message.progress.CopyFrom(progress_to_proto(progress))
        elif change.error is not None:
            message.error.CopyFrom(error_status(change.error))
        size = message.ByteSize()
        if size > budget and len(responses[-1].changes) > 1:  # into a message of its own
            moved = job_service_pb2.WatchJobsResponse()
            moved.changes.add().CopyFrom(message)
            del responses[-1].changes[-1]
            responses.append(moved)
            budget = budget_bytes
        budget -= size
    return responses
