"""Names, references and meta messages of the claim-check objects (asyncinfer.blobs): pure
functions and values, no I/O.

An object is "<tenant>/in/<id>" (an upload) or "<tenant>/out/<job_id>" (a result); callers see the
part after the tenant. Its meta message (JSON, the Object Store's layout) carries its size, its
chunk name (`nuid`), and in headers the expiry, the SHA-256 and its chunks' stream sequences.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from asyncinfer import contract
from asyncinfer.contract import BATCHES_HEADER, CHUNK_SEQUENCES_HEADER
from asyncinfer.contract import EXPIRES_HEADER as EXPIRES_HEADER
from asyncinfer.contract import SHA256_HEADER as SHA256_HEADER
from asyncinfer.errors import AsyncInferError, FieldViolation, InvalidArgument, NotFound
from asyncinfer.ids import is_job_id, new_job_id
from asyncinfer.jobs import BlobRef
from asyncinfer.nats import NUID, OBJ_CHUNKS_PRE_TEMPLATE, OBJ_DEFAULT_CHUNK_SIZE, OBJ_META_PRE_TEMPLATE

log = structlog.get_logger("asyncinfer.blobs")

CHUNK_BYTES = OBJ_DEFAULT_CHUNK_SIZE
# A result's chunks, written whole by the scheduler: fewer, larger messages (a 4 MiB batch-chunk
# result is 8 publishes, not 32); under NATS's default max_payload of 1 MiB.
RESULT_CHUNK_BYTES = 512 * 1024
INPUT_KIND = "in"
RESULT_KIND = "out"
# in/<id>, out/<job_id>, and out/<job_id>.<attempt> (outputs a batcher stored: attempt_result_ref).
_REF_PATTERN = re.compile(r"^(in/([0-9a-f-]{36})|out/([0-9a-f-]{36})(\.[1-9][0-9]{0,8})?)$")
_ATTEMPT_PATTERN = re.compile(r"[1-9][0-9]{0,8}")
_SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")
# Names of objects' chunk subjects, as nats-py's object store makes them (random prefix, then a count).
CHUNK_NAMES = NUID()


class BlobCorrupt(AsyncInferError):
    """A stored object does not match its recorded size or digest."""

    code = grpc.StatusCode.DATA_LOSS
    default_reason = "BLOB_CORRUPT"


def new_input_ref() -> str:
    return f"{INPUT_KIND}/{new_job_id()}"


def result_ref(job_id: str) -> str:
    return f"{RESULT_KIND}/{job_id}"


def attempt_result_ref(job_id: str, attempt: int) -> str:
    """The object a batcher stores an attempt's outputs in (batcher.claim_check_io): one per
    attempt, so a late attempt that was fenced off cannot replace the one a record names."""
    return f"{RESULT_KIND}/{job_id}.{attempt}"


def attempt_of_result_ref(job_id: str, ref: str) -> int | None:
    """The attempt whose outputs `ref` names for the job (attempt_result_ref's form), or None for
    any other name (an input, the scheduler's own out/<job_id>, another job's object)."""
    prefix = f"{RESULT_KIND}/{job_id}."
    if not ref.startswith(prefix) or _ATTEMPT_PATTERN.fullmatch(ref[len(prefix) :]) is None:
        return None
    return int(ref[len(prefix) :])


def sequence_runs(sequences: list[int]) -> str:
    """Stream sequences as runs, "first+count,…" (one run for an object written alone)."""
    runs: list[list[int]] = []
    for sequence in sequences:
        if runs and runs[-1][0] + runs[-1][1] == sequence:
            runs[-1][1] += 1
        else:
            runs.append([sequence, 1])
    return ",".join(f"{first}+{count}" for first, count in runs)


def chunk_sequences(info: BlobInfo) -> list[int] | None:
    """The object's chunk sequences from its meta, in order; None for an object written without
    them (or unreadable ones): such an object is read by walking its chunks."""
    runs = ((info.meta.get("headers") or {}).get(CHUNK_SEQUENCES_HEADER) or [""])[0]
    try:
        sequences = [
            first + k for first, count in (map(int, run.split("+")) for run in runs.split(",")) for k in range(count)
        ]
    except ValueError:
        return None
    return sequences if len(sequences) == int(info.meta.get("chunks") or -1) else None


def is_sha256_hex(text: str) -> bool:
    return bool(_SHA256_PATTERN.match(text))


@dataclass(frozen=True, slots=True)
class BlobInfo:
    """What the meta message says about a stored object."""

    name: str
    ref: BlobRef
    nuid: str
    expires_at: float | None
    deleted: bool
    meta_sequence: int
    meta: dict[str, Any]
    batches: tuple[str, ...] = ()  # the batches created over it (BATCHES_HEADER)

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


def _what(ref: str) -> str:
    return "result" if ref.startswith(RESULT_KIND + "/") else "input"


def blob_not_found(ref: str, what: str = "") -> NotFound:
    what = what or _what(ref)
    return NotFound(f"{what} {ref[:80]!r} not found", reason=f"{what.upper()}_NOT_FOUND", metadata={"ref": ref[:80]})


def cut_short(read: BlobInfo, now: BlobInfo | None) -> NotFound | BlobCorrupt:
    """Why a read of the object `read` describes came up short of its size or digest, given its
    meta as it stands after the read (`now`, None when it has none). Deleted meanwhile (a delete
    writes its tombstone, then purges the chunks, then the meta) or replaced (another put of the
    name has another nuid): NotFound, as a read that starts after it answers, never DATA_LOSS,
    which says the store lost what it still holds. Still there as it was read: corrupt."""
    if now is None or now.deleted or now.nuid != read.nuid:
        what = _what(read.ref.ref)
        return NotFound(
            f"{what} {read.ref.ref[:80]!r} was deleted while it was read (its retention passed, or it was deleted)",
            reason=f"{what.upper()}_NOT_FOUND",
            metadata={"ref": read.ref.ref[:80]},
        )
    return BlobCorrupt(f"the stored object {read.ref.ref!r} is incomplete or corrupt")


def blob_expired(ref: str) -> NotFound:
    what = _what(ref)
    return NotFound(
        f"{what} {ref!r} expired (its retention passed) and is being deleted",
        reason=f"{what.upper()}_EXPIRED",
        metadata={"ref": ref},
    )


def object_name(tenant: str, ref: str) -> str:
    """The object's name for the caller's tenant; NotFound for anything that is not a reference
    this store hands out (so odd text never reaches NATS as a subject)."""
    match = _REF_PATTERN.match(ref)
    if match is None or not is_job_id(match.group(2) or match.group(3)):
        raise blob_not_found(ref)
    return contract.object_name(tenant, ref)


def chunks_name(tenant: str, ref: str) -> str:
    """A new object's chunk name (its meta's `nuid`; the chunks go on `$O.<bucket>.C.<name>`).
    An upload's carries its tenant (`in.<tenant>.<nuid>`), so that the tenant's stored uploads are
    a subject filter away (`input_chunks_filter`) and counted from the stream itself; readers take
    the name from the meta, whatever its tokens (nats-py's and the Go client's alike)."""
    nuid = CHUNK_NAMES.next().decode()
    return f"{INPUT_KIND}.{tenant}.{nuid}" if ref.startswith(INPUT_KIND + "/") else nuid


def input_chunks_filter(bucket: str, tenant: str) -> str:
    """Every chunk of the tenant's uploads (those stored since chunk names carry the tenant)."""
    return OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=f"{INPUT_KIND}.{tenant}.*")


