"""Sending deliveries: pulls them from the WEBHOOKS stream, POSTs them signed (post_attempt.py makes
each HTTP attempt), records each attempt in the job's status entry, and acks (done) or NAKs with a
delay (retry later).

- Success is a 2xx answer, nothing else. Redirects are never followed: a 3xx is a failed attempt.
- 410 Gone disables the URL for the tenant (a `disabled.` key, for webhooks.disabled_for_s: 7
  days); this and every later delivery to it meanwhile become DISABLED without a request.
- Other answers, timeouts and connection failures are retried with exponential backoff and full
  jitter: the n-th failure waits uniform(0, min(backoff_max_s, backoff_base_s * 2^(n-1))), or the
  receiver's Retry-After when that is longer (capped at backoff_max_s). The last retry is moved to
  fall on the horizon (retry_horizon_s after the first attempt) rather than past it; a failure at
  or after the horizon is final (FAILED).
- The URL is vetted again before each attempt against the addresses it resolves to now, and the
  connection goes to a vetted address (DNS rebinding cannot point it inside); a URL refused now,
  or a tenant whose secret was removed, is FAILED at once.
- The delay lives in JetStream (NAK with delay), so a pending retry survives restarts and goes to
  whichever scheduler pulls it when it is due. The status is written before the ack/NAK: a crash
  in between repeats an attempt (same webhook-id; receivers deduplicate), never loses one.
- A message seen for the first time whose delivery already has attempts is a second message of it
  (enqueued again past the stream's duplicate window): acked without an attempt, since the message
  that made the attempts still carries its retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import replace
from urllib.parse import urlsplit

import structlog
from prometheus_client import CollectorRegistry, Counter

from asyncinfer.config import Config
from asyncinfer.contract import WEBHOOK_SENDER_CONSUMER as SENDER_CONSUMER
from asyncinfer.errors import Unavailable
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import Msg
from asyncinfer.supervision import Supervisor
from asyncinfer.webhook_status import DeliveryState, DeliveryStatus, JobDeliveries
from services.scheduler.webhooks.deliveries import Delivery, decode_delivery
from services.scheduler.webhooks.held_pull import HeldPull, interrupted_within
from services.scheduler.webhooks.post_attempt import DeliveryPoster
from services.scheduler.webhooks.status_store import StatusStore
from services.scheduler.webhooks.streams import sender_ack_wait_s

log = structlog.get_logger("asyncinfer.scheduler.webhooks")

STATUS_RETRY_DELAY_S = 1.0
# A delivery past its origin's share waits here for a slot while the origin's oldest attempt in
# flight is younger than this; past it the origin is slow (hanging, perhaps), and what waited and
# what comes for it wait in the stream (request_timeout_s) so that other origins get the slots.
SLOW_ORIGIN_S = 1.0
MAX_BACKOFF_EXPONENT = 60


def backoff_delay(failures: int, *, base_s: float, max_s: float, rng: random.Random) -> float:
    """Full jitter: uniform over [0, min(max_s, base_s * 2^(failures-1))]."""
    cap = min(max_s, base_s * 2.0 ** min(max(failures - 1, 0), MAX_BACKOFF_EXPONENT))
    return rng.uniform(0.0, cap)


# How an attempt ended (services.scheduler.webhooks.post_attempt): the status class, 410 (the URL is
# disabled), ERROR (no answer) or REFUSED (the address is not allowed).
ATTEMPT_OUTCOMES = ("2XX", "3XX", "4XX", "5XX", "410", "ERROR", "REFUSED")


class WebhookMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.attempts = Counter(
            "asyncinfer_webhook_attempts",
            "Webhook delivery attempts, by outcome (2XX, 3XX, 4XX, 5XX, 410, ERROR, REFUSED).",
            ["outcome"],
            registry=registry,
        )
        self.finished = Counter(
            "asyncinfer_webhook_deliveries_finished",
            "Webhook deliveries that reached a final state (DELIVERED, FAILED, DISABLED).",
            ["state"],
            registry=registry,
        )
        # At 0 from the start, so that increase() sees the first failure (a series first scraped at 1
        # has no increase to Prometheus).
        for outcome in ATTEMPT_OUTCOMES:
            self.attempts.labels(outcome=outcome)
        for state in DeliveryState:
            if state.is_final:
                self.finished.labels(state=state.value)


def _first_delivery(msg: Msg) -> bool:
    """Whether the message comes from the consumer for the first time (never NAKed, never
    redelivered); False when it cannot tell, so that it is attempted."""
    try:
        return msg.metadata.num_delivered <= 1
    except Exception:  # no JetStream reply subject
        return False


def _origin(url: str) -> str:
    """scheme://host:port of a delivery's URL (its receiver)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.scheme}://{(parts.hostname or '').lower()}:{port}"


