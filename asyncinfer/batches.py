"""Batch jobs as the domain sees them (docs/BATCHES.md): states, request counts, the chunk plan and
its pure transitions. No NATS and no protobuf: the gateway's batch driver reads a record, asks
these functions what follows from what its chunks' jobs say, and writes the answer back with a
compare-and-set.

Records are numbered 0..n-1 in input order (valid ones only: a line that fails validation is an
error line at once and never gets a number). A chunk is a range [start, end) of records that runs
as one job; chunks stay sorted by start, so the output in chunk order is the input order. A chunk
whose job fails is split in two (a bisection), so a poison record ends alone in a chunk of one and
goes to the error file by itself while its neighbours succeed.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from asyncinfer.ids import job_id_time_ms
from asyncinfer.jobs import CallbackSpec, JobError, JobState, Priority
from asyncinfer.open_enums import OpenStrEnum

# At most this many errors are kept in the record (GetBatch's first_errors); the rest are only in
# the error file.
FIRST_ERRORS_KEPT = 10
# A create sends its batch's record within this long of minting the batch's ID, or never: it mints
# the ID just before it claims the idempotency key (which waits out NATS for up to 10 s) and names
# the batch on its upload, and checks the time (its monotonic clock) before the record's write.
CREATE_RECORD_WITHIN_S = 20.0
# Beyond that: the record's write, sent just inside the bound, may still be in flight (nats-py's
# JetStream requests time out after 5 s).
CREATE_WRITE_MARGIN_S = 6.0
RECORD_VERSION = 1


class BatchState(OpenStrEnum):
    VALIDATING = "VALIDATING"
    IN_PROGRESS = "IN_PROGRESS"
    FINALIZING = "FINALIZING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    EXPIRED = "EXPIRED"
    CANCELLING = "CANCELLING"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in (BatchState.COMPLETED, BatchState.FAILED, BatchState.EXPIRED, BatchState.CANCELLED)


class ChunkStatus(enum.StrEnum):
    WAITING = "W"  # planned, its job not submitted yet
    QUEUED = "Q"  # its job submitted (queued or running)
    DONE = "D"  # its job succeeded: its outputs are in the job's result
    FAILED = "F"  # its records failed (a chunk of one, or past the split limit)
    SPLIT = "S"  # failed and replaced by its two halves
    SKIPPED = "X"  # never ran to the end: the batch was cancelled or expired


class InputFormat(enum.StrEnum):
    JSONL = "JSONL"
    NPY = "NPY"
    NPZ = "NPZ"


@dataclass(frozen=True, slots=True)
class ErrorLine:
    """One line of the error file."""

    line: int  # 1-based input line (record index + 1 for arrays)
    custom_id: str
    code: str  # a canonical gRPC code name
    message: str


@dataclass(frozen=True, slots=True)
class Chunk:
    start: int
    end: int
    status: ChunkStatus = ChunkStatus.WAITING
    # Set for FAILED and SKIPPED: why its records did not run.
    code: str = ""
    message: str = ""

    @property
    def records(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class ReadProgress:
    """How far a VALIDATING batch's preparation has read its input (Unix seconds)."""

    bytes_read: int
    bytes_total: int
    records: int  # read so far, valid or not
    started: float  # when this reading began
    updated: float  # when it was reported

    def rate(self) -> tuple[float, float | None]:
        """Records read per second, and when the reading should end at its rate of bytes (None
        while unknown)."""
        took = self.updated - self.started
        if took <= 0:
            return 0.0, None
        end = None
        if 0 < self.bytes_read < self.bytes_total:
            end = self.started + took * self.bytes_total / self.bytes_read
        return self.records / took, end


