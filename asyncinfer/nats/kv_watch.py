"""A watch of a KV bucket's keys as plain updates: the latest write of every key, then every write,
through one ordered push consumer (nats-py remakes it on a gap), so a reader keeps a local view of
the bucket current without reading per request. What nats-py's messages are (subjects, the
KV-Operation header, headers-only delivery) stays here; callers get `KeyUpdate`s."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.kv import KV_OP

from asyncinfer.nats.protocol import MSG_TTL, kv_stream, kv_subject_prefix
from asyncinfer.nats.streams import declaration

log = structlog.get_logger("asyncinfer.nats.kv_watch")
DEFAULT_IDLE_HEARTBEAT_S = 5.0  # nats-py's for an ordered consumer


@dataclass(frozen=True, slots=True)
class KeyUpdate:
    key: str
    value: bytes  # empty when headers_only, or when the write removed the key
    headers: Mapping[str, str]
    removed: bool  # a delete or purge (or a server-placed marker), not a value

    @property
    def lasting_marker(self) -> bool:
        """A removal whose marker stays in the bucket for good (no per-message TTL of its own)."""
        return self.removed and MSG_TTL not in self.headers


class KeyWatch:
    """Calls `on_update` (on the event loop: keep it quick) with each update of the keys matching
    `keys` (a subject pattern under the bucket: ">" for all of them), in order; `stop` ends it.

    `idle_heartbeat_s` is how often the server tells an idle watch it is still there: a watch whose
    deliveries stopped (its consumer deleted, or gone with a restarted nats-server) is remade after
    it missed two, within four of them, resuming after the last change it delivered. nats-py's 5 s
    is the default: each heartbeat is a message read on the event loop, per watch, idle or not."""

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        on_update: Callable[[KeyUpdate], None],
        *,
        keys: str = ">",
        headers_only: bool = False,
        name: str,
        idle_heartbeat_s: float = DEFAULT_IDLE_HEARTBEAT_S,
    ) -> None:
        if not idle_heartbeat_s > 0:
            raise ValueError(f"idle_heartbeat_s must be above 0, not {idle_heartbeat_s}")
        self._js = js
        self._bucket = bucket
        self._on_update = on_update
        self._keys = keys
        self._headers_only = headers_only
        self._name = name
        self._idle_heartbeat_s = idle_heartbeat_s
        self._subject_prefix = kv_subject_prefix(bucket)
        self._subscription: JetStreamContext.PushSubscription | None = None

    async def start(self) -> None:
        async def watch(_timeout_s: float) -> JetStreamContext.PushSubscription:
            return await self._js.subscribe(
                self._subject_prefix + self._keys,
                stream=kv_stream(self._bucket),
                cb=self._deliver,
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                headers_only=self._headers_only,
                idle_heartbeat=self._idle_heartbeat_s,
            )

        # At start, a leader election may be under way (a node lost as the service started).
        self._subscription = await declaration(watch, what=f"watch the {self._bucket} bucket")

    async def stop(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            try:
                await subscription.unsubscribe()
            except Exception as exc:  # the connection may already be gone
                log.warning("kv_watch_unsubscribe_failed", watch=self._name, error=str(exc))

    async def _deliver(self, msg: Msg) -> None:
        headers = dict(msg.headers or {})
        removed = KV_OP in headers or (not self._headers_only and not msg.data)
        update = KeyUpdate(
            key=msg.subject.removeprefix(self._subject_prefix),
            value=b"" if removed else (msg.data or b""),
            headers=headers,
            removed=removed,
        )
        self._on_update(update)
