"""The raw read and compare-and-set of one KV key, for stores that keep their own records in a
bucket (asyncinfer.job_store): on the fast path when it is enabled, on `KeyValue.get` and
`JetStreamContext.publish` otherwise.

A `KvBucket` carries what both need and nats-py's `KeyValue` keeps to itself: the bucket's name
(its stream and subjects follow from it) and the JetStream context it was opened with. A write
here may carry headers `KeyValue.update` cannot send (a per-message TTL).
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KV_DEL, KV_OP, KeyValue

from asyncinfer.nats import _fastpath
from asyncinfer.nats.protocol import EXPECTED_LAST_SUBJECT_SEQUENCE, MSG_TTL, kv_stream, kv_subject_prefix
from asyncinfer.nats.requests import js_publish

# nats-py's default for a JetStream call, which the KV calls here replace.
DEFAULT_TIMEOUT_S = 5.0


@dataclass(frozen=True, kw_only=True)
class KvBucket:
    name: str
    kv: KeyValue
    js: JetStreamContext
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def stream(self) -> str:
        return kv_stream(self.name)

    @property
    def subject_prefix(self) -> str:
        return kv_subject_prefix(self.name)


async def open_kv_bucket(js: JetStreamContext, name: str) -> KvBucket:
    """An existing bucket (BucketNotFoundError if there is none)."""
    return KvBucket(name=name, kv=await js.key_value(name), js=js)


async def kv_latest(bucket: KvBucket, key: str) -> tuple[bytes, int] | None:
    """(value, revision) of the key's latest write; None when it has none, or when that write is a
    delete or purge, or a server-placed delete marker (empty body). InvalidKeyError for a key
    KeyValue would refuse."""
    last = await kv_last_write(bucket, key)
    return last if last is not None and last[0] else None


async def kv_last_write(bucket: KvBucket, key: str) -> tuple[bytes, int] | None:
    """(value, revision) of the key's latest write, None when the key has never been written; the
    value is empty when that write removed it (a delete or purge, or a server-placed delete
    marker)."""
    if _fastpath.FASTPATH_ENABLED:
        return await _fastpath.kv_latest(
            bucket.js, stream=bucket.stream, subject_prefix=bucket.subject_prefix, key=key, timeout_s=bucket.timeout_s
        )
    try:
        entry = await bucket.kv.get(key)
    except KeyNotFoundError as exc:
        # KeyValue.get raises this for a delete or purge too, carrying the removal's entry.
        removal = exc.entry
        return (b"", removal.revision or 0) if removal is not None else None
    if entry.revision is None:  # a revision it always has
        return None
    return entry.value or b"", entry.revision


async def kv_put_with_ttl(bucket: KvBucket, key: str, value: bytes, *, ttl_s: int) -> int:
    """Writes `value` at the key, to be removed by the server ttl_s seconds later (unless written
    again); the new revision."""
    return await js_publish(
        bucket.js, bucket.subject_prefix + key, value, timeout_s=bucket.timeout_s, headers={MSG_TTL: str(ttl_s)}
    )


async def kv_delete_with_ttl(bucket: KvBucket, key: str, *, ttl_s: int) -> int:
    """Deletes the key with a delete marker the server removes ttl_s seconds later: a watcher
    still hears of the deletion, and a key deleted at every process's stop (a heartbeat of one
    run) leaves nothing behind for good, where KeyValue.delete's marker stays for ever; the
    marker's revision."""
    return await js_publish(
        bucket.js,
        bucket.subject_prefix + key,
        b"",
        timeout_s=bucket.timeout_s,
        headers={KV_OP: KV_DEL, MSG_TTL: str(ttl_s)},
    )


async def kv_put_expecting(
    bucket: KvBucket,
    key: str,
    value: bytes,
    *,
    last_revision: int,
    ttl_s: int | None = None,
    extra_headers: dict[str, str] | None = None,
) -> int:
    """Writes `value` only if the key's latest revision is `last_revision` (0: the key has no
    history at all), with a per-message TTL and headers of the caller's when given; the new
    revision. Raises KeyWrongLastSequenceError when the key has moved on."""
    headers = {**(extra_headers or {}), EXPECTED_LAST_SUBJECT_SEQUENCE: str(last_revision)}
    if ttl_s is not None:
        headers[MSG_TTL] = str(ttl_s)
    return await js_publish(bucket.js, bucket.subject_prefix + key, value, timeout_s=bucket.timeout_s, headers=headers)


async def kv_purge_through(bucket: KvBucket, key: str, revision: int) -> None:
    """Removes the key's writes up to and including `revision`, leaving no marker: with none after
    it the key is as if never written (a create expecting revision 0 succeeds), and a write after it
    stays. A conditional delete: a KV delete or purge leaves a marker, which a create expecting 0
    is refused over."""
    await bucket.js.purge_stream(bucket.stream, subject=bucket.subject_prefix + key, seq=revision + 1)
