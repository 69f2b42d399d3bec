"""The batcher's side of the scheduler's WorkerService.Connect stream: keeps one open,
reconnecting after failures.

Each connection is a WorkSession (work_session.py: hello, credits, orders, results). When the
stream breaks, the session's orders are abandoned (the scheduler re-queues them), and a new session
starts after a short delay (0.1 s, doubling up to `reconnect_delay_s`, so a restarted scheduler is
found at once but a dead one is not hammered) with a fresh hello and fresh credits. Protobuf stays
in this module, work_session.py and work_messages.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from asyncinfer.access import bearer_metadata
from asyncinfer.backoff import retrying
from asyncinfer.config import BatcherConfig, ModelConfig
from asyncinfer.grpc_keepalive import Keepalive
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.supervision import Supervisor
from asyncinfer.tls import ClientCertificates, read_secret, renewing_channel_credentials
from asyncinfer.v1 import worker_service_pb2_grpc
from services.batcher.claim_checks import ClaimChecks
from services.batcher.engine import BatchingEngine
from services.batcher.model_control import ModelControl
from services.batcher.work_session import WorkSession

log = structlog.get_logger("asyncinfer.batcher.worker")

FIRST_RECONNECT_DELAY_S = 0.1
STABLE_SESSION_S = 5.0
# While the scheduler stays unreachable, a failed attempt is logged at most this often (the first
# at once): reconnecting every second, it would otherwise be a line a second.
FAILURE_LOG_INTERVAL_S = 30.0


@dataclass(frozen=True, slots=True)
class WorkerSecurity:
    """How the work stream reaches the scheduler: TLS credentials (None: plaintext), made again
    for a stream opened after their files changed, and the call metadata carrying the batcher's
    API key (empty without one)."""

    tls: ClientCertificates[grpc.ChannelCredentials] | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    client_cert: bool = False  # the credentials present batcher.scheduler_cert_file

    @classmethod
    def from_config(cls, batcher: BatcherConfig) -> WorkerSecurity:
        tls = None
        if batcher.scheduler_tls or batcher.scheduler_ca_file or batcher.scheduler_cert_file:
            tls = renewing_channel_credentials(
                ca_file=batcher.scheduler_ca_file,
                cert_file=batcher.scheduler_cert_file,
                key_file=batcher.scheduler_key_file,
                key="batcher.scheduler",
                service="batcher",
            )
        key = read_secret(batcher.api_key, batcher.api_key_file, "batcher.api_key")
        return cls(tls=tls, metadata=bearer_metadata(key), client_cert=bool(batcher.scheduler_cert_file))


class WorkerClient:
    """Keeps one work stream to the scheduler open, reconnecting after failures."""

    def __init__(
        self,
        *,
        address: str,
        batcher_id: str,
        engine: BatchingEngine,
        reconnect_delay_s: float,
        supervisor: Supervisor,
        work_batches: bool = True,
        security: WorkerSecurity | None = None,
        progress_interval_s: float = 0.15,
        progress_max_bytes: int = 256 * 1024,
        models: ModelControl | None = None,
        claim_checks: ClaimChecks | None = None,
        max_result_bytes: int = 0,
        keepalive: Keepalive | None = None,
    ) -> None:
        self._keepalive = keepalive
        self._claim_checks = claim_checks
        self._max_result_bytes = max_result_bytes
        self._models = models
        self._progress_interval_s = progress_interval_s
        self._progress_max_bytes = progress_max_bytes
        self._address = address
        self._security = security or WorkerSecurity()
        self._supervisor = supervisor
        self._work_batches = work_batches
        self._batcher_id = batcher_id
        self._engine = engine
        self._reconnect_delay_s = reconnect_delay_s
        self._failed_orders = RepeatedLines()
        self._task: asyncio.Task[None] | None = None
        self._session: WorkSession | None = None
        self._loading: tuple[ModelConfig, ...] = ()
        self._stopping = False
        self._outage = _Outage()
        # Set at the first welcome from a scheduler: `up` prints its banner once the batcher is
        # connected, so that "ready" means a job submitted then is computed at once.
        self.connected = asyncio.Event()

    async def start(self) -> None:
        if self._task is None:
            self._task = self._supervisor.start("batcher-worker-client", self._run())

    def models_changed(self, loading: Iterable[ModelConfig] = ()) -> None:
        """Announces the versions served now (and those loading) on the open stream; a new stream
        says hello with them anyway."""
        self._loading = tuple(loading)
        if self._session is not None:
            self._session.models_changed(self._loading)

    def reachable_changed(self) -> None:
        """A model's Triton went out of reach or answers again: announced again (LOADING while it
        is out of reach, services/batcher/work_messages.served_models). Not once it stops: the
        scheduler was told it serves nothing."""
        if self._session is not None and not self._stopping:
            self._session.models_changed(self._loading)

    def stop_granting(self) -> None:
        """Offers no more credits (the first step of shutdown) and does not reconnect."""
        self._stopping = True
        if self._session is not None:
            self._session.stop_granting()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Sends the results of orders still in the engine and half-closes the stream, within
        grace_s; then cancels. Results not sent by then are abandoned (the scheduler re-queues
        those jobs when the stream breaks). Idempotent."""
        self.stop_granting()
        if self._task is None:
            return
        if self._session is not None and not self._task.done():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace_s):
                    await self._session.drain()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        while not self._stopping:
            await self._reconnecting()

    async def _reconnecting(self) -> None:
        """Opens work streams, backing off from FIRST_RECONNECT_DELAY_S up to reconnect_delay_s
        between them, until one that was up for STABLE_SESSION_S ends (the next failure is a new
        one: the backoff starts again) or the client stops."""
        first_delay_s = min(FIRST_RECONNECT_DELAY_S, self._reconnect_delay_s)
        async for attempt in retrying(
            _StreamEnded, retry_for_s=None, first_delay_s=first_delay_s, max_delay_s=self._reconnect_delay_s
        ):
            with attempt:
                if self._stopping:
                    return
                started = time.monotonic()
                await self._stream_once()
                if time.monotonic() - started > STABLE_SESSION_S:
                    return
                raise _StreamEnded

    async def _stream_once(self) -> None:
        """One work stream, from connecting until it ends (each way it ends is logged; a scheduler
        that stays unreachable, every FAILURE_LOG_INTERVAL_S)."""
        session: WorkSession | None = None
        try:
            # Work orders carry whole inputs (up to the gateway's upload limit); the scheduler,
            # a trusted peer, bounds them with its own server's send limit.
            options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", -1)]
            if self._keepalive is not None:
                # A scheduler that vanished (its node lost, its pod replaced elsewhere) closes no
                # connection: without pings this stream would wait for orders for ever.
                options += self._keepalive.client_options(without_calls=True)
            # A new channel each stream: a client certificate renewed on disk is presented from
            # the next one (a channel of gRPC's reconnects with the credentials it was made with).
            tls = self._security.tls
            credentials = await asyncio.to_thread(tls.current) if tls is not None else None
            channel = (
                grpc.aio.secure_channel(self._address, credentials, options=options)
                if credentials is not None
                else grpc.aio.insecure_channel(self._address, options=options)
            )
            async with channel:
                stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
                self._session = session = WorkSession(
                    stub,
                    self._batcher_id,
                    self._engine,
                    work_batches=self._work_batches,
                    metadata=self._security.metadata,
                    progress_interval_s=self._progress_interval_s,
                    progress_max_bytes=self._progress_max_bytes,
                    loading=self._loading,
                    models=self._models,
                    claim_checks=self._claim_checks,
                    max_result_bytes=self._max_result_bytes,
                    on_welcome=self.connected.set,
                    failed_orders=self._failed_orders,
                )
                await self._session.run()
            self._outage.ended()
            log.warning("work_stream_closed_by_scheduler", scheduler=self._address)
        except grpc.aio.AioRpcError as error:
            if session is not None and session.welcomed:
                self._outage.ended()  # the stream was up: this failure starts a new outage
            if (repeat := self._outage.failed()) is not None:
                code = error.code()
                hint = _REFUSALS.get(code) or self._connection_hint(error)
                log.warning(
                    "work_stream_failed",
                    scheduler=self._address,
                    code=code.name,
                    details=error.details(),
                    **({"hint": hint} if hint else {}),
                    **repeat,
                )
        except Exception:
            log.exception("work_stream_failed", scheduler=self._address)

    def _connection_hint(self, error: grpc.aio.AioRpcError) -> str | None:
        """The settings to check where the scheduler closed a TLS connection that presented no
        client certificate: a scheduler with tls_client_ca_file requires one, and its refusal
        reaches this side as gRPC's "Socket closed" (asyncinfer.client.errors.SOCKET_CLOSED)."""
        closed = error.code() is grpc.StatusCode.UNAVAILABLE and "Socket closed" in (error.details() or "")
        if not closed or self._security.tls is None or self._security.client_cert:
            return None
        return (
            "the scheduler closed the connection after the TLS handshake: if it requires client certificates "
            "(mutual TLS: scheduler.tls_client_ca_file), set batcher.scheduler_cert_file and "
            "batcher.scheduler_key_file (a certificate its CA signed)"
        )


