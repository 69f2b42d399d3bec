"""A prototype for issue 14, item 4: a batcher that pulls its work from JetStream itself, with no
scheduler in the data path. Bench only: it changes none of the shipped services, and
bench/system/direct_pull_ab.py measures it against today's stack.

    python -m bench.system.direct_pull --config FILE

It is the batcher (services.batcher.app.BatcherApp, its models, batching engine and KServe server;
no WorkerService stream) with the scheduler's data path moved in, a group of jobs at a time:

- pull: per model, no-wait pulls of at most the engine's free slots, chosen across the
  (model, priority) consumers by the scheduler's own PrioritySelector and TenantRoundRobin
  (services.scheduler.work_queue.ModelQueues), so nothing is taken before there is a slot for it;
  woken by the gateway's queued notices (whose records spare a read), else every poll interval;
- RUNNING: the lifecycle's Dispatch written by JobStore.transition (the same compare-and-set that
  counts the attempt, the fencing token), the group's writes awaited together (pipelined on the
  one connection, one round trip for the group);
- run: the envelope's tensors straight into the engine (no WorkOrder proto);
- terminal: as items resolve, the lifecycle's Finish (or Drop for an item dropped before it ran)
  written for everything that finished together, then acks that are published, not awaited one by
  one for an answer (an ack has none);
- leases: in-progress acks every scheduler.lease_renew_interval_s for the messages held, so
  AckWait bounds how long a killed batcher's jobs wait before they run elsewhere;
- cancel: the cancel notices every scheduler hears (`cancel_subject`), heard here too: a held item
  not started is dropped (then CANCELED by the Drop), one running ends CANCELED by the Finish;
- pause: the queues bucket's `paused.<model>` keys (services.scheduler.pauses.PauseState).

What the prototype leaves out (the decision in docs/ARCHITECTURE.md prices each): retries (a model
error ends the job FAILED) and dead letters (a job whose attempts are spent is left to AckWait, i.e.
to the control plane), execution timeouts, claim-check inputs and large results (an output over
the inline limit is stored inline all the same), the tenants' queued counters, drain, metrics. None of them runs on the measured path of a no-op burst.

Importing services.scheduler from here is a prototype's shortcut: adopting the design would move
ModelQueues and the lifecycle glue to shared code (asyncinfer/), as the layering requires.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from asyncinfer import job_errors, lifecycle
from asyncinfer.codecs.envelope import decode_envelope
from asyncinfer.config import Config, load_config
from asyncinfer.contract import cancel_subject, queued_subjects
from asyncinfer.declarations import ensure_jobs_bucket, ensure_queues_bucket, ensure_work_consumer, ensure_work_stream
from asyncinfer.errors import AsyncInferError
from asyncinfer.gc_tuning import tune_for_serving
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import PRIORITIES_BY_RANK, BatchInfo, JobError, JobRecord, JobState, Priority, WorkEnvelope
from asyncinfer.logs import configure_logging
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import Msg, Subscription
from asyncinfer.nats.connection import connect
from asyncinfer.queued_notice import decode_queued_notice
from asyncinfer.queues import CancelNotice
from asyncinfer.runner import run_until_stopped
from asyncinfer.supervision import Supervisor
from services.batcher.app import BatcherApp
from services.batcher.engine import BatchingEngine, PendingItem
from services.batcher.work_messages import is_shutdown
from services.scheduler.pauses import PauseState
from services.scheduler.priority import PrioritySelector
from services.scheduler.queued_records import QueuedRecords
from services.scheduler.work_queue import ModelQueues

log = structlog.get_logger("asyncinfer.bench.direct_pull")

# The most messages one pull asks for (the scheduler's MAX_PULL_PER_ROUND).
MAX_PULL = 64
# As job_dispatch.RECORD_WAITS_S: the gateway writes the record just after its publish.
RECORD_WAITS_S = (0.001, 0.002, 0.004, 0.008, 0.015, 0.03)
# A message this process will not run (attempts spent, a failed read) comes back after this.
LEAVE_FOR_S = 1.0
# build_slow's time per batch.
SLOW_BATCH_S = 0.02
SLOWER_BATCH_S = 0.2


@dataclass(slots=True)
class Held:
    """A job this batcher runs: its unacked message (the lease), the RUNNING record, its item."""

    msg: Msg
    record: JobRecord
    item: PendingItem


async def quietly(action: Awaitable[None]) -> None:
    with contextlib.suppress(Exception):
        await action


class ModelPuller:
    """The data path of one model: pull -> RUNNING -> engine -> terminal -> ack."""

    def __init__(
        self,
        *,
        nc: NatsClient,
        store: JobStore,
        engine: BatchingEngine,
        config: Config,
        model_name: str,
        batcher_id: str,
        supervisor: Supervisor,
        resumed: asyncio.Event,
    ) -> None:
        settings = config.scheduler
        self.model_name = model_name
        self._nc = nc
        self._store = store
        self._engine = engine
        self._batcher_id = batcher_id
        self._supervisor = supervisor
        self._resumed = resumed
        self._poll_interval_s = settings.poll_interval_ms / 1000.0
        weights = {
            Priority.HIGH: settings.weight_high,
            Priority.NORMAL: settings.weight_normal,
            Priority.LOW: settings.weight_low,
        }
        self._queues = ModelQueues(
            nc,
            config.nats.work_stream,
            model_name,
            PrioritySelector(weights, settings.aging_s),
            empty_for_s=self._poll_interval_s,
        )
        self._records = QueuedRecords()
        self._doorbell = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        # Pulled and being written RUNNING: not in the engine yet, but their slots are taken.
        self._reserved = 0
        self.held: dict[str, Held] = {}
        self._finished: list[Held] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._subscriptions: list[Subscription] = []
        self._loop: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._engine.add_slot_listener(self._on_slot_freed)
        self._subscriptions.append(await self._nc.subscribe(queued_subjects(self.model_name), cb=self._ring))
        self._subscriptions.append(await self._nc.subscribe(cancel_subject(self.model_name), cb=self._on_cancel))
        self._loop = self._supervisor.start(f"direct-pull-{self.model_name}", self._run())

    async def stop(self, grace_s: float) -> None:
        """Stops pulling; lets what is held finish within grace_s (what is left comes back after
        AckWait)."""
        self._stopping.set()
        self._doorbell.set()
        self._slot_freed.set()
        if self._loop is not None:
            await asyncio.gather(self._loop, return_exceptions=True)
        deadline = time.monotonic() + grace_s
        # What is being started, then what runs, then its settlement (each started by the one before).
        for _ in range(3):
            pending: list[asyncio.Future[Any]] = [*self._tasks, *(held.item.future for held in self.held.values())]
            left_s = deadline - time.monotonic()
            if not pending or left_s <= 0:
                break
            await asyncio.wait(pending, timeout=left_s)
            await asyncio.sleep(0)  # the settlement a resolved item schedules
        for subscription in self._subscriptions:
            await quietly(subscription.unsubscribe())
        await self._queues.close()

    # --- the doorbells ------------------------------------------------------------------------

    async def _ring(self, msg: Msg) -> None:
        try:
            key, revision, record_data = decode_queued_notice(msg.data)
        except ValueError:
            pass
        else:
            self._records.put(key, revision, record_data)
        token = msg.subject.rpartition(".")[2]
        for priority in PRIORITIES_BY_RANK:
            if priority.subject_token == token:
                self._queues.note_publish(priority)
        self._doorbell.set()

    def _on_slot_freed(self, model_name: str) -> None:
        if model_name == self.model_name:
            self._slot_freed.set()

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            notice = CancelNotice.decode(msg.data)
        except (ValueError, TypeError):
            return
        held = self.held.get(notice.job_id)
        if held is not None:
            held.item.cancel()  # dropped if its batch has not started; its Drop then writes CANCELED

    # --- pull -> RUNNING -> engine ------------------------------------------------------------

    def _free(self) -> int:
        return self._engine.free_slots(self.model_name) - self._reserved

    async def _run(self) -> None:
        while not self._stopping.is_set():
            if not self._resumed.is_set():
                await self._wait(self._resumed, None)
                continue
            free = self._free()
            if free <= 0:
                self._slot_freed.clear()
                if self._free() <= 0:
                    await self._wait(self._slot_freed, None)
                continue
            self._doorbell.clear()
            msgs = await self._queues.pull_next(min(free, MAX_PULL))
            if not msgs:
                await self._wait(self._doorbell, self._poll_interval_s)
                continue
            self._reserved += len(msgs)
            self._own(self._start_group(msgs))

    async def _wait(self, event: asyncio.Event, timeout_s: float | None) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)

    def _own(self, work: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("direct_pull_task_failed", error=repr(task.exception()))

    async def _start_group(self, msgs: list[Msg]) -> None:
        try:
            await asyncio.gather(*(self._start_one(msg) for msg in msgs))
        finally:
            self._reserved -= len(msgs)
            self._slot_freed.set()

    async def _record_of(self, envelope: WorkEnvelope) -> JobRecord | None:
        record = self._records.take(envelope.key)
        if record is not None:
            return record
        record = await self._store.get(envelope.key)
        for pause_s in RECORD_WAITS_S:
            if record is not None:
                return record
            await asyncio.sleep(pause_s)
            record = await self._store.get(envelope.key)
        return record

    async def _start_one(self, msg: Msg) -> None:
        try:
            envelope = decode_envelope(msg.data)
        except (ValueError, KeyError, TypeError):
            await quietly(msg.term())
            return
        try:
            record = await self._record_of(envelope)
            if record is None:
                await quietly(msg.nak(delay=LEAVE_FOR_S))  # the control plane's orphan rules apply
                return
            now = time.time()
            event = lifecycle.Dispatch(batcher_id=self._batcher_id)
            latest, written = await self._store.transition(record, lifecycle.decider(event, now))
        except AsyncInferError:
            await quietly(msg.nak(delay=LEAVE_FOR_S))
            return
        if latest is None:
            await quietly(msg.term())
            return
        if not written or latest.state is not JobState.RUNNING:
            refusal = None if written else lifecycle.dispatch(latest, event, now)
            if isinstance(refusal, lifecycle.Refusal) and refusal.reason is lifecycle.Refused.ATTEMPTS_SPENT:
                # Dead letters stay with the control plane (not in the prototype): left to AckWait.
                return
            await quietly(msg.ack())  # canceled, expired or terminal: nothing to run
            return
        timeout_s = envelope.deadline - time.time() if envelope.deadline is not None else None
        try:
            item = self._engine.submit(
                self.model_name, envelope.inputs, timeout_s=timeout_s, priority=envelope.priority
            )
        except AsyncInferError as error:
            log.info("direct_pull_submit_refused", job_id=envelope.job_id, reason=error.reason)
            await self._end(
                latest, msg, lifecycle.Requeue(attempt=latest.attempt, error=job_errors.dropped_unrun(), refund=True)
            )
            return
        held = Held(msg=msg, record=latest, item=item)
        self.held[envelope.job_id] = held
        item.future.add_done_callback(functools.partial(self._item_done, held))

    # --- engine -> terminal -> ack ------------------------------------------------------------

    def _item_done(self, held: Held, _future: object) -> None:
        """An item resolved: settled with every other item that resolved in the same turn of the
        loop (a batch's items resolve together)."""
        if not self._finished:
            asyncio.get_running_loop().call_soon(self._settle_finished)
        self._finished.append(held)

    def _settle_finished(self) -> None:
        group, self._finished = self._finished, []
        self._own(self._settle_group(group))

    async def _settle_group(self, group: list[Held]) -> None:
        now = time.time()
        events = [self._event_of(held) for held in group]
        written = await asyncio.gather(
            *(
                self._store.transition(held.record, lifecycle.decider(event, now))
                for held, event in zip(group, events, strict=True)
            ),
            return_exceptions=True,
        )
        for held, event, outcome in zip(group, events, written, strict=True):
            self.held.pop(held.record.job_id, None)
            if isinstance(outcome, BaseException):
                log.warning("direct_pull_settle_failed", job_id=held.record.job_id, error=repr(outcome))
                continue  # NATS trouble: the message comes back after AckWait
            latest, _ = outcome
            if isinstance(event, lifecycle.Drop) and latest is not None and not latest.state.is_terminal:
                # The Drop ended nothing on the record held here (a cancel's CANCELLING is written
                # elsewhere, so the refusal came before any compare-and-set): put the job back, as
                # the scheduler's settlement does; that write finds the CANCELLING and cancels.
                requeue = lifecycle.Requeue(attempt=held.record.attempt, error=job_errors.dropped_unrun(), refund=True)
                self._own(self._end(latest, held.msg, requeue))
                continue
            if latest is not None and latest.state.is_terminal:
                await quietly(held.msg.ack())  # a publish: no answer is awaited
            elif latest is not None and latest.state is JobState.QUEUED:
                await quietly(held.msg.nak())

    def _event_of(self, held: Held) -> lifecycle.Event:
        future = held.item.future
        attempt = held.record.attempt
        if future.cancelled():
            return lifecycle.Drop(attempt)
        error = future.exception()
        if isinstance(error, AsyncInferError) and is_shutdown(error):
            return lifecycle.Requeue(attempt=attempt, error=job_errors.dropped_unrun(), refund=True)
        if error is not None:
            # Retries are the control plane's: here every error ends the job (not on the bench's path).
            wrapped = error if isinstance(error, AsyncInferError) else AsyncInferError(repr(error))
            job_error = JobError.from_exception(wrapped)
            return lifecycle.Finish(attempt=attempt, state=JobState.FAILED, error=job_error)
        outcome = future.result()
        batch = BatchInfo(batcher_id=self._batcher_id, batch_size=outcome.batch_items, compute_s=outcome.compute_s)
        return lifecycle.Finish(attempt=attempt, state=JobState.SUCCEEDED, outputs=tuple(outcome.outputs), batch=batch)

    async def _end(self, record: JobRecord, msg: Msg, event: lifecycle.Event) -> None:
        latest, _ = await self._store.transition(record, lifecycle.decider(event, time.time()))
        if latest is not None and latest.state.is_terminal:
            await quietly(msg.ack())
        else:
            await quietly(msg.nak())

    async def renew(self) -> None:
        for held in list(self.held.values()):
            await quietly(held.msg.in_progress())


def _sleeping_identity(batch_s: float) -> Any:
    import torch

    class SleepingIdentity(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(batch_s)
            return x

    return SleepingIdentity()


def build_slow() -> Any:
    """The no-op model taking SLOW_BATCH_S per batch (a loader, for the kill check: the killed
    batcher must be holding work when it dies)."""
    return _sleeping_identity(SLOW_BATCH_S)


def build_slower() -> Any:
    """The no-op model taking SLOWER_BATCH_S per batch (for the cancel check: jobs wait their turn
    in the engine, RUNNING, long enough to be cancelled there)."""
    return _sleeping_identity(SLOWER_BATCH_S)


class DirectPullApp:
    """The batcher's app with the pullers on top; an App for asyncinfer.runner."""

    def __init__(self, config: Config) -> None:
        self.config = config.replace(batcher={"scheduler_address": ""})
        self.batcher = BatcherApp(self.config)
        self.supervisor = self.batcher.supervisor
        self.port = 0
        self._nc: NatsClient | None = None
        self._pauses: PauseState | None = None
        self._pullers: list[ModelPuller] = []
        self._renewal: asyncio.Task[None] | None = None

    async def start(self) -> None:
        config = self.config
        self._nc = nc = await connect(config.nats, name=f"direct-pull-{self.batcher.batcher_id}")
        js = nc.jetstream()
        await ensure_work_stream(js, config.nats)
        store = JobStore(await ensure_jobs_bucket(js, config.nats), work_stream=config.nats.work_stream)
        for model in config.models:
            for priority in PRIORITIES_BY_RANK:
                await ensure_work_consumer(
                    js, config.nats, model_name=model.name, priority=priority, ack_wait_s=config.scheduler.ack_wait_s
                )
        self._pauses = PauseState(await ensure_queues_bucket(js, config.nats), self.supervisor)
        await self._pauses.start()
        await self.batcher.start()
        self.port = self.batcher.port
        for name in self.batcher.engine.model_names:
            puller = ModelPuller(
                nc=nc,
                store=store,
                engine=self.batcher.engine,
                config=config,
                model_name=name,
                batcher_id=self.batcher.batcher_id,
                supervisor=self.supervisor,
                resumed=self._pauses.resumed(name),
            )
            await puller.start()
            self._pullers.append(puller)
        self._renewal = self.supervisor.start("direct-pull-renewal", self._renew())

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.config.scheduler.lease_renew_interval_s)
            for puller in self._pullers:
                await puller.renew()

    async def stop(self, grace_s: float = 5.0) -> None:
        for puller in self._pullers:
            await puller.stop(grace_s)
        if self._renewal is not None:
            self._renewal.cancel()
            await asyncio.gather(self._renewal, return_exceptions=True)
        await self.batcher.stop(grace_s)
        if self._pauses is not None:
            await self._pauses.stop()
        if self._nc is not None and not self._nc.is_closed:
            await quietly(self._nc.drain())


def main() -> int:
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    args = parser.parse_args()
    config = load_config(args.config)
    configure_logging(config.logging, service="batcher")

    async def start() -> DirectPullApp:
        app = DirectPullApp(config)
        await app.start()
        return app

    def started(_apps: object) -> None:
        tune_for_serving()
        print("direct-pull batcher serving", flush=True)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(run_until_stopped([start], grace_s=10.0, on_started=started))


if __name__ == "__main__":
    sys.exit(main())
