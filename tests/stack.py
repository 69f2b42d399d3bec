"""The whole stack in the test's process: gateway and scheduler, and a batcher when asked for
(connected to that scheduler), stopped in reverse order. The `stack` and `idle_stack` fixtures
(tests/conftest.py) wrap it; tests that need more (a channel, helpers) subclass it."""

from __future__ import annotations

from asyncinfer.config import Config
from services.batcher.app import BatcherApp
from services.gateway.app import GatewayApp
from services.scheduler.app import SchedulerApp


class Stack:
    def __init__(self, config: Config, scheduler_config: Config | None = None) -> None:
        self.config = config
        self.gateway = GatewayApp(config)
        self.scheduler = SchedulerApp(scheduler_config or config)
        self.batcher: BatcherApp | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    @property
    def ops_address(self) -> str:
        return f"127.0.0.1:{self.scheduler.port}"

    async def start(self, *, batcher: bool = True) -> None:
        await self.gateway.start()
        await self.scheduler.start()
        if batcher:
            await self.start_batcher()

    async def start_batcher(self) -> None:
        self.batcher = BatcherApp(self.config.replace(batcher={"scheduler_address": self.ops_address}))
        await self.batcher.start()

    async def stop(self) -> None:
        if self.batcher is not None:
            await self.batcher.stop(2.0)
        await self.scheduler.stop(2.0)
        await self.gateway.stop(2.0)
