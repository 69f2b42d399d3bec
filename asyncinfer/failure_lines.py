"""How a loop that runs every round (a dispatcher's pulls, a held pull) logs what failed it: NATS out
of reach (an election, an outage) in one warning line with its error, anything else, a bug, with its
traceback; either at most once per interval per kind, with how many were held back since
(`more_since_last`). A loop failing each round logged a traceback each poll interval (20 a second at
50 ms), each drawn on the event loop."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from asyncinfer.errors import Unavailable
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.log_throttle import Throttle

INTERVAL_S = 5.0


def unreachable(exc: BaseException) -> str | None:
    """What to say of `exc` in a line when it is NATS (or another dependency) out of reach: the
    store's Unavailable, a NATS error, a timeout. None for anything else: its traceback is wanted."""
    if isinstance(exc, Unavailable):
        return exc.message
    if isinstance(exc, NATS_FAILURES):
        return f"{type(exc).__name__}: {exc}"
    return None


class FailureLines:
    def __init__(self, interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._lines = Throttle(interval_s, clock)

    def failed(self, log: Any, event: str, exc: BaseException, **fields: Any) -> None:
        """Logs `event` for `exc` raised on a path that repeats (call it in the `except`)."""
        error = unreachable(exc)
        # A bug is told apart by where it was raised: another one in the same loop is not held back.
        key = (event, type(exc), None if error is not None else _raised_at(exc))
        held = self._lines.allow(key)
        if held is None:
            return
        more = {"more_since_last": held} if held else {}
        if error is not None:
            log.warning(event, error=error, **fields, **more)
        else:
            log.error(event, exc_info=exc, **fields, **more)


def _raised_at(exc: BaseException) -> tuple[str, int] | None:
    tb = exc.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename, tb.tb_lineno
