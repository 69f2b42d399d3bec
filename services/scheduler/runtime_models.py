"""Model names the scheduler's file does not declare, learnt at runtime from what its batchers
announce (their hello, then each `ServedModels` change): issue 16, item 2's last gap.

When a connected batcher announces a model name that is neither configured nor already known
here, one owned loop declares that model's durable work consumers (one per priority, as start-up
does for the configured models) and starts its dispatcher. From then on the model is dispatched,
counted in GetQueueStats (and desired_batchers) and in the queue snapshots the gateways read,
exactly as a configured one; its job policy is the defaults of a `[[models]]` table (the
scheduler's per-model lookups already fall back to them for a name its file does not declare).

A model learnt here is kept until the scheduler stops, even when every batcher unloads it: its
consumers are durable and cheap, and jobs queued for it wait (NO_WORKER / NO_VERSION) rather than
being lost, and run once a batcher serves it again. A restarted scheduler learns it again from the
first batcher that announces it; until then the jobs wait in the stream, untouched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from asyncinfer.config import Config, NatsConfig
from asyncinfer.declarations import ensure_work_consumer
from asyncinfer.errors import Unavailable
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.jobs import PRIORITIES_BY_RANK
from asyncinfer.nats import JetStreamContext
from asyncinfer.supervision import end_if_cancelled
from services.scheduler.batchers import BatcherRegistry, BatcherSession

log = structlog.get_logger("asyncinfer.scheduler.runtime_models")

RETRY_S = 1.0


async def declare_consumers(js: JetStreamContext, nats: NatsConfig, model_name: str, *, ack_wait_s: float) -> None:
    """The model's durable work consumers, one per priority (idempotent)."""
    for priority in PRIORITIES_BY_RANK:
        await ensure_work_consumer(js, nats, model_name=model_name, priority=priority, ack_wait_s=ack_wait_s)


class RuntimeModels:
    def __init__(
        self,
        config: Config,
        batchers: BatcherRegistry,
        *,
        js: JetStreamContext,
        start_dispatcher: Callable[[str], Awaitable[None]],
    ) -> None:
        """`start_dispatcher(name)`: starts the model's dispatcher (its consumers declared)."""
        self._config = config
        self._configured = frozenset(m.name for m in config.models)
        self._batchers = batchers
        self._js = js
        self._start_dispatcher = start_dispatcher
        self._names: list[str] = []
        self._dirty = asyncio.Event()

    @property
    def names(self) -> tuple[str, ...]:
        """The model names learnt at runtime, in the order they were learnt."""
        return tuple(self._names)

    def knows(self, model_name: str) -> bool:
        return model_name in self._configured or model_name in self._names

    def changed(self, _session: BatcherSession | None = None) -> None:
        """A session started, changed what it serves, or ended."""
        self._dirty.set()

    def chained(self, other: Callable[[BatcherSession], None]) -> Callable[[BatcherSession], None]:
        """A session listener that tells `other`, then this."""

        def both(session: BatcherSession) -> None:
            other(session)
            self.changed(session)

        return both

    def unknown_names(self) -> list[str]:
        """Names announced by an open session (ready or loading) that are not known yet."""
        announced = {m.model_name for s in self._batchers.sessions if not s.closed for m in s.announced}
        return sorted(n for n in announced if n and not self.knows(n))

    async def learn(self) -> bool:
        """Learns each name announced and not known yet, each on its own; False when one could not
        be (NATS or JetStream out of reach): it is tried again RETRY_S later, as `run` does."""
        learnt_all = True
        for name in self.unknown_names():
            try:
                await declare_consumers(self._js, self._config.nats, name, ack_wait_s=self._config.scheduler.ack_wait_s)
                await self._start_dispatcher(name)
            except (Unavailable, *NATS_FAILURES) as exc:
                # Unavailable: JetStream out for the declaration's whole wait (DECLARE_RETRY_S). It
                # was not caught here: the loop ended, and the scheduler exited 70 with it.
                log.warning("model_learn_failed", model=name, error=str(exc), retry_in_s=RETRY_S)
                learnt_all = False
                continue
            self._names.append(name)
            log.info("model_learnt_at_runtime", model=name)
        return learnt_all

    async def run(self) -> None:
        """Learns the new names on every change, until cancelled; those that could not be learnt,
        again every RETRY_S until they are (or no batcher announces them any more)."""
        while True:
            end_if_cancelled()  # a stop's cancellation that the last round's NATS request lost
            await self._dirty.wait()
            self._dirty.clear()
            if not await self.learn():
                self._dirty.set()
                await asyncio.sleep(RETRY_S)
