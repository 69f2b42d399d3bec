"""The deadline sweep: a queued job past its deadline ends EXPIRED at its deadline even when nothing
pulls it (a paused queue, or a backlog whose oldest job has waited `deadline_sweep_backlog_s`),
not at the queue's resume or someone's read, and its message stops counting in its queue's depth
and its tenant's quota.

Per model, while it is swept: a cursor over WORK (the model's messages in stream order, each read
once for its DEADLINE_HEADER; the payload is skipped, not decoded) and a heap of (deadline,
sequence) of those that carry one. At each sweep the entries whose deadline passed are expired:
the message is read by its sequence (gone: a dispatch took it), its record decided by
lifecycle.Expire and written with the compare-and-set a dispatch's expiry makes, so one of a
dispatch, a gateway's read and every scheduler's sweep writes EXPIRED; then the message of a job
that ended EXPIRED or CANCELED (which nothing runs again) is deleted by its sequence. A model no
longer swept forgets its cursor and heap: swept again later, it is read from the start (a job whose
deadline passed meanwhile was its dispatch's). A message without the header (an older gateway's) is
left to its dispatch or a read, as before.

Bounds, per model and sweep: SCAN_MOST messages read, EXPIRE_MOST jobs expired (the rest at the
next), EXPIRE_CONCURRENCY at a time. With several schedulers each sweeps: each reads every message
once and tries every expiry; the compare-and-set lets one write, and each other pays a message
read and a record read (or a message not found) per expired job. A backlog is judged on the
scheduler's own view (the pending and its own put-backs, not the cluster's): the queue's oldest job
is the pending's first, which every scheduler reads, or a put-back, which its putter counts, so one
sweeps at least, and a sweep reads every message whoever pulled it (a put-back's message stays in
the stream; its putter forgets it at its next put-back check, services.scheduler.put_back_checks).
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import structlog

from asyncinfer import lifecycle
from asyncinfer.codecs.envelope import deadline_of_headers, decode_envelope
from asyncinfer.contract import model_work_subjects
from asyncinfer.errors import Unavailable
from asyncinfer.job_store import NATS_FAILURES, JobStore, UnreadableJob, UnreadableOnce
from asyncinfer.jobs import JobState
from asyncinfer.nats import Client, JetStreamContext, NotFoundError
from asyncinfer.nats.streams import delete_message, next_headers
from asyncinfer.tracing import trace_fields
from services.scheduler.metrics import SchedulerMetrics

log = structlog.get_logger("asyncinfer.scheduler.deadlines")

SCAN_MOST = 2_000
EXPIRE_MOST = 1_000
EXPIRE_CONCURRENCY = 16
REQUEST_TIMEOUT_S = 5.0
# The states whose message nothing will take again: removed by the sweep. (A FAILED or TIMED_OUT
# job's message is its settlement's to ack; and a replay may re-queue it under the same subject.)
NEVER_RUN_AGAIN = frozenset({JobState.EXPIRED, JobState.CANCELED})


@dataclass(slots=True)
class _ModelScan:
    cursor: int = 0  # the last stream sequence read
    deadlines: list[tuple[float, int]] = field(default_factory=list)  # heap of (deadline, sequence)

    def take_due(self, now: float, most: int) -> list[tuple[float, int]]:
        due: list[tuple[float, int]] = []
        while self.deadlines and self.deadlines[0][0] <= now and len(due) < most:
            due.append(heapq.heappop(self.deadlines))
        return due


class DeadlineSweep:
    def __init__(
        self,
        *,
        nc: Client,
        js: JetStreamContext,
        store: JobStore,
        stream: str,
        metrics: SchedulerMetrics,
        models: Callable[[], Iterable[str]],
        is_paused: Callable[[str], bool],
        backlog_s: float,
        clock: Callable[[], float],
        on_message_dropped: Callable[[str, str], None] = lambda model_name, job_id: None,
    ) -> None:
        self._nc = nc
        self._js = js
        self._store = store
        self._unreadable = UnreadableOnce("deadline_sweep")
        self._stream = stream
        self._metrics = metrics
        self._models = models
        self._is_paused = is_paused
        self._backlog_s = backlog_s
        self._clock = clock
        self._on_message_dropped = on_message_dropped
        self._oldest_age_s: dict[str, float] = {}
        self._scans: dict[str, _ModelScan] = {}
        # What the sweeps did, for tests and the measurements in docs/ARCHITECTURE.md.
        self.messages_read = 0
        self.jobs_expired = 0

    def observe(self, model_name: str, oldest_ages_s: Iterable[float | None]) -> None:
        """The model's oldest waiting job's age per priority, from a queue stats round."""
        self._oldest_age_s[model_name] = max((age for age in oldest_ages_s if age is not None), default=0.0)

    def swept(self, model_name: str) -> bool:
        """Whether the model's queue is one nothing pulls from soon: paused, or backlogged."""
        return self._is_paused(model_name) or self._oldest_age_s.get(model_name, 0.0) >= self._backlog_s

    async def sweep(self) -> None:
        """One sweep of every model. A NATS failure of an expiry is raised once the other models are
        swept (their own reads fail at once while NATS is away), for the sweep's loop to say once
        an interval; the expiries it cut short wait in the heap for the next sweep."""
        failure: Exception | None = None
        for model_name in list(self._models()):
            if not self.swept(model_name):
                self._scans.pop(model_name, None)
                continue
            scan = self._scans.setdefault(model_name, _ModelScan())
            await self._read(model_name, scan)
            due = scan.take_due(self._clock(), EXPIRE_MOST)
            if due:
                expired = self.jobs_expired
                failed = await self._expire_all(model_name, scan, due)
                log.info("queued_jobs_expired", model=model_name, jobs=self.jobs_expired - expired, due=len(due))
                failure = failure or failed
        if failure is not None:
            raise failure

    async def _read(self, model_name: str, scan: _ModelScan) -> None:
        """Reads up to SCAN_MOST of the model's messages past the cursor, noting their deadlines."""
        subjects = model_work_subjects(model_name)
        for _ in range(SCAN_MOST):
            found = await next_headers(
                self._nc, self._stream, subjects, from_seq=scan.cursor + 1, timeout_s=REQUEST_TIMEOUT_S
            )
            if found is None:
                return
            seq, headers = found
            scan.cursor = seq
            self.messages_read += 1
            deadline = deadline_of_headers(headers)
            if deadline is not None:
                heapq.heappush(scan.deadlines, (deadline, seq))

    async def _expire_all(self, model_name: str, scan: _ModelScan, due: list[tuple[float, int]]) -> Exception | None:
        """Expires the `due` entries, EXPIRE_CONCURRENCY at a time; the first NATS failure, if any.
        After it, the entries not yet started are not tried: with NATS away each would wait out
        its request timeout (REQUEST_TIMEOUT_S, 16 at a time: 5 minutes for EXPIRE_MOST) and log
        a line. Every entry not expired is put back for the next sweep; a dispatch or a read may
        well be first."""
        slots = asyncio.Semaphore(EXPIRE_CONCURRENCY)
        failures: list[Exception] = []

        async def one(entry: tuple[float, int]) -> None:
            async with slots:
                if failures:
                    heapq.heappush(scan.deadlines, entry)
                    return
                try:
                    await self._expire(model_name, entry[1])
                except (*NATS_FAILURES, Unavailable) as exc:
                    heapq.heappush(scan.deadlines, entry)
                    failures.append(exc)

        await asyncio.gather(*(one(entry) for entry in due))
        return failures[0] if failures else None

    async def _expire(self, model_name: str, seq: int) -> None:
        try:
            message = await self._js.get_msg(self._stream, seq=seq)
        except NotFoundError:
            return  # taken by a dispatch (and settled), or removed
        try:
            envelope = decode_envelope(message.data or b"")
        except (ValueError, KeyError, TypeError) as exc:  # its dispatch terms it
            log.warning("deadline_sweep_message_undecodable", model=model_name, seq=seq, error=str(exc))
            return
        # A submit's message is the job's QUEUED record until a write makes the bucket's (a create
        # that finds one decides again on it); a replay's has its record in the bucket.
        try:
            record = envelope.queued_record() if envelope.is_record else await self._store.recorded(envelope.key)
            if record is None:
                return
            latest, written = await self._store.transition(record, lifecycle.decider(lifecycle.Expire(), self._clock()))
        except UnreadableJob as exc:  # a later release's (its scheduler expires it), or corrupted
            self._unreadable.say(exc)
            return
        if latest is None:
            return
        if written:
            self.jobs_expired += 1
            self._metrics.job_transition(latest)
            # At debug, as job_dispatched: a paused queue's thousands at once; the sweep's line counts them.
            about = {"job_id": latest.job_id, "model": latest.model_name, "tenant": latest.tenant}
            log.debug("job_expired_in_queue", **about, **trace_fields(latest.traceparent))
        if latest.state in NEVER_RUN_AGAIN:
            # Gone already: another scheduler's sweep, or the dispatch's ack, was first.
            await delete_message(self._nc, self._stream, seq, timeout_s=REQUEST_TIMEOUT_S)
            self._on_message_dropped(model_name, latest.job_id)
