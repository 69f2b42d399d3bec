"""The attempts of a long server stream that is opened again when it breaks (a bulk's SubmitJobs, a
job's watch, a watch of many jobs, a batch's watch), kept in one place so that every such stream
retries the same way: the errors RetryPolicy retries, its jittered backoff and `on_retry`,
`max_attempts` until the stream first answers and `stream_resume_s` after a break that followed
answers. Each answer starts the ladder again: a break is the first attempt's. Where the stream
resumes (the revision after, the requests not yet answered) is its caller's, who opens it again."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeAlias

import grpc

from asyncinfer.client._retry import Deadline, StreamBreaks
from asyncinfer.client.errors import AsyncInferClientError, UnavailableError, from_rpc_error

# The client's wait before a stream's next attempt, `ClientChannel._backoff_or_raise(error, attempt,
# deadline, cause, broken_at, earlier)`: per its RetryPolicy (what is retried, the jittered backoff,
# `on_retry`, the resume of a stream that had answered), or `error` raised (a DEADLINE_EXCEEDED with
# the hint of `earlier`, the error the attempt before was retried for).
Backoff: TypeAlias = Callable[
    [AsyncInferClientError, int, Deadline, BaseException | None, float | None, AsyncInferClientError | None],
    Awaitable[None],
]


class StreamAttempts:
    """One stream's attempts, used as

        attempts = StreamAttempts(backoff, deadline)
        while True:
            call = stub.Watch(request, timeout=attempts.start("the watch"))
            with attempts.running(call):
                async for response in call:
                    attempts.answered()
                    ...  # yield; return once done
            await attempts.broke("the watch ended before the job did")

    `running` takes a gRPC error as the attempt's break; a stream that ends without one before its
    caller returned broke too (the gateway ends none early), UNAVAILABLE with `broke`'s words."""

    def __init__(
        self,
        backoff: Backoff,
        deadline: Deadline,
        *,
        on_cancel: Callable[[], None] | None = None,
    ) -> None:
        self._backoff = backoff
        self._deadline = deadline
        # Called when the caller's task is cancelled in an attempt (the client may raise that it
        # was closed meanwhile instead).
        self._on_cancel = on_cancel
        self._attempt = 0
        self._breaks = StreamBreaks()
        self._error: AsyncInferClientError | None = None
        self._cause: BaseException | None = None
        self._earlier: AsyncInferClientError | None = None  # the break the last backoff was for

    def start(self, what: str) -> float | None:
        """Counts the next attempt; the seconds left, the stream's gRPC timeout (None: no limit).
        DeadlineExceededError naming `what` once the deadline has passed: nothing is opened."""
        self._attempt += 1
        self._deadline.check(what)
        return self._deadline.remaining()

    def answered(self) -> None:
        """The stream answered: a break from here on is the first attempt's, and resumed for
        `stream_resume_s`."""
        self._attempt = 1
        self._earlier = None
        self._breaks.answered()

    @contextmanager
    def running(
        self,
        call: grpc.aio.Call,
        *,
        timed_out: str | None = None,
        breaks_on: tuple[type[AsyncInferClientError], ...] = (),
    ) -> Iterator[None]:
        """One attempt's stream: a gRPC error raised in it is its break (kept for `broke`), as are
        the client errors of `breaks_on`; the call is cancelled however it ends. With `timed_out`,
        a DEADLINE_EXCEEDED once the stream's own deadline has passed is `Deadline.exceeded`
        naming it (grpc's words are "Stream removed")."""
        try:
            yield
        except asyncio.CancelledError:
            if self._on_cancel is not None:
                self._on_cancel()
            raise
        except grpc.RpcError as rpc_error:
            error = from_rpc_error(rpc_error)
            if timed_out is not None and error.code is grpc.StatusCode.DEADLINE_EXCEEDED and self._deadline.expired():
                error = self._deadline.exceeded(timed_out)
            self._error, self._cause = error, rpc_error
        except breaks_on as client_error:
            self._error, self._cause = client_error, None
        finally:
            call.cancel()

    async def broke(self, ended_early: str) -> None:
        """After an attempt that did not return: sleeps out the backoff before the next attempt,
        or raises the break's error (UNAVAILABLE `ended_early` for a stream that ended without
        one) when it is not retried, out of attempts, or past the deadline."""
        error = self._error or UnavailableError(ended_early, code=grpc.StatusCode.UNAVAILABLE)
        cause, self._error, self._cause = self._cause, None, None
        await self._backoff(error, self._attempt, self._deadline, cause, self._breaks.broke(), self._earlier)
        self._earlier = error
