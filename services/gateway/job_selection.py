"""Which of a tenant's jobs a label selector shows: one rule for ListJobs and for WatchJobs by label,
so that a live watch and the listing a client catches up with (the SDK's, when it reopens a label
watch) show the same jobs."""

from __future__ import annotations

from collections.abc import Mapping

from asyncinfer.job_errors import is_withdrawal
from asyncinfer.jobs import BATCH_LABEL, JobRecord


def selects(labels: Mapping[str, str], record: JobRecord) -> bool:
    """Whether a listing or watch asking for the jobs with all of `labels` shows `record`."""
    # A withdrawal is a fence, not a job its caller has: their submit was answered UNAVAILABLE
    # or with the key's other job. GetJob by its ID still answers it, saying why.
    if is_withdrawal(record):
        return False
    # A batch's chunk jobs are its own business (thousands for a large file): shown only when the
    # caller asks for a batch's, by its label, as the batch's own tests and tools do.
    if BATCH_LABEL in record.labels and BATCH_LABEL not in labels:
        return False
    return all(record.labels.get(key) == value for key, value in labels.items())
