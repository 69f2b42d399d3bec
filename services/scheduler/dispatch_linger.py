"""When a dispatcher waits a moment before its next pull: under a steady stream of jobs only.

A dispatcher round pulls what waits and sends it on at once, and at light load that is what keeps
the round trip short. Under a stream of jobs that arrive one at a time (unary SubmitJobs from many
clients), the same eagerness makes rounds of one or two jobs: each pays a pull, a WorkOrders message,
a batch in the batcher and a WorkUpdates message of its own, and the CPU that costs is taken from
the gateway that accepts the jobs (session 18: a unary burst's batches were of one to three jobs in
its slow runs, and the system's CPU per job 2.4 ms against 1.8 ms in runs of larger batches).

So after two rounds in a row that found jobs already waiting (the stream outpaces the rounds), a
round that pulled fewer than `SMALL_ROUND` jobs is followed by a wait of `linger_s` before the next
pull, and the jobs that arrive meanwhile go out together. A round that found nothing waiting (an
idle queue, or a job it had to wait for) ends the streak, so a job at light load never waits; a
job that arrives during a linger waits at most `linger_s`, like an item in the batcher's own
`max_queue_delay_ms`. Pure: the dispatcher (services.scheduler.dispatcher) does the waiting.
"""

from __future__ import annotations

# A round this small is worth waiting for; a larger one is already shared by enough jobs.
SMALL_ROUND = 8
# Rounds in a row that must find jobs waiting before the first linger.
STREAK = 2


class DispatchLinger:
    def __init__(self, linger_s: float) -> None:
        self._linger_s = linger_s
        self._streak = 0

    def after_round(self, pulled: int, found_waiting: bool) -> float:
        """Seconds to wait before the next round, after one that pulled `pulled` jobs (some of them
        already waiting when it asked, if `found_waiting`)."""
        self._streak = self._streak + 1 if pulled and found_waiting else 0
        if self._linger_s > 0 and self._streak >= STREAK and pulled < SMALL_ROUND:
            return self._linger_s
        return 0.0
