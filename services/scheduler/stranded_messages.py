"""Work messages no consumer will deliver again: queued once more, so that no accepted job is lost.

A WorkQueue stream removes a message when its consumer acks it, so a message at or below its
consumer's ack floor should not exist. The chaos soak (bench/soak.py, session 38) found such messages:
in 3 runs of 15, 2 to 4 jobs that a killed scheduler or a lost batcher had put back, or that AckWait
had redelivered, sat in WORK below the floor of their consumer with nothing pending, so nats-server
never delivered them again, and their records stayed QUEUED or RUNNING for good. The cause,
found the same session: a queued job's cancel purged its message by its own subject, and nats-server
2.15.1 handles a purge narrower than a consumer's filter by raising the consumer's delivered ack
floor past older deliveries still pending (bench/nats_purge_strands.py; JobStore.drop_work_message
now deletes by sequence). This sweep stays as the backstop, for messages stranded so before the fix
and for any other cause:

Every CHECK_INTERVAL_S, per (model, priority) queue: the consumer's ack floor, then the queue's
messages at or below it (one next-by-subject read finds none in the normal case). A message found
there twice in a row (an ack that is being applied is not mistaken for one) is read with its job's
record: a job that has ended has its message deleted; any other is published again on its subject
(the same payload and headers, a message ID of its own: `<job_id>.requeued.<seq>`, so that two
schedulers doing it at once make one) and the stranded copy deleted. The new message is delivered
as any other; its dispatch reads the record and counts the lapsed attempt, as after AckWait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from asyncinfer.codecs.envelope import decode_envelope
from asyncinfer.config import Config
from asyncinfer.contract import work_consumer_name, work_subject
from asyncinfer.job_store import NATS_FAILURES, JobStore, UnreadableJob
from asyncinfer.jobs import PRIORITIES_BY_RANK
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import JetStreamContext, NotFoundError
from asyncinfer.nats.requests import js_publish
from asyncinfer.nats.streams import delete_message, messages_between
from asyncinfer.supervision import end_if_cancelled

log = structlog.get_logger("asyncinfer.scheduler.stranded_messages")

CHECK_INTERVAL_S = 30.0
REQUEST_TIMEOUT_S = 5.0
MSG_ID_HEADER = "Nats-Msg-Id"


class StrandedMessages:
    def __init__(
        self,
        nc: NatsClient,
        js: JetStreamContext,
        store: JobStore,
        config: Config,
        models: Callable[[], list[str]],
        *,
        interval_s: float = CHECK_INTERVAL_S,
    ) -> None:
        self._nc = nc
        self._js = js
        self._store = store
        self._stream = config.nats.work_stream
        self._models = models
        self._interval_s = interval_s
        self._seen: set[int] = set()  # stranded at the last check: requeued if still there at the next

    async def run(self) -> None:
        """Checks every interval until cancelled; a failed check is a warning, tried again next time."""
        while True:
            end_if_cancelled()  # a stop's cancellation that the last round's NATS request lost
            await asyncio.sleep(self._interval_s)
            try:
                await self.check()
            except NATS_FAILURES as exc:
                log.warning("stranded_messages_check_failed", error=str(exc) or type(exc).__name__)

    async def check(self) -> int:
        """Requeues (or deletes, for a job that has ended) the messages found stranded at this
        check and the one before; how many."""
        stranded: set[int] = set()
        handled = 0
        for model in self._models():
            for priority in PRIORITIES_BY_RANK:
                try:
                    info = await self._js.consumer_info(self._stream, work_consumer_name(model, priority))
                except NotFoundError:  # not declared yet (a model learnt a moment ago)
                    continue
                floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
                if not floor:
                    continue
                below = await messages_between(
                    self._js, self._stream, f"{work_subject(model, priority)}.>", first_seq=1, last_seq=floor
                )
                for seq, subject in below:
                    stranded.add(seq)
                    if seq in self._seen and await self._requeue(seq, subject, floor):
                        handled += 1
        self._seen = stranded
        return handled

    async def _requeue(self, seq: int, subject: str, floor: int) -> bool:
        try:
            message = await self._js.get_msg(self._stream, seq=seq)
        except NotFoundError:  # gone meanwhile: nothing stranded any more
            return False
        try:
            envelope = decode_envelope(message.data or b"")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("stranded_message_undecodable", seq=seq, subject=subject, error=str(exc))
            return False
        about = {"job_id": envelope.job_id, "model": envelope.model_name, "tenant": envelope.tenant, "seq": seq}
        try:
            record = await self._store.recorded(envelope.key)
        except UnreadableJob:  # a later release's record: its scheduler decides
            return False
        if record is not None and record.state.is_terminal:
            await delete_message(self._nc, self._stream, seq, timeout_s=REQUEST_TIMEOUT_S)
            log.warning("stranded_work_message_deleted", **about, state=record.state.value, ack_floor=floor)
            return True
        headers = {**(message.headers or {}), MSG_ID_HEADER: f"{envelope.job_id}.requeued.{seq}"}
        await js_publish(self._js, subject, message.data or b"", timeout_s=REQUEST_TIMEOUT_S, headers=headers)
        await delete_message(self._nc, self._stream, seq, timeout_s=REQUEST_TIMEOUT_S)
        state = record.state.value if record is not None else "QUEUED"
        log.warning("stranded_work_message_requeued", **about, state=state, ack_floor=floor)
        return True