class Sender:
    def __init__(
        self,
        nc: NatsClient,
        store: StatusStore,
        config: Config,
        metrics: WebhookMetrics,
        supervisor: Supervisor,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._nc = nc
        self._store = store
        self._config = config
        self._settings = config.webhooks
        self._metrics = metrics
        self._supervisor = supervisor
        # Replaceable so tests can pin the jitter.
        self.rng = rng or random.Random()
        self._clock = clock
        self._poster = DeliveryPoster(config.webhooks, metrics.attempts, clock=clock)
        # A delivery's failure lines, once per interval per tenant and kind (the rest at debug):
        # an endpoint that is down, or NATS away, fails every job's delivery.
        self._failure_lines = RepeatedLines()
        self._pull: HeldPull | None = None
        self._task: asyncio.Task[None] | None = None
        self._deliveries: set[asyncio.Task[None]] = set()
        self._slot_freed = asyncio.Event()
        self._closing = False
        # Attempts in flight per origin (webhooks.max_concurrent_per_origin), by when each began.
        self._by_origin: dict[str, list[float]] = {}
        # Set (and replaced) when an origin's attempt ends: what waits for that origin looks again.
        self._origin_freed = asyncio.Event()

    async def start(self) -> None:
        self._pull = HeldPull(self._nc, self._config.nats.webhooks_stream, SENDER_CONSUMER, as_they_come=True)
        self._task = self._supervisor.start("webhook-sender", self._run())

    async def stop(self, grace_s: float) -> None:
        """Stops pulling, lets attempts in flight finish within grace_s, then cancels the rest
        (NAKed: they come back at once, to this or another scheduler)."""
        self._closing = True
        if self._task is not None and self._pull is not None:
            await interrupted_within(self._task, self._pull, grace_s)
        if self._deliveries:
            _done, pending = await asyncio.wait(set(self._deliveries), timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._pull is not None:
            await self._pull.close()
        await self._poster.close()

    async def _run(self) -> None:
        assert self._pull is not None
        limit = self._settings.max_concurrent_deliveries
        while not self._closing:
            free = limit - len(self._deliveries)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            # One pull held for up to 10 s (held_pull.py) for as many as the slots free now: those
            # there come at once, the others as they are stored, each started as it comes.
            await self._pull.next_round(free, self._start, pause_s=STATUS_RETRY_DELAY_S)

    async def _start(self, msg: Msg) -> None:
        if self._closing:  # pulled as the sender stops: back at once, to this or another scheduler
            with contextlib.suppress(Exception):
                await msg.nak()
            return
        task = asyncio.create_task(self._deliver(msg))
        self._deliveries.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._deliveries.discard(task)
        self._slot_freed.set()

    async def _deliver(self, msg: Msg) -> None:
        try:
            delivery = decode_delivery(msg.data)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("webhook_delivery_unreadable", error=str(exc))
            with contextlib.suppress(Exception):
                await msg.term()
            return
        origin = _origin(delivery.url)
        try:
            if not await self._origin_slot(origin, msg):
                # That receiver is slow (hanging, perhaps) and has its share in flight: this one
                # waits in the stream, unattempted, and its slot here goes to the next delivery.
                with contextlib.suppress(Exception):
                    await msg.nak(delay=self._settings.request_timeout_s)
                return
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await msg.nak()
            raise
        started = time.monotonic()
        self._by_origin.setdefault(origin, []).append(started)
        try:
            delay = await self.attempt(delivery, first_delivery=_first_delivery(msg))
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await msg.nak()
            raise
        except (Unavailable, *NATS_FAILURES) as exc:
            self._failure_lines.say(
                log,
                "warning",
                "webhook_status_unavailable",
                kind=type(exc).__name__,
                job_id=delivery.job_id,
                error=str(exc),
            )
            with contextlib.suppress(Exception):
                await msg.nak(delay=STATUS_RETRY_DELAY_S)
            return
        except Exception as exc:  # a bug: the delivery comes back later rather than being lost
            self._failure_lines.say(
                log,
                "error",
                "webhook_attempt_crashed",
                kind=type(exc).__name__,
                job_id=delivery.job_id,
                webhook_id=delivery.webhook_id,
                exc_info=exc,
            )
            with contextlib.suppress(Exception):
                await msg.nak(delay=STATUS_RETRY_DELAY_S)
            return
        finally:
            in_flight = self._by_origin[origin]
            in_flight.remove(started)
            if not in_flight:
                del self._by_origin[origin]
            freed, self._origin_freed = self._origin_freed, asyncio.Event()
            freed.set()
        with contextlib.suppress(Exception):
            if delay is None:
                await msg.ack()
            else:
                await msg.nak(delay=delay)

    async def _origin_slot(self, origin: str, msg: Msg) -> bool:
        """Waits here for a slot of the origin's while the origin answers (its oldest attempt in
        flight is younger than SLOW_ORIGIN_S); False once it does not. A delivery past the share was
        put back for request_timeout_s whatever the receiver: a burst of 1,000 webhooks to one
        healthy receiver took 32 s (15-s steps; a scale pass), now as long as the receiver takes."""
        waited = False
        while len(in_flight := self._by_origin.get(origin, ())) >= self._settings.max_concurrent_per_origin:
            if time.monotonic() - min(in_flight) > SLOW_ORIGIN_S:
                return False
            waited = True
            freed = self._origin_freed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SLOW_ORIGIN_S):
                    await freed.wait()
        if waited:  # its AckWait counts from its delivery to this scheduler: it starts again now
            with contextlib.suppress(Exception):
                await msg.in_progress()
        return True

    def _chain_alive(self, status: DeliveryStatus) -> bool:
        """Whether the message that made `status`'s attempts is still due to come back: its next
        attempt is not yet an AckWait overdue. Past that it is taken for lost (an operator removed
        the sender's consumer, which delivers every message as new again): this message carries
        the delivery on, as a duplicate POST (same webhook-id) is better than none."""
        if status.next_attempt_time is None:
            return False
        overdue_after_s = sender_ack_wait_s(self._config)
        return self._clock() < status.next_attempt_time + overdue_after_s

    async def attempt(self, delivery: Delivery, *, first_delivery: bool = False) -> float | None:
        """One attempt (or none, when the delivery is final, a late duplicate or its URL
        disabled); the delay before the next, or None when this message is done with.
        `first_delivery`: the message comes to a sender for the first time (its metadata says so)."""
        entry = await self._store.read(delivery.tenant, delivery.job_id)
        status = entry.find(delivery.webhook_id) or DeliveryStatus(
            webhook_id=delivery.webhook_id,
            event=delivery.event,
            job_attempt=delivery.job_attempt,
            create_time=self._clock(),
        )
        if status.state.is_final:
            return None  # a duplicate message of a finished delivery
        if first_delivery and status.attempts > 0 and self._chain_alive(status):
            # A message new to the stream's consumer, for a delivery with attempts already made: a
            # second message of it (a batch's end enqueued again past the duplicate window by a
            # driver that adopted it). The message that made those attempts is still on the
            # stream (NAKed to its next attempt, or in flight) and carries on: attempting this one
            # too would run a second retry chain of the same webhook.
            log.info("webhook_duplicate_dropped", job_id=delivery.job_id, webhook_id=delivery.webhook_id)
            return None
        bound = log.bind(
            job_id=delivery.job_id,
            tenant=delivery.tenant,
            webhook_id=delivery.webhook_id,
            callback_event=delivery.event.value,
            attempt=status.attempts + 1,
        )
        if await self._store.is_disabled(delivery.tenant, delivery.url):
            disabled = replace(
                status,
                state=DeliveryState.DISABLED,
                next_attempt_time=None,
                last_error="the URL answered 410 Gone to an earlier delivery and is disabled for this tenant",
            )
            await self._record(delivery, disabled)
            self._failure_lines.say(bound, "info", "webhook_disabled_url_skipped", kind=(delivery.tenant, "disabled"))
            return None
        started = self._clock()
        code, error, retry_after = await self._poster.post(delivery)
        now = self._clock()
        first = status.first_attempt_time or started
        status = replace(
            status,
            attempts=status.attempts + 1,
            first_attempt_time=first,
            last_attempt_time=started,
            last_status_code=code,
            last_error=error,
            next_attempt_time=None,
        )
        delay: float | None = None
        if 200 <= code < 300:
            status = replace(status, state=DeliveryState.DELIVERED, last_error="")
        elif code == 410:
            await self._store.disable(
                delivery.tenant,
                delivery.url,
                reason=f"410 Gone to {delivery.webhook_id}",
                for_s=self._settings.disabled_for_s,
            )
            status = replace(status, state=DeliveryState.DISABLED)
        elif code < 0:  # refused before any request
            status = replace(status, state=DeliveryState.FAILED, last_status_code=0)
        else:
            horizon = first + self._settings.retry_horizon_s
            delay = backoff_delay(
                status.attempts, base_s=self._settings.backoff_base_s, max_s=self._settings.backoff_max_s, rng=self.rng
            )
            if retry_after is not None:
                delay = max(delay, min(retry_after, self._settings.backoff_max_s))
            if now >= horizon:
                delay = None
                status = replace(
                    status,
                    state=DeliveryState.FAILED,
                    last_error=f"{error}; gave up: the retry horizon of {self._settings.retry_horizon_s:g} s passed",
                )
            else:
                delay = min(delay, horizon - now)
                status = replace(status, next_attempt_time=now + delay)
        await self._record(delivery, status)
        if status.state.is_final:
            self._metrics.finished.labels(state=status.state.value).inc()
        # A delivery is at debug (at info its line, ~380 bytes, was a third of the log of a job
        # with a webhook); an attempt that failed is at info, with its retry, and one that gave up
        # (FAILED, DISABLED) at warning: the first of its kind (per tenant, state and status code),
        # then one per interval, the rest at debug (an endpoint that is down fails every job's).
        fields = {"status_code": code, "state": status.state.value, "error": error or None, "retry_in_s": delay}
        if status.state is DeliveryState.DELIVERED:
            bound.debug("webhook_attempted", **fields)
        else:
            level = "info" if status.state is DeliveryState.PENDING else "warning"
            kind = (delivery.tenant, status.state, code)
            self._failure_lines.say(bound, level, "webhook_attempted", kind=kind, **fields)
        return delay

    async def _record(self, delivery: Delivery, status: DeliveryStatus) -> None:
        def change(current: JobDeliveries) -> JobDeliveries:
            ttl_s = current.ttl_s or delivery.ttl_s
            return replace(current.with_delivery(status), ttl_s=ttl_s)

        await self._store.update(delivery.tenant, delivery.job_id, change)
