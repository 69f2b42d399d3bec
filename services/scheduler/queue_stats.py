"""Queue statistics per model and priority, read from the consumers, for OpsService, metrics, the
priority selector's aging and the queue snapshots the gateway reads (asyncinfer.queues).

The desired batcher count (the autoscaler's signal): zero when nothing waits or runs (scale to
zero); otherwise enough batchers to clear the backlog (waiting + in flight) within
`autoscale_target_drain_s` at the throughput one batcher was measured to give
(completed_per_s / connected batchers), at least one. Before anything was measured (no batcher
yet, or none finished anything), one, or the batchers connected. While the queue is held (paused,
or the scheduler draining) its waiting jobs do not count, since nothing will run them: only the
jobs in flight do, and never more batchers than are connected (an autoscaler must not scale up a
queue nobody may dispatch from, and may scale it to zero once its jobs in flight are done).
Running batches' chunks not yet queued as jobs (services.scheduler.batch_plans) count as waiting
jobs, up to `batches.chunks_in_flight` more batchers per batch (a batch runs no more at once).

The submission rate counts the queued notices heard (asyncinfer.queued_notice: one per submitted
job, and one per replayed dead letter); a notice lost on the way is a job missing from the rate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from asyncinfer import queues
from asyncinfer.config import Config
from asyncinfer.contract import WORK_SUBJECT_PREFIX, work_consumer_name, work_filters
from asyncinfer.jobs import PRIORITIES_BY_RANK, Priority
from asyncinfer.nats import Client, JetStreamContext, NotFoundError
from asyncinfer.nats.streams import ATTEMPT_TIMEOUT_S, consumer_counts, subject_counts
from services.scheduler.batchers import BatcherRegistry

# Up to this many work subjects (one per job queued or running) are listed in a stream info to
# learn which queues are empty (~70 bytes each in the answer); past it every queue without a held
# pull is asked its consumer's info, as before.
LISTED_SUBJECTS_MOST = 1_000


@dataclass(frozen=True, slots=True)
class PriorityQueueSnapshot:
    priority: Priority
    depth: int
    oldest_age_s: float | None
    # Unix seconds the oldest waiting message was queued (None when empty or unknown).
    oldest_create_time: float | None = None
    # ... and the newest (the last message on the queue's subjects).
    newest_create_time: float | None = None
    # Of `depth`, the jobs this scheduler put back (its own part; the rest is the consumer's
    # pending, every scheduler's alike), and when the oldest of them past its backoff was stored.
    put_back: int = 0
    put_back_oldest_create_time: float | None = None
    # The consumer's unacknowledged deliveries, as read with the depth (0 where the stream holds no
    # message of the queue; None: not read, a pull of this scheduler held open on the queue). The
    # shared form carries them only with put-backs (asyncinfer.snapshot_merge caps the put-backs by
    # them); the cluster's view counts those no scheduler accounts for
    # (services.scheduler.cluster_queues.unclaimed_deliveries).
    ack_pending: int | None = None
    # When the oldest message of the queue delivered and not yet acknowledged was stored (the
    # server's stamp, Unix seconds): read only where the model's deliveries are more than this
    # scheduler's put-backs and jobs in flight (some may be put back by a scheduler since gone,
    # services.scheduler.cluster_queues.unclaimed_deliveries), else None. Whoever holds it: a job
    # in flight on another scheduler may be older than the put-back, so an upper bound. This
    # scheduler's own view alone (the shared form does not carry it).
    unacked_oldest_create_time: float | None = None


@dataclass(frozen=True, slots=True)
class BatchSizeCount:
    batch_size: int
    batches: int  # batches of that size (its jobs / the size, rounded: each job counts 1/size)
    jobs: int


@dataclass(frozen=True, slots=True)
class ModelQueueSnapshot:
    model_name: str
    priorities: tuple[PriorityQueueSnapshot, ...]
    in_flight: int
    connected_batchers: int
    free_credits: int
    desired_batchers: int
    paused: bool = False
    completed_per_s: float = 0.0
    updated_at: float = 0.0
    draining: bool = False
    submitted_per_s: float = 0.0
    # Jobs completed over the last minute by the size of the batch each ran in.
    batch_sizes: tuple[BatchSizeCount, ...] = ()
    # Schedulers reporting the model, this one included, and how many of them drain: 1 and 0 (or
    # 1) for this scheduler's own view; the cluster's in GetQueueStats (services.scheduler.cluster_queues).
    schedulers: int = 1
    draining_schedulers: int = 0

    @property
    def depth(self) -> int:
        return sum(q.depth for q in self.priorities)

    def oldest_ages(self) -> dict[Priority, float | None]:
        return {q.priority: q.oldest_age_s for q in self.priorities}

    def to_shared(self, scheduler: str) -> queues.QueueSnapshot:
        """The form the gateway reads from the queues bucket, naming the `scheduler` writing it."""
        return queues.QueueSnapshot(
            model_name=self.model_name,
            updated_at=self.updated_at,
            priorities={
                q.priority.value: queues.PriorityQueueSnapshot(
                    depth=q.depth,
                    oldest_create_time=q.oldest_create_time,
                    newest_create_time=q.newest_create_time,
                    put_back=q.put_back,
                    put_back_oldest_create_time=q.put_back_oldest_create_time,
                    ack_pending=q.ack_pending if q.put_back else None,
                )
                for q in self.priorities
            },
            in_flight=self.in_flight,
            connected_batchers=self.connected_batchers,
            free_credits=self.free_credits,
            completed_per_s=self.completed_per_s,
            paused=self.paused,
            desired_batchers=self.desired_batchers,
            draining=self.draining,
            scheduler=scheduler,
        )


def waited_s(stored_at: float, *, server_now: float | None, wall_now: float) -> float:
    """How long a message stored at `stored_at` (the server's stamp, Unix seconds) has waited:
    against the server's time as it answered (`server_now`), so a step of the scheduler's wall
    clock ages no queue; against the scheduler's clock (`wall_now`) only where the server does not
    say its time (older than 2.10)."""
    now = server_now if server_now is not None else wall_now
    return max(now - stored_at, 0.0)


def desired_batchers(
    *,
    waiting: int,
    in_flight: int,
    connected: int,
    completed_per_s: float,
    target_drain_s: float,
    held: bool = False,
    planned: int = 0,
    planned_batches: int = 0,
    chunks_in_flight: int = 0,
) -> int:
    """`held`: the queue is paused or its scheduler draining (see the module's docstring).
    `planned`: chunks of `planned_batches` running batches not yet queued as jobs, each a job to
    come; since a batch keeps at most `chunks_in_flight` chunks queued or running, they add at
    most that many batchers per batch to what the queue alone asks for."""
    backlog = in_flight if held else waiting + in_flight
    if not held and planned > 0:
        alone = desired_batchers(
            waiting=waiting,
            in_flight=in_flight,
            connected=connected,
            completed_per_s=completed_per_s,
            target_drain_s=target_drain_s,
        )
        wanted = desired_batchers(
            waiting=waiting + planned,
            in_flight=in_flight,
            connected=connected,
            completed_per_s=completed_per_s,
            target_drain_s=target_drain_s,
        )
        return min(wanted, alone + planned_batches * max(chunks_in_flight, 1))
    if backlog <= 0:
        return 0
    if connected <= 0 or completed_per_s <= 0:
        wanted = max(1, connected)
    else:
        per_batcher = completed_per_s / connected
        wanted = max(1, math.ceil(backlog / (per_batcher * target_drain_s)))
    return min(wanted, connected) if held else wanted


class QueueStatsReader:
    def __init__(
        self,
        *,
        js: JetStreamContext,
        config: Config,
        batchers: BatcherRegistry,
        in_flight_count: Callable[[str], int],
        completed_per_s: Callable[[str], float],
        is_paused: Callable[[str], bool],
        submitted_per_s: Callable[[str], float],
        is_draining: Callable[[], bool],
        put_back_count: Callable[[str, Priority], int] = lambda _model, _priority: 0,
        batch_sizes: Callable[[str], tuple[BatchSizeCount, ...]] = lambda _model: (),
        planned_chunks: Callable[[str], tuple[int, int]] = lambda _model: (0, 0),
        runtime_models: Callable[[], Iterable[str]] = lambda: (),
        held_open: Callable[[str, Priority], bool] = lambda _model, _priority: False,
        put_back_jobs: Callable[[str, Priority], frozenset[str]] = lambda _model, _priority: frozenset(),
        put_back_oldest: Callable[[str, Priority], float | None] = lambda _model, _priority: None,
        forget_put_back: Callable[[str, str], None] = lambda _model, _job_id: None,
        nc: Client,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._nc = nc
        self._clock = clock  # the wall clock: each snapshot's `updated_at`
        self._held_open = held_open
        self._runtime_models = runtime_models  # names learnt from batchers (services.scheduler.runtime_models)
        self._planned_chunks = planned_chunks
        self._put_back_count = put_back_count
        self._put_back_jobs = put_back_jobs
        self._put_back_oldest = put_back_oldest
        self._forget_put_back = forget_put_back
        self._batch_sizes = batch_sizes
        self._js = js
        self._config = config
        self._batchers = batchers
        self._in_flight_count = in_flight_count
        self._completed_per_s = completed_per_s
        self._is_paused = is_paused
        self._submitted_per_s = submitted_per_s
        self._is_draining = is_draining

    async def snapshot(self, model_name: str = "") -> list[ModelQueueSnapshot]:
        """Every configured or learnt model (or just model_name); unknown names give an empty list."""
        names = [m.name for m in self._config.models] + list(self._runtime_models())
        models = [n for n in names if not model_name or n == model_name]
        # Jobs put back here are looked for in the listing too (a queue with some is asked).
        put_back = {(n, p): self._put_back_jobs(n, p) for n in models for p in PRIORITIES_BY_RANK}
        asked = any(not self._held_open(n, p) or put_back[n, p] for n in models for p in PRIORITIES_BY_RANK)
        occupied = await self._occupied_queues(put_back) if asked else None
        return list(await asyncio.gather(*(self._model_snapshot(n, occupied) for n in models)))

    async def _occupied_queues(
        self, put_back: Mapping[tuple[str, Priority], frozenset[str]]
    ) -> set[tuple[str, str]] | None:
        """The (model, priority token) of every queue the work stream holds a message of, waiting
        or in flight (a WorkQueue stream: a job's message leaves when its result is stored), or
        None when unknown (too many subjects to list): a queue not in it has nothing waiting, and
        is not asked. A scale pass: an idle scheduler of 100 models and no batcher (no pull held
        open) asked 300 consumer infos a round, 150 a second, 25-30 ms of each round; now one
        stream info (two while a few jobs are queued or running).

        The jobs `put_back` (pulled and put back here before the listing) whose messages it does not
        list are gone (another scheduler pulled one again and ran it; it was cancelled or expired):
        forgotten, else counted as waiting here for good."""
        counts = await subject_counts(
            self._nc,
            self._config.nats.work_stream,
            f"{WORK_SUBJECT_PREFIX}.>",
            most=LISTED_SUBJECTS_MOST,
            timeout_s=ATTEMPT_TIMEOUT_S,
        )
        if counts is None:
            return None
        occupied: set[tuple[str, str]] = set()
        stored: set[str] = set()  # the jobs whose messages the stream holds
        unnamed: set[tuple[str, str]] = set()  # queues with an older gateway's message (no job in its subject)
        for subject, count in counts.items():
            # asyncinfer.work.<model>.<priority>[.<tenant>.<job_id>]; model names hold no dot
            tokens = subject.split(".", 4)
            if count > 0 and len(tokens) >= 4:
                occupied.add((tokens[2], tokens[3]))
                if len(tokens) == 5:
                    stored.add(subject.rpartition(".")[2])
                else:
                    unnamed.add((tokens[2], tokens[3]))
        for (model_name, priority), jobs in put_back.items():
            if (model_name, priority.subject_token) not in unnamed:
                for job_id in jobs - stored:
                    self._forget_put_back(model_name, job_id)
        return occupied

    async def _model_snapshot(self, name: str, occupied: set[tuple[str, str]] | None = None) -> ModelQueueSnapshot:
        queued = await asyncio.gather(*(self._queue(name, p, occupied) for p in PRIORITIES_BY_RANK))
        sessions = self._batchers.serving(name)
        in_flight = self._in_flight_count(name)
        queued = await self._with_unacked_oldest(name, queued, in_flight)
        rate = self._completed_per_s(name)
        paused = self._is_paused(name)
        draining = self._is_draining()
        return ModelQueueSnapshot(
            model_name=name,
            priorities=tuple(queued),
            in_flight=in_flight,
            connected_batchers=len(sessions),
            free_credits=self._batchers.free_credits(name),
            desired_batchers=self.desired(
                name,
                waiting=sum(q.depth for q in queued),
                in_flight=in_flight,
                connected=len(sessions),
                completed_per_s=rate,
                held=paused or draining,
            ),
            paused=paused,
            completed_per_s=rate,
            updated_at=self._clock(),
            draining=draining,
            submitted_per_s=self._submitted_per_s(name),
            batch_sizes=self._batch_sizes(name),
        )

    async def _with_unacked_oldest(
        self, model_name: str, queued: list[PriorityQueueSnapshot], in_flight: int
    ) -> list[PriorityQueueSnapshot]:
        """`queued` with each priority's `unacked_oldest_create_time` where the model's consumers
        hold more deliveries than this scheduler accounts for (its put-backs and jobs in flight): a
        job put back by a scheduler since gone (killed, restarted) is counted waiting by the
        cluster's view, and its oldest time is its message's stored time, as a pending job's is.
        The oldest message stored on the priority's subjects at or before the consumer's delivered
        sequence is delivered and unacknowledged (a WorkQueue stream drops a message once acked).
        One more read per such priority and round; none while this scheduler holds every
        delivery (one scheduler, as a rule)."""
        excess = {
            q.priority: q.ack_pending - q.put_back
            for q in queued
            if q.ack_pending is not None and q.ack_pending > q.put_back
        }
        if sum(excess.values()) <= in_flight:
            return queued
        stream = self._config.nats.work_stream
        result = []
        for queue in queued:
            if queue.priority in excess:
                try:
                    first = await self._js.get_msg(
                        stream, seq=1, subject=work_filters(model_name, queue.priority)[-1], next=True
                    )
                except NotFoundError:
                    first = None
                if first is not None and first.time is not None:
                    queue = dataclasses.replace(queue, unacked_oldest_create_time=first.time.timestamp())
            result.append(queue)
        return result

    def desired(
        self, model_name: str, *, waiting: int, in_flight: int, connected: int, completed_per_s: float, held: bool
    ) -> int:
        """desired_batchers for the model's queue as given: this scheduler's own, or the cluster's
        (services.scheduler.cluster_queues), with its running batches' chunks to come."""
        planned, planned_batches = self._planned_chunks(model_name)
        return desired_batchers(
            waiting=waiting,
            in_flight=in_flight,
            connected=connected,
            completed_per_s=completed_per_s,
            target_drain_s=self._config.scheduler.autoscale_target_drain_s,
            held=held,
            planned=planned,
            planned_batches=planned_batches,
            chunks_in_flight=self._config.batches.chunks_in_flight,
        )

    async def _queue(
        self, model_name: str, priority: Priority, occupied: set[tuple[str, str]] | None = None
    ) -> PriorityQueueSnapshot:
        # Pulled and put back by this scheduler (services.scheduler.held_pulls): waiting, though
        # the consumer counts them as delivered.
        put_back = self._put_back_count(model_name, priority)
        if not put_back and self._held_open(model_name, priority):
            # A pull of ours is held open on the queue, so nothing waits on it: the server hands
            # a message to a waiting pull as it is stored (no ack-pending limit holds it back:
            # asyncinfer.declarations). An idle scheduler asked for each consumer's info at every
            # snapshot, its own and the console's, each every 2 s: 15 requests a second for
            # `asyncinfer up`'s 5 models, more than everything else it asked while idle.
            return PriorityQueueSnapshot(priority=priority, depth=0, oldest_age_s=None)
        if not put_back and occupied is not None and (model_name, priority.subject_token) not in occupied:
            # No message of it stored: none waits, and none is delivered unacknowledged either.
            return PriorityQueueSnapshot(priority=priority, depth=0, oldest_age_s=None, ack_pending=0)
        stream = self._config.nats.work_stream
        info = await consumer_counts(
            self._nc, stream, work_consumer_name(model_name, priority), timeout_s=ATTEMPT_TIMEOUT_S
        )
        depth = info.num_pending + put_back
        oldest_age_s: float | None = None
        oldest_create_time: float | None = None
        newest_create_time: float | None = None
        put_back_oldest: float | None = None
        if depth:
            # The oldest waiting message: the first on the subject past the delivered sequence, or
            # one put back here (pulled, so delivered: older than that first one, as a rule).
            first = None
            try:
                if info.num_pending:  # else only jobs put back wait
                    first = await self._js.get_msg(
                        stream,
                        seq=info.delivered_stream_seq + 1,
                        subject=work_filters(model_name, priority)[-1],  # every job's subject
                        next=True,
                    )
            except NotFoundError:
                pass
            stored_at = [first.time.timestamp()] if first is not None and first.time is not None else []
            if put_back:
                put_back_oldest = self._put_back_oldest(model_name, priority)
                if put_back_oldest is not None:
                    stored_at.append(put_back_oldest)
            if stored_at:
                oldest_create_time = min(stored_at)
                oldest_age_s = waited_s(
                    oldest_create_time, server_now=info.server_time, wall_now=datetime.now(UTC).timestamp()
                )
            if depth > 1:  # where the gateway places a queued job between the two (its position)
                newest_create_time = await self._newest_create_time(stream, model_name, priority)
        return PriorityQueueSnapshot(
            priority=priority,
            depth=depth,
            oldest_age_s=oldest_age_s,
            oldest_create_time=oldest_create_time,
            newest_create_time=newest_create_time,
            put_back=put_back,
            put_back_oldest_create_time=put_back_oldest,
            ack_pending=info.num_ack_pending,
        )

    async def _newest_create_time(self, stream: str, model_name: str, priority: Priority) -> float | None:
        """When the last message on the queue's subjects was published (a waiting job's, as the
        consumer delivers in order and the queue has more than one waiting)."""
        try:
            last = await self._js.get_msg(stream, subject=work_filters(model_name, priority)[-1])
        except NotFoundError:
            return None
        return None if last.time is None else last.time.timestamp()
