"""Whether another scheduler took a job this one put back: read before each stats round.

A job put back here (a nak: services.scheduler.work_queue.ModelQueues.put_back) is counted in this
scheduler's depth, as its own part of the queue's (the consumer counts the message delivered, not
pending), until a pull of its own brings it back. Another scheduler may pull it first and run it:
nothing tells the putter, and the stats round's listing still holds its message (a WorkQueue
stream keeps it until its result is stored), so it stayed counted here while it ran there, once in
the other's jobs in flight and once in these put-backs, and the readers' merge (which adds every
scheduler's put-backs to the pending) counted it twice. So each round first reads the records of
up to CHECKS_PER_ROUND jobs put back here, those checked longest ago first (one direct get each,
READS_AT_ONCE at a time), and forgets those whose record moved on (ModelQueues.checked).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobRecord
from services.scheduler.superseded import READS_AT_ONCE
from services.scheduler.work_queue import ModelQueues

# Records read a round (every queue_stats_interval_s, 2 s by default): put-backs are few as a rule
# (a held pull's or a tenant window's rest, an attempt given back); a backlog of more is checked in
# turn.
CHECKS_PER_ROUND = 256


async def check_put_backs(store: JobStore, queues: Iterable[ModelQueues]) -> None:
    """Reads the records of up to CHECKS_PER_ROUND jobs put back on `queues` and tells each queue
    what it read. A record that cannot be read (NATS away) tells nothing: the job stays counted."""
    left = CHECKS_PER_ROUND
    for model_queues in queues:
        if left <= 0:
            return
        jobs = model_queues.put_back_to_check(left)
        left -= len(jobs)
        for first in range(0, len(jobs), READS_AT_ONCE):
            group = jobs[first : first + READS_AT_ONCE]
            records = await asyncio.gather(*(store.recorded(key) for _, key in group), return_exceptions=True)
            for (job_id, _), record in zip(group, records, strict=True):
                if record is None or isinstance(record, JobRecord):
                    model_queues.checked(job_id, record)
