"""How full the JetStream store is, read by the scheduler (it owns the streams) for its gauges, so
that an operator is warned while there is room left, not only once writes are refused.

One round is the account's JetStream info (`$JS.API.INFO`: storage and memory used, and the
account's limits) and the info of each of the stack's streams with a byte limit of its own
(`max_bytes`). Which streams have one is learnt from every stream's info in the first round and
again every `REREAD_ALL_EVERY` rounds (an operator may set or lift a stream's limit while the
stack runs), so a round without limited streams is one request.

JetStream's API reports the account's limits, not the server's (`jetstream { max_file_store }`),
and the global account (where users without an account of their own are: `up`'s, and the shipped
cluster's) has none. So each server in `scheduler.nats_monitor_urls` is asked too, on its
monitoring port (`/jsz`: what that server stores, of every account and replica, and its own
limits): what refuses writes first is whichever of the two fills first.

The same round counts the dead letters stored per model: one info of the dead-letter stream with
its subjects (one subject per model), the backlog an operator must replay or purge."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import structlog

from asyncinfer import contract
from asyncinfer.config import NatsConfig
from asyncinfer.nats import OBJ_STREAM_TEMPLATE, JetStreamContext, NotFoundError

log = structlog.get_logger("asyncinfer.scheduler.store_usage")
# A monitoring endpoint that does not answer in this long is skipped for the round.
MONITOR_TIMEOUT_S = 5.0

# Every this many rounds, every stream's info is read again to see which have a byte limit.
REREAD_ALL_EVERY = 10


@dataclass(frozen=True, kw_only=True)
class StreamUsage:
    stream: str
    used_bytes: int
    limit_bytes: int  # its max_bytes; 0: none


@dataclass(frozen=True, kw_only=True)
class ServerUsage:
    server: str  # the monitoring endpoint's host:port
    file_used_bytes: int
    memory_used_bytes: int
    file_limit_bytes: int  # the server's max_file_store (its own or, unset, what it chose at start)
    memory_limit_bytes: int


@dataclass(frozen=True, kw_only=True)
class StoreUsage:
    file_used_bytes: int
    memory_used_bytes: int
    file_limit_bytes: int  # the account's max_storage; 0: none
    memory_limit_bytes: int  # the account's max_memory; 0: none
    streams: tuple[StreamUsage, ...]  # those with a byte limit
    servers: tuple[ServerUsage, ...] = ()  # those of nats_monitor_urls that answered
    dead_letters: dict[str, int] | None = None  # stored now, by model; None: not read


async def read_server_usage(session: aiohttp.ClientSession, url: str) -> ServerUsage:
    """One server's own store, from its monitoring port's /jsz."""
    async with session.get(f"{url}/jsz") as reply:
        reply.raise_for_status()
        jsz = await reply.json(content_type=None)
    if not isinstance(jsz, dict):
        raise ValueError(f"{url}/jsz answered {type(jsz).__name__}, not an object")
    config = jsz.get("config")
    if not isinstance(config, dict):
        raise ValueError(f"{url}/jsz has no JetStream config (is JetStream enabled there?)")
    return ServerUsage(
        server=urlsplit(url).netloc,
        file_used_bytes=int(jsz.get("storage", 0)),
        memory_used_bytes=int(jsz.get("memory", 0)),
        file_limit_bytes=_limit(config.get("max_storage")),
        memory_limit_bytes=_limit(config.get("max_memory")),
    )


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


def _limit(value: object) -> int:
    return value if isinstance(value, int) and value > 0 else 0


class StoreUsageReader:
    def __init__(self, js: JetStreamContext, nats: NatsConfig, *, monitor_urls: Sequence[str] = ()) -> None:
        self._js = js
        self._streams = stack_streams(nats)
        self._dead_letter_stream = nats.dead_letter_stream
        self._monitor_urls = tuple(monitor_urls)
        self._unanswered: set[str] = set()
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
        servers: list[ServerUsage] = []
        if self._monitor_urls:
            # Together, so that a server that does not answer holds the round MONITOR_TIMEOUT_S once.
            timeout = aiohttp.ClientTimeout(total=MONITOR_TIMEOUT_S)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                found = await asyncio.gather(*(self._server(session, url) for url in self._monitor_urls))
            servers = [usage for usage in found if usage is not None]
        return StoreUsage(
            file_used_bytes=account.storage,
            memory_used_bytes=account.memory,
            file_limit_bytes=_limit(account.limits.max_storage),
            memory_limit_bytes=_limit(account.limits.max_memory),
            streams=tuple(streams),
            servers=tuple(servers),
            dead_letters=await self._dead_letters(),
        )

    async def _server(self, session: aiohttp.ClientSession, url: str) -> ServerUsage | None:
        """Its usage; None (its series go) while it does not answer: one of a cluster's servers
        restarting must not stop the others' readings, nor the account's."""
        try:
            usage = await read_server_usage(session, url)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            if url not in self._unanswered:
                log.warning("nats_monitor_unanswered", url=url, error=f"{type(exc).__name__}: {exc}")
                self._unanswered.add(url)
            return None
        if url in self._unanswered:
            log.info("nats_monitor_answered", url=url)
            self._unanswered.discard(url)
        return usage

    async def _dead_letters(self) -> dict[str, int] | None:
        """The letters stored now by model: the stream's message count per subject."""
        try:
            info = await self._js.stream_info(self._dead_letter_stream, subjects_filter=contract.DEAD_SUBJECTS)
        except NotFoundError:
            return None
        prefix = contract.DEAD_SUBJECT_PREFIX + "."
        return {
            subject.removeprefix(prefix): int(count)
            for subject, count in (info.state.subjects or {}).items()
            if subject.startswith(prefix)
        }
