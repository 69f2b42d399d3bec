"""Idempotent submit: a repeated SubmitJob with the same (tenant, idempotency key) returns the first
job and queues nothing new; the same key with a different request answers ALREADY_EXISTS.

The claim (claims.py stores it). A KV entry per (tenant, key) in the idempotency bucket, keyed
"<tenant>.<sha256(key) hex>" (keys may hold any character; hashed, they are valid KV tokens of a
fixed length), holding {job_id, fingerprint, claim_time}. Creating it is a compare-and-set on the
key's last revision (as `KeyValue.create`), so of any number of identical submits racing, exactly
one creates the entry: that one (the owner) enqueues the job under the job ID it wrote in the entry
*before* publishing anything. Every other submit reads the entry and:

- different fingerprint (SHA-256 of a canonical encoding of the request's domain fields, minus the
  key; a queue TTL is compared as given, not as the deadline derived from it) -> ALREADY_EXISTS,
  reason IDEMPOTENCY_KEY_REUSED, naming the first job (metadata job_id);
- the job's record exists -> that job, deduplicated;
- no record yet -> the owner is still publishing and recording: wait for it (polling, bounded).

Invalid inline requests are refused before claiming. The owner that fails (invalid input_ref,
admission refused, NATS unavailable) releases the entry (a compare-and-set delete whose marker has
a short TTL) when its record is certainly absent, so a retry starts afresh at once. A retry that
has become invalid since (its deadline passed) still gets the first job. An owner that
crashed leaves a claim without a record. Every owner gives up by its own bound,
gateway.enqueue_retry_s after it claimed (plus TAKEOVER_MARGIN_S for a last KV request in flight),
so a claim older than that whose record is missing can never get one: the next submit with the
key deletes that claim (compare-and-set on its revision, so one taker wins) and claims it afresh
with a NEW job ID. A new ID rather than the old one, because the old job's work message may
already have been dropped as an orphan by the scheduler while the stream's duplicate window still
remembers its Nats-Msg-Id, so a re-publish under it would be silently swallowed and its record
would stay QUEUED forever; the old message, if still there, is dropped as an orphan (its record
never appears). This relies on the bound the scheduler's orphan rule already relies on: a submit
writes its record within enqueue_retry_s of starting. A claim is that old when two clocks say so:
the wall clocks (claim_time, the claiming gateway's, against the reader's) and the server's (when
it stored the claim, against its time now: a message get and a stream info, asked only of a claim
the wall clocks call stale). A step of one clock (an NTP sync after a resume) then leaves a live
claim with its owner; before, a forward step during a submit handed it to a concurrent duplicate,
and the key had two jobs.

A claim's owner may only have stalled (a frozen process, a suspended host: it keeps no bound of its
own then), so a takeover first withdraws the owner's job: a CANCELED record created under its ID
(expected revision 0, IDEMPOTENCY_SUPERSEDED), which every later create of that record loses, a
scheduler's dispatch of its work message included; the takeover goes on only if that create won (or
only a marker is left: the job ended long ago). An owner whose submit took FENCE_AFTER_SHARE of the
bound or more (by its monotonic or its wall clock) creates its job's record itself, racing that
withdrawal; losing, it answers what a duplicate gets. A faster owner's publish landed before any
takeover could look, so it checks nothing. An owner whose publish went unanswered withdraws its job
(NOT_ACCEPTED) before it frees the key, as that publish may land later.

Lifetime. The entry carries a per-message TTL: the longest the job can live (its queue deadline,
or QUEUE_HORIZON_WITHOUT_DEADLINE_S without one, plus every attempt's timeout and backoff, plus its
result retention, plus slack). When the job ends, the service that ends it cuts that TTL to the
job's retention plus the slack (asyncinfer.claim_lifetimes), and a replay gives the long one back.
The TTL only collects garbage: what decides is the record. Once the job's record is gone (its
retention passed) the entry is a stale claim like any other, so the key is free again: keys live
as long as their job's record. (A job queued longer than QUEUE_HORIZON_WITHOUT_DEADLINE_S without
a deadline outlives its claim; a repeat after that would make a second job.)

Cost: a keyed submit makes one more KV write than a plain one (the claim), and a read and a write
more when it ends (its claim's TTL cut); a repeat makes a failed write and two reads; a takeover, a
failed submit and one that stalled make one create more.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from asyncinfer import job_errors
from asyncinfer.backoff import retry, retrying
from asyncinfer.config import Config, ModelConfig

# Named in asyncinfer.contract; re-exported for its callers here.
from asyncinfer.contract import claim_key as claim_key
from asyncinfer.error_bounds import clip_text
from asyncinfer.errors import AlreadyExists, AsyncInferError, Unavailable
from asyncinfer.idempotency_claims import Claim, ClaimStore, ClaimWritten
from asyncinfer.ids import new_job_id
from asyncinfer.job_store import NATS_FAILURES, JobStore
from asyncinfer.jobs import JobRecord, job_key
from asyncinfer.log_throttle import RepeatedLines, Throttle
from asyncinfer.nats import Client, JetStreamContext, KeyValue, KeyWrongLastSequenceError
from asyncinfer.nats.streams import store_full
from asyncinfer.supervision import outcome_seen
from services.gateway.claims import claim_ttl_s, request_fingerprint
from services.gateway.submit import JobSubmitter
from services.gateway.submit_request import SubmitRequest, resolve_model, validate_submit
from services.gateway.transitions import Expiry
from services.gateway.work_message import withdrawn_record

log = structlog.get_logger("asyncinfer.gateway.idempotency")

KEY_REUSED_REASON = "IDEMPOTENCY_KEY_REUSED"
# Of the key, in the message saying it was reused: enough to recognise it.
KEY_QUOTED_BYTES = 40
# Beyond enqueue_retry_s: a KV request the owner sent last may still be in flight (nats-py's
# JetStream requests time out after 5 s).
TAKEOVER_MARGIN_S = 6.0
FIRST_POLL_S = 0.005
MAX_POLL_S = 0.25
# Of stale_after_s: a submit that took this share of it or more creates its job's record, in a race
# with a takeover's withdrawal of the job (half: a wall clock or the server's may step meanwhile).
FENCE_AFTER_SHARE = 0.5
# Claim, lose, find the claim gone, claim again...: only a storm of failing owners gets this far.
MAX_CLAIM_ROUNDS = 8
# A claim the wall clocks call stale and the server's clock does not is read every MAX_POLL_S.
CLOCK_LOG_INTERVAL_S = 60.0


@dataclass(frozen=True, slots=True)
class SubmitOutcome:
    record: JobRecord
    deduplicated: bool = False


class _ClaimHeld(Exception):
    """Another submit holds the key with a live claim (for the job `job_id`): look again later."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id


