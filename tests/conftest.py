"""Shared fixtures: a real nats-server per test (free ports, temporary store) and a configuration
pointing every service at it on free ports.

The nats-server starts only for a test that asks for it (`nats_server`, or a fixture built on it:
`config`, `nc`, the stacks); nothing here is autouse, so a test without them runs without one.
The `unit` marker (the fast tier, `pytest -m unit`) says so of a test, and is checked."""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry

from asyncinfer.config import Config, ModelConfig
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.logs import TRACEBACKS
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.connection import connect
from services.batcher.app import BatcherApp
from tests.certs import TestCA
from tests.file_order import longest_first
from tests.stack import Stack, StartStack, run_every
from tests.tls_helpers import tls_nats_server

# The services in a test process log through structlog's default configuration, whose console
# renderer draws a traceback with every frame's locals (Rich's): ~0.25-1.5 s of CPU each on the event
# loop, which a burst of them froze the test's whole stack with. Drawn as the services draw theirs.
structlog.configure(
    processors=[
        structlog.dev.ConsoleRenderer(colors=False, exception_formatter=TRACEBACKS)
        if isinstance(processor, structlog.dev.ConsoleRenderer)
        else processor
        for processor in structlog.get_config()["processors"]
    ]
)


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False  # xdist keeps the order below (tests/file_order.py)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("unit") and "nats_server" in getattr(item, "fixturenames", ()):
            raise pytest.UsageError(f"{item.nodeid} is marked unit but starts a nats-server (through its fixtures)")
    if getattr(config.option, "dist", "no") == "loadfile":
        items[:] = longest_first(items)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServerProcess]:
    server = NatsServerProcess(store_dir=tmp_path / "nats", log_file=tmp_path / "nats.log")
    server.start()
    try:
        yield server
    finally:
        # Killed, not stopped: its store is the test's temporary directory, read by nothing after
        # the test, and every service of the test's has stopped before (the fixtures that start
        # them depend on this one). A graceful stop (SIGTERM) took nats-server ~0.11 s once a
        # scheduler had made its durable consumers (~50 ms, then ~10 ms a consumer), 86 % of a
        # short stack test's teardown; a kill takes ~2 ms. Tests that need a graceful stop or a
        # restart on the same store (a store flushed) call `stop` themselves.
        server.kill()


@pytest.fixture
def config(nats_server: NatsServerProcess) -> Config:
    """Every service on port 0 (the OS picks), metrics off, against the test's nats-server."""
    return Config().replace(
        nats={"url": nats_server.url},
        gateway={"port": 0, "metrics_port": 0},
        scheduler={"port": 0, "metrics_port": 0, "poll_interval_ms": 50.0},
        batcher={"port": 0, "metrics_port": 0, "scheduler_address": None},
        logging={"level": "warning", "format": "console"},
    )


@pytest.fixture
async def nc(config: Config) -> AsyncIterator[NatsClient]:
    client = await connect(config.nats, name="test")
    try:
        yield client
    finally:
        await client.drain()


@pytest.fixture
async def make_engine() -> AsyncIterator[Callable[..., Any]]:
    """Builds batching engines around a torch module with the demo model's config (plus overrides);
    every engine made is stopped at the end. Imports torch lazily: most tests do not need it."""
    import torch

    from asyncinfer.config import DEMO_MODEL
    from services.batcher.backends.torch_backend import TorchBackend
    from services.batcher.engine import BatchingEngine
    from services.batcher.metrics import BatcherMetrics

    engines: list[BatchingEngine] = []

    async def make(module: torch.nn.Module, registry: CollectorRegistry | None = None, **overrides: Any) -> Any:
        config = DEMO_MODEL.model_copy(update=overrides)
        engine = BatchingEngine(metrics=BatcherMetrics(registry) if registry is not None else None)
        engine.add_model(config, TorchBackend(config.name, module, config.signature, torch.device("cpu")))
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    await run_every([functools.partial(engine.stop, grace_s=1.0) for engine in engines])


@pytest.fixture
async def start_stack(config: Config) -> AsyncIterator[StartStack]:
    """Starts stacks (tests/stack.py) on the test's configuration, or another one built from it;
    every stack started is stopped at the end of the test, the last started first."""
    started: list[Stack] = []

    async def start(
        stack_config: Config | None = None, *, scheduler: bool = True, batcher: bool = True, **options: Any
    ) -> Stack:
        running = Stack(stack_config or config, **options)
        await running.start(scheduler=scheduler, batcher=batcher)
        started.append(running)
        return running

    try:
        yield start
    finally:
        # Every one, also after one that failed to stop: one left running failed a later test.
        await run_every([functools.partial(stop_or_show_what_hangs, running) for running in reversed(started)])


STACK_STOP_LIMIT_S = 60.0  # under pytest-timeout's 120 s, so a hung stop says where it hangs


async def stop_or_show_what_hangs(running: Stack) -> None:
    """Stops the stack; one that has not stopped within STACK_STOP_LIMIT_S fails the test with
    every task's stack printed. (pytest-timeout's dump shows only threads, and an event loop that
    waits on a hung coroutine shows as a thread in select.)"""
    stopping = asyncio.create_task(running.stop())
    await asyncio.wait({stopping}, timeout=STACK_STOP_LIMIT_S)
    if stopping.done():
        stopping.result()
        return
    for task in asyncio.all_tasks():
        if task is not asyncio.current_task():
            print(f"--- {task.get_name()}", file=sys.stderr)
            task.print_stack(file=sys.stderr)
    stopping.cancel()
    pytest.fail(f"the stack did not stop within {STACK_STOP_LIMIT_S:g} s (every task's stack is on stderr)")


@pytest.fixture
async def stack(start_stack: StartStack) -> Stack:
    """The whole stack: jobs run to completion."""
    return await start_stack()


@pytest.fixture
async def idle_stack(start_stack: StartStack) -> Stack:
    """No batcher: jobs stay QUEUED until the test starts one (`start_batcher`)."""
    return await start_stack(batcher=False)


@pytest.fixture
async def batchers(start_stack: StartStack) -> AsyncIterator[Callable[..., Any]]:
    """Starts batchers, each with its own models, against a stack's scheduler (`await
    batchers(stack, batcher_id, *models)`); all stopped at the end."""
    started: list[BatcherApp] = []

    async def start(stack: Stack, batcher_id: str, *models: ModelConfig) -> BatcherApp:
        config = stack.config.replace(models=[m.model_dump() for m in models]).replace(
            batcher={"scheduler_address": stack.ops_address, "batcher_id": batcher_id}
        )
        app = BatcherApp(config)
        await app.start()
        started.append(app)
        return app

    yield start
    for app in reversed(started):
        await app.stop(1.0)


@pytest.fixture
def ca(tmp_path: Path) -> TestCA:
    """A test certificate authority of the test's own (tests/certs.py)."""
    return TestCA(tmp_path / "pki")


@pytest.fixture
def verifying_nats(tmp_path: Path, ca: TestCA) -> Iterator[NatsServerProcess]:
    """A nats-server on TLS that verifies client certificates against `ca`."""
    with tls_nats_server(tmp_path, ca) as server:
        yield server
