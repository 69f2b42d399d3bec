"""SubmitJob's wait (its `wait` field): the answer is held until the job ends, or until the wait
passes, so that a caller who wants the result now makes one call instead of a SubmitJob and a
WatchJob (Replicate's `Prefer: wait`, a synchronous call on an asynchronous API).

The job is accepted first, exactly as without a wait: durably queued, its ID fixed. The wait is a
watch of that job (services.gateway.watch_one) with a time limit, and however it ends (the limit,
the gateway shutting down, the caller going away) the job goes on; the answer is the latest record
the watch saw, which a caller reads like any SubmitJob answer (a finished job, or one still QUEUED
or RUNNING to watch or poll). The wait is cut to `gateway.max_submit_wait_s`, and ends early enough
for the answer to reach the caller before its call's deadline: a caller whose deadline passed
would learn nothing of a job that was accepted.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from asyncinfer.errors import AsyncInferError
from asyncinfer.jobs import JobRecord
from asyncinfer.log_throttle import RepeatedLines
from services.gateway.watch_hub import WatchHub
from services.gateway.watch_one import watch_job

log = structlog.get_logger("asyncinfer.gateway")

# The answer must leave this long before the call's deadline (or with a quarter of the time left,
# when less remains): serializing it and crossing the network take a moment, longer on a busy machine.
ANSWER_MARGIN_S = 0.25


def wait_budget_s(asked_s: float, max_s: float, time_remaining_s: float | None) -> float:
    """How long a SubmitJob that asked to wait `asked_s` holds its answer: at most `max_s`
    (gateway.max_submit_wait_s), and ending before the call's deadline (`time_remaining_s`, None:
    the call has none)."""
    budget = min(asked_s, max_s)
    if time_remaining_s is not None:
        budget = min(budget, time_remaining_s - min(ANSWER_MARGIN_S, time_remaining_s / 4))
    return max(budget, 0.0)


async def wait_for_end(hub: WatchHub, record: JobRecord, budget_s: float, lines: RepeatedLines) -> JobRecord:
    """The job's record once it is terminal, or the latest one seen when `budget_s` pass (the job
    itself goes on either way). `lines`: the service's, for a wait that ended early."""
    latest = record
    if budget_s <= 0 or record.state.is_terminal:
        return latest
    try:
        async with asyncio.timeout(budget_s):
            async with contextlib.aclosing(watch_job(hub, record.tenant, record.job_id)) as changes:
                async for change in changes:
                    if isinstance(change, JobRecord):  # (no progress asides: no queue of its own)
                        latest = change
    except TimeoutError:
        pass
    except AsyncInferError as error:  # the gateway is stopping, say: the job was accepted, answer it
        # Once per interval per model and reason (the rest at debug): a stopping gateway ends every
        # waiting call at once, a line each.
        lines.say(
            log,
            "warning",
            "submit_wait_ended",
            kind=(record.model_name, error.reason),
            job_id=record.job_id,
            model=record.model_name,
            error=error.message,
        )
    return latest
