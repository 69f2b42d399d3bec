"""A keyed job's idempotency claim lives as long as the job's record, not days longer.

The gateway writes a claim with a TTL long enough for anything the job may still do (services/
gateway/claims.py: with no queue deadline it may wait a week). Once the job has ended, its record
lives for its result retention (a per-message TTL, asyncinfer.job_store), and so need its claim:
the claim's TTL is cut then to the retention plus KEY_TTL_SLACK_S, so that the claim still outlives
the record (a repeat within the retention gets the job) and goes an hour after it. An operator's
Replay of an ended job queues it again: `renew` gives its claim the long TTL back first, and the
replayed record keeps the claim's new revision. Before this, every claim stayed ~7 days whatever
its job's retention (a soak: 20,362 claims, 7.15 MB, ten minutes after all but 169 of their jobs'
records were gone).

Best effort, off every job's path: the job store reports each record write it made
(`JobStore(after_write=...)`); `rewrite_for` says whether the write ends a keyed job, and a worker of
`ClaimLifetimes` rewrites the claim. A job's record keeps the claim its submit wrote (its revision
and the request's fingerprint), so an ending is one write published without an answer: the same
claim with the new TTL, on condition that the key's last revision is still the one the record
keeps, so a claim changed since (a submit took the key over) is left alone. A job submitted by an
older gateway (no claim kept) is a read, then a compare-and-set on the revision read, of the claim
if it still names the job. A rewrite that is refused, fails or is dropped (its queue full, NATS
away, the service stopping) leaves the claim's first TTL: it only collects garbage later, since
what a repeat gets is decided by the job's record (services/gateway/idempotency.py). The rewrites
of one claim go to one worker, in the order of their writes.

Cost per keyed job, when it ends: one message published by the service that ends it, and stored.
Measured as an A/B against the release without it, every submit keyed (`bench.system.ab --keyed`, 3
alternated rounds on the 2-core machine): none that the noise shows (CPU per job 0.89x in the unary
burst, 0.98x in the batch-API burst; bench/results/ab_claim_lifetimes_one_write.md). The read-and-
write form, measured first, cost ~0.23 ms more scheduler CPU and ~0.14 ms more nats-server CPU per
keyed job in a unary burst, 1.36x CPU per job in the batch-API burst (ab_claim_lifetimes.md).
"""

from __future__ import annotations

import asyncio
import math
import zlib
from dataclasses import dataclass

import structlog

from asyncinfer.contract import claim_key
from asyncinfer.errors import Unavailable
from asyncinfer.idempotency_claims import KEY_TTL_SLACK_S, QUEUE_HORIZON_WITHOUT_DEADLINE_S, Claim, ClaimStore
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.jobs import JobRecord
from asyncinfer.log_throttle import Throttle
from asyncinfer.nats import Client, KeyWrongLastSequenceError
from asyncinfer.supervision import Supervisor, end_if_cancelled

log = structlog.get_logger("asyncinfer.claim_lifetimes")

WORKERS = 4
QUEUE_SIZE = 8192
# A replayed job's attempts, as far as its claim's TTL counts (its own timeout when it has one).
REPLAYED_ATTEMPT_ALLOWANCE_S = 3600.0
FAILURE_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class ClaimRewrite:
    """The claim at `key` should live `ttl_s` more seconds, if it still names `job_id`. `written`:
    the claim as its submit wrote it (its revision, and its content at once), when the record kept
    it and the write ends the job; None to read it first."""

    key: str
    job_id: str
    ttl_s: int
    written: tuple[int, Claim] | None = None


def rewrite_for(previous: JobRecord, written: JobRecord) -> ClaimRewrite | None:
    """What the write of `written` over `previous` asks of the job's claim: a keyed job that ended
    keeps it for its retention (and the slack). Nothing for any other write, or a job without a key."""
    if not written.idempotency_key or not written.state.is_terminal or previous.state.is_terminal:
        return None
    kept: tuple[int, Claim] | None = None
    if written.claim_revision and written.claim_fingerprint:  # else read first: never write it blank
        kept = (written.claim_revision, Claim(written.job_id, written.claim_fingerprint, written.create_time))
    key = claim_key(written.tenant, written.idempotency_key)
    return ClaimRewrite(key, written.job_id, max(1, math.ceil(written.result_retention_s + KEY_TTL_SLACK_S)), kept)


