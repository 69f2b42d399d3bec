"""Queued notices: "this job can be pulled now, and here is its record".

Sent on core NATS (not stored) whenever a job's work message is durably queued with a QUEUED
record: by the gateway after a submit's record write, by a replay after its publish. A scheduler's
dispatcher wakes on them (rather than on the work publish itself, which a core subscriber can see
before the stream has stored it) and dispatches with the record it carries instead of reading the
record back. A hint only: a scheduler that misses one finds the job by its poll interval and
reads the record; a stale one fails the compare-and-set of the RUNNING write, which then reads.

Its format (a text line, then the record as stored, in the record's own versioned codec) has no
version of its own: a notice is never stored, and one a scheduler cannot read is dropped and costs
only the poll interval.
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from asyncinfer.codecs.record import encode_record

# Named in asyncinfer.contract; the prefix is re-exported for its callers here.
from asyncinfer.contract import QUEUED_SUBJECT_PREFIX as QUEUED_SUBJECT_PREFIX
from asyncinfer.contract import queued_subject
from asyncinfer.jobs import JobRecord
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.requests import publish_all

log = structlog.get_logger("asyncinfer.queued_notice")


def encode_queued_notice(key: str, revision: int, record_data: bytes) -> bytes:
    """The record's revision and key on the first line, then the record as stored."""
    return b"%d %s\n%s" % (revision, key.encode(), record_data)


def decode_queued_notice(payload: bytes) -> tuple[str, int, bytes]:
    """(key, revision, record data); ValueError when the payload is not a queued notice."""
    head, newline, data = payload.partition(b"\n")
    revision, space, key = head.partition(b" ")
    if not newline or not space or not key or not revision.isdigit():
        raise ValueError("not a queued notice")
    return key.decode(), int(revision), data


async def announce_queued(nc: NatsClient, records: Sequence[JobRecord]) -> None:
    """Sends the notice of each record (as written, at its revision), all in one write. Never
    raises: the jobs are queued whether or not a scheduler hears of them this way."""
    try:
        await publish_all(
            nc,
            [
                (
                    queued_subject(record.model_name, record.priority),
                    encode_queued_notice(record.key, record.revision, encode_record(record)),
                )
                for record in records
            ],
        )
    except Exception as exc:  # a hint: nothing is lost without it
        log.debug("queued_notices_not_sent", jobs=len(records), error=str(exc))
