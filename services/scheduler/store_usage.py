"""How full the JetStream store is, read by the scheduler (it owns the streams) for its gauges, so
that an operator is warned while there is room left, not only once writes are refused.

One round is the account's JetStream info (`$JS.API.INFO`: storage and memory used, and the
account's limits) and the info of each of the stack's streams with a byte limit of its own
(`max_bytes`). Which streams have one is learnt from every stream's info in the first round and
again every `REREAD_ALL_EVERY` rounds (an operator may set or lift a stream's limit while the
stack runs), so a round without limited streams is one request.

JetStream's API reports the account's limits, not the server's (`jetstream { max_file_store }`):
where only the server has one, the used bytes are exported and the limit is not."""

from __future__ import annotations

from dataclasses import dataclass

from asyncinfer import contract
from asyncinfer.config import NatsConfig
from asyncinfer.nats import OBJ_STREAM_TEMPLATE, JetStreamContext, NotFoundError

# Every this many rounds, every stream's info is read again to see which have a byte limit.
REREAD_ALL_EVERY = 10


@dataclass(frozen=True, kw_only=True)
class StreamUsage:
    stream: str
    used_bytes: int
    limit_bytes: int  # its max_bytes; 0: none


@dataclass(frozen=True, kw_only=True)
class StoreUsage:
    file_used_bytes: int
    memory_used_bytes: int
    file_limit_bytes: int  # the account's max_storage; 0: none
    memory_limit_bytes: int  # the account's max_memory; 0: none
    streams: tuple[StreamUsage, ...]  # those with a byte limit


def stack_streams(nats: NatsConfig) -> tuple[str, ...]:
    """Every stream the stack declares (what the scheduler's NATS user may read the info of)."""
    buckets = (
        nats.jobs_bucket,
        nats.queues_bucket,
        nats.idempotency_bucket,
        nats.webhooks_bucket,
        nats.models_bucket,
        nats.batches_bucket,
    )
    return (
        nats.work_stream,
        nats.dead_letter_stream,
        nats.webhooks_stream,
        *(contract.kv_stream(bucket) for bucket in buckets),
        OBJ_STREAM_TEMPLATE.format(bucket=nats.objects_bucket),
    )


def _limit(value: int | None) -> int:
    return value if value is not None and value > 0 else 0


class StoreUsageReader:
    def __init__(self, js: JetStreamContext, nats: NatsConfig) -> None:
        self._js = js
        self._streams = stack_streams(nats)
        self._limited: tuple[str, ...] = ()
        self._rounds = 0

    async def read(self) -> StoreUsage:
        account = await self._js.account_info()
        everything = self._rounds % REREAD_ALL_EVERY == 0
        self._rounds += 1
        streams: list[StreamUsage] = []
        for name in self._streams if everything else self._limited:
            try:
                info = await self._js.stream_info(name)
            except NotFoundError:  # not declared yet (the batches bucket comes with the gateway)
                continue
            limit = _limit(info.config.max_bytes)
            if limit:
                streams.append(StreamUsage(stream=name, used_bytes=info.state.bytes, limit_bytes=limit))
        self._limited = tuple(s.stream for s in streams)
        return StoreUsage(
            file_used_bytes=account.storage,
            memory_used_bytes=account.memory,
            file_limit_bytes=_limit(account.limits.max_storage),
            memory_limit_bytes=_limit(account.limits.max_memory),
            streams=tuple(streams),
        )
