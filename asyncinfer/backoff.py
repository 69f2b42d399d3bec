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

import asyncio
import importlib.util
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import stamina
import structlog

log = structlog.get_logger("asyncinfer.backoff")

# stamina's own hooks log every scheduled retry as a warning ("stamina.retry_scheduled", naming
# the block only as "<context block>"): a batcher waiting for its scheduler wrote one a second.
# Each loop here says what it retries itself (the first failure, then now and then), so only
# stamina's Prometheus counter (stamina_retries_total) is kept.
stamina.instrumentation.set_on_retry_hooks(
    [stamina.instrumentation.PrometheusOnRetryHook] if importlib.util.find_spec("prometheus_client") else []
)

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
    jitter_s: float | None = None,
) -> AsyncIterator[stamina.Attempt]:
    """`async for attempt in retrying(...): with attempt: ...` — the block is run again while it
    raises `on`, until `retry_for_s` has passed (or `attempts` were made); None and None: forever.
    The n-th wait is min(max_delay_s, first_delay_s * 2^(n-1) + uniform(0, jitter_s)); jitter_s is
    first_delay_s unless given."""
    return stamina.retry_context(
        on=on,
        attempts=attempts,
        timeout=retry_for_s,
        wait_initial=first_delay_s,
        wait_max=max_delay_s,
        wait_jitter=first_delay_s if jitter_s is None else jitter_s,
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
    """operation(), tried again while it raises `on`, for at most `retry_for_s`.

    The first try is a plain call: most succeed, and building the retry state for each one cost
    more than the publish it guards (6% of the gateway's CPU in a bulk burst, py-spy). The waits
    after a failure follow the rule above: the first one here, the rest by `retrying`."""
    give_up_at = time.monotonic() + retry_for_s
    try:
        return await operation()
    except on as exc:
        first_wait_s = min(max_delay_s, first_delay_s + random.uniform(0.0, first_delay_s))
        if time.monotonic() + first_wait_s >= give_up_at:
            raise
        # Debug: a leader election retries every publish in flight (~750 lines per event at
        # info); the failures that last are said by their callers, once.
        log.debug("retrying", what=what, attempt=1, error=repr(exc))
    await asyncio.sleep(first_wait_s)
    retries = retrying(
        on,
        retry_for_s=max(give_up_at - time.monotonic(), 0.0),
        first_delay_s=min(first_delay_s * 2, max_delay_s),
        max_delay_s=max_delay_s,
        jitter_s=first_delay_s,
    )
    async for attempt in retries:
        with attempt:
            try:
                return await operation()
            except on as exc:
                log.debug("retrying", what=what, attempt=attempt.num + 1, error=repr(exc))
                raise
    raise AssertionError("unreachable: stamina raises the last error")  # pragma: no cover
