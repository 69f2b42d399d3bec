"""Retrying transient errors: the one rule for every loop that waits out a NATS leader election, a
reconnecting client or a peer that is not up yet.

Built on stamina (tenacity underneath): exponential backoff from `first_delay_s`, doubling up to
`max_delay_s`, plus a random jitter of up to `first_delay_s` (stamina's additive jitter), for at
most `retry_for_s` in all; the last error is raised. Only for idempotent operations. A background
loop that must outlast any outage (a feed, a reconnecting stream) passes `retry_for_s=None`: it
retries for as long as it runs, and its owner ends it by cancelling it.

The job-retry policy (how long a failed job waits before its next attempt) is domain logic and
lives in `asyncinfer.lifecycle`, not here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import stamina
import structlog

log = structlog.get_logger("asyncinfer.backoff")

T = TypeVar("T")

FIRST_DELAY_S = 0.05
MAX_DELAY_S = 1.0


def retrying(
    on: type[Exception] | tuple[type[Exception], ...],
    *,
    retry_for_s: float | None,
    first_delay_s: float = FIRST_DELAY_S,
    max_delay_s: float = MAX_DELAY_S,
    attempts: int | None = None,
) -> AsyncIterator[stamina.Attempt]:
    """`async for attempt in retrying(...): with attempt: ...` — the block is run again while it
    raises `on`, until `retry_for_s` has passed (or `attempts` were made); None and None: forever."""
    return stamina.retry_context(
        on=on,
        attempts=attempts,
        timeout=retry_for_s,
        wait_initial=first_delay_s,
        wait_max=max_delay_s,
        wait_jitter=first_delay_s,
        wait_exp_base=2,
    )


async def retry(
    operation: Callable[[], Awaitable[T]],
    *,
    on: type[Exception] | tuple[type[Exception], ...],
    retry_for_s: float,
    what: str,
    first_delay_s: float = FIRST_DELAY_S,
    max_delay_s: float = MAX_DELAY_S,
) -> T:
    """operation(), tried again while it raises `on`, for at most `retry_for_s`."""
    async for attempt in retrying(on, retry_for_s=retry_for_s, first_delay_s=first_delay_s, max_delay_s=max_delay_s):
        with attempt:
            try:
                return await operation()
            except on as exc:
                log.info("retrying", what=what, attempt=attempt.num, error=repr(exc))
                raise
    raise AssertionError("unreachable: stamina raises the last error")  # pragma: no cover
