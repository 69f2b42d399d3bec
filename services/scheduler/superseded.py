"""Which attempts held here another scheduler has taken over: read before each renewal round.

An in-progress ack names its message by stream sequence, and nats-server applies it to the
delivery pending now, whichever it is. So a scheduler whose lease lapsed (frozen, its renewals
lost) and that still holds the attempt kept renewing the newer attempt's delivery too: had the
newer scheduler died, its message stayed out until the stale attempt ended (up to its execution
timeout, or for ever without one) instead of coming back after AckWait. Nothing tells the stale
scheduler before its attempt's own end: no write of its own is due (a progress write at most), and
the one that took over tells no one. So each renewal round first reads the records of the attempts
it renews (one direct get each, READS_AT_ONCE at a time), and lets go of those whose record names a
later attempt. The cost (bench/lease_renewal_reads.py) is in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobRecord
from services.scheduler.leases import InFlightJob

# Record reads in flight at once: one group of pipelined requests, not thousands of futures.
READS_AT_ONCE = 256


@dataclass(frozen=True, slots=True)
class Superseded:
    """An attempt held here whose record names a later one (`latest`)."""

    job: InFlightJob
    latest: JobRecord


async def superseded(store: JobStore, jobs: Sequence[InFlightJob]) -> list[Superseded]:
    """The attempts among `jobs` whose record, as read now, names a later attempt. A record that
    cannot be read (NATS away) or is gone counts as not superseded: the renewal goes on as before,
    and the attempt's own end finds out."""
    found: list[Superseded] = []
    for first in range(0, len(jobs), READS_AT_ONCE):
        group = jobs[first : first + READS_AT_ONCE]
        records = await asyncio.gather(*(store.recorded(job.record.key) for job in group), return_exceptions=True)
        for job, latest in zip(group, records, strict=True):
            # Later only: a replica a write has not reached yet answers an older revision.
            if isinstance(latest, JobRecord) and latest.attempt > job.attempt:
                found.append(Superseded(job=job, latest=latest))
    return found
