"""The one in-process stack harness for tests: the gateway, the scheduler and a batcher connected
to it, all in the test's process against the test's nats-server (tests/conftest.py), stopped in
reverse order.

What tests vary is the configuration (`config`, and `scheduler_config` for a scheduler that sees
another one, as after a change the gateway has not made; `batcher_config` for a batcher's own, as
its NATS user), which parts run (`start(scheduler=...,
batcher=...)`; `start_batcher()` later) and the claim-check sweep interval. Started, it holds a
JobService channel (`jobs`), a NATS connection of the test's own (`nc`) and the claim-check store
(`blobs`). `ThreadedStack` runs one on its own event loop for synchronous tests.

The `stack`, `idle_stack` and `start_stack` fixtures (tests/conftest.py) build on it. (The
subprocess `asyncinfer up` of test_up_grpcurl.py, and bench/system/e2e.py's, are other things.)"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc

from asyncinfer.blobs import BlobStore
from asyncinfer.config import Config
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.connection import connect
from asyncinfer.v1 import job_service_pb2_grpc
from services.batcher.app import BatcherApp
from services.gateway.app import GatewayApp
from services.scheduler.app import SchedulerApp

if TYPE_CHECKING:
    from asyncinfer.v1.job_service_pb2_grpc import JobServiceAsyncStub as JobStub

T = TypeVar("T")
GRACE_S = 2.0


class StartStack(Protocol):
    """The `start_stack` fixture: starts a Stack (on the test's configuration unless given one)."""

    async def __call__(
        self, stack_config: Config | None = None, *, scheduler: bool = True, batcher: bool = True, **options: Any
    ) -> Stack: ...


class Stack:
    def __init__(
        self,
        config: Config,
        *,
        scheduler_config: Config | None = None,
        batcher_config: Config | None = None,
        blob_sweep_interval_s: float | None = None,
        scheduler_wall_clock: Callable[[], float] | None = None,
        gateway_wall_clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        self._batcher_config = batcher_config or config
        # Its jobs' create_time and its queue view's clock, skewed against nats-server's.
        self.gateway = (
            GatewayApp(config) if gateway_wall_clock is None else GatewayApp(config, wall_clock=gateway_wall_clock)
        )
        options: dict[str, Any] = (
            {} if blob_sweep_interval_s is None else {"blob_sweep_interval_s": blob_sweep_interval_s}
        )
        if scheduler_wall_clock is not None:  # its snapshots' time, skewed against the other hosts'
            options["wall_clock"] = scheduler_wall_clock
        self.scheduler = SchedulerApp(scheduler_config or config, **options)
        self.batcher: BatcherApp | None = None
        self.channel: grpc.aio.Channel | None = None
        self._nc: NatsClient | None = None
        self._scheduler_started = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    @property
    def ops_address(self) -> str:
        return f"127.0.0.1:{self.scheduler.port}"

    @property
    def jobs(self) -> JobStub:
        """A JobService stub on the stack's channel (to the gateway, across restarts)."""
        assert self.channel is not None, "start the stack first"
        return job_service_pb2_grpc.JobServiceStub(self.channel)

    @property
    def nc(self) -> NatsClient:
        """The test's own NATS connection (not any service's)."""
        assert self._nc is not None, "start the stack first"
        return self._nc

    @property
    def closed(self) -> bool:
        """Whether the test's channel and NATS connection are closed (by `stop`)."""
        return self.channel is None and self._nc is None

    @property
    def blobs(self) -> BlobStore:
        """The claim-check store (uploaded inputs, large results), read as the services do."""
        return BlobStore(self.nc, self.config.nats.objects_bucket, directory=self.config.nats.objects_directory)

    async def start(self, *, scheduler: bool = True, batcher: bool = True) -> None:
        """The gateway, then the scheduler and a batcher (each when asked for; a batcher needs the
        scheduler). Whatever started is stopped by `stop`, also when a later part fails to start."""
        assert scheduler or not batcher, "a batcher needs a scheduler"
        try:
            self._nc = await connect(self.config.nats, name="test")
            await self.gateway.start()
            self.channel = grpc.aio.insecure_channel(self.address)
            if scheduler:
                self._scheduler_started = True
                await self.scheduler.start()
            if batcher:
                await self.start_batcher()
        except BaseException:
            await self.stop()
            raise

    async def start_batcher(self) -> None:
        """A batcher connected to this stack's scheduler (one at a time)."""
        assert self._scheduler_started, "a batcher needs the scheduler"
        assert self.batcher is None, "the stack runs one batcher"
        self.batcher = BatcherApp(self._batcher_config.replace(batcher={"scheduler_address": self.ops_address}))
        await self.batcher.start()

    async def restart_gateway(
        self, grace_s: float = 1.0, away_s: float = 0.0, while_away: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Stops the gateway and starts a new one on the same configuration: with a fixed port, the
        same address (calls on the old one end with UNAVAILABLE; the channel reconnects). `away_s`:
        how long nothing listens between the two; `while_away`: what happens meanwhile (awaited)."""
        await self.gateway.stop(grace_s)
        await asyncio.sleep(away_s)
        if while_away is not None:
            await while_away()
        self.gateway = GatewayApp(self.config)
        await self.gateway.start()

    async def stop(self) -> None:
        """Batcher, scheduler, gateway, then the channel and the connection. Idempotent. Each
        is stopped even when stopping one before it failed (then the first failure is raised once
        all are): a part left running outlives the test's event loop, and its sockets and tasks,
        finalised by the garbage collector in some later test, failed that one instead."""
        steps: list[Callable[[], Awaitable[None]]] = []
        if (batcher := self.batcher) is not None:
            steps.append(lambda: batcher.stop(GRACE_S))
        if self._scheduler_started:
            steps.append(lambda: self.scheduler.stop(GRACE_S))
        steps += [lambda: self.gateway.stop(GRACE_S), self._close_channel, self._close_nc]
        await run_every(steps)

    async def _close_channel(self) -> None:
        if self.channel is not None:
            channel, self.channel = self.channel, None
            await channel.close()

    async def _close_nc(self) -> None:
        if self._nc is not None:
            nc, self._nc = self._nc, None
            await nc.close()


async def run_every(steps: list[Callable[[], Awaitable[None]]]) -> None:
    """Awaits every step in order, also those after one that failed; then raises the first failure
    (a cancellation included, once every step has run)."""
    failure: BaseException | None = None
    for step in steps:
        try:
            await step()
        except BaseException as exc:  # re-raised below, once every step has run
            failure = failure or exc
    if failure is not None:
        raise failure


class ThreadedStack:
    """A Stack on its own event loop in a thread, so a synchronous test can drive it (and the
    synchronous client) while the stack serves; `run` calls into the stack's loop."""

    def __init__(self, config: Config, *, batcher: bool = True, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._batcher = batcher
        self.stack = Stack(config, **options)

    def run(self, work: Callable[[], Awaitable[T]], timeout_s: float = 60.0) -> T:
        """`work()` awaited on the stack's loop; its result, or its exception."""

        async def call() -> T:
            return await work()

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout=timeout_s)

    def __enter__(self) -> ThreadedStack:
        self._thread.start()
        try:
            self.run(lambda: self.stack.start(batcher=self._batcher))
        except BaseException:
            self._close_loop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(self.stack.stop)
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
