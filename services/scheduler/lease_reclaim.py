"""Returning the jobs of a scheduler that died: at once, not after AckWait.

A killed scheduler's work messages stay delivered and unacked on their consumers until AckWait
(`scheduler.ack_wait_s`, 30 s) lapses. Its RUNNING records say who held them: `dispatched_by`
(the instance) and `lease_subject` (the ack subject of the delivery). So a scheduler that starts
looks at each consumer's messages delivered and not acked (stream sequences above the ack floor,
up to the last delivered: a WorkQueue stream keeps only unacked ones), reads their records, and
naks every one whose RUNNING (or CANCELLING) attempt is held by an instance that no longer runs
(services.scheduler.instances). JetStream redelivers them at once; the next dispatch counts the
lapsed attempt as it does after AckWait (lifecycle.dispatch), and a late result of the old attempt
is fenced out. A nak names its message by stream sequence: nats-server applies it to the delivery
pending now, even one made after the delivery it was sent for (checked against nats-server 2.15:
tests/test_scheduler.py). So a sweep that read a record held by a dead instance, and naks after
AckWait's redelivery has already started the next attempt here, sends that message back once more;
the dispatcher holding the attempt adopts the redelivery (job_dispatch: `live_attempt_redelivered`)
rather than counting a lapsed lease. Another scheduler that gets it cannot tell it from a lapsed
lease, and spends an attempt: the race needs a sweep and a redelivery in the same few
milliseconds.

It runs once at start (for the process this one replaced) and again after the heartbeat TTL (for
instances elsewhere whose heartbeat has lapsed since), in the background: start-up does not wait
for it and a stop cancels it; and whenever a peer scheduler's heartbeat stops (services.scheduler.peer_watch). The cost is a consumer info per (model, priority) and one message
read plus one record read per message in flight, once per start.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from asyncinfer.config import Config
from asyncinfer.contract import work_consumer_name, work_subject
from asyncinfer.job_store import JobStore, UnreadableJob, UnreadableOnce
from asyncinfer.jobs import PRIORITIES_BY_RANK, JobRecord, JobState, job_key
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import JetStreamContext
from asyncinfer.nats.streams import messages_between, nak_delivery
from asyncinfer.supervision import end_if_cancelled
from asyncinfer.tracing import trace_fields
from services.scheduler.instances import HEARTBEAT_TTL_S, SchedulerInstance

log = structlog.get_logger("asyncinfer.scheduler.lease_reclaim")

HELD_STATES = (JobState.RUNNING, JobState.CANCELLING)
# Records read at once.
READ_CONCURRENCY = 32


class LeaseReclaimer:
    def __init__(
        self,
        nc: NatsClient,
        js: JetStreamContext,
        store: JobStore,
        config: Config,
        instance: SchedulerInstance,
        *,
        models: Callable[[], list[str]] | None = None,
    ) -> None:
        """`models`: the names of the models dispatched here now (those learnt at runtime too:
        services.scheduler.runtime_models); the configured ones by default."""
        self._models = models or (lambda: [model.name for model in config.models])
        self._nc = nc
        self._js = js
        self._store = store
        self._unreadable = UnreadableOnce("lease_reclaim")
        self._config = config
        self._instance = instance

    async def run(self) -> None:
        """At start, then once more after the heartbeat TTL; cancelled by a stop."""
        await self.reclaim()
        end_if_cancelled()  # a stop's cancellation that the reclaim's NATS requests lost
        await asyncio.sleep(HEARTBEAT_TTL_S + 1.0)
        await self.reclaim()

    async def reclaim(self) -> int:
        """Naks the messages of jobs held by instances that no longer run; how many."""
        returned = 0
        for model in self._models():
            for priority in PRIORITIES_BY_RANK:
                try:
                    returned += await self._reclaim_queue(
                        work_consumer_name(model, priority), work_subject(model, priority)
                    )
                except Exception as exc:  # a sweep is an optimisation: AckWait still returns them
                    log.warning("lease_reclaim_failed", model=model, priority=priority.value, error=str(exc))
        if returned:
            log.info("leases_reclaimed", jobs=returned, scheduler=self._instance.id)
        return returned

    async def _reclaim_queue(self, consumer: str, queue_subject: str) -> int:
        stream = self._config.nats.work_stream
        info = await self._js.consumer_info(stream, consumer)
        if not info.num_ack_pending:
            return 0
        first = (info.ack_floor.stream_seq or 0) + 1 if info.ack_floor is not None else 1
        last = info.delivered.stream_seq or 0 if info.delivered is not None else 0
        messages = await messages_between(self._js, stream, f"{queue_subject}.>", first_seq=first, last_seq=last)
        semaphore = asyncio.Semaphore(READ_CONCURRENCY)

        async def one(seq: int, subject: str) -> bool:
            async with semaphore:
                return await self._return_if_orphaned(seq, subject)

        results = await asyncio.gather(*(one(seq, subject) for seq, subject in messages))
        return sum(results)

    async def _return_if_orphaned(self, seq: int, subject: str) -> bool:
        # asyncinfer.work.<model>.<priority>.<tenant>.<job_id>
        tokens = subject.split(".")
        if len(tokens) != 6:
            return False
        try:
            record = await self._store.recorded(job_key(tokens[4], tokens[5]))
        except UnreadableJob as exc:  # a later release's (its scheduler reclaims it), or corrupted
            self._unreadable.say(exc)
            return False
        if record is None or not self._holds(record, seq):
            return False
        if not await self._instance.is_gone(record.dispatched_by):
            return False
        await nak_delivery(self._nc, record.lease_subject)
        about = {"job_id": record.job_id, "attempt": record.attempt, **trace_fields(record.traceparent)}
        log.info("lease_returned", **about, held_by=record.dispatched_by)
        return True

    @staticmethod
    def _holds(record: JobRecord, seq: int) -> bool:
        """Whether the record's attempt holds this message's delivery: its ack subject names the
        stream sequence ($JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>..., or with a
        domain and an account hash after ACK, as nats-py reads it)."""
        if record.state not in HELD_STATES or not record.lease_subject or not record.dispatched_by:
            return False
        tokens = record.lease_subject.split(".")
        if len(tokens) == 9:
            tokens = [*tokens[:2], "", "", *tokens[2:]]
        return len(tokens) >= 11 and tokens[:2] == ["$JS", "ACK"] and tokens[7] == str(seq)
