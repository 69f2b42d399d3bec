"""One log line per interval for a failure that repeats many times a second (a pull refused while
a stream's leader is elected: ~50 lines a second), with how many were held back."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable


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
