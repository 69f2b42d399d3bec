"""The scheduler's model dispatchers (services.scheduler.app starts them: the configured models'
and those learnt at runtime), by model, and what the rest of the scheduler asks of a model's
dispatchers: its put-backs (counted, listed, forgotten, added: JobFlow, the queue stats and the
deadline sweep ask by the model's name), whether one of them holds a pull open, and the stop of
them all.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import structlog

from asyncinfer.contract import WORK_SUBJECT_PREFIX
from asyncinfer.jobs import Priority
from asyncinfer.nats import Msg
from asyncinfer.nats.pull_inbox import PullEnd
from services.scheduler.dispatcher import PRIORITY_BY_SUBJECT_TOKEN, ModelDispatcher

# The app's logger: held_pulls_ended_at_stop is said of the scheduler as a whole.
log = structlog.get_logger("asyncinfer.scheduler")


class ModelDispatchers:
    """Every dispatcher the scheduler started (`all`), and the same by model (`by_model`)."""

    def __init__(self) -> None:
        self.all: list[ModelDispatcher] = []
        # The same, by model: a put-back, a dropped message and each queue of a stats round look
        # their model's up, where each went through every dispatcher (100 models: 30,000 steps a
        # round, 100 a put-back message).
        self.by_model: dict[str, list[ModelDispatcher]] = {}

    def add(self, model_name: str, dispatcher: ModelDispatcher) -> None:
        """A dispatcher started for `model_name`."""
        self.all.append(dispatcher)
        self.by_model.setdefault(model_name, []).append(dispatcher)

    async def stop(self) -> None:
        """Stops every dispatcher, together; says how the pulls held open at that moment ended."""
        # Together: each waits for its round's pull, which with NATS gone lasts its timeout.
        held_ends = sum(await asyncio.gather(*(d.stop() for d in self.all)), Counter[PullEnd]())
        if held_ends:
            # Interrupted: ended by the stop, not waited out (a hold of 10 s and 2 s each with NATS
            # away, "lost"; "empty" as it expired). A message an interrupted pull was handed at that
            # moment is back after AckWait.
            log.info("held_pulls_ended_at_stop", **{str(end): count for end, count in held_ends.items()})

    def put_back_count(self, model_name: str, priority: Priority) -> int:
        return sum(d.queues.put_back_count(priority) for d in self.by_model.get(model_name, ()))

    def put_back_jobs(self, model_name: str, priority: Priority) -> frozenset[str]:
        return frozenset().union(*(d.queues.put_back_jobs(priority) for d in self.by_model.get(model_name, ())))

    def put_back_oldest(self, model_name: str, priority: Priority) -> float | None:
        times = (d.queues.put_back_oldest(priority) for d in self.by_model.get(model_name, ()))
        return min((t for t in times if t is not None), default=None)

    def held_open(self, model_name: str, priority: Priority) -> bool:
        return any(d.holding(priority) for d in self.by_model.get(model_name, ()))

    def forget_put_back(self, model_name: str, job_id: str) -> None:
        for dispatcher in self.by_model.get(model_name, ()):
            dispatcher.queues.forget(job_id)

    def put_back(self, msg: Msg, delay_s: float, backoff: bool) -> None:
        """A work message pulled here is being put back (an attempt's end gave its job back, or
        its dispatch waits): counted in its queue's depth by its model's dispatcher, as the
        dispatchers' own put-backs are, until a pull brings it back (it was not: with no credit to
        pull it, the queue said 0 jobs waiting and no oldest time while it waited); the dispatcher
        is woken for one offered again at once."""
        # asyncinfer.work.<model>.<priority>[.<tenant>.<job_id>]
        model_name, _, rest = msg.subject.removeprefix(f"{WORK_SUBJECT_PREFIX}.").partition(".")
        priority_token = rest.partition(".")[0]
        dispatchers = self.by_model.get(model_name, ())
        priority = PRIORITY_BY_SUBJECT_TOKEN.get(priority_token)
        if dispatchers and priority is not None:
            # One of them (the depth sums them); a backoff keeps it out of the oldest time meanwhile.
            dispatchers[0].queues.put_back(priority, msg, backoff_s=delay_s if backoff else 0.0)
        if delay_s <= 0:
            for dispatcher in dispatchers:
                dispatcher.wake(priority_token)
