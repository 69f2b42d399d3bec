"""Job record writes -> webhook deliveries, without touching the jobs flow.

A durable pull consumer on the jobs bucket's stream (streams.FEED_CONSUMER) sees every record
write, whoever made it (scheduler, gateway cancel or expiry), across restarts. For a record with a
callback whose state maps to a wanted event, one delivery per (job, event, job attempt) is enqueued
exactly once:

1. the delivery is added to the job's status entry (compare-and-set; present already: skip),
2. then published to the WEBHOOKS stream with Nats-Msg-Id = the webhook ID,
3. then the feed message is acked.

A crash between 1 and 2 is repaired when the unacked feed message comes back (redelivered): an
entry still PENDING with no attempt is published again, and a publish that had landed is dropped
by the stream's duplicate window. Past half that window only a redelivered record write repairs:
another write of the job (its end, which also yields the RUNNING event) finding the RUNNING
delivery unattempted (its receiver slow, the sender behind) published it again, and past the
duplicate window (2 min) that was a second message, a second retry chain of the same webhook.
Within half the window any write repairs, for the job's next write may replace the crashed one
(the bucket keeps one revision) before it comes back. The status entry is written before the
publish so the sender always finds it.

The jobs bucket keeps one revision per key, so a RUNNING write replaced (by the job's end) before
this consumer read it is gone: a terminal record of a job that ran also yields the RUNNING event of
its attempt (same webhook ID, so it is enqueued once either way). Deliveries are independent
messages: a receiver may see `job.completed` before `job.running`; each body has its timestamp.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from asyncinfer.codecs.record import decode_record
from asyncinfer.config import Config
from asyncinfer.contract import WEBHOOK_FEED_CONSUMER as FEED_CONSUMER
from asyncinfer.errors import Unavailable
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.jobs import JobRecord, JobState
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.nats import KV_DEL, KV_OP, KV_PURGE, JetStreamContext, Msg
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.streams import publish_durably
from asyncinfer.supervision import Supervisor
from asyncinfer.webhook_status import (
    EVENT_OF_STATE,
    CallbackEvent,
    DeliveryState,
    DeliveryStatus,
    JobDeliveries,
    wanted_events,
    webhook_id,
)
from services.scheduler.webhooks.deliveries import Delivery, encode_delivery, event_body
from services.scheduler.webhooks.held_pull import HeldPull, interrupted_within
from services.scheduler.webhooks.status_store import StatusStore
from services.scheduler.webhooks.streams import jobs_stream

log = structlog.get_logger("asyncinfer.scheduler.webhooks")

FETCH_BATCH = 128
RETRY_DELAY_S = 1.0
PUBLISH_RETRY_FOR_S = 10.0
_RAN = frozenset({JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED, JobState.TIMED_OUT})


def _redelivered(msg: Msg) -> bool:
    """Whether the feed message came before (not acked: a crash, a NAK); True when it cannot
    tell (a repeat publish is dropped, or at worst sent twice with the same webhook-id)."""
    try:
        return msg.metadata.num_delivered > 1
    except Exception:  # no JetStream reply subject
        return True


def due_events(record: JobRecord) -> list[CallbackEvent]:
    """The events `record` stands for that its callback asks for, RUNNING first."""
    if record.callback is None:
        return []
    wanted = wanted_events(record.callback.events)
    due: list[CallbackEvent] = []
    if (
        CallbackEvent.RUNNING in wanted
        and record.state in _RAN
        and record.start_time is not None
        and record.attempt >= 1
    ):
        due.append(CallbackEvent.RUNNING)
    event = EVENT_OF_STATE.get(record.state)
    if event is not None and event is not CallbackEvent.RUNNING and event in wanted:
        due.append(event)
    return due


class Notifier:
    def __init__(
        self, js: JetStreamContext, nc: NatsClient, store: StatusStore, config: Config, supervisor: Supervisor
    ) -> None:
        self._js = js
        self._nc = nc
        self._supervisor = supervisor
        # A record's enqueue failing, once per interval per kind (the rest at debug): NATS away, or a
        # bug, fails every job's.
        self._failure_lines = RepeatedLines()
        self._store = store
        self._config = config
        self._pull: HeldPull | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.enqueued = 0

    async def start(self) -> None:
        self._pull = HeldPull(self._nc, jobs_stream(self._config.nats), FEED_CONSUMER)
        self._task = self._supervisor.start("webhook-notifier", self._run())

    async def stop(self, grace_s: float) -> None:
        """Finishes the record being handled (within grace_s); those not handled come back later."""
        self._closing = True
        if self._task is not None and self._pull is not None:
            await interrupted_within(self._task, self._pull, grace_s)
        if self._pull is not None:
            await self._pull.close()

    async def _run(self) -> None:
        assert self._pull is not None
        while not self._closing:
            # What is there, or one held for up to 10 s while idle (held_pull.py).
            await self._pull.next_round(FETCH_BATCH, self._handle_unless_closing, pause_s=RETRY_DELAY_S)

    async def _handle_unless_closing(self, msg: Msg) -> None:
        if self._closing:
            with contextlib.suppress(Exception):
                await msg.nak()  # back at once, to this or another scheduler
            return
        await self._handle(msg)

    async def _handle(self, msg: Msg) -> None:
        try:
            await self.process(msg)
        except (Unavailable, *NATS_FAILURES) as exc:
            self._failure_lines.say(
                log, "warning", "webhook_enqueue_failed", kind=type(exc).__name__, subject=msg.subject, error=str(exc)
            )
            with contextlib.suppress(Exception):
                await msg.nak(delay=RETRY_DELAY_S)
            return
        except Exception as exc:  # a bug: keep the feed going, and this record comes back later
            self._failure_lines.say(
                log, "error", "webhook_enqueue_crashed", kind=type(exc).__name__, subject=msg.subject, exc_info=exc
            )
            with contextlib.suppress(Exception):
                await msg.nak(delay=RETRY_DELAY_S)
            return
        with contextlib.suppress(Exception):
            await msg.ack()

    async def process(self, msg: Msg) -> None:
        operation = (msg.headers or {}).get(KV_OP)
        # Most records have no callback: skip them without decoding (outputs can be large).
        if operation in (KV_DEL, KV_PURGE) or not msg.data or b'"callback"' not in msg.data:
            return
        try:
            record = decode_record(msg.data)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("webhook_record_unreadable", subject=msg.subject, error=str(exc))
            return
        repair = _redelivered(msg)
        for event in due_events(record):
            await self._enqueue(record, event, repair=repair)

    async def _enqueue(self, record: JobRecord, event: CallbackEvent, *, repair: bool) -> None:
        """Adds the delivery to the job's status entry and publishes it; a delivery already there
        is published again only on `repair` (this record write came back: a crash, or a failed
        publish, may have fallen between its status write and its publish)."""
        assert record.callback is not None
        wid = webhook_id(record.job_id, event, record.attempt)
        delivery = Delivery(
            webhook_id=wid,
            tenant=record.tenant,
            job_id=record.job_id,
            event=event,
            job_attempt=record.attempt,
            url=record.callback.url,
            body=event_body(record, event),
            ttl_s=record.result_retention_s + self._config.webhooks.retry_horizon_s,
        )
        now = time.time()
        repair_window_s = self._config.nats.duplicate_window_s / 2
        publish = False

        def add(current: JobDeliveries) -> JobDeliveries | None:
            nonlocal publish
            existing = current.find(wid)
            if existing is not None:
                # Published before unless a crash fell between the write and the publish, which
                # a redelivered record write can have seen; so can a later write of the job that
                # replaced the crashed one (the bucket keeps one revision) before it came back:
                # within half the duplicate window of the entry, a publish that had landed is
                # still dropped, so that one publishes too.
                unattempted = existing.state is DeliveryState.PENDING and existing.attempts == 0
                publish = unattempted and (repair or now - existing.create_time < repair_window_s)
                return None
            publish = True
            status = DeliveryStatus(
                webhook_id=wid, event=event, job_attempt=record.attempt, create_time=now, next_attempt_time=now
            )
            return JobDeliveries(
                deliveries=current.with_delivery(status).deliveries, ttl_s=delivery.ttl_s, revision=current.revision
            )

        await self._store.update(record.tenant, record.job_id, add)
        if not publish:
            return
        await publish_durably(
            self._js,
            delivery.subject,
            encode_delivery(delivery),
            stream=self._config.nats.webhooks_stream,
            msg_id=wid,
            retry_for_s=PUBLISH_RETRY_FOR_S,
        )
        self.enqueued += 1
        log.info(
            "webhook_enqueued", job_id=record.job_id, tenant=record.tenant, callback_event=event.value, webhook_id=wid
        )
