"""What a gRPC caller is told when a handler's NATS request failed and the handler did not say
(asyncinfer.grpc_errors' `Translate`, given to the gateway's and the scheduler's servers): a full
store is RESOURCE_EXHAUSTED STORE_FULL with a retry delay, any other NATS failure UNAVAILABLE
NATS_UNAVAILABLE. An operator's PauseQueue against a full store answered UNKNOWN with the class name
of nats-py's exception."""

from __future__ import annotations

from asyncinfer.errors import AsyncInferError, ResourceExhausted, Unavailable
from asyncinfer.nats import NatsError
from asyncinfer.nats.streams import store_full

# Seconds a full store is expected to stay full at least (the gateway's RetryInfo says the same).
STORE_FULL_RETRY_AFTER_S = 5.0


def nats_failure_status(exc: Exception) -> AsyncInferError | None:
    full = store_full(exc)
    if full is not None:
        return ResourceExhausted(
            f"NATS's store is full ({full.description}): nothing was changed; try again later",
            retry_after_s=STORE_FULL_RETRY_AFTER_S,
            reason="STORE_FULL",
        )
    if isinstance(exc, NatsError):
        return Unavailable(
            f"NATS did not take the request ({type(exc).__name__}: {exc}); try again", reason="NATS_UNAVAILABLE"
        )
    return None
