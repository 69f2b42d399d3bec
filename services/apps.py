"""The service apps by name, each imported when it is made: the gateway and the scheduler run
without torch installed, and the base install (no nats-py, no uvloop) runs the client commands."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

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