def replayed_ttl_s(record: JobRecord, budget: int) -> int:
    """The claim's TTL for a job queued again by a replay with `budget` attempts: as long as a job
    queued anew without a deadline may live (an hour an attempt where it has no timeout of its own)."""
    attempt_s = record.execution_timeout_s or REPLAYED_ATTEMPT_ALLOWANCE_S
    ttl_s = QUEUE_HORIZON_WITHOUT_DEADLINE_S + budget * attempt_s + record.result_retention_s + KEY_TTL_SLACK_S
    return math.ceil(ttl_s)


class ClaimLifetimes:
    """Rewrites claims' TTLs as their jobs end, in WORKERS tasks owned by `supervisor`."""

    def __init__(self, claims: ClaimStore, nc: Client, supervisor: Supervisor, *, workers: int = WORKERS) -> None:
        self._claims = claims
        self._nc = nc
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
            end_if_cancelled()  # a stop's cancellation that the last rewrite's NATS request lost
            rewrite = await queue.get()
            try:
                await self.apply(rewrite)
            except (Unavailable, *NATS_FAILURES, KeyWrongLastSequenceError) as exc:
                self._left(type(exc).__name__, rewrite)

    async def apply(self, rewrite: ClaimRewrite) -> bool:
        """Rewrites the claim with the new TTL if it still names the job; whether it did (an
        unanswered write: whether it was sent)."""
        if rewrite.written is not None:
            revision, kept = rewrite.written
            await self._claims.write_unanswered(
                self._nc, rewrite.key, kept.encode(), last_revision=revision, ttl_s=rewrite.ttl_s
            )
            self.rewritten += 1
            return True
        claim, _ = await self._claims.read(rewrite.key)
        if claim is None or claim.job_id != rewrite.job_id:
            self._left("claim_not_the_jobs", rewrite)
            return False
        await self._claims.write(rewrite.key, claim.encode(), last_revision=claim.revision, ttl_s=rewrite.ttl_s)
        self.rewritten += 1
        return True

    async def renew(self, record: JobRecord, ttl_s: int) -> tuple[int, str]:
        """Gives a keyed job's claim `ttl_s` more seconds, before an operator's replay queues the job
        again (its claim may have been cut when it ended): the claim's new revision and its
        fingerprint, for the replayed record to keep (a record from an older gateway, or rewritten
        by an older scheduler, keeps none: its end would have written the claim with a blank
        fingerprint, and every repeat of the key was refused ALREADY_EXISTS); or the record's own
        when the claim names another job or cannot be written now (it keeps the TTL it has).
        Awaited: replays are rare."""
        key = claim_key(record.tenant, record.idempotency_key)
        try:
            claim, _ = await self._claims.read(key)
            if claim is None or claim.job_id != record.job_id:
                return record.claim_revision, record.claim_fingerprint
            revision = await self._claims.write(key, claim.encode(), last_revision=claim.revision, ttl_s=ttl_s)
            return revision, claim.fingerprint
        except (Unavailable, *NATS_FAILURES, KeyWrongLastSequenceError) as exc:
            log.warning("claim_not_renewed", job_id=record.job_id, error=str(exc))
            return record.claim_revision, record.claim_fingerprint

    def _left(self, why: str, rewrite: ClaimRewrite) -> None:
        self.left += 1
        held = self._throttle.allow(why)
        if held is not None:
            # Debug: the claim keeps its first, longer TTL; nothing a caller sees changes.
            log.debug(
                "claim_ttl_left", reason=why, job_id=rewrite.job_id, **({"more_since_last": held} if held else {})
            )