def key_reused(idempotency_key: str, job_id: str) -> AlreadyExists:
    # Worded as Stripe words its idempotency_error (a key goes only with the parameters it was first
    # used with): what happened, whose the key is, and both ways on, within the MAX_MESSAGE_BYTES an
    # error keeps (the key is clipped so that the way on is never the part cut). Which fields differ
    # is not known here: the claim keeps a fingerprint of the request, not the request.
    return AlreadyExists(
        f"idempotency key {clip_text(idempotency_key, KEY_QUOTED_BYTES)!r} was first used for job {job_id}, "
        "with a different request: a key can be sent again only with its first request (a retry, answered "
        "with that job). Get that job with GetJob, or use a new key for a different request",
        reason=KEY_REUSED_REASON,
        metadata={"job_id": job_id},
    )


class IdempotentSubmitter:
    """JobSubmitter.submit, deduplicated by idempotency key where the request has one."""

    def __init__(
        self,
        config: Config,
        submitter: JobSubmitter,
        records: JobStore,
        claims: KeyValue,
        expiry: Expiry,
        *,
        js: JetStreamContext,
        nc: Client,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        self._submitter = submitter
        self._records = records
        self._claims = ClaimStore(claims, js, bucket=config.nats.idempotency_bucket)
        self._expiry = expiry
        self._nc = nc
        self._clock = clock
        self._stale_after_s = config.gateway.enqueue_retry_s + TAKEOVER_MARGIN_S
        self._owners: set[asyncio.Task[JobRecord | None]] = set()
        self._clock_lines = Throttle(CLOCK_LOG_INTERVAL_S)
        # A submit's NATS trouble, once per interval per kind (the rest at debug): while it lasts,
        # every keyed submit meets it.
        self._failure_lines = RepeatedLines()

    async def submit(self, request: SubmitRequest, *, tenant: str) -> SubmitOutcome:
        if not request.idempotency_key:
            return SubmitOutcome(await self._submitter.submit(request, tenant=tenant))
        key = claim_key(tenant, request.idempotency_key)
        fingerprint = request_fingerprint(request)
        now = self._clock()
        try:
            model = resolve_model(self._config, request.model_name, request.model_version, self._submitter.catalog)
            if not request.input_ref:
                # Inline requests are checked before claiming, so invalid ones write nothing; one
                # with an input_ref is checked by the submitter once it has read the upload (an
                # invalid one then releases its claim).
                validate_submit(request, self._config, now=now, catalog=self._submitter.catalog)
        except AsyncInferError:
            # A retry of an accepted request may have become invalid since (its deadline passed):
            # it still names the first job.
            claim, _ = await self._claims.read(key)
            if claim is not None and claim.fingerprint == fingerprint:
                record = await self._records.get(job_key(tenant, claim.job_id))
                if record is not None:
                    return await self._deduplicated(record)
            raise
        ttl_s = claim_ttl_s(request, model, self._config, now=now)
        last_revision = 0  # of the key's delete marker, if it has one: a create must name it
        job_id = new_job_id()
        for _ in range(MAX_CLAIM_ROUNDS):
            owner = asyncio.create_task(
                self._claim_and_submit(
                    request,
                    tenant=tenant,
                    key=key,
                    claim=Claim(job_id, fingerprint, now),
                    ttl_s=ttl_s,
                    last_revision=last_revision,
                    model=model,
                )
            )
            # Shielded: a claim must be followed by its job (or released) even if the caller left.
            self._owners.add(owner)
            owner.add_done_callback(self._owners.discard)
            owner.add_done_callback(outcome_seen)
            record = await asyncio.shield(owner)
            if record is not None:
                return SubmitOutcome(record)
            job_id = new_job_id()  # the next round's: a takeover's withdrawal of the holder names it
            taking_over = _TakeOver(request, model, ttl_s, successor=job_id)
            outcome, last_revision = await self._await_first(
                request, tenant=tenant, key=key, fingerprint=fingerprint, taking_over=taking_over
            )
            if outcome is not None:
                return outcome
            now = self._clock()
        raise Unavailable(
            f"idempotency key {request.idempotency_key[:64]!r} is contended; try again", reason="IDEMPOTENCY_CONTENDED"
        )

    async def drain(self) -> None:
        """Waits for owners whose callers went away (each bounded by enqueue_retry_s)."""
        if self._owners:
            await asyncio.gather(*self._owners, return_exceptions=True)

    async def _claim_and_submit(
        self,
        request: SubmitRequest,
        *,
        tenant: str,
        key: str,
        claim: Claim,
        ttl_s: int,
        last_revision: int,
        model: ModelConfig,
    ) -> JobRecord | None:
        """The new job, or None when the key is not as `last_revision` says (another submit
        holds it, or released it since), or was taken over while this submit stalled."""
        started = (time.monotonic(), self._clock())
        try:
            revision = await self._write_claim(key, claim, last_revision=last_revision, ttl_s=ttl_s)
        except NATS_FAILURES as exc:
            full = store_full(exc)
            if full is None:
                raise
            raise self._submitter.store_refusal(full) from exc  # no room for the claim: as no room for the job
        except _ClaimNotAnswered as exc:
            raise Unavailable(
                f"cannot record the idempotency key ({exc}); the job was not accepted, submit it again",
                reason="ENQUEUE_FAILED",
            ) from exc
        if revision is None:
            return None
        try:
            record = await self._submitter.submit(
                request, tenant=tenant, job_id=claim.job_id, claim=ClaimWritten(revision, claim.fingerprint)
            )
        except BaseException as exc:
            withdrawn = None
            if isinstance(exc, (Unavailable, *NATS_FAILURES)):  # its publish may have landed, or may yet
                withdrawn = withdrawn_record(
                    request,
                    model,
                    self._config,
                    tenant=tenant,
                    now=self._clock(),
                    job_id=claim.job_id,
                    error=job_errors.not_accepted(),
                )
            await self._release(key, tenant, claim.job_id, revision, withdrawn=withdrawn, ttl_s=ttl_s)
            raise
        # Both clocks: a suspend stops the monotonic one (on Linux), a wall clock may step back.
        stalled_s = max(time.monotonic() - started[0], self._clock() - started[1])
        if stalled_s < self._stale_after_s * FENCE_AFTER_SHARE:
            # Its publish landed within the bound, so before any takeover's read of the job (which
            # comes only once the claim is stale_after_s old by the server's clock): one job.
            return record
        return await self._fenced(record)

    async def _fenced(self, record: JobRecord) -> JobRecord | None:
        """A submit that took so long that a duplicate may have taken its key over meanwhile (a
        freeze, a stall, a suspend): its job's record is created now, in a race with the takeover's
        withdrawal of the job (a create of a CANCELED record under its ID; a dispatch's create
        races it alike). The job, when this create won or the job has a record of its own
        (dispatched or cancelled meanwhile); None when the withdrawal came first: the job never
        runs (its work message is dropped), and the caller gets what a duplicate gets."""
        try:
            _, found = await self._records.create_first(record, ttl_s=None)
        except Unavailable as exc:
            # The withdrawal, if any, still keeps the job from running; its caller gets this job.
            self._failure_lines.say(
                log,
                "warning",
                "idempotency_fence_not_written",
                kind=exc.reason,
                job_id=record.job_id,
                error=str(exc),
            )
            return record
        if found is None or found.error is None or found.error.reason != job_errors.IDEMPOTENCY_SUPERSEDED:
            return record
        log.warning("idempotency_claim_lost_while_stalled", tenant=record.tenant, job_id=record.job_id)
        with contextlib.suppress(Unavailable):  # else a dispatch of it finds the CANCELED record
            await self._records.drop_work_message(record)
        return None

    async def _write_claim(self, key: str, claim: Claim, *, last_revision: int, ttl_s: int) -> int | None:
        """The claim's revision, or None when another submit holds the key. A write NATS does not
        answer (a leader election: ~5 s) is tried again for gateway.enqueue_retry_s, as a job's
        publish is; one that landed with its answer lost is then refused as not the key's last
        revision, and read back: ours if it names our job. (Tried once, every keyed submit, which
        is every SDK submit, was refused UNAVAILABLE at once during an election, and CreateBatch.)"""
        attempts = 0

        async def attempt() -> int | None:
            nonlocal attempts
            attempts += 1
            try:
                return await self._claims.write(key, claim.encode(), last_revision=last_revision, ttl_s=ttl_s)
            except KeyWrongLastSequenceError:
                if attempts == 1:
                    return None
                try:
                    found, _ = await self._claims.read(key)
                except Unavailable as exc:
                    raise _ClaimNotAnswered(str(exc)) from exc
                return found.revision if found is not None and found.job_id == claim.job_id else None
            except NATS_FAILURES as exc:
                if store_full(exc) is not None:
                    raise
                raise _ClaimNotAnswered(str(exc)) from exc

        return await retry(
            attempt, on=_ClaimNotAnswered, retry_for_s=self._config.gateway.enqueue_retry_s, what="an idempotency claim"
        )

    async def _release(
        self, key: str, tenant: str, job_id: str, revision: int, *, withdrawn: JobRecord | None, ttl_s: int
    ) -> None:
        """Frees the key of a job that was not accepted, unless its record exists after all (a
        create whose answer was lost) or that cannot be told; then the claim goes stale instead.
        `withdrawn`: a submit whose publish may land late (NATS unanswered) withdraws its job
        first, a create that a later dispatch of it loses; a record found at that create, the
        job's, keeps the claim. (A read instead, as for a submit that published nothing, let a
        publish landing after it run a job whose key was free: a retry made a second.)"""
        try:
            if withdrawn is not None:
                _, found = await self._records.create_first(withdrawn, ttl_s=ttl_s)
                if found is None:
                    await self._claims.remove(key, revision)
            elif await self._records.get(job_key(tenant, job_id)) is None:
                await self._claims.remove(key, revision)
        except (Unavailable, *NATS_FAILURES) as exc:
            self._failure_lines.say(
                log,
                "warning",
                "idempotency_key_not_released",
                kind=type(exc).__name__,
                tenant=tenant,
                job_id=job_id,
                error=str(exc),
            )

    async def _deduplicated(self, record: JobRecord) -> SubmitOutcome:
        settled = await self._expiry.settle(record)
        return SubmitOutcome(settled or record, deduplicated=True)

    async def _await_first(
        self, request: SubmitRequest, *, tenant: str, key: str, fingerprint: str, taking_over: _TakeOver
    ) -> tuple[SubmitOutcome | None, int]:
        """The first job of a key held by another submit; or None when the key is free again
        (released, expired, or a stale claim this call removed), with the revision to claim it at.
        A live claim is read again, backing off, until it goes stale: Unavailable if it has not
        once stale_after_s have passed (its holder's clock is ahead of ours)."""
        try:
            # Unavailable too: a read of the claim or of its job's record during a leader election
            # (the first job's answer, to a retry of its submit, was UNAVAILABLE at once).
            async for attempt in retrying(
                (_ClaimHeld, Unavailable),
                retry_for_s=self._stale_after_s + 2 * MAX_POLL_S,
                first_delay_s=FIRST_POLL_S,
                max_delay_s=MAX_POLL_S,
            ):
                with attempt:
                    return await self._first_or_free(
                        request, tenant=tenant, key=key, fingerprint=fingerprint, taking_over=taking_over
                    )
        except _ClaimHeld as exc:
            raise Unavailable(
                f"idempotency key {request.idempotency_key[:64]!r} is still held by job {exc.job_id}; try again",
                reason="IDEMPOTENCY_CONTENDED",
            ) from None
        raise AssertionError("unreachable: the last error is raised")  # pragma: no cover

    async def _first_or_free(
        self, request: SubmitRequest, *, tenant: str, key: str, fingerprint: str, taking_over: _TakeOver
    ) -> tuple[SubmitOutcome | None, int]:
        """One look at the key for _await_first; _ClaimHeld while another submit holds it."""
        claim, revision = await self._claims.read(key)
        if claim is None:
            return None, revision
        record = await self._records.get(job_key(tenant, claim.job_id))
        if record is not None:
            if claim.fingerprint != fingerprint:
                raise key_reused(request.idempotency_key, claim.job_id)
            return await self._deduplicated(record), 0
        if self._clock() - claim.claim_time >= self._stale_after_s:
            # Stale by the wall clocks (the writer's stamp against ours); the server's clock must
            # agree, so that a step of one gateway's clock (an NTP sync after a resume) cannot hand
            # a live claim to a duplicate: two jobs for one key.
            stored_s = await self._claims.stored_age_s(self._nc, claim)
            if stored_s is None:
                raise _ClaimHeld(claim.job_id)  # replaced or removed since it was read: read again
            if stored_s < self._stale_after_s:
                held_back = self._clock_lines.allow(None)
                if held_back is not None:
                    log.warning(
                        "idempotency_claim_clocks_disagree",
                        job_id=claim.job_id,
                        wall_age_s=round(self._clock() - claim.claim_time, 3),
                        stored_age_s=round(stored_s, 3),
                        **({"more_since_last": held_back} if held_back else {}),
                    )
                raise _ClaimHeld(claim.job_id)
            if not await self._withdraw(tenant, claim, taking_over, stalled_s=stored_s):
                raise _ClaimHeld(claim.job_id)  # its record came after all: the next look reads it
            try:
                marker = await self._claims.remove(key, claim.revision)
            except KeyWrongLastSequenceError:
                raise _ClaimHeld(claim.job_id) from None  # another submit took it over first: read its claim
            except NATS_FAILURES as exc:
                raise Unavailable(f"cannot take over the idempotency key: {exc}") from exc
            log.warning("idempotency_claim_taken_over", tenant=tenant, abandoned_job_id=claim.job_id)
            return None, marker
        if claim.fingerprint != fingerprint:
            # A live claim holds the key: a different request cannot have it.
            raise key_reused(request.idempotency_key, claim.job_id)
        raise _ClaimHeld(claim.job_id)

    async def _withdraw(self, tenant: str, claim: Claim, taking_over: _TakeOver, *, stalled_s: float) -> bool:
        """Before a stale claim is taken over: its job is withdrawn, a CANCELED record created under
        its ID, so that a claimant that only stalled (a frozen process, a suspended host) and wakes
        can never make it live: a dispatch of its work message creates the record the same way
        and loses, as does its own create after a stall (_fenced), which then answers with the
        key's job. Whether the takeover may go on: the job was withdrawn, or only a marker is
        left of its record (it ended, and its retention passed). False when the job has a record:
        it was made live after all."""
        withdrawn = withdrawn_record(
            taking_over.request,
            taking_over.model,
            self._config,
            tenant=tenant,
            now=self._clock(),
            job_id=claim.job_id,
            error=job_errors.superseded(taking_over.successor, round(stalled_s, 1)),
        )
        written, found = await self._records.create_first(withdrawn, ttl_s=taking_over.ttl_s)
        return written is not None or found is None


@dataclass(frozen=True, slots=True)
class _TakeOver:
    """What a takeover withdraws the holder's job with: the request and model that the taker's
    own job is made of (the holder's are not kept), the TTL of its record (as long as the claim's:
    the holder's work message, if it lands, lives no longer), and the taker's next job ID."""

    request: SubmitRequest
    model: ModelConfig
    ttl_s: int
    successor: str


class _ClaimNotAnswered(Exception):
    """A claim's write (or its read back) that NATS did not answer: tried again."""