@dataclass(frozen=True, slots=True)
class RequestCounts:
    """As OpenAI's Batch API counts: `completed` and `failed` only of the records that ran (or
    failed validation); the records a cancel or the end of the completion window skipped are
    neither, the rest of `total` (`not_run`, the error file's CANCELLED and DEADLINE_EXCEEDED lines)."""

    total: int = 0
    completed: int = 0
    failed: int = 0
    not_run: int = 0


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """A batch's record in the batches bucket. Times are Unix seconds."""

    batch_id: str
    tenant: str
    model_name: str
    model_version: str
    input_ref: str
    input_format: InputFormat | None  # None: detect from the content
    state: BatchState
    priority: Priority
    max_attempts: int
    create_time: float
    expires_at: float
    result_retention_s: float
    labels: Mapping[str, str] = field(default_factory=dict)
    idempotency_key: str = ""
    callback: CallbackSpec | None = None
    chunks: tuple[Chunk, ...] = ()
    invalid_lines: int = 0  # lines that failed validation (in the errors object)
    total: int = 0  # lines (JSONL) or records (arrays) in the input, once validated
    splits: int = 0
    first_errors: tuple[ErrorLine, ...] = ()
    failure_message: str = ""
    in_progress_time: float | None = None
    finalizing_time: float | None = None
    end_time: float | None = None
    # The terminal webhook is on the WEBHOOKS stream (asyncinfer.batch_webhooks): set by the write
    # after the enqueue, so a driver that finds a terminal record without it enqueues again.
    callback_enqueued: bool = False
    # The W3C traceparent of its CreateBatch span (tracing on): each chunk job's trace links to it,
    # whichever gateway's driver submits the chunk, before or after a restart.
    traceparent: str = ""
    # While VALIDATING: the preparation's last report of its reading (a large input); None before
    # and after.
    reading: ReadProgress | None = None
    # Not stored: the KV revision it was read at.
    revision: int = 0

    def evolve(self, **changes: Any) -> BatchRecord:
        return dataclasses.replace(self, **changes)

    @property
    def kept_until(self) -> float:
        """Until when the batch's objects, its chunks' results and its record are kept (its files
        readable): the end of its completion window plus the result retention."""
        return self.expires_at + self.result_retention_s

    @property
    def counts(self) -> RequestCounts:
        completed = sum(c.records for c in self.chunks if c.status is ChunkStatus.DONE)
        failed = sum(c.records for c in self.chunks if c.status is ChunkStatus.FAILED)
        not_run = sum(c.records for c in self.chunks if c.status is ChunkStatus.SKIPPED)
        return RequestCounts(total=self.total, completed=completed, failed=failed + self.invalid_lines, not_run=not_run)

    @property
    def live_chunks(self) -> tuple[Chunk, ...]:
        """The chunks of the plan as it stands (split ones replaced by their halves)."""
        return tuple(c for c in self.chunks if c.status is not ChunkStatus.SPLIT)


def create_settles_in_s(batch_id: str, *, now: float) -> float:
    """How long a batch with no record may still get one, by the wall clocks (`now` against the
    time in its ID, the minting gateway's): its create may write it until CREATE_RECORD_WITHIN_S
    after minting the ID, and the write may land CREATE_WRITE_MARGIN_S after that. 0 once it
    cannot (the create died or gave up), and for what is not a batch ID."""
    try:
        minted_s = job_id_time_ms(batch_id) / 1000.0
    except ValueError:
        return 0.0
    return max(minted_s + CREATE_RECORD_WITHIN_S + CREATE_WRITE_MARGIN_S - now, 0.0)


def create_settled_after_s() -> float:
    """How long after its create claimed a key or named its batch a batch with no record cannot
    get one any more: the bound create_settles_in_s applies, on a clock of its caller's choice."""
    return CREATE_RECORD_WITHIN_S + CREATE_WRITE_MARGIN_S


# A withdrawn batch's failure_message starts so (withdrawn_batch); nothing else writes it.
WITHDRAWN_PREFIX = "withdrawn before it ran: "


def withdrawn_batch(record: BatchRecord, *, batch_id: str, now: float, why: str) -> BatchRecord:
    """The record that keeps the keyed batch `batch_id` from ever being created (services/gateway/
    batch_service.py): `record`'s request ended FAILED at `now`, never validated, saying `why`.
    Created where the batch's own record would be (a create expecting revision 0), which its
    create then loses. No callback: nobody asked for its end."""
    return record.evolve(
        batch_id=batch_id,
        state=BatchState.FAILED,
        failure_message=WITHDRAWN_PREFIX + why,
        end_time=now,
        callback=None,
        chunks=(),
        traceparent="",  # the taker's create's, not the holder's
        revision=0,
    )


def is_withdrawn(record: BatchRecord) -> bool:
    """Whether `record` is a withdrawal (withdrawn_batch), not a batch its create wrote."""
    return (
        record.state is BatchState.FAILED
        and record.in_progress_time is None
        and record.failure_message.startswith(WITHDRAWN_PREFIX)
    )


def superseded_why(successor: str, stalled_s: float) -> str:
    """Why a keyed batch was withdrawn by a takeover of its stale claim."""
    return (
        f"its create did not write it within {stalled_s:g} s of claiming its idempotency key, and a duplicate "
        f"create took the key over as batch {successor}; a create with the key returns the key's batch"
    )


NOT_ACCEPTED_WHY = (
    "its create failed writing it (its caller was told so) and freed its idempotency key; a create with the key "
    "makes a new batch"
)


def may_read_its_input(batch_id: str, record: BatchRecord | None, *, now: float) -> bool:
    """Whether a batch named on an upload (BATCHES_HEADER) may still read it, so that DeleteInput
    must wait for it: its record says it has not ended, or it has no record yet and its create may
    still write one (create_settles_in_s: a create names the batch before writing its record). An
    ended batch reads nothing more; one whose record is gone older than that ended and outlived
    its retention, or its create died before writing it."""
    if record is not None:
        return not record.state.is_terminal
    return create_settles_in_s(batch_id, now=now) > 0


