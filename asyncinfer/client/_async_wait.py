"""AsyncClient's waits (asyncinfer.client._async): wait and wait_jobs until jobs end, and run (submit, wait,
outputs); an interrupted wait or run says in a note that its job goes on."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import difflib
import inspect
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from asyncinfer.client._async_blobs import BlobCalls
from asyncinfer.client._async_channel import JobLike, _job_id, _job_ids, _unary_budget
from asyncinfer.client._async_jobs import WATCH_JOBS_MAX_IDS, JobCalls
from asyncinfer.client._async_watch import JobWatches
from asyncinfer.client._retry import Deadline
from asyncinfer.client.errors import (
    AsyncInferClientError,
    DeadlineExceededError,
    InternalError,
    JobFailedError,
    ended_at,
)
from asyncinfer.client.types import Inputs, Job

# The keywords `run` passes on to `submit` (its own `timeout_s` bounds the whole run).
_SUBMIT_OPTIONS = frozenset(
    name for name, parameter in inspect.signature(JobCalls.submit).parameters.items()
    if parameter.kind is parameter.KEYWORD_ONLY and name != "timeout_s"
)  # fmt: skip


def check_run_options(submit_options: dict[str, Any]) -> None:
    """TypeError for a keyword `run` does not take, saying what it takes and where inputs go:
    `run("demo", x=array)` was "JobCalls.submit() got an unexpected keyword argument 'x'", a
    method the caller never called."""
    for name in submit_options:
        if name not in _SUBMIT_OPTIONS:
            close = difflib.get_close_matches(name, [*_SUBMIT_OPTIONS, "timeout_s"], n=1)
            meant = (
                f"did you mean {close[0]!r}?" if close else f"inputs go in a mapping: run(model, {{{name!r}: array}})"
            )
            raise TypeError(
                f"run() got an unexpected keyword argument {name!r}: {meant} (run takes timeout_s and "
                f"submit's options: {', '.join(sorted(_SUBMIT_OPTIONS))})"
            )


def wait_interrupted_note(job_id: str) -> str:
    """The note on an interrupted wait (KeyboardInterrupt, CancelledError): the job goes on."""
    return f"job {job_id} goes on: client.wait({job_id!r}) waits for it again"


def run_interrupted_note(submitted: Sequence[Job], idempotency_key: str) -> str:
    """The note on an interrupted run: its job, or, before the gateway answered the submit (which
    it holds while the job runs: wait_s), the idempotency key that finds it."""
    if submitted:
        job_id = submitted[0].job_id
        return (
            f"the run's job {job_id} goes on: client.wait({job_id!r}) waits for it again, "
            f"client.cancel({job_id!r}) stops it"
        )
    return (
        f"the gateway had not answered the run's submit yet, so its job may be queued: submitting "
        f"the same request with idempotency_key={idempotency_key!r} returns that job if so (and queues it once "
        "if not)"
    )


class JobWaits(JobWatches, BlobCalls):
    """AsyncClient's wait, wait_jobs and run, over its submits, watches and result reads."""

    async def wait_jobs(
        self, jobs: Iterable[JobLike], *, timeout_s: float | None = None
    ) -> dict[str, Job | AsyncInferClientError]:
        """Waits until every job is terminal, on one WatchJobs stream per 10,000 jobs; each job ID
        mapped to its final Job (or the error for it: NotFoundError, or InternalError naming the
        state of a job the gateway ended in a state newer than this SDK, as `wait` raises it).
        DeadlineExceededError when
        `timeout_s` passes first. When one stream fails, the others are closed before its error
        is raised."""
        ids = _job_ids(jobs)
        found: dict[str, Job | AsyncInferClientError] = {}

        async def watch(chunk: list[str]) -> None:
            async with contextlib.aclosing(self.watch_jobs(chunk, timeout_s=timeout_s)) as updates:
                async for update in updates:
                    if isinstance(update, Job):
                        if update.done:
                            found[update.job_id] = update
                    else:
                        found[update[0]] = update[1]

        # Each stream a task owned here: the first to fail (a refusal, its retries spent) ends the
        # wait, and the others are cancelled and awaited before its error is raised (under gather
        # they watched on with nothing awaiting them). Not a TaskGroup: under Python 3.11 one whose
        # child fails while it waits on them leaves the caller's task marked as being cancelled.
        streams = [
            asyncio.create_task(watch(ids[start : start + WATCH_JOBS_MAX_IDS]))
            for start in range(0, len(ids), WATCH_JOBS_MAX_IDS)
        ]
        try:
            for finished in asyncio.as_completed(streams):
                await finished
        finally:
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
        return {job_id: found[job_id] for job_id in ids}

    async def wait(self, job: JobLike, *, timeout_s: float | None = None) -> Job:
        """Waits until the job is in a terminal state (SUCCEEDED, FAILED, CANCELED, EXPIRED,
        TIMED_OUT) and returns it; it does not raise for a failed job (see `run`).
        DeadlineExceededError when `timeout_s` passes first (the job itself carries on).
        Cancelled (a task's cancel, an asyncio.timeout, Ctrl-C under asyncio.run), the job goes
        on: the CancelledError's note names it, as the blocking Client's KeyboardInterrupt's does."""
        try:
            return await self._wait(job, timeout_s=timeout_s)
        except asyncio.CancelledError as cancelled:
            cancelled.add_note(wait_interrupted_note(_job_id(job)))
            raise

    async def _wait(self, job: JobLike, *, timeout_s: float | None = None) -> Job:
        last: Job | None = None
        async with contextlib.aclosing(self.watch(job, timeout_s=timeout_s)) as updates:
            async for update in updates:
                last = update
        if last is None:  # watch only ends early by raising
            raise InternalError(f"the watch of {_job_id(job)} ended without a terminal state")
        if not last.done:
            # The gateway ended the watch, so the job is terminal, in a state newer than this SDK.
            raise ended_at(f"job {_job_id(job)}", last.state)
        return last

    async def run(
        self, model: str, inputs: Inputs | None = None, *, timeout_s: float | None = None, **submit_options: Any
    ) -> dict[str, npt.NDArray[np.generic]]:
        """Submits, waits and returns the outputs (read with `read_result` when large);
        JobFailedError when the job ends in any state but SUCCEEDED. `timeout_s` bounds the whole
        run; submit options are those of `submit`. A job that ends within the submit's own
        deadline is answered by that one call (the gateway holds its answer: `submit`'s `wait_s`);
        a longer one is then watched to its end. When `timeout_s` passes, DeadlineExceededError
        names the job (it goes on). Cancelled, the job goes on too: the CancelledError's note names
        it, or, when the gateway had not answered the submit yet, the idempotency key that finds it."""
        # Known here, not only inside the submit: a run is mostly cancelled while the gateway holds
        # the submit's answer (wait_s), before any job ID has come back.
        key = submit_options.get("idempotency_key") or str(uuid.uuid4())
        submitted: builtins.list[Job] = []
        try:
            return await self._run_job(
                model, inputs, timeout_s, {**submit_options, "idempotency_key": key}, submitted.append
            )
        except asyncio.CancelledError as cancelled:
            cancelled.add_note(run_interrupted_note(submitted, key))
            raise

    async def _run_job(
        self,
        model: str,
        inputs: Inputs | None,
        timeout_s: float | None,
        submit_options: dict[str, Any],
        submitted: Callable[[Job], None] | None,
    ) -> dict[str, npt.NDArray[np.generic]]:
        """`run`; `submitted` is told the job once the gateway has answered (the blocking Client
        names it when Ctrl-C interrupts the run)."""
        deadline = Deadline(timeout_s)
        check_run_options(submit_options)
        deadline.check("the run (nothing was submitted)")
        budget = _unary_budget(deadline, self.timeout_s)
        submit_options.setdefault("wait_s", budget)  # cut to leave the answer its time (submit_request)
        job = await self.submit(model, inputs, timeout_s=budget, **submit_options)
        if submitted is not None:
            submitted(job)
        try:
            done = job if job.done else await self._wait(job, timeout_s=deadline.remaining())
        except DeadlineExceededError as error:
            if not deadline.expired():
                raise
            # The wait's own text gave what was left of the run's time ("within 0.495 s" for a
            # run given 2 s): say the run's.
            raise deadline.exceeded(f"the run of job {job.job_id} (it goes on)") from error
        if not done.succeeded:
            raise JobFailedError(done)
        return await self.outputs(done, timeout_s=deadline.remaining())
