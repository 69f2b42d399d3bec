"""A keyed job's idempotency claim lives as long as the job's record, not days longer.

The gateway writes a claim with a TTL long enough for anything the job may still do (services/
gateway/claims.py: with no queue deadline it may wait a week). Once the job has ended, its record
lives for its result retention (a per-message TTL, asyncinfer.job_store), and so need its claim:
the claim's TTL is cut then to the retention plus KEY_TTL_SLACK_S, so that the claim still outlives
the record (a repeat within the retention gets the job) and goes an hour after it. An operator's
Replay of an ended job queues it again: its claim gets the long horizon back. Before this, every
claim stayed ~7 days whatever its job's retention (a soak: 20,362 claims, 7.15 MB, ten minutes
after all but 169 of their jobs' records were gone).

Best effort, off every job's path: the job store reports each record write it made
(`JobStore(after_write=...)`); `rewrite_for` says whether the write ends (or replays) a keyed job,
and a worker of `ClaimLifetimes` rewrites the claim: a read, then a compare-and-set on the
revision read, of the same claim with the new TTL, only while the claim still names this job (a
submit that took the key over later keeps its own). A rewrite that is refused, fails or is dropped
(its queue full, NATS away, the service stopping) leaves the claim's first TTL: it only collects
garbage later, since what a repeat gets is decided by the job's record (services/gateway/
idempotency.py). The rewrites of one claim go to one worker, in the order of their writes.

Cost: two JetStream requests per keyed job, when it ends, in the service that ended it.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from dataclasses import dataclass

import structlog

from asyncinfer.contract import claim_key
from asyncinfer.errors import Unavailable
from asyncinfer.idempotency_claims import KEY_TTL_SLACK_S, QUEUE_HORIZON_WITHOUT_DEADLINE_S, ClaimStore
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.jobs import JobRecord
from asyncinfer.log_throttle import Throttle
from asyncinfer.nats import KeyWrongLastSequenceError
from asyncinfer.supervision import Supervisor

log = structlog.get_logger("asyncinfer.claim_lifetimes")

WORKERS = 4
QUEUE_SIZE = 8192
# A replayed job's attempts, as far as its claim's TTL counts (its own timeout when it has one).
REPLAYED_ATTEMPT_ALLOWANCE_S = 3600.0
FAILURE_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class ClaimRewrite:
    """The claim at `key` should live `ttl_s` more seconds, if it still names `job_id`."""

    key: str
    job_id: str
    ttl_s: int


def rewrite_for(previous: JobRecord, written: JobRecord) -> ClaimRewrite | None:
    """What the write of `written` over `previous` asks of the job's claim: a keyed job that ended
    keeps it for its retention (and the slack); one replayed after it ended, for the horizon of a
    job queued anew. Nothing for any other write, or a job without a key."""
    if not written.idempotency_key:
        return None
    if written.state.is_terminal and not previous.state.is_terminal:
        ttl_s = written.result_retention_s + KEY_TTL_SLACK_S
    elif previous.state.is_terminal and not written.state.is_terminal:
        attempt_s = written.execution_timeout_s or REPLAYED_ATTEMPT_ALLOWANCE_S
        ttl_s = (
            QUEUE_HORIZON_WITHOUT_DEADLINE_S
            + written.max_attempts * attempt_s
            + written.result_retention_s
            + KEY_TTL_SLACK_S
        )
    else:
        return None
    return ClaimRewrite(claim_key(written.tenant, written.idempotency_key), written.job_id, max(1, math.ceil(ttl_s)))


class ClaimLifetimes:
    """Rewrites claims' TTLs as their jobs end, in WORKERS tasks owned by `supervisor`."""

    def __init__(self, claims: ClaimStore, supervisor: Supervisor, *, workers: int = WORKERS) -> None:
        self._claims = claims
        self._supervisor = supervisor
        self._queues: list[asyncio.Queue[ClaimRewrite]] = [asyncio.Queue(QUEUE_SIZE) for _ in range(workers)]
        self._tasks: list[asyncio.Task[None]] = []
        self._throttle = Throttle(FAILURE_LOG_INTERVAL_S)
        self.rewritten = 0
        self.left = 0  # refused (the claim changed or names another job), failed or dropped

    def start(self) -> None:
        self._tasks = [
            self._supervisor.start(f"claim-lifetimes-{i}", self._work(queue)) for i, queue in enumerate(self._queues)
        ]

    def after_write(self, previous: JobRecord, written: JobRecord) -> None:
        """JobStore's after_write: queues the rewrite the write asks for, if any (never waits)."""
        rewrite = rewrite_for(previous, written)
        if rewrite is None or not self._tasks:
            return
        queue = self._queues[zlib.crc32(rewrite.key.encode()) % len(self._queues)]
        try:
            queue.put_nowait(rewrite)
        except asyncio.QueueFull:
            self._left("queue_full", rewrite)

    async def _work(self, queue: asyncio.Queue[ClaimRewrite]) -> None:
        while True:
            rewrite = await queue.get()
            try:
                await self.apply(rewrite)
            except (Unavailable, *NATS_FAILURES, KeyWrongLastSequenceError) as exc:
                self._left(type(exc).__name__, rewrite)

    async def apply(self, rewrite: ClaimRewrite) -> bool:
        """Rewrites the claim with the new TTL if it still names the job; whether it did."""
        claim, _ = await self._claims.read(rewrite.key)
        if claim is None or claim.job_id != rewrite.job_id:
            self._left("claim_not_the_jobs", rewrite)
            return False
        await self._claims.write(rewrite.key, claim.encode(), last_revision=claim.revision, ttl_s=rewrite.ttl_s)
        self.rewritten += 1
        return True

    def _left(self, why: str, rewrite: ClaimRewrite) -> None:
        self.left += 1
        held = self._throttle.allow(why)
        if held is not None:
            # Debug: the claim keeps its first, longer TTL; nothing a caller sees changes.
            log.debug("claim_ttl_left", reason=why, job_id=rewrite.job_id, held_back=held)
