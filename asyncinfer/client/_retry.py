"""Retry policy and deadlines: exponential backoff with equal jitter, bounded in attempts and by the
call's own deadline (a retry never sleeps past it)."""

from __future__ import annotations

import numbers
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from asyncinfer.client._convert import a_kind
from asyncinfer.client.errors import MESSAGE_TOO_LARGE, AsyncInferClientError, DeadlineExceededError, no_such_host


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """When and how long to wait before trying a call again.

    UNAVAILABLE is retriable (the gateway restarting, a load balancer between pods, NATS failing
    over), a host name DNS says does not exist included: a program (a Kubernetes pod, a compose
    service) often starts before its gateway's name exists (a headless Service's pod record, a
    compose service's name appear once the gateway runs). The error raised when the attempts or the
    deadline run out then ends with the hint "no host has that name: is it spelled right?" (a
    DeadlineExceededError met on a try after such a name's: "earlier tries: no host ...").
    `retry_no_such_host=False` raises it at once instead (the CLI's policy: at a command line such a
    name is a typo; it was 7 attempts, 4.7 s, there). RESOURCE_EXHAUSTED is retried when
    `retry_resource_exhausted` is set, waiting at least the server's RetryInfo delay. After attempt
    n (1-based) the wait is a random time in [c / 2, c], c = min(max_backoff_s, initial_backoff_s *
    multiplier ** (n - 1)) ("equal jitter"): spread, as full jitter's [0, c] is, but never short, so
    that the attempts of a call span at least half their ceilings. By default 7 attempts wait
    3.15-6.3 s in all: a gateway restarting (1-2 s when measured) is outlasted (with full jitter and
    6 attempts, 1.55 s on average, half the calls made during a 1.5-s restart failed), and a wrong
    address is still said within seconds.

    A long stream that was answering (a bulk, a watch) and then breaks is reopened for up to
    `stream_resume_s` after the break, beyond `max_attempts`: a gateway restarting, or a rolling
    update of a single replica, takes seconds, and the stream's caller is part-way through work
    it would otherwise start again. 0 turns the resume off.

    `on_retry(error, delay_s)` is called before each wait (the CLI says once that it is trying
    again: a gateway that is down was 5-6 s of silence before its error)."""

    max_attempts: int = 7
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    retry_resource_exhausted: bool = True
    retry_no_such_host: bool = True
    stream_resume_s: float = 30.0
    on_retry: Callable[[AsyncInferClientError, float], None] | None = field(default=None, compare=False)

    def retriable(self, error: AsyncInferClientError) -> bool:
        if error.code is grpc.StatusCode.UNAVAILABLE:
            return self.retry_no_such_host or not no_such_host(error)
        return (
            self.retry_resource_exhausted
            and error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            and error.reason != MESSAGE_TOO_LARGE  # a request over the message limit stays over it
        )

    def allows_attempt(self, attempt: int, broken_at: float | None) -> bool:
        """Whether attempt `attempt + 1` may follow; `broken_at` is when a stream that had been
        answering broke (monotonic seconds), None for a call that has not been answered."""
        if attempt < self.max_attempts:
            return True
        return broken_at is not None and time.monotonic() - broken_at < self.stream_resume_s

    def backoff_s(self, attempt: int, error: AsyncInferClientError) -> float:
        ceiling = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** max(attempt - 1, 0))
        delay = random.uniform(ceiling / 2, ceiling)
        if error.retry_after_s is not None:
            delay = max(delay, error.retry_after_s)
        return delay


class StreamBreaks:
    """When a long stream that had been answering broke: `broken_at` is None until its first
    answer and after each later one, and the time of the first failure since then otherwise
    (what `RetryPolicy.allows_attempt` measures the resume from)."""

    def __init__(self) -> None:
        self._answered = False
        self.broken_at: float | None = None

    def answered(self) -> None:
        self._answered = True
        self.broken_at = None

    def broke(self) -> float | None:
        if self._answered and self.broken_at is None:
            self.broken_at = time.monotonic()
        return self.broken_at


NO_RETRY = RetryPolicy(max_attempts=1, stream_resume_s=0.0)


def checked_timeout(timeout_s: float | None) -> float | None:
    """A caller's `timeout_s`: None (no limit) or seconds, 0 or more; ValueError otherwise (a
    negative one was taken as a deadline already passed, and said "within -1 s"). 0 is a deadline
    that has passed: the call raises DeadlineExceededError and sends nothing, as a zero timeout
    does in gRPC and in httpx (so the OpenAI SDK), not a poll answering what is there."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
        # A str was "'>=' not supported between instances of 'str' and 'int'"; True was 1 s.
        raise TypeError(f"timeout_s is seconds, 0 or more (None: no limit), got {a_kind(timeout_s)} {timeout_s!r}")
    if not timeout_s >= 0:  # NaN too
        raise ValueError(f"timeout_s is seconds, 0 or more (None: no limit), got {timeout_s}")
    return timeout_s


class Deadline:
    """A call's absolute deadline on the monotonic clock; `None` seconds means none."""

    def __init__(self, timeout_s: float | None) -> None:
        checked_timeout(timeout_s)
        self._at = None if timeout_s is None else time.monotonic() + timeout_s
        self.timeout_s = timeout_s

    def remaining(self) -> float | None:
        """Seconds left (never negative), or None without a deadline."""
        if self._at is None:
            return None
        return max(self._at - time.monotonic(), 0.0)

    def expired(self) -> bool:
        remaining = self.remaining()
        return remaining is not None and remaining <= 0.0

    def exceeded(self, what: str) -> DeadlineExceededError:
        return DeadlineExceededError(
            f"{what} did not complete within {self.timeout_s:.3g} s", code=grpc.StatusCode.DEADLINE_EXCEEDED
        )

    def check(self, what: str) -> None:
        """Raises `exceeded(what)` once the deadline has passed: before a call or a stream is
        opened, so that nothing is sent after it (gRPC given a timeout of 0 sent the request, and
        most such calls were answered: a submit queued its job, a watch its first state)."""
        if self.expired():
            raise self.exceeded(what)

    def allows_sleep(self, seconds: float) -> bool:
        remaining = self.remaining()
        return remaining is None or seconds < remaining