def chunk_job_id(batch_id: str, start: int, end: int) -> str:
    """The job ID of a chunk: a UUIDv7 with the batch's time and bits derived from the range, the
    same on every driver, so that a chunk submitted twice (a driver killed between the publish and
    the record's write) is one job."""
    digest = int.from_bytes(hashlib.sha256(f"{batch_id}:{start}:{end}".encode()).digest()[:10], "big")
    ms = job_id_time_ms(batch_id)
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | (digest >> 62 & 0xFFF) << 64 | 0b10 << 62
    value |= digest & ((1 << 62) - 1)
    return str(uuid.UUID(int=value))


def derived_ref(kind: str, batch_id: str, what: str) -> str:
    """A claim-check reference ("in/<uuid7>") for one of the batch's own objects (a chunk's inputs,
    the record index, the validation errors), derived from the batch and what it holds."""
    digest = hashlib.sha256(f"{batch_id}:{what}".encode()).hexdigest()
    base = chunk_job_id(batch_id, int(digest[:8], 16), int(digest[8:16], 16))
    return f"{kind}/{base}"


def plan_chunks(runs: Sequence[tuple[int, int]], chunk_records: int) -> tuple[Chunk, ...]:
    """Chunks of at most chunk_records over runs of records that may share a chunk (records of
    one run have the same non-batch shapes), in order."""
    chunks: list[Chunk] = []
    for start, end in runs:
        for first in range(start, end, chunk_records):
            chunks.append(Chunk(first, min(first + chunk_records, end)))
    return tuple(chunks)


@dataclass(frozen=True, slots=True)
class ChunkOutcome:
    """What a chunk's job says, for `settle_chunks`: its terminal state and error."""

    start: int
    state: JobState
    error: JobError | None = None


def _code_name(error: JobError | None, state: JobState) -> str:
    if error is None:
        return {JobState.EXPIRED: "DEADLINE_EXCEEDED", JobState.CANCELED: "CANCELLED"}.get(state, "UNKNOWN")
    for code in grpc.StatusCode:
        if code.value[0] == error.code:
            return str(code.name)
    return "UNKNOWN"


def settle_chunks(record: BatchRecord, outcomes: Sequence[ChunkOutcome], *, max_splits: int) -> BatchRecord:
    """The record with each ended chunk job's outcome applied: DONE, SKIPPED (cancelled or expired
    before it ran), or, for a failure, split into halves (WAITING) while the chunk has more than
    one record and the batch is under max_splits, else FAILED."""
    by_start = {o.start: o for o in outcomes}
    chunks: list[Chunk] = []
    splits = record.splits
    for chunk in record.chunks:
        outcome = by_start.get(chunk.start) if chunk.status is ChunkStatus.QUEUED else None
        if outcome is None:
            chunks.append(chunk)
            continue
        if outcome.state is JobState.SUCCEEDED:
            chunks.append(dataclasses.replace(chunk, status=ChunkStatus.DONE))
            continue
        code = _code_name(outcome.error, outcome.state)
        message = outcome.error.message if outcome.error is not None else f"the chunk's job ended {outcome.state}"
        if outcome.state in (JobState.CANCELED, JobState.EXPIRED):
            chunks.append(dataclasses.replace(chunk, status=ChunkStatus.SKIPPED, code=code, message=message))
        elif chunk.records > 1 and splits < max_splits:
            middle = chunk.start + chunk.records // 2
            splits += 1
            chunks.append(dataclasses.replace(chunk, status=ChunkStatus.SPLIT))
            chunks.extend((Chunk(chunk.start, middle), Chunk(middle, chunk.end)))
        else:
            chunks.append(dataclasses.replace(chunk, status=ChunkStatus.FAILED, code=code, message=message))
    return record.evolve(chunks=tuple(chunks), splits=splits)


def mark_submitted(record: BatchRecord, starts: Sequence[int]) -> BatchRecord:
    wanted = set(starts)
    chunks = tuple(
        dataclasses.replace(c, status=ChunkStatus.QUEUED)
        if c.start in wanted and c.status is ChunkStatus.WAITING
        else c
        for c in record.chunks
    )
    return record.evolve(chunks=chunks)


def skip_waiting(record: BatchRecord, *, code: str, message: str) -> BatchRecord:
    """Every chunk not yet submitted marked SKIPPED (cancelled, or past the completion window)."""
    chunks = tuple(
        dataclasses.replace(c, status=ChunkStatus.SKIPPED, code=code, message=message)
        if c.status is ChunkStatus.WAITING
        else c
        for c in record.chunks
    )
    return record.evolve(chunks=chunks)


