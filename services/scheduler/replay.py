"""Replaying a dead letter: the same job runs again as a new attempt.

Order, so that a crash anywhere loses nothing and runs nothing twice: the record goes back to
QUEUED first (compare-and-set from FAILED/TIMED_OUT, so two operators replaying at once replay it
once), then the original work message (no longer as the job's record) is published again with `Nats-Msg-Id:
<job_id>.replay.<dead-letter sequence>` (a retried publish is dropped as a duplicate), then the dead
letter is deleted. If the publish fails, the record is put back as it was. A file batch's chunk
job is not replayed: its batch has taken its failure over (FAILED_PRECONDITION; `all` skips it).

Attempts: `attempt` keeps counting (it is the fencing token, so it never goes back); the job gets
a fresh budget instead: max_attempts becomes attempt + its original per-job max_attempts (capped by
the model's max_attempts_limit). The error that killed it moves to last_error. A deadline that has
passed makes the replayed job EXPIRED at dispatch. A keyed job's idempotency claim, cut to the job's
retention when it ended, gets the long TTL of a queued job back first.
"""

from __future__ import annotations

import dataclasses
import time

import structlog

from asyncinfer import lifecycle
from asyncinfer.claim_lifetimes import ClaimLifetimes, replayed_ttl_s
from asyncinfer.codecs.envelope import deadline_header, encode_envelope
from asyncinfer.config import Config
from asyncinfer.contract import replay_msg_id, routing_headers
from asyncinfer.errors import FailedPrecondition, NotFound, Unavailable
from asyncinfer.job_store import NATS_FAILURES, JobStore
from asyncinfer.jobs import BATCH_LABEL, CHUNK_LABEL, JobRecord, job_key
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import JetStreamContext
from asyncinfer.nats.streams import publish_durably
from asyncinfer.queued_notice import announce_queued
from services.scheduler.dead_letters import DeadLetter, DeadLetterStore

log = structlog.get_logger("asyncinfer.scheduler.replay")

PUBLISH_RETRY_FOR_S = 10.0


async def replay(
    letter: DeadLetter,
    *,
    store: JobStore,
    letters: DeadLetterStore,
    nc: NatsClient,
    js: JetStreamContext,
    config: Config,
    claims: ClaimLifetimes | None = None,
) -> JobRecord:
    envelope = letter.envelope
    record = await store.get(job_key(letter.tenant, letter.job_id))
    if record is None:
        raise NotFound(
            f"job {letter.job_id} has no record any more (its retention passed); purge the dead letter",
            reason="JOB_NOT_FOUND",
        )
    if CHUNK_LABEL in record.labels:
        # Its batch took the failure over (bisection, then the error file): run again, the chunk's
        # result would be read by nobody.
        raise FailedPrecondition(
            f"job {letter.job_id} is a chunk of file batch {record.labels.get(BATCH_LABEL, '?')}: its failed "
            "records are in the batch's error file; create a batch of them to run them again",
            reason="BATCH_CHUNK_NOT_REPLAYABLE",
        )
    model = config.model(letter.model_name)
    limit = model.max_attempts_limit if model is not None else envelope.max_attempts
    budget = max(1, min(envelope.max_attempts, limit))
    now = time.time()
    # A keyed job's claim may have been cut to its retention when it ended: it gets the long TTL of a
    # job queued anew, and the record its new revision (asyncinfer.claim_lifetimes).
    claim = (record.claim_revision, record.claim_fingerprint)
    if claims is not None and record.idempotency_key:
        claim = await claims.renew(record, replayed_ttl_s(record, budget))
    requeue = lifecycle.decider(lifecycle.Replay(budget=budget), now)

    def decide(current: JobRecord) -> JobRecord | None:
        new = requeue(current)
        return new.evolve(claim_revision=claim[0], claim_fingerprint=claim[1]) if new is not None else None

    queued, written = await store.transition(record, decide)
    if queued is None or not written:
        state = queued.state.value if queued is not None else "gone"
        raise FailedPrecondition(
            f"job {letter.job_id} is {state}, not FAILED or TIMED_OUT: it cannot be replayed",
            reason="NOT_REPLAYABLE",
        )
    try:
        await publish_durably(
            js,
            envelope.subject,
            # The original message, but not as the job's record: that is in the jobs bucket now,
            # with its history.
            encode_envelope(dataclasses.replace(envelope, is_record=False)),
            stream=config.nats.work_stream,
            msg_id=replay_msg_id(letter.job_id, letter.sequence),
            retry_for_s=PUBLISH_RETRY_FOR_S,
            # The letter keeps the original payload, not its headers: the same ones again.
            headers=routing_headers(
                tenant=envelope.tenant,
                job_id=envelope.job_id,
                priority=envelope.priority,
                model_name=envelope.model_name,
            )
            | deadline_header(envelope.deadline),
        )
    except NATS_FAILURES as exc:
        restored = record.evolve(revision=queued.revision)
        try:
            await store.replace(restored)
        except Exception as revert_error:
            # QUEUED without a work message: it needs an operator (the dead letter is kept).
            log.error("replay_not_reverted", job_id=letter.job_id, error=str(revert_error))
        raise Unavailable(f"the job could not be queued again: {exc}") from exc
    await announce_queued(nc, [queued])
    await letters.delete(letter.sequence)
    return queued
