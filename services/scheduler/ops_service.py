"""OpsService: queue statistics, dead letters, pause/resume and drain/undrain, for operators
(grpcurl) and autoscalers. Protobuf stays here; the work is done by the stats reader, the
dead-letter store, `replay`, the pause state and the app's drain.

Every answer says what happened (grpcurl leaves out fields at their defaults, so an answer of
zeros alone would print `{}`): the queue's state, and counts that are present even when 0."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
import structlog
from google.protobuf import duration_pb2, timestamp_pb2

from asyncinfer.claim_lifetimes import ClaimLifetimes
from asyncinfer.config import Config
from asyncinfer.drain_orders import ANSWER_MARGIN_S, DrainAction, DrainOrder, SchedulerOutcome
from asyncinfer.error_status import error_to_proto
from asyncinfer.errors import (
    AsyncInferError,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    Unavailable,
    unknown_model,
)
from asyncinfer.job_store import NATS_FAILURES, JobStore
from asyncinfer.jobs import JobRecord
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import JetStreamContext
from asyncinfer.nats.failures import nats_failure_status
from asyncinfer.proto_durations import checked_duration
from asyncinfer.v1 import ops_service_pb2, ops_service_pb2_grpc
from services.scheduler.cluster_drains import ClusterDrains
from services.scheduler.dead_letters import DeadLetter, DeadLetterStore, each_at_most
from services.scheduler.model_controls import ModelControls
from services.scheduler.model_ops import ModelOps
from services.scheduler.pauses import PauseState
from services.scheduler.queue_stats import ModelQueueSnapshot, QueueStatsReader
from services.scheduler.replay import replay
from services.scheduler.worker_service import PRIORITY_TO_PROTO

log = structlog.get_logger("asyncinfer.scheduler.ops")

Context = grpc.aio.ServicerContext[Any, Any]
DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
DEFAULT_DRAIN_TIMEOUT_S = 30.0


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration


def snapshot_to_proto(snapshot: ModelQueueSnapshot) -> ops_service_pb2.ModelQueueStats:
    priorities = []
    for queue in snapshot.priorities:
        stats = ops_service_pb2.PriorityQueueStats(priority=PRIORITY_TO_PROTO[queue.priority], depth=queue.depth)
        if queue.oldest_age_s is not None:
            stats.oldest_age.CopyFrom(_duration(queue.oldest_age_s))
        priorities.append(stats)
    return ops_service_pb2.ModelQueueStats(
        model_name=snapshot.model_name,
        priorities=priorities,
        in_flight=snapshot.in_flight,
        connected_batchers=snapshot.connected_batchers,
        free_credits=snapshot.free_credits,
        desired_batchers=snapshot.desired_batchers,
        completed_per_second=snapshot.completed_per_s,
        submitted_per_second=snapshot.submitted_per_s,
        paused=snapshot.paused,
        draining=snapshot.draining,
        state=queue_state(paused=snapshot.paused, draining=snapshot.draining),
        batch_sizes=[
            ops_service_pb2.BatchSizeCount(batch_size=c.batch_size, batches=c.batches, jobs=c.jobs)
            for c in snapshot.batch_sizes
        ],
        schedulers=snapshot.schedulers,
        draining_schedulers=snapshot.draining_schedulers,
    )


def queue_state(*, paused: bool, draining: bool) -> ops_service_pb2.QueueState.ValueType:
    if paused:
        return ops_service_pb2.QUEUE_STATE_PAUSED
    if draining:
        return ops_service_pb2.QUEUE_STATE_DRAINING
    return ops_service_pb2.QUEUE_STATE_DISPATCHING


def dead_letter_to_proto(letter: DeadLetter, *, with_original: bool = False) -> ops_service_pb2.DeadLetter:
    dead_time = timestamp_pb2.Timestamp()
    dead_time.FromNanoseconds(round(letter.dead_time * 1e9))
    message = ops_service_pb2.DeadLetter(
        sequence=letter.sequence,
        job_id=letter.job_id,
        tenant=letter.tenant,
        model_name=letter.model_name,
        reason=letter.reason,
        attempts=letter.attempts,
        given_back_attempts=letter.given_back_attempts,
        allowed_attempts=letter.allowed_attempts,
        dead_time=dead_time,
    )
    if letter.last_error is not None:
        message.last_error.CopyFrom(error_to_proto(letter.last_error))
    if with_original:
        message.original_request = letter.original
    return message


SEQUENCES_NAMED = 20


def _sequences_text(sequences: list[int]) -> str:
    """Up to SEQUENCES_NAMED of them, comma-separated, and how many more."""
    text = ",".join(str(sequence) for sequence in sequences[:SEQUENCES_NAMED])
    return text + (f" and {len(sequences) - SEQUENCES_NAMED} more" if len(sequences) > SEQUENCES_NAMED else "")


def _refuse_missing(missing: list[int]) -> None:
    """NOT_FOUND naming the sequences given that have no letter, before any is replayed or purged
    (as when they were read one at a time)."""
    if missing:
        raise NotFound(
            f"no dead letter with sequence {missing[0]}"
            + (f" ({len(missing)} of the sequences given have none)" if len(missing) > 1 else ""),
            reason="DEAD_LETTER_NOT_FOUND",
            metadata={"missing_sequences": _sequences_text(missing)},
        )


def partly_done(verb: str, done: int, asked: int, failures: list[tuple[int, Exception]]) -> Exception:
    """The error of a purge or replay of which `failures` ((sequence, why), in the request's order)
    failed while `done` of the `asked` letters were purged or replayed: the first failure's status
    (a NATS failure as its handler's translation says it), its message saying how many were done,
    and ErrorInfo metadata `<verb>` (that count) and `not_<verb>` (the sequences that failed)."""
    sequence, first = failures[0]
    error = first if isinstance(first, AsyncInferError) else nats_failure_status(first)
    if error is None:
        return first  # no failure of NATS nor of the letter's job: a bug, raised as it is
    error.message = (
        f"{error.message} (dead letter {sequence}; {done} of {asked} {verb}, "
        f"{len(failures)} not: {_sequences_text([s for s, _ in failures])})"
    )
    error.metadata |= {verb: str(done), f"not_{verb}": _sequences_text([s for s, _ in failures])}
    return error


@contextlib.contextmanager
def nats_unavailable(what: str) -> Iterator[None]:
    """A NATS outage as UNAVAILABLE (`what: <the error>`), as every other read says it; unmapped
    it was UNKNOWN with a traceback in the log (the console's queue page during an outage)."""
    try:
        yield
    except NATS_FAILURES as exc:
        raise Unavailable(f"{what}: {exc}") from exc


class OpsService(ModelOps, ops_service_pb2_grpc.OpsServiceServicer):
    def __init__(
        self,
        *,
        config: Config,
        stats: QueueStatsReader,
        letters: DeadLetterStore,
        store: JobStore,
        nc: NatsClient,
        js: JetStreamContext,
        pauses: PauseState,
        drain: Callable[[float], Awaitable[int]],
        undrain: Callable[[], bool],
        scheduler_name: str,
        drains: ClusterDrains | None = None,
        controls: ModelControls | None = None,
        knows_model: Callable[[str], bool] | None = None,
        learnt_models: Callable[[], tuple[str, ...]] | None = None,
        claims: ClaimLifetimes | None = None,
        cluster_wide: Callable[[ModelQueueSnapshot], ModelQueueSnapshot] | None = None,
    ) -> None:
        # This scheduler's snapshot with the other schedulers' batchers, jobs in flight and rates
        # (services.scheduler.cluster_queues); None: its own alone.
        self._cluster_wide = cluster_wide
        self._controls = controls
        self._claims = claims
        # Configured names, plus those learnt from batchers at runtime (services.scheduler.runtime_models).
        self._knows_model = knows_model
        self._learnt_models = learnt_models
        self._error_to_proto = error_to_proto
        self._config = config
        self._stats = stats
        self._letters = letters
        self._store = store
        self._nc = nc
        self._js = js
        self._pauses = pauses
        self._drain = drain
        self._undrain = undrain
        # Its instance name (services.scheduler.instances.instance_name), as its queue snapshots
        # carry it: what a Drain's answer names, and who paused a queue.
        self._scheduler_name = scheduler_name
        # Drain orders to every scheduler (Drain and Undrain with `all` or `scheduler`); None: refused.
        self._drains = drains
        self._model_names = frozenset(m.name for m in config.models)

    def _known_model(self, model_name: str, *, required: bool = False) -> None:
        if required and not model_name:
            raise InvalidArgument("model_name is required", [FieldViolation("model_name", "give the model")])
        known = model_name in self._model_names or (self._knows_model is not None and self._knows_model(model_name))
        if model_name and not known:
            # Named as the gateway's submit names them (services.gateway.model_catalog): a typo is
            # fixed from the message alone.
            learnt = self._learnt_models() if self._learnt_models is not None else ()
            raise unknown_model(model_name, self._model_names.union(learnt), "the models this scheduler knows")

    async def GetQueueStats(
        self, request: ops_service_pb2.GetQueueStatsRequest, context: Context
    ) -> ops_service_pb2.GetQueueStatsResponse:
        self._known_model(request.model_name)
        with nats_unavailable("cannot read the queues"):
            snapshots = await self._cluster_snapshots(request.model_name)
        return ops_service_pb2.GetQueueStatsResponse(models=[snapshot_to_proto(s) for s in snapshots])

    async def ListDeadLetters(
        self, request: ops_service_pb2.ListDeadLettersRequest, context: Context
    ) -> ops_service_pb2.ListDeadLettersResponse:
        self._known_model(request.model_name)
        if request.page_size < 0:
            raise InvalidArgument("page_size must not be negative", [FieldViolation("page_size", "must be >= 0")])
        size = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        token = request.page_token
        # A stream sequence, as the last page gave it: digits only (int() also takes " 7", "1_000"
        # and other scripts' digits), within JetStream's range (a larger one reached NATS, whose
        # refusal was answered UNAVAILABLE, retriable).
        if token and not (token.isascii() and token.isdigit() and len(token) <= 20 and int(token) < 2**64 - 1):
            raise InvalidArgument(
                "page_token is not one this service gave", [FieldViolation("page_token", "not a page token")]
            )
        after = int(token) if token else 0
        # One more than asked says whether there is a next page.
        with nats_unavailable("cannot read the dead letters"):
            letters = await self._letters.page(model_name=request.model_name, after=after, limit=size + 1)
            total = await self._letters.count(model_name=request.model_name)
        page = letters[:size]
        next_token = str(page[-1].sequence) if len(letters) > size else ""
        return ops_service_pb2.ListDeadLettersResponse(
            dead_letters=[dead_letter_to_proto(letter) for letter in page],
            next_page_token=next_token,
            total=total,
        )

    async def GetDeadLetter(
        self, request: ops_service_pb2.GetDeadLetterRequest, context: Context
    ) -> ops_service_pb2.GetDeadLetterResponse:
        letter = await self._get(request.sequence)
        return ops_service_pb2.GetDeadLetterResponse(dead_letter=dead_letter_to_proto(letter, with_original=True))

    async def _get(self, sequence: int) -> DeadLetter:
        with nats_unavailable("cannot read the dead letter"):
            letter = await self._letters.get(sequence) if sequence > 0 else None
        if letter is None:
            raise NotFound(f"no dead letter with sequence {sequence}", reason="DEAD_LETTER_NOT_FOUND")
        return letter

    def _check_selection(self, sequences: list[int], every: bool, model_name: str) -> None:
        self._known_model(model_name)
        if sequences and every:
            raise InvalidArgument(
                "give sequences or all, not both", [FieldViolation("all", "cannot be combined with sequences")]
            )
        if not every and not sequences:
            raise InvalidArgument(
                "give the dead letters' sequences, or all = true", [FieldViolation("sequences", "none given")]
            )

    async def _selected(self, sequences: list[int], every: bool, model_name: str) -> list[DeadLetter]:
        """The letters a replay names (by sequence, or all of the model's), read: it replays them."""
        self._check_selection(sequences, every, model_name)
        if every:
            return await self._letters.all(model_name=model_name)
        # A sequence given twice is one letter (the second replay found it gone: NOT_REPLAYABLE
        # after the first had run it; the second purge was answered UNAVAILABLE).
        unique = [sequence for sequence in dict.fromkeys(sequences) if sequence > 0]
        with nats_unavailable("cannot read the dead letters"):
            found = await self._letters.get_many(unique)
        letters = [letter for letter in found if letter is not None]
        present = {letter.sequence for letter in letters}
        _refuse_missing([sequence for sequence in dict.fromkeys(sequences) if sequence not in present])
        return letters

    async def ReplayDeadLetters(
        self, request: ops_service_pb2.ReplayDeadLettersRequest, context: Context
    ) -> ops_service_pb2.ReplayDeadLettersResponse:
        letters = await self._selected(list(request.sequences), request.all, request.model_name)

        async def replay_one(letter: DeadLetter) -> JobRecord:
            return await replay(
                letter,
                store=self._store,
                letters=self._letters,
                nc=self._nc,
                js=self._js,
                config=self._config,
                claims=self._claims,
            )

        # LETTERS_AT_ONCE at a time, each to its end: one that fails stops none of the others, and
        # the answer (or the error) says how many were replayed.
        outcomes = await each_at_most(letters, replay_one)
        job_ids: list[str] = []
        skipped = 0
        failures: list[tuple[int, Exception]] = []
        for letter, outcome in zip(letters, outcomes, strict=True):
            if isinstance(outcome, AsyncInferError) and request.all:
                # Replaying everything skips what cannot be replayed and says so in the log.
                log.warning(
                    "dead_letter_not_replayed", sequence=letter.sequence, job_id=letter.job_id, error=outcome.message
                )
                skipped += 1
            elif isinstance(outcome, Exception):
                failures.append((letter.sequence, outcome))
            else:
                job_ids.append(letter.job_id)
                log.info(
                    "dead_letter_replayed", sequence=letter.sequence, job_id=letter.job_id, model=letter.model_name
                )
        if failures:
            raise partly_done("replayed", len(job_ids), len(letters), failures)
        return ops_service_pb2.ReplayDeadLettersResponse(
            replayed=len(job_ids),
            job_ids=job_ids,
            skipped=skipped,
            remaining=await self._letters.count(model_name=request.model_name),
        )

    async def PurgeDeadLetters(
        self, request: ops_service_pb2.PurgeDeadLettersRequest, context: Context
    ) -> ops_service_pb2.PurgeDeadLettersResponse:
        self._check_selection(list(request.sequences), request.all, request.model_name)
        if request.all:
            purged = await self._letters.purge(model_name=request.model_name)
        else:
            # Every one must be there before any is deleted; the stream's sequences say so, no
            # letter read (a replay reads its letters in _selected: it re-publishes them).
            sequences = list(dict.fromkeys(request.sequences))
            with nats_unavailable("cannot read the dead letters"):
                missing = await self._letters.missing(sequences)
            _refuse_missing(missing)
            outcomes = await self._letters.delete_many(sequences)
            purged = sum(outcome is True for outcome in outcomes)
            failures = [
                (sequence, outcome)
                for sequence, outcome in zip(sequences, outcomes, strict=True)
                if isinstance(outcome, Exception)
            ]
            if failures:
                raise partly_done("purged", purged, len(sequences), failures)
        log.info("dead_letters_purged", purged=purged, model=request.model_name or None)
        return ops_service_pb2.PurgeDeadLettersResponse(
            purged=purged, remaining=await self._letters.count(model_name=request.model_name)
        )

    async def PauseQueue(
        self, request: ops_service_pb2.PauseQueueRequest, context: Context
    ) -> ops_service_pb2.PauseQueueResponse:
        self._known_model(request.model_name, required=True)
        await self._pauses.pause(request.model_name, by=self._scheduler_name)
        return ops_service_pb2.PauseQueueResponse(
            paused=True,
            model_name=request.model_name,
            state=ops_service_pb2.QUEUE_STATE_PAUSED,
            queued=await self._queued(request.model_name),
        )

    async def ResumeQueue(
        self, request: ops_service_pb2.ResumeQueueRequest, context: Context
    ) -> ops_service_pb2.ResumeQueueResponse:
        self._known_model(request.model_name, required=True)
        # Counted before the resume, while nothing leaves the queue: the jobs it lets go. Counted
        # after, a dispatcher the resume woke may have taken them already ("0 queued" for a job
        # that had waited through the pause).
        (snapshot,) = await self._cluster_snapshots(request.model_name)
        await self._pauses.resume(request.model_name)
        return ops_service_pb2.ResumeQueueResponse(
            paused=False,
            model_name=request.model_name,
            state=queue_state(paused=False, draining=snapshot.draining),
            queued=snapshot.depth,
        )

    async def _queued(self, model_name: str) -> int:
        return sum(s.depth for s in await self._cluster_snapshots(model_name))

    async def _cluster_snapshots(self, model_name: str) -> list[ModelQueueSnapshot]:
        """The model's queue as GetQueueStats counts it: the whole cluster's (the consumers' pending
        plus every scheduler's put-backs). PauseQueue and ResumeQueue counted this scheduler's own
        view alone: a job another scheduler's held pull took while paused and put back there is that
        one's alone, and `queue resume` said "0 queued" for it."""
        snapshots = await self._stats.snapshot(model_name)
        if self._cluster_wide is not None:
            snapshots = [self._cluster_wide(s) for s in snapshots]
        return snapshots

    async def Drain(self, request: ops_service_pb2.DrainRequest, context: Context) -> ops_service_pb2.DrainResponse:
        violations: list[FieldViolation] = []
        timeout = checked_duration(request.timeout, "timeout", violations) if request.HasField("timeout") else None
        if violations:
            raise InvalidArgument(f"invalid request: timeout: {violations[0].description}", violations)
        timeout_s = timeout if timeout is not None else DEFAULT_DRAIN_TIMEOUT_S
        if timeout_s < 0:
            raise InvalidArgument("timeout must not be negative", [FieldViolation("timeout", "must be >= 0")])
        addressed = self._addressed(request.all, request.scheduler)
        remaining = context.time_remaining()
        if remaining is not None:
            # An order's answers must come back before the call's deadline.
            margin_s = ANSWER_MARGIN_S if addressed is not None else 0.0
            timeout_s = min(timeout_s, max(remaining - margin_s - 0.1, 0.0))
        if addressed is None:
            in_flight = await self._drain(timeout_s)
            return ops_service_pb2.DrainResponse(
                in_flight=in_flight,
                state=ops_service_pb2.QUEUE_STATE_DRAINING,
                drained=in_flight == 0,
                scheduler=self._scheduler_name,
            )
        results = await self._send(DrainOrder(action=DrainAction.DRAIN, timeout_s=timeout_s, scheduler=addressed))
        return ops_service_pb2.DrainResponse(
            in_flight=sum(r.answer.in_flight for r in results if r.answer is not None),
            state=ops_service_pb2.QUEUE_STATE_DRAINING,
            drained=all(r.answer is not None and r.answer.in_flight == 0 for r in results),
            scheduler=self._scheduler_name,
            schedulers=[
                ops_service_pb2.SchedulerDrainResult(
                    scheduler=r.scheduler,
                    answered=r.answer is not None,
                    in_flight=r.answer.in_flight if r.answer is not None else 0,
                    drained=r.answer is not None and r.answer.in_flight == 0,
                )
                for r in results
            ],
        )

    async def Undrain(
        self, request: ops_service_pb2.UndrainRequest, context: Context
    ) -> ops_service_pb2.UndrainResponse:
        addressed = self._addressed(request.all, request.scheduler)
        if addressed is None:
            was_draining = self._undrain()
            return ops_service_pb2.UndrainResponse(
                state=ops_service_pb2.QUEUE_STATE_DISPATCHING, was_draining=was_draining, scheduler=self._scheduler_name
            )
        results = await self._send(DrainOrder(action=DrainAction.UNDRAIN, scheduler=addressed))
        return ops_service_pb2.UndrainResponse(
            state=ops_service_pb2.QUEUE_STATE_DISPATCHING,
            was_draining=any(r.answer is not None and r.answer.was_draining for r in results),
            scheduler=self._scheduler_name,
            schedulers=[
                ops_service_pb2.SchedulerUndrainResult(
                    scheduler=r.scheduler,
                    answered=r.answer is not None,
                    was_draining=r.answer is not None and r.answer.was_draining,
                )
                for r in results
            ],
        )

    def _addressed(self, every_one: bool, scheduler: str) -> str | None:
        """Whom a Drain or Undrain addresses: None, the scheduler the call reached alone; "",
        every scheduler; else the one named."""
        if every_one and scheduler:
            raise InvalidArgument(
                "give `all` or `scheduler`, not both",
                [FieldViolation("scheduler", "leave it empty with `all`, or leave `all` false")],
            )
        if not every_one and not scheduler:
            return None
        if self._drains is None:
            raise FailedPrecondition(
                "this scheduler sends no drain orders to the others", reason="CLUSTER_DRAIN_UNAVAILABLE"
            )
        return scheduler

    async def _send(self, order: DrainOrder) -> tuple[SchedulerOutcome, ...]:
        assert self._drains is not None  # _addressed refused the call otherwise
        with nats_unavailable("cannot send the drain order to the schedulers"):
            return await self._drains.send(order)
