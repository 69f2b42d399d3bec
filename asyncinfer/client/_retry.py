"""Retry policy and deadlines: exponential backoff with full jitter, bounded in attempts and by the
call's own deadline (a retry never sleeps past it)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import grpc

from asyncinfer.client.errors import MESSAGE_TOO_LARGE, AsyncInferClientError, DeadlineExceededError


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """When and how long to wait before trying a call again.

    UNAVAILABLE is always retriable (the gateway restarting, a load balancer between pods, NATS
    failing over). RESOURCE_EXHAUSTED is retried when `retry_resource_exhausted` is set, waiting at
    least the server's RetryInfo delay. Attempt n (1-based) waits a random time in
    [0, min(max_backoff_s, initial_backoff_s * multiplier ** (n - 1))] ("full jitter")."""

    max_attempts: int = 6
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    retry_resource_exhausted: bool = True

    def retriable(self, error: AsyncInferClientError) -> bool:
        if error.code is grpc.StatusCode.UNAVAILABLE:
            return True
        return (
            self.retry_resource_exhausted
            and error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            and error.reason != MESSAGE_TOO_LARGE  # a request over the message limit stays over it
        )

    def backoff_s(self, attempt: int, error: AsyncInferClientError) -> float:
        ceiling = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** max(attempt - 1, 0))
        delay = random.uniform(0.0, ceiling)
        if error.retry_after_s is not None:
            delay = max(delay, error.retry_after_s)
        return delay


NO_RETRY = RetryPolicy(max_attempts=1)


class Deadline:
    """A call's absolute deadline on the monotonic clock; `None` seconds means none."""

    def __init__(self, timeout_s: float | None) -> None:
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

    def allows_sleep(self, seconds: float) -> bool:
        remaining = self.remaining()
        return remaining is None or seconds < remaining
