"""What `AsyncClient.watch_jobs` returns: the changes of a WatchJobs stream, and `ready()`, which
returns once the gateway listens.

A label watch hears the jobs submitted from the moment the gateway has subscribed to what it needs,
which it says by sending the stream's headers (asyncinfer.grpc_headers.WATCH_READY_HEADER) before
any change. `ready()` waits for them, so that

    watch = client.watch_jobs(labels={"run": "7"})
    await watch.ready()
    job = await client.submit("demo", inputs, labels={"run": "7"})

sees the job from QUEUED on. A gateway before session 29 sends its headers only with the first
change, which may never come: the wait is bounded (READY_WAIT_S), after which the watch carries
on as before (a job submitted meanwhile may show no QUEUED change, its later changes do come).

A label watch hears nothing while its stream is broken (a gateway restart, a network blip), so
after reopening it, and once the new stream listens, the SDK lists the jobs with the same labels
(ListJobs) and yields those whose latest record it has not delivered: list, then watch, as a
Kubernetes informer relists. A caught-up job comes as it stands (its latest record, not each change
it went through while the watch was broken), unmarked: after a reconnect each job's latest state
comes at least once, then the live changes. `DeliveredRevisions` and `missed` decide which.
A reopened stream taken as listening before its headers came (READY_WAIT_S ran out: a loaded
gateway just restarted) lists again once they say it listens: a job that changed between the first
listing and the gateway's subscription came neither way (session 32).

The catch-up's listing is retried for as long as the watch may live (`catch_up_retries`): after a
gateway restart every label watch lists at once, and a listing that ran past its call deadline
(DEADLINE_EXCEEDED, which no other call retries) ended the watch (session 30: 136 of 200 watches).
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import grpc
from grpc import aio

from asyncinfer.client._retry import RetryPolicy
from asyncinfer.client.errors import AsyncInferClientError
from asyncinfer.client.types import Job
from asyncinfer.grpc_headers import WATCH_READY_HEADER, WATCH_SINCE_HEADER

# The longest a label watch waits for its headers (then it carries on without them). A gateway
# sends them a NATS round trip or three after the stream opens (milliseconds); one before session 29
# only with the first change.
READY_WAIT_S = 5.0
# How long a watch that answered or ended is given to hand over headers it already has.
LATE_HEADERS_WAIT_S = 1.0

# Jobs whose last delivered revision a label watch keeps (the one that changed least recently is
# forgotten first), as the gateway keeps per stream (services/gateway/watch_many.py); and the most
# jobs a reopened label watch lists (ListJobs, newest first: the oldest beyond it are not caught up).
REVISIONS_KEPT = 10_000
CATCH_UP_MAX_JOBS = 10_000
# ListJobs' largest page.
CATCH_UP_PAGE_SIZE = 1000

WatchUpdate = Job | tuple[str, AsyncInferClientError]


class Listening:
    """Put by the watch's generator before its first change: the gateway listens (a label watch's
    headers came, or its wait for them ended; a watch of IDs answered)."""


LISTENING = Listening()


@dataclass(frozen=True, slots=True)
class Listened:
    """A label watch's stream listens; `since`: from when, on the gateway's clock (its
    WATCH_SINCE_HEADER), None from a gateway that did not say (before session 30, or no headers)."""

    since: datetime | None = None
    # Taken as listening because its headers did not come within the wait (a loaded gateway, or
    # one before session 29), not because they said so.
    unconfirmed: bool = False


@dataclass(frozen=True, slots=True)
class StreamHeaders:
    """What a label watch reads in its stream's headers: whether the gateway says it listens
    (WATCH_READY_HEADER) and from when on its clock (WATCH_SINCE_HEADER, None when it does not
    say). A call that ended without headers says neither."""

    ready: bool = False
    since: datetime | None = None


async def stream_headers(call: aio.UnaryStreamCall[Any, Any], wait_s: float | None) -> StreamHeaders | None:
    """The call's headers, once they come within `wait_s` (None: no bound); None when they do not.
    The one reader of the headers a gateway sends: `listened`, `said_listening` and `headers_since`
    are what each moment of a label watch makes of them."""
    try:
        async with asyncio.timeout(wait_s):
            headers = await call.initial_metadata()
    except TimeoutError:
        return None
    except grpc.RpcError:
        return StreamHeaders()
    return StreamHeaders(ready=any(key == WATCH_READY_HEADER for key, _ in headers or ()), since=_gateway_time(headers))


async def listened(call: aio.UnaryStreamCall[Any, Any], remaining_s: float | None) -> Listened | None:
    """Whether to take a label watch as listening now: its headers say so (WATCH_READY_HEADER), or
    none came within READY_WAIT_S (or the call's `remaining_s`, if shorter: a gateway before
    session 29, carry on without). None when headers came without it (such a gateway's first
    change, or the call's end): the stream says the rest."""
    headers = await stream_headers(call, READY_WAIT_S if remaining_s is None else min(READY_WAIT_S, remaining_s))
    if headers is None:
        return Listened(unconfirmed=True)
    return Listened(since=headers.since) if headers.ready else None


async def said_listening(call: aio.UnaryStreamCall[Any, Any], remaining_s: float | None) -> bool:
    """Whether a stream taken as listening before its headers came (Listened.unconfirmed) says
    now, within `remaining_s`, that it listens: its headers came with WATCH_READY_HEADER. A
    gateway before session 29 sends its headers with its first change instead (False: the change
    is the stream's to read, and nothing was missed that its headers would tell)."""
    headers = await stream_headers(call, remaining_s)
    return headers is not None and headers.ready


async def headers_since(call: aio.UnaryStreamCall[Any, Any]) -> datetime | None:
    """The WATCH_SINCE_HEADER of a call whose headers have come (it answered, or it ended), None
    when they say none: for a watch that took itself as listening before its headers came (a
    loaded gateway past READY_WAIT_S) and then read the client's clock."""
    headers = await stream_headers(call, LATE_HEADERS_WAIT_S)
    return headers.since if headers is not None else None


def _gateway_time(headers: Any) -> datetime | None:
    """The WATCH_SINCE_HEADER's Unix seconds as a time; None when absent, not a number or no date
    (past what datetime holds: the header is a server's to say, the error would be the watch's)."""
    value = next((value for key, value in headers or () if key == WATCH_SINCE_HEADER), None)
    try:
        seconds = float(value) if isinstance(value, str) else math.nan
        return datetime.fromtimestamp(seconds, UTC) if math.isfinite(seconds) else None
    except (ValueError, OverflowError, OSError):
        return None


class DeliveredRevisions:
    """The last revision a label watch delivered of each job, at most `kept` jobs (the one that
    changed least recently forgotten first: a forgotten job that changed while the watch was broken
    may come again after the reconnect, at least once rather than never)."""

    def __init__(self, kept: int = REVISIONS_KEPT) -> None:
        self._kept = kept
        self._revisions: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._revisions)

    def knows(self, job_id: str) -> bool:
        return job_id in self._revisions

    def is_new(self, job: Job) -> bool:
        """Whether `job` is newer than what was delivered of it (a reopened stream, or the listing
        after it, repeats what came before the break; a queued job stays at revision 0)."""
        known = self._revisions.get(job.job_id)
        return known is None or job.revision > known

    def delivered(self, job: Job) -> None:
        self._revisions[job.job_id] = job.revision
        self._revisions.move_to_end(job.job_id)
        if len(self._revisions) > self._kept:
            self._revisions.popitem(last=False)


