"""Webhooks at the gateway: the submit-time check of a callback (the tenant has a signing secret;
the URL's form and every address it resolves to are allowed, see asyncinfer.webhook_urls) and
GetJob's view of the deliveries the scheduler made (read from the webhooks bucket)."""

from __future__ import annotations

from google.protobuf import timestamp_pb2

from asyncinfer.config import WebhooksConfig
from asyncinfer.errors import FailedPrecondition, FieldViolation, InvalidArgument, Unavailable
from asyncinfer.jobs import CallbackSpec, JobRecord
from asyncinfer.nats import KeyValue
from asyncinfer.v1 import job_pb2
from asyncinfer.webhook_status import JobDeliveries, read_deliveries
from asyncinfer.webhook_urls import RefusedUrl, ResolverFailed, check_callback_url, parse_networks


async def check_callback(callback: CallbackSpec, config: WebhooksConfig, *, tenant: str) -> None:
    """Raises FailedPrecondition when the tenant cannot sign webhooks, InvalidArgument (on
    `callback.url`) when the URL may not be called, Unavailable when the resolver gave no answer."""
    if config.secret_for(tenant) is None:
        raise FailedPrecondition(
            f"tenant {tenant!r} has no webhook signing secret, so it cannot ask for callbacks: run "
            f'`asyncinfer webhook-secret` and add {{ tenant = "{tenant}", secret = "whsec_..." }} to '
            "webhooks.secrets in the configuration (give the receiver the same secret to verify signatures)",
            reason="WEBHOOK_SECRET_MISSING",
            metadata={"tenant": tenant},
        )
    try:
        await check_callback_url(callback.url, parse_networks(config.allowed_networks))
    except ResolverFailed as exc:
        # No answer from the resolver says nothing of the URL: the caller tries again (retriable).
        raise Unavailable(f"callback.url: {exc}; try again", reason="CALLBACK_URL_UNRESOLVED") from None
    except RefusedUrl as exc:
        raise InvalidArgument(
            f"invalid request: callback.url: {exc}",
            [FieldViolation("callback.url", str(exc))],
            reason="CALLBACK_URL_REFUSED",
        ) from None


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(round(seconds * 1e9))
    return stamp


def deliveries_to_proto(entry: JobDeliveries) -> list[job_pb2.CallbackDelivery]:
    messages = []
    for delivery in entry.deliveries:
        message = job_pb2.CallbackDelivery(
            webhook_id=delivery.webhook_id,
            event=job_pb2.CallbackEvent.Value(f"CALLBACK_EVENT_{delivery.event.value}"),
            state=job_pb2.CallbackDeliveryState.Value(f"CALLBACK_DELIVERY_STATE_{delivery.state.value}"),
            attempts=delivery.attempts,
            last_status_code=delivery.last_status_code,
            last_error=delivery.last_error,
        )
        if delivery.last_attempt_time is not None:
            message.last_attempt_time.CopyFrom(_timestamp(delivery.last_attempt_time))
        if delivery.next_attempt_time is not None and not delivery.state.is_final:
            message.next_attempt_time.CopyFrom(_timestamp(delivery.next_attempt_time))
        messages.append(message)
    return messages


class CallbackDeliveries:
    """GetJob's reader of a job's webhook deliveries."""

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    async def for_job(self, record: JobRecord) -> list[job_pb2.CallbackDelivery]:
        if record.callback is None:
            return []
        return deliveries_to_proto(await read_deliveries(self._kv, record.tenant, record.job_id))
