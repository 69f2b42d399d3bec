"""The service apps by name, each imported when it is made: the gateway and the scheduler run
without torch installed, and the base install (no nats-py, no uvloop) runs the client commands."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # services.cli lists SERVICES for every command: the client ones need neither (pydantic, structlog)
    from asyncinfer.config import Config
    from asyncinfer.runner import App


def make_gateway(config: Config) -> App:
    from services.gateway.app import GatewayApp

    app: App = GatewayApp(config)
    return app


def make_scheduler(config: Config) -> App:
    from services.scheduler.app import SchedulerApp

    app: App = SchedulerApp(config)
    return app


def make_batcher(config: Config, config_path: Path | None = None) -> App:
    from services.batcher.app import BatcherApp

    # With its file, SIGHUP reloads the models it declares (docs/MODEL_VERSIONS.md).
    app: App = BatcherApp(config, config_path=config_path)
    return app


def make_console(config: Config) -> App:
    from services.console.app import ConsoleApp

    app: App = ConsoleApp(config)
    return app


SERVICES: dict[str, Callable[[Config], App]] = {
    "gateway": make_gateway,
    "scheduler": make_scheduler,
    "batcher": make_batcher,
    "console": make_console,
}


# The module each app is made from. Importing one is 0.2-0.3 s of the interpreter's time (grpc,
# nats-py, which imports aiohttp, which builds two SSL contexts at import; 2 cores), all of it on
# the event loop when `make_*` imports it there: `up`'s gateway answered nothing while the
# scheduler's and the console's modules loaded, and a stop signal waited for the import.
APP_MODULES = {
    "gateway": "services.gateway.app",
    "scheduler": "services.scheduler.app",
    "batcher": "services.batcher.app",
    "console": "services.console.app",
}


async def import_app_module(name: str) -> None:
    """Imports the app's module in a thread, so the event loop runs between the import's
    bytecodes (the GIL changes hands every few ms); `make_*` then finds it imported."""
    await asyncio.to_thread(importlib.import_module, APP_MODULES[name])
