"""AsyncClient's watches (asyncinfer.client._async): one job's changes on WatchJob (watch), and many jobs' on
one WatchJobs stream (watch_jobs), reopened when it breaks; a label watch then catches up on what it missed
from ListJobs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Iterable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import grpc

from asyncinfer.client._async_channel import JobLike, _job_id, _job_ids, _unary_budget
from asyncinfer.client._async_jobs import JobCalls
from asyncinfer.client._convert import error_from_proto, job_from_proto
from asyncinfer.client._retry import Deadline, checked_timeout
from asyncinfer.client._stream_retry import StreamAttempts
from asyncinfer.client.errors import (
    AsyncInferClientError,
    ended_at,
    from_rpc_error,
    make_error,
    with_connection_hint,
    with_earlier_hint,
)
from asyncinfer.client.jobs_watch import (
    CATCH_UP_MAX_JOBS,
    CATCH_UP_PAGE_SIZE,
    LISTENING,
    CatchUpTries,
    DeliveredRevisions,
    JobsWatch,
    Listening,
    WatchUpdate,
    catch_up_retries,
    headers_since,
    listened,
    missed,
    said_listening,
)
from asyncinfer.client.types import Job, JobProgress
from asyncinfer.v1 import job_service_pb2

# The logger's name is the module's that held the watches before they moved here.
_log = logging.getLogger("asyncinfer.client._async")


def watch_given_up_note(job_id: str, last_revision: int) -> str:
    """The note on a watch that gave up on a broken stream: the job goes on, and where to resume."""
    resume = (
        f"client.watch({job_id!r}, after_revision={last_revision})" if last_revision else f"client.watch({job_id!r})"
    )
    return f"job {job_id} goes on: {resume} resumes the watch from the last change it saw"


class JobWatches(JobCalls):
    """AsyncClient's watch and watch_jobs: streams reopened after a break, no change lost or repeated."""

    async def watch(
        self, job: JobLike, *, after_revision: int = 0, timeout_s: float | None = None
    ) -> AsyncGenerator[Job, None]:
        """The job now, then each change, ending after a terminal state. With `after_revision` (a
        revision seen before) only the changes after it: nothing when the job ended at it. A model
        that reports progress adds a snapshot per report (`progress`); a running job's snapshot
        carries the latest progress of its attempt, whatever message brought it.

        A broken stream (the gateway restarting, a network blip) is reopened with
        `after_revision`, so no change is lost or repeated. `timeout_s` bounds the whole watch
        (default: none); when it passes, DeadlineExceededError."""
        if after_revision < 0:
            raise ValueError(f"after_revision is a record revision (0 or more), got {after_revision}")
        job_id = _job_id(job)
        deadline = Deadline(timeout_s)
        last_revision = after_revision
        seen = False  # a record was yielded: a reopened watch's first record may repeat it
        progress: tuple[int, JobProgress] | None = None  # the latest, and the attempt it is of
        attempts = StreamAttempts(self._backoff_or_raise, deadline, on_cancel=self._raise_if_closed_meanwhile)
        what = f"the watch of job {job_id} (it goes on)"
        while True:
            timeout = attempts.start(what)
            request = job_service_pb2.WatchJobRequest(job_id=job_id, after_revision=last_revision)
            call = self._stub.WatchJob(request, timeout=timeout, metadata=self._metadata)
            first = True
            with attempts.running(call, timed_out=what):
                async for response in call:
                    snapshot = job_from_proto(
                        response.job, response.progress if response.HasField("progress") else None
                    )
                    # after_revision 0 sends the current record whatever its revision, and a
                    # job still queued has revision 0: the reopened watch repeats it.
                    repeated = (
                        seen and first and snapshot.revision <= last_revision and not response.HasField("progress")
                    )
                    first = False
                    if repeated:
                        continue
                    if snapshot.progress is not None:
                        progress = (snapshot.attempt, snapshot.progress)
                    elif progress is not None and progress[0] == snapshot.attempt and not snapshot.done:
                        # A message of the record alone (its state, or the scheduler keeping the
                        # progress every few seconds): the latest progress still holds.
                        snapshot = replace(snapshot, progress=progress[1])
                    last_revision = max(last_revision, snapshot.revision)
                    seen = True
                    attempts.answered()
                    yield snapshot
                    if snapshot.done:
                        return
                if first and last_revision:
                    # Ended OK with nothing newer: the gateway ends a watch only once the job is
                    # terminal, here at the revision already seen (`after_revision` was its last).
                    return
            try:
                await attempts.broke("the watch ended before the job did")
            except AsyncInferClientError as given_up:
                if self.retry.retriable(given_up):  # the stream broke for longer than it is resumed for
                    given_up.add_note(watch_given_up_note(job_id, last_revision))
                raise

    def watch_jobs(
        self,
        jobs: Iterable[JobLike] = (),
        *,
        labels: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> JobsWatch:
        """Many jobs on one stream (WatchJobs). With `jobs`: each job now, then each change, until
        all are terminal; a job that is not there yields (job_id, NotFoundError) and the others go
        on, as does one the gateway ended in a state newer than this SDK (its Job yielded as it
        ended, `done` False), then (job_id, InternalError naming the state). With `labels` instead: every change, from now on, of your jobs that carry all of them,
        until you stop iterating or `timeout_s` passes. `await watch.ready()` returns once the
        gateway listens: a job submitted after it is seen from QUEUED on (asyncinfer.client.jobs_watch).
        A broken stream is reopened (the jobs not yet terminal are sent again as they stand, so a
        change is never lost). A label watch hears no change while it is broken, so once reopened it
        lists the jobs with its labels (ListJobs) and first yields, as they stand now, those that
        changed since it started and whose latest state it has not yielded: after a reconnect, each
        job's latest state at least once, then the live changes (at most 10,000 jobs listed,
        newest first; a job that ended before the watch started is not yielded)."""
        checked_timeout(timeout_s)  # here, not at the first step
        return JobsWatch(self._watch_jobs(jobs, labels, timeout_s))

    async def _watch_jobs(
        self, jobs: Iterable[JobLike], labels: Mapping[str, str] | None, timeout_s: float | None
    ) -> AsyncGenerator[WatchUpdate | Listening, None]:
        ids = _job_ids(jobs)
        deadline = Deadline(timeout_s)
        done: set[str] = set()
        attempts = StreamAttempts(self._backoff_or_raise, deadline, on_cancel=self._raise_if_closed_meanwhile)
        listening = False
        # A label watch: when it first listened (on the gateway's clock), and what it delivered of
        # each job (what a reopened watch's catch-up compares the listed jobs with, and what drops
        # a repeated change).
        since: datetime | None = None
        since_call: grpc.aio.UnaryStreamCall[Any, Any] | None = None  # whose late headers may say `since`
        delivered = DeliveredRevisions()
        catch_up_tries = CatchUpTries()
        while True:
            watching = [job_id for job_id in ids if job_id not in done]
            if ids and not watching:
                return
            timeout = attempts.start(
                f"the watch of {len(watching)} job(s)" if ids else f"the label watch of {dict(labels or {})}"
            )
            request = job_service_pb2.WatchJobsRequest(job_ids=watching, labels=dict(labels or {}))
            call = self._stub.WatchJobs(request, timeout=timeout, metadata=self._metadata)
            sent: dict[str, Job] = {}  # a watch of IDs: each job's latest state on this stream
            # A failure of the catch-up's ListJobs is a break as the stream's are.
            with attempts.running(call, breaks_on=(AsyncInferClientError,)):
                if labels and since is None and (ready := await listened(call, deadline.remaining())) is not None:
                    # The gateway's clock, which the listed jobs' times are compared with after a
                    # reconnect; the client's only until the gateway says (its headers came late), or
                    # from one that does not (before session 30).
                    listening, since = True, ready.since or datetime.now(UTC)
                    since_call = None if ready.since is not None else call
                    attempts.answered()
                    yield LISTENING
                elif labels and since is not None:
                    # Reopened: once the new stream listens, what changed while the old one was
                    # broken (the changes after the headers come on the stream, repeats dropped).
                    reopened = await listened(call, deadline.remaining())
                    if not call.done():  # else the stream says why it ended, and the next one catches up
                        if since_call is not None:
                            since = await headers_since(since_call) or since
                            since_call = None
                        attempts.answered()
                        caught_up = self._missed_by_label_watch(
                            labels, since, delivered, deadline, call, catch_up_tries
                        )
                        async with contextlib.aclosing(caught_up):
                            async for job in caught_up:
                                delivered.delivered(job)
                                yield job
                        # Listed before the gateway said it listens (its headers late: a loaded
                        # gateway just restarted): a job that changed between that listing and its
                        # subscription came neither way (session 32's CI4: the watch waited for it
                        # to its timeout). Once it says so, list again; repeats are dropped.
                        if (
                            reopened is not None
                            and reopened.unconfirmed
                            and await said_listening(call, deadline.remaining())
                        ):
                            caught_up = self._missed_by_label_watch(
                                labels, since, delivered, deadline, call, catch_up_tries
                            )
                            async with contextlib.aclosing(caught_up):
                                async for job in caught_up:
                                    delivered.delivered(job)
                                    yield job
                async for response in call:
                    attempts.answered()
                    if not listening:  # the first message (a watch of IDs: every job as it stands)
                        listening = True
                        if labels and since is None:
                            since = await headers_since(call) or datetime.now(UTC)
                        yield LISTENING
                    for change in response.changes:
                        if change.HasField("job"):
                            snapshot = job_from_proto(
                                change.job, change.progress if change.HasField("progress") else None
                            )
                            if labels:
                                if not delivered.is_new(snapshot):
                                    continue
                                delivered.delivered(snapshot)
                            # What a watch of IDs ends by; a label watch keeps only `delivered`
                            # (bounded), or it held every job that ended for as long as it lived.
                            elif snapshot.done:
                                done.add(change.job_id)
                            else:
                                sent[change.job_id] = snapshot
                            yield snapshot
                        else:
                            if ids:
                                done.add(change.job_id)
                            failure = error_from_proto(change.error)
                            yield change.job_id, make_error(failure.code, failure.message, reason=failure.reason)
                # The gateway ends a watch of IDs once every job is terminal: one this SDK does not
                # take for done ended in a state newer than it. Before, the end was taken for a
                # break and the stream opened again, answered with the job and ended, for ever.
                for job_id, last in sent.items():
                    if job_id not in done:
                        done.add(job_id)
                        yield job_id, ended_at(f"job {job_id}", last.state)
                if ids and all(job_id in done for job_id in ids):
                    return
            await attempts.broke("the watch ended before the jobs did")

    async def _missed_by_label_watch(
        self,
        labels: Mapping[str, str],
        since: datetime,
        delivered: DeliveredRevisions,
        deadline: Deadline,
        stream: grpc.aio.Call,
        tries: CatchUpTries,
    ) -> AsyncGenerator[Job, None]:
        """The jobs with `labels` whose latest record a reopened label watch has not delivered
        (jobs_watch.missed), as they stand: at most CATCH_UP_MAX_JOBS listed, newest first. Each
        page is tried until it is answered while the watch may live (jobs_watch.catch_up_retries);
        it stops early when the reopened `stream` ended meanwhile (the next one catches up)."""
        listed = 0
        token = ""
        while True:
            page = await self._catch_up_page(labels, token, deadline, stream, tries)
            if page is None:
                return
            for message in page.jobs:
                listed += 1
                if listed > CATCH_UP_MAX_JOBS:
                    _log.warning(
                        "a label watch of %s reconnected; more than %d jobs carry the labels: the changes "
                        "of the older ones while it was broken are not caught up",
                        dict(labels),
                        CATCH_UP_MAX_JOBS,
                    )
                    return
                job = job_from_proto(message)
                if missed(job, delivered, since):
                    yield job
            token = page.next_page_token
            if not token:
                return

    async def _catch_up_page(
        self,
        labels: Mapping[str, str],
        token: str,
        deadline: Deadline,
        stream: grpc.aio.Call,
        tries: CatchUpTries,
    ) -> job_service_pb2.ListJobsResponse | None:
        """One page of a catch-up's listing, retried with the policy's backoff and jitter (each try
        with the client's call timeout, within the watch's); None when `stream` ended first. `tries`:
        what the watch's catch-ups met since one was answered."""
        request = job_service_pb2.ListJobsRequest(page_size=CATCH_UP_PAGE_SIZE, labels=dict(labels), page_token=token)
        attempt = 0
        while True:
            attempt += 1
            try:
                page = await self._stub.ListJobs(
                    request, timeout=_unary_budget(deadline, self.timeout_s), metadata=self._metadata
                )
            except asyncio.CancelledError:
                self._raise_if_closed_meanwhile()
                raise
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error)
                # Raised as the other calls raise theirs (ClientChannel._backoff_or_raise): the
                # most telling error of the target's addresses and its hint (TLS, mutual TLS), and
                # at the deadline what the listing met rather than "did not complete". A last try
                # that the watch's deadline cut short (DEADLINE_EXCEEDED, on a busy machine) keeps
                # the hint of what a try before it met ("earlier tries: ..."), in this catch-up or
                # an earlier one of the watch (CatchUpTries).
                if not catch_up_retries(error, self.retry) or not deadline.allows_sleep(
                    delay := self.retry.backoff_s(attempt, error)
                ):
                    hinted = await self._hinted(error, deadline)
                    tries.met(hinted)
                    raise with_earlier_hint(
                        hinted, tries.telling, tls=self._tls, client_cert=self._client_cert
                    ) from rpc_error
                if stream.done():
                    return None
                if self.retry.on_retry is not None:
                    self.retry.on_retry(error, delay)
                # What a try met (a try cut short by the client's call timeout has no hint: the
                # catch-up tries those again too): the hint a later DEADLINE_EXCEEDED keeps.
                tries.met(with_connection_hint(error, tls=self._tls, client_cert=self._client_cert))
                await asyncio.sleep(delay)
            else:
                tries.answered()
                return page
