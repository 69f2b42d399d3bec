"""One log line per interval for a failure that repeats many times a second (a pull refused while
a stream's leader is elected: ~50 lines a second), with how many were held back."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any


class Throttle:
    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[Hashable, float] = {}
        self._held: dict[Hashable, int] = {}

    def allow(self, key: Hashable) -> int | None:
        """None to leave this occurrence unlogged; else how many of the key's were held back since
        the last one logged."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)


# A line said of many jobs that fail alike is said at most once per this long per model and kind.
REPEATED_LINE_INTERVAL_S = 5.0


class RepeatedLines:
    """A line said of each of many jobs or batches that fail alike (a model that always fails, at 100
    jobs a second): the first of its kind at once, whole, naming its job; then at most one per
    interval, with how many were held back since (`more_since_last`); those held back at debug, whole,
    so that debug still has each job's. A failing model wrote a line per job and per batch at info
    and warning: hundreds a second, which buried every other line and cost the event loop."""

    def __init__(
        self, interval_s: float = REPEATED_LINE_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._throttle = Throttle(interval_s, clock)

    def say(self, logger: Any, level: str, event: str, *, kind: Hashable, **fields: Any) -> None:
        """Logs `event` at `level` (a logger's method name), or at debug when another of the same
        `kind` (the model and what went wrong: a bounded set) was logged less than an interval ago."""
        held = self._throttle.allow((event, kind))
        if held is None:
            logger.debug(event, **fields)
            return
        getattr(logger, level)(event, **fields, **({"more_since_last": held} if held else {}))
