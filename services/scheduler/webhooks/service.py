"""Webhooks in the scheduler process: declares the WEBHOOKS stream, the webhooks bucket and both
consumers, then runs the notifier (record writes -> deliveries) and the sender (deliveries -> HTTP).

Shutdown order: the notifier first (no new deliveries), then the sender (attempts in flight get
the grace period, the rest go back to the stream). Nothing is lost: both consumers are durable.

Without any signing secret (webhooks.secrets) no job can ask for callbacks (the gateway refuses
them), so the notifier is not run: it would read and ack every record write (three per job) for
nothing. Its durable consumer is still declared and waits: a scheduler started later with secrets
resumes from where it stopped (a gateway given secrets before the scheduler loses no callback).
"""

from __future__ import annotations

import random

import structlog
from prometheus_client import CollectorRegistry

from asyncinfer.config import Config
from asyncinfer.nats import Client as NatsClient
from asyncinfer.supervision import Supervisor
from asyncinfer.webhook_status import ensure_webhooks_bucket
from services.scheduler.webhooks.notifier import Notifier
from services.scheduler.webhooks.sender import Sender, WebhookMetrics
from services.scheduler.webhooks.status_store import StatusStore
from services.scheduler.webhooks.streams import ensure_feed_consumer, ensure_sender_consumer, ensure_webhooks_stream

log = structlog.get_logger("asyncinfer.scheduler.webhooks")


class WebhookService:
    def __init__(self, config: Config, nc: NatsClient, registry: CollectorRegistry, supervisor: Supervisor) -> None:
        self._config = config
        self._supervisor = supervisor
        self._nc = nc
        self._metrics = WebhookMetrics(registry)
        self._notifier: Notifier | None = None
        self._sender: Sender | None = None

    @property
    def sender(self) -> Sender:
        if self._sender is None:
            raise RuntimeError("webhooks are not started")
        return self._sender

    def pin_jitter(self, rng: random.Random) -> None:
        """For tests: the random source of the backoff jitter."""
        self.sender.rng = rng

    async def start(self) -> None:
        config = self._config
        js = self._nc.jetstream()
        await ensure_webhooks_stream(js, config.nats)
        kv = await ensure_webhooks_bucket(js, config.nats)
        await ensure_sender_consumer(js, config)
        # Declared even when idle: its position starts now, so a scheduler that later has secrets
        # catches up on every record written since (none lost to a scheduler configured late).
        await ensure_feed_consumer(js, config.nats)
        store = StatusStore(js, kv, config.nats.webhooks_bucket)
        if config.webhooks.secrets:
            self._notifier = Notifier(js, self._nc, store, config, self._supervisor)
            await self._notifier.start()
        else:
            log.info(
                "webhook_notifier_off", reason="no signing secrets in webhooks.secrets: no job can ask for callbacks"
            )
        self._sender = Sender(self._nc, store, config, self._metrics, self._supervisor)
        await self._sender.start()

    async def stop(self, grace_s: float) -> None:
        if self._notifier is not None:
            await self._notifier.stop(grace_s)
        if self._sender is not None:
            await self._sender.stop(grace_s)
