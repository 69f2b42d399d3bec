"""Compare-and-set writes of a job's delivery status (`job.<tenant>.<job_id>` in the webhooks
bucket), each with the entry's TTL (nats-py's KeyValue.update cannot set one, so the write is the
same publish it makes, plus Nats-TTL)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from asyncinfer.contract import EXPECTED_LAST_SUBJECT_SEQUENCE_HEADER, kv_subject_prefix
from asyncinfer.errors import Unavailable
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.nats import APIError, JetStreamContext, KeyDeletedError, KeyNotFoundError, KeyValue
from asyncinfer.webhook_status import (
    JobDeliveries,
    deliveries_key,
    disabled_key,
    encode_deliveries,
    read_deliveries,
)

_WRONG_LAST_SEQUENCE = (10071, 10164)
MAX_CAS_TRIES = 20

# Given the entry as it is, the entry to write, or None to leave it.
Change = Callable[[JobDeliveries], JobDeliveries | None]


class StatusStore:
    def __init__(self, js: JetStreamContext, kv: KeyValue, bucket: str) -> None:
        self._js = js
        self._kv = kv
        self._subject_prefix = kv_subject_prefix(bucket)

    async def read(self, tenant: str, job_id: str) -> JobDeliveries:
        return await read_deliveries(self._kv, tenant, job_id)

    async def update(self, tenant: str, job_id: str, change: Change) -> JobDeliveries:
        """Applies `change` to the latest entry, again on a lost race; the entry as it stands after."""
        for _ in range(MAX_CAS_TRIES):
            current = await self.read(tenant, job_id)
            new = change(current)
            if new is None:
                return current
            try:
                ack = await self._js.publish(
                    self._subject_prefix + deliveries_key(tenant, job_id),
                    encode_deliveries(new),
                    headers={EXPECTED_LAST_SUBJECT_SEQUENCE_HEADER: str(current.revision)},
                    msg_ttl=max(new.ttl_s, 1.0),
                )
            except APIError as exc:
                if exc.err_code in _WRONG_LAST_SEQUENCE:
                    continue
                raise Unavailable(f"cannot write the webhook deliveries: {exc}") from exc
            except NATS_FAILURES as exc:
                raise Unavailable(f"cannot write the webhook deliveries: {exc}") from exc
            return replace(new, revision=ack.seq)
        raise Unavailable("the webhook deliveries kept changing under this write")

    async def is_disabled(self, tenant: str, url: str) -> bool:
        try:
            entry = await self._kv.get(disabled_key(tenant, url))
        except (KeyNotFoundError, KeyDeletedError):
            return False
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot read the disabled URLs: {exc}") from exc
        return entry.value is not None

    async def disable(self, tenant: str, url: str, *, reason: str, for_s: float) -> None:
        """Records the URL as disabled for the tenant, for `for_s` (0: until the key is deleted)."""
        try:
            await self._js.publish(
                self._subject_prefix + disabled_key(tenant, url),
                reason.encode(),
                msg_ttl=max(for_s, 1.0) if for_s > 0 else None,
            )
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot record the disabled URL: {exc}") from exc
