"""Batch records in their KV bucket (asyncinfer.batches holds the record and its codec): keyed
`<tenant>.<batch_id>`, every write a compare-and-set on the revision read, so two gateways driving
one batch never both win a transition. An idempotency key claims `<tenant>.key.<sha256(key)>` in
the same bucket, created atomically (a compare-and-set on the revision of a delete marker it
finds there), holding the batch ID it stands for."""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import AsyncGenerator

from asyncinfer.backoff import retry
from asyncinfer.batch_plans import BATCHES_BUCKET_DESCRIPTION, PLANNED_HEADER, encode_planned, planned_chunks
from asyncinfer.batches import BatchRecord, decode_batch, encode_batch
from asyncinfer.config import NatsConfig
from asyncinfer.errors import AsyncInferError, Unavailable
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.nats import Client, JetStreamContext, KeyWrongLastSequenceError
from asyncinfer.nats.kv import KvBucket, kv_last_write, kv_latest, kv_purge_through, kv_put_expecting
from asyncinfer.nats.streams import ensure_kv_bucket, store_full, stored_age_s, subject_pages
from services.gateway.newest_ids import NewestIds
from services.gateway.store_health import store_full_error

# How long a batch's idempotency claim waits out NATS (as gateway.enqueue_retry_s, by default).
CLAIM_RETRY_S = 10.0
# Creates of one claim refused with no claim to read after: over a marker one is (the next one
# names its revision); each more means the key was removed again between a read and a write.
CLAIM_ROUNDS = 8
# A stream info answer listing the batch records' subjects (100,000 of them: ~8 MB of JSON).
KEYS_TIMEOUT_S = 10.0


class BatchConflict(Exception):
    """Another writer changed the record since it was read."""


class UnreadableBatch(AsyncInferError):
    """A batch record this release cannot decode: written by a later release (a state or a field
    shape it does not know, during a rolling upgrade), or corrupted. INTERNAL BATCH_UNREADABLE to a
    caller (GetBatch, ListBatches, ...), naming the batch and its key; the batch driver leaves the
    batch alone (a gateway that reads it drives it). It was the decoder's ValueError: UNKNOWN with
    a traceback to a caller, and the end of the batch driver, and with it the gateway."""

    def __init__(self, tenant: str, batch_id: str, error: str) -> None:
        key = batch_key(tenant, batch_id)
        super().__init__(
            f"batch {batch_id}'s record (key {key!r}) cannot be read by this gateway's release: {error}; written "
            "by a later release (a rolling upgrade), or corrupted",
            reason="BATCH_UNREADABLE",
            metadata={"batch_id": batch_id, "key": key},
        )
        self.key = key
        self.error = error


def ttl_until(when: float) -> int:
    """A per-message TTL (whole seconds, at least one) that removes a write at `when`."""
    return max(math.ceil(when - time.time()), 1)


def batch_key(tenant: str, batch_id: str) -> str:
    return f"{tenant}.{batch_id}"


def batch_claim_key(tenant: str, idempotency_key: str) -> str:
    return f"{tenant}.key.{hashlib.sha256(idempotency_key.encode()).hexdigest()}"


def holder_or_revision(last_write: tuple[bytes, int] | None) -> str | int:
    """What a claim refused over the key's `last_write` does next: the batch ID holding the key,
    or the revision to create the claim at (a delete or purge marker's, which a create expecting
    revision 0 is refused over; 0 when the key has no write left: purged or expired since)."""
    if last_write is None:
        return 0
    value, revision = last_write
    return value.decode() if value else revision


async def ensure_batches_bucket(js: JetStreamContext, config: NatsConfig) -> KvBucket:
    kv = await ensure_kv_bucket(js, config, bucket=config.batches_bucket, description=BATCHES_BUCKET_DESCRIPTION)
    return KvBucket(name=config.batches_bucket, kv=kv, js=js)