def meta_subject(bucket: str, name: str) -> str:
    return OBJ_META_PRE_TEMPLATE.format(bucket=bucket, obj=base64.urlsafe_b64encode(name.encode()).decode())


def upload_too_large(limit_bytes: int, seen_bytes: int, *, declared: bool) -> InvalidArgument:
    what = "declares" if declared else "streamed"
    message = (
        f"the upload {what} {seen_bytes} bytes, over the limit of {limit_bytes} bytes "
        "(gateway.max_upload_bytes); nothing was kept"
    )
    field = "metadata.size_bytes" if declared else "chunk"
    return InvalidArgument(message, [FieldViolation(field, message)], reason="UPLOAD_TOO_LARGE")


def parse_meta(data: bytes, sequence: int) -> BlobInfo | None:
    try:
        obj = json.loads(data)
        name = obj["name"]
    except (ValueError, KeyError, TypeError):
        log.warning("blob_meta_unreadable", sequence=sequence)
        return None
    headers = obj.get("headers") or {}
    expires = headers.get(EXPIRES_HEADER) or [None]
    sha = headers.get(SHA256_HEADER) or [""]
    _, _, ref = name.partition("/")
    return BlobInfo(
        name=name,
        ref=BlobRef(ref=ref, size_bytes=int(obj.get("size") or 0), sha256=str(sha[0])),
        nuid=str(obj.get("nuid") or ""),
        expires_at=float(expires[0]) if expires[0] is not None else None,
        deleted=bool(obj.get("deleted")),
        meta_sequence=sequence,
        meta=obj,
        batches=tuple(str(batch_id) for batch_id in headers.get(BATCHES_HEADER) or ()),
    )