class CatchUpTries:
    """What a label watch's catch-up listings met since one was last answered: the latest error that
    had a hint (a closed socket's "if the server is on TLS, give tls_ca_file="), which a try cut short
    by the watch's deadline keeps ("earlier tries: ..."). Kept across catch-ups, not per listing: a
    catch-up refused until its deadline left no room for a wait ends, the stream reopens (and
    answers), and the next catch-up's first try may be the one cut short (CI, session 38: a
    "Deadline Exceeded" with no hint after 5 s of refused listings)."""

    def __init__(self) -> None:
        self.telling: AsyncInferClientError | None = None

    def met(self, error: AsyncInferClientError) -> None:
        """A try's error, its hint (if any) already set: kept when it has one."""
        if error.hint:
            self.telling = error

    def answered(self) -> None:
        self.telling = None


def missed(job: Job, delivered: DeliveredRevisions, since: datetime) -> bool:
    """Whether a job listed after a reconnect is news to the watch: newer than what it delivered of
    the job; for a job it delivered nothing of (or forgot), one that changed since the watch first
    listened (`since`: the gateway's clock then, as its headers said; a job's times are the
    services' that wrote them, so only the servers' skew among themselves moves the boundary, not
    the client's). A job that ended before the watch started is not news: a label watch reports
    changes from when it starts."""
    if delivered.knows(job.job_id):
        return delivered.is_new(job)
    changed = job.end_time if job.done else job.update_time
    return changed is None or changed >= since


def catch_up_retries(error: AsyncInferClientError, retry: RetryPolicy) -> bool:
    """Whether a reopened label watch tries its catch-up's ListJobs page again after `error`: what
    the policy retries (UNAVAILABLE; RESOURCE_EXHAUSTED unless turned off) and DEADLINE_EXCEEDED
    (a gateway answering every reconnected watch at once), without a count of attempts: the watch's
    own timeout, if any, bounds them, as it bounds the reopened stream. Not when the policy turns
    stream resumes off (`stream_resume_s` 0): the catch-up is part of the resume."""
    if not retry.stream_resume_s:
        return False
    return error.code is grpc.StatusCode.DEADLINE_EXCEEDED or retry.retriable(error)


class JobsWatch:
    """The changes of one watch (an async iterator, closed with `aclose`, as the async generator it
    replaces, or at the end of an `async with` block), and `ready()`.

        async with client.watch_jobs(labels={"run": "7"}) as watch:
            await watch.ready()
            async for update in watch:
                ...

    Leaving the block, part-way, at an error or without iterating, ends the stream at once (the
    gateway's watcher goes with it), as the blocking client's StreamIterator does in a `with`."""

    def __init__(self, updates: AsyncGenerator[WatchUpdate | Listening, None]) -> None:
        self._updates = updates
        # Changes `ready` read before the marker: none while the generator puts the marker first,
        # and none lost if it ever did not.
        self._early: list[WatchUpdate] = []
        self._listening = False

    async def ready(self) -> None:
        """Returns once the gateway listens: for a label watch, a job submitted after it is seen
        from QUEUED on (against a gateway before session 29: after READY_WAIT_S at most, with no
        such promise). For a watch of IDs, once its first message came. Raises what the watch
        raises before that (InvalidArgumentError for a bad selector)."""
        while not self._listening:
            try:
                update = await anext(self._updates)
            except StopAsyncIteration:
                return
            if isinstance(update, Listening):
                self._listening = True
            else:
                self._early.append(update)

    def __aiter__(self) -> JobsWatch:
        return self

    async def __anext__(self) -> WatchUpdate:
        if self._early:
            return self._early.pop(0)
        while True:
            update = await anext(self._updates)
            if not isinstance(update, Listening):
                return update
            self._listening = True

    async def aclose(self) -> None:
        """Ends the watch: its stream is cancelled before this returns. A closed watch ends
        (StopAsyncIteration), as a closed generator does; closing it again does nothing."""
        await self._updates.aclose()

    async def __aenter__(self) -> JobsWatch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
