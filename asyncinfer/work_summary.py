"""A line at info now and then saying what work a service did, per model, in place of a line per job.

The lines each job used to write at info (job_submitted, job_dispatched, job_finished,
webhook_attempted) came to ~850 bytes a job, ~70 GB a day at 1,000 jobs/s, and rendering them cost
the hot path CPU; they are at debug now. So that an operator still sees work flowing, a service
counts what its jobs did (`count`: one dict increment, nothing rendered) and logs `jobs_summary`
once per interval (`logging.summary_interval_s`), a line per model that had any: the counts since
the last line and the seconds they cover. An interval with nothing to say logs nothing, and a stop
logs what the last, partial interval counted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger("asyncinfer.work_summary")


class WorkSummary:
    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._since = clock()
        # (model, what) -> how many since the last line: a tuple key, so a count is one lookup.
        self._counts: dict[tuple[str, str], int] = {}

    def count(self, model: str, what: str) -> None:
        key = (model, what)
        self._counts[key] = self._counts.get(key, 0) + 1

    def take(self) -> dict[str, dict[str, int]]:
        """The counts since the last take, per model (models in order of name), and a fresh start."""
        counts, self._counts = self._counts, {}
        by_model: dict[str, dict[str, int]] = {}
        for (model, what), n in sorted(counts.items()):
            by_model.setdefault(model, {})[what] = n
        return by_model

    def flush(self) -> None:
        """Logs a line per model counted since the last flush; nothing when none was."""
        now = self._clock()
        over_s = round(now - self._since, 1)
        self._since = now
        for model, counts in self.take().items():
            log.info("jobs_summary", model=model, over_s=over_s, **counts)

    async def run(self) -> None:
        """Flushes every interval until cancelled, then once more: a stop says the last interval's
        work too (run under the service's supervisor)."""
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                self.flush()
        finally:
            self.flush()