class BatchStore:
    def __init__(self, bucket: KvBucket, nc: Client) -> None:
        self._bucket = bucket
        self._nc = nc  # for the listings' stream info answers past the first 100,000 subjects

    @property
    def bucket(self) -> KvBucket:
        return self._bucket

    async def get(self, tenant: str, batch_id: str) -> BatchRecord | None:
        try:
            latest = await kv_latest(self._bucket, batch_key(tenant, batch_id))
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot read the batch: {exc}") from exc
        if latest is None:
            return None
        data, revision = latest
        try:
            return decode_batch(data, revision)
        except ValueError as exc:
            raise UnreadableBatch(tenant, batch_id, str(exc)) from exc

    async def write(self, record: BatchRecord) -> BatchRecord:
        """Writes the record over the revision it was read at (0: creates it); BatchConflict
        when another writer was first. A terminal record is written with a TTL: it is removed
        when its files can no longer be read (BatchRecord.kept_until), so the bucket does not grow with every
        batch ever run."""
        try:
            revision = await kv_put_expecting(
                self._bucket,
                batch_key(record.tenant, record.batch_id),
                encode_batch(record),
                last_revision=record.revision,
                ttl_s=ttl_until(record.kept_until) if record.state.is_terminal else None,
                # What the scheduler's autoscaling signal counts (asyncinfer.batch_plans).
                extra_headers={PLANNED_HEADER: encode_planned(planned_chunks(record))},
            )
        except KeyWrongLastSequenceError as exc:
            raise BatchConflict(record.batch_id) from exc
        except NATS_FAILURES as exc:
            raise _refusal(exc, "cannot write the batch", "the batch was not written") from exc
        return record.evolve(revision=revision)

    async def create_first(self, record: BatchRecord) -> tuple[BatchRecord | None, BatchRecord | None]:
        """Writes `record` only if its key was never written (a create expecting revision 0, which
        any earlier write refuses, a marker included): (the record written, None) when it won;
        (None, the record there, or None where only a marker is) when refused. The fence between a
        keyed batch's withdrawal (asyncinfer.batches.withdrawn_batch) and its create's own write:
        whichever is first, the other loses."""
        try:
            return await self.write(record.evolve(revision=0)), None
        except BatchConflict:
            return None, await self.get(record.tenant, record.batch_id)

    async def claim(self, tenant: str, idempotency_key: str, batch_id: str, *, until: float) -> str:
        """The batch ID that holds the key: `batch_id` when this call claimed it, else the first's.
        The claim is removed at `until` (the batch's kept_until: a key is remembered as long as
        its batch). A key whose last write is a delete or purge marker (an operator's `nats kv
        del`) is claimed by a compare-and-set on the marker's revision, so of racing creates one
        wins and the others read its claim. UNAVAILABLE IDEMPOTENCY_CONTENDED if CLAIM_ROUNDS
        creates were refused without a claim to read (the key removed again each time)."""
        key = batch_claim_key(tenant, idempotency_key)
        last_revision = 0  # of the key's last write, once a refused create found a marker there

        async def attempt() -> str | int:
            """The key's batch ID after one create, or the revision to create it at next when
            the create was refused and the key holds no claim (a marker's; 0: no write at all).
            A create that landed with its answer lost is refused as not the key's last write: the
            key then names this batch, which is read back."""
            try:
                try:
                    await kv_put_expecting(
                        self._bucket, key, batch_id.encode(), last_revision=last_revision, ttl_s=ttl_until(until)
                    )
                    return batch_id
                except KeyWrongLastSequenceError:
                    return holder_or_revision(await kv_last_write(self._bucket, key))
            except NATS_FAILURES as exc:
                if store_full(exc) is not None:
                    raise _refusal(exc, "cannot claim the idempotency key", "no batch was created") from exc
                raise _NotAnswered(str(exc)) from exc

        for _ in range(CLAIM_ROUNDS):
            try:
                # Waits out a leader election, as a job's publish does (it was refused at once).
                outcome = await retry(attempt, on=_NotAnswered, retry_for_s=CLAIM_RETRY_S, what="a batch's claim")
            except _NotAnswered as exc:
                raise Unavailable(
                    f"cannot claim the idempotency key: {exc}; no batch was created", reason="NATS_UNAVAILABLE"
                ) from exc
            if isinstance(outcome, str):
                return outcome
            last_revision = outcome
        raise Unavailable(
            f"cannot claim the idempotency key {idempotency_key[:64]!r}: {CLAIM_ROUNDS} creates were refused and "
            "each time the key held no claim (removed again meanwhile); no batch was created, create it again",
            reason="IDEMPOTENCY_CONTENDED",
            metadata={"claim_attempts": str(CLAIM_ROUNDS), "key_revision": str(last_revision)},
        )

    async def holder(self, tenant: str, idempotency_key: str) -> tuple[str, int] | None:
        """The batch ID holding the key and the claim's revision; None when the key is free."""
        try:
            latest = await kv_latest(self._bucket, batch_claim_key(tenant, idempotency_key))
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot read the idempotency key: {exc}", reason="NATS_UNAVAILABLE") from exc
        return (latest[0].decode(), latest[1]) if latest is not None else None

    async def stored_age_s(self, nc: Client, revision: int) -> float | None:
        """How long ago the server stored the claim at `revision`, by its own clock alone (a batch
        ID's time is its minting gateway's wall clock, read against the reader's: a step of either
        fools it); None when the bucket no longer holds it (replaced or removed since)."""
        try:
            return await stored_age_s(
                self._bucket.js, nc, self._bucket.stream, revision, timeout_s=self._bucket.timeout_s
            )
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot read the idempotency key's age: {exc}", reason="NATS_UNAVAILABLE") from exc

    async def take_over(self, tenant: str, idempotency_key: str, holder: str, batch_id: str, *, until: float) -> str:
        """Moves the key's claim from `holder` (a batch that was never written and cannot be any
        more: its create died or gave up between the claim and the record) to `batch_id`; the
        claim's batch ID after the move (a racing create's, if it moved it first). UNAVAILABLE
        NATS_UNAVAILABLE (ErrorInfo batch_id: the holder) when NATS does not answer; nothing of the
        create is written then."""
        key = batch_claim_key(tenant, idempotency_key)
        try:
            latest = await kv_latest(self._bucket, key)
            if latest is None or latest[0].decode() != holder:
                if latest is not None:
                    return latest[0].decode()
                return await self.claim(tenant, idempotency_key, batch_id, until=until)
            try:
                await kv_put_expecting(
                    self._bucket, key, batch_id.encode(), last_revision=latest[1], ttl_s=ttl_until(until)
                )
                return batch_id
            except KeyWrongLastSequenceError:
                moved = await kv_latest(self._bucket, key)
        except NATS_FAILURES as exc:
            if store_full(exc) is not None:
                raise _refusal(exc, "cannot take over the idempotency key", "no batch was created") from exc
            raise Unavailable(
                f"cannot take over the idempotency key from batch {holder} ({exc}); no batch was created, "
                "create it again",
                reason="NATS_UNAVAILABLE",
                metadata={"batch_id": holder},
            ) from exc
        if moved is None:  # released or expired since it was read: free for a claim (it read as ours)
            return await self.claim(tenant, idempotency_key, batch_id, until=until)
        return moved[0].decode()

    async def release(self, tenant: str, idempotency_key: str, batch_id: str) -> bool:
        """Frees the key if its claim still names `batch_id` (a create that failed before writing
        its batch); whether it did. The key's writes up to that claim are purged, leaving no marker,
        so it reads as never claimed to this release's claim and to the one before (whose claim
        loops without end over a marker: a create expecting revision 0, refused, reads no holder);
        a claim written after it (a takeover) stays."""
        key = batch_claim_key(tenant, idempotency_key)
        try:
            latest = await kv_latest(self._bucket, key)
            if latest is None or latest[0].decode() != batch_id:
                return False
            await kv_purge_through(self._bucket, key, latest[1])
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot release the idempotency key: {exc}", reason="NATS_UNAVAILABLE") from exc
        return True

    async def key_pages(self, tenant: str | None = None) -> AsyncGenerator[list[tuple[str, str]], None]:
        """(tenant, batch_id) of every batch record (of one tenant, when given), one stream info
        answer at a time: the server lists at most 100,000 subjects in one, and past that sorts
        them and answers the rest behind an offset (asyncinfer.nats.streams.subject_pages)."""
        # The stream's subjects, not KeyValue.keys: its filters are substrings of the keys, and a
        # watch's end marker can come before every key has been delivered. "<tenant>.<id>": the
        # idempotency claims ("<tenant>.key.<hash>") have a token more.
        prefix = self._bucket.subject_prefix
        try:
            async for subjects in subject_pages(
                self._nc, self._bucket.stream, f"{prefix}{tenant or '*'}.*", timeout_s=KEYS_TIMEOUT_S
            ):
                pairs = []
                for subject in subjects:
                    owner, _, batch_id = subject.removeprefix(prefix).partition(".")
                    if batch_id and "." not in batch_id:
                        pairs.append((owner, batch_id))
                yield pairs
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot list batches: {exc}") from exc

    async def newest_ids(self, tenant: str, *, before: str | None, most: int) -> tuple[list[str], bool]:
        """The newest `most` of the tenant's batch IDs older than `before` (all when None), newest
        first, and whether older ones were left out. Kept answer by answer, so a listing holds a
        page's worth of IDs beside the answer it reads, however many batches the tenant has."""
        newest = NewestIds(before=before, most=most)
        async for pairs in self.key_pages(tenant):
            newest.add(batch_id for _, batch_id in pairs)
        return newest.newest_first(), newest.left_out


def _refusal(exc: BaseException, what: str, outcome: str) -> AsyncInferError:
    """RESOURCE_EXHAUSTED STORE_FULL for a full store, as UploadInput and SubmitJob answer (it was
    UNAVAILABLE quoting nats-py's exception, which clients retry at once); UNAVAILABLE otherwise."""
    full = store_full(exc)
    if full is not None:
        return store_full_error(full, what=outcome)
    return Unavailable(f"{what}: {exc}")


class _NotAnswered(Exception):
    """A claim's write or read that NATS did not answer (a leader election): tried again."""