# What a refusal of the work stream says of this batcher's configuration (the scheduler is up).
_REFUSALS = {
    grpc.StatusCode.UNAUTHENTICATED: "the scheduler refused this batcher's key: set batcher.api_key (or "
    "api_key_file) to a key of role batcher in the scheduler's gateway.api_keys",
    grpc.StatusCode.PERMISSION_DENIED: "this batcher's key is not of role batcher (the scheduler's WorkerService "
    "takes no other)",
}


class _Outage:
    """Failed attempts to reach the scheduler since the stream was last up: the first is logged,
    then one every FAILURE_LOG_INTERVAL_S with how many failed and for how long."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._failures = 0
        self._logged_at = 0.0

    def ended(self) -> None:
        self._since = None

    def failed(self) -> dict[str, float] | None:
        """The fields to log this failure with, or None to leave it unlogged."""
        now = time.monotonic()
        if self._since is None:
            self._since, self._failures, self._logged_at = now, 1, now
            return {}
        self._failures += 1
        if now - self._logged_at < FAILURE_LOG_INTERVAL_S:
            return None
        self._logged_at = now
        return {"attempts": self._failures, "failing_for_s": round(now - self._since, 1)}


class _StreamEnded(Exception):
    """A work stream ended before it was up for STABLE_SESSION_S: reconnect after a backoff."""