def to_submit(record: BatchRecord, *, window: int) -> tuple[Chunk, ...]:
    """The waiting chunks to submit now: enough for `window` chunks queued or running at once (so
    a large batch holds a bounded share of the queue), in order."""
    queued = sum(1 for c in record.chunks if c.status is ChunkStatus.QUEUED)
    room = max(window - queued, 0)
    return tuple(c for c in record.chunks if c.status is ChunkStatus.WAITING)[:room]


def finished(record: BatchRecord) -> bool:
    return not any(c.status in (ChunkStatus.WAITING, ChunkStatus.QUEUED) for c in record.chunks)


def end_state(record: BatchRecord, *, now: float) -> BatchState:
    """The terminal state of a batch whose chunks have all ended."""
    if record.state is BatchState.CANCELLING:
        return BatchState.CANCELLED
    if any(c.status is ChunkStatus.SKIPPED for c in record.chunks) or now >= record.expires_at:
        return BatchState.EXPIRED
    return BatchState.COMPLETED


def finish(record: BatchRecord, *, now: float) -> BatchRecord:
    return record.evolve(state=end_state(record, now=now), finalizing_time=now, end_time=now)


def progress_rate(record: BatchRecord, *, now: float) -> tuple[float, float | None]:
    """Records done per second since the batch started running, and when it should finish at that
    rate (None when unknown or ended)."""
    started = record.in_progress_time
    if started is None:
        return 0.0, None
    until = record.end_time if record.end_time is not None else now
    counts = record.counts
    rate = counts.completed / (until - started) if until > started else 0.0
    if record.state.is_terminal or rate <= 0:
        return rate, None
    if record.state is BatchState.CANCELLING:  # what is left will not run
        return rate, None
    remaining = counts.total - counts.completed - counts.failed - counts.not_run
    return rate, now + remaining / rate


# --- the record's codec (versioned JSON, like the job records) ---------------------------------


_STORED_FIELDS = frozenset(f.name for f in dataclasses.fields(BatchRecord)) - {"revision"}


def encode_batch(record: BatchRecord) -> bytes:
    data = dataclasses.asdict(record)
    data.pop("revision")
    if not record.callback_enqueued:
        # Left out unless set: a gateway of the release before it refuses a field it does not know,
        # so only batches with a callback that ended carry it.
        data.pop("callback_enqueued")
    if not record.traceparent:  # likewise: only batches created with tracing on carry it
        data.pop("traceparent")
    if record.reading is None:  # likewise: only a batch being read carries it
        data.pop("reading")
    else:
        r = record.reading
        data["reading"] = [r.bytes_read, r.bytes_total, r.records, r.started, r.updated]
    data["v"] = RECORD_VERSION
    data["chunks"] = [[c.start, c.end, c.status.value, c.code, c.message] for c in record.chunks]
    data["first_errors"] = [[e.line, e.custom_id, e.code, e.message] for e in record.first_errors]
    return json.dumps(data, separators=(",", ":")).encode()


def decode_batch(data: bytes, revision: int = 0) -> BatchRecord:
    """The record in `data`, read at KV revision `revision`. ValueError, whatever is wrong with it
    (not JSON, a field missing or of another shape, a state or a status this release does not
    know: a later release's, written during a rolling upgrade), so that a reader skips one record
    with one `except`; a KeyError or a TypeError from a malformed one got past them."""
    try:
        return _decoded(data, revision)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a batch record: {type(exc).__name__}: {exc}") from exc


def _decoded(data: bytes, revision: int) -> BatchRecord:
    raw = json.loads(data)
    raw.pop("v", None)
    # A field this release does not know (a later release's, written during a rolling upgrade) is
    # skipped: it refused the record (TypeError), failing the batch's every read here.
    for unknown in raw.keys() - _STORED_FIELDS:
        del raw[unknown]
    callback = raw.pop("callback")
    return BatchRecord(
        **{
            **raw,
            "input_format": InputFormat(raw["input_format"]) if raw["input_format"] else None,
            "state": BatchState(raw["state"]),
            "priority": Priority(raw["priority"]),
            "labels": dict(raw["labels"]),
            "callback": CallbackSpec(callback["url"], tuple(callback["events"])) if callback else None,
            "chunks": tuple(Chunk(s, e, ChunkStatus(st), code, msg) for s, e, st, code, msg in raw["chunks"]),
            "first_errors": tuple(ErrorLine(*e) for e in raw["first_errors"]),
            "reading": ReadProgress(*raw["reading"]) if raw.get("reading") else None,
        },
        revision=revision,
    )


def merge_first_errors(kept: Sequence[ErrorLine], more: Sequence[ErrorLine]) -> tuple[ErrorLine, ...]:
    return tuple(sorted([*kept, *more], key=lambda e: e.line)[:FIRST_ERRORS_KEPT])
