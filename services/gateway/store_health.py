"""The gateway's health while the store is full.

A submit whose work message JetStream refuses for want of space (the WORK stream at its limits, the
server's or account's storage used up: `StoreFullError`) is answered at once RESOURCE_EXHAUSTED
STORE_FULL, rather than retried for enqueue_retry_s as a leader election would be, and nothing of it
is left behind (the message is the submit's one durable write). From then on health says
NOT_SERVING, so that load balancers and probes send traffic elsewhere, until a write succeeds again
or a probe (every PROBE_INTERVAL_S) finds room in the stream and the account for a request, and
then writes a request's worth (STORE_PROBE_SUBJECT, gone in a second): a server whose own store
limit or disk is full reports no limit reached, and only a write tells.
"""

from __future__ import annotations

import asyncio

import structlog

from asyncinfer.contract import STORE_PROBE_SUBJECT
from asyncinfer.errors import ResourceExhausted
from asyncinfer.grpc_server import GrpcServer
from asyncinfer.nats import JetStreamContext
from asyncinfer.nats.streams import StoreFullError, store_has_room
from asyncinfer.supervision import Supervisor, end_if_cancelled

log = structlog.get_logger("asyncinfer.gateway.store")

PROBE_INTERVAL_S = 1.0
# Seconds a full store is expected to stay full at least: the client's RetryInfo.
RETRY_AFTER_S = 5.0


def store_full_error(error: StoreFullError, *, what: str = "nothing was queued") -> ResourceExhausted:
    return ResourceExhausted(
        f"the job store is full ({error.description}); {what}, try again later",
        retry_after_s=RETRY_AFTER_S,
        reason="STORE_FULL",
        metadata={"cause": error.description},
    )


class StoreHealth:
    def __init__(self, js: JetStreamContext, *, work_stream: str, headroom_bytes: int, supervisor: Supervisor) -> None:
        self._js = js
        self._work_stream = work_stream
        self._headroom_bytes = headroom_bytes
        self._supervisor = supervisor
        self._server: GrpcServer | None = None
        self._full = False
        self._wake = asyncio.Event()

    @property
    def full(self) -> bool:
        return self._full

    def serve_on(self, server: GrpcServer) -> None:
        self._server = server
        self._supervisor.start("store-health", self._watch())

    def refusal(self, error: StoreFullError, *, what: str = "nothing was queued") -> ResourceExhausted:
        """What the caller of a write refused for want of space is answered (and health follows)."""
        self.refused(error)
        return store_full_error(error, what=what)

    def refused(self, error: StoreFullError) -> None:
        """A write was refused for want of space."""
        if not self._full:
            log.error("store_full", cause=error.description)
            self._full = True
            self._wake.set()

    def wrote(self) -> None:
        """A write succeeded: there is room again."""
        if self._full:
            self._full = False
            self._wake.set()

    async def _watch(self) -> None:
        serving = True
        while True:
            end_if_cancelled()  # a stop's cancellation that the last probe's NATS request lost
            if self._full:
                try:
                    async with asyncio.timeout(PROBE_INTERVAL_S):
                        await self._wake.wait()
                except TimeoutError:
                    await self._probe()
            else:
                await self._wake.wait()
            self._wake.clear()
            if serving == (not self._full) or self._server is None:
                continue
            serving = not self._full
            await self._server.set_serving(serving)
            log.info("store_health", serving=serving)

    async def _probe(self) -> None:
        try:
            if await store_has_room(
                self._js, self._work_stream, headroom_bytes=self._headroom_bytes, probe_subject=STORE_PROBE_SUBJECT
            ):
                log.info("store_has_room_again")
                self.wrote()
        except Exception as exc:  # NATS itself may be down: stay NOT_SERVING, probe again
            log.warning("store_probe_failed", error=str(exc))
