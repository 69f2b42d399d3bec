"""The store gauges: the scheduler, as its own NATS user (asyncinfer.nats_users), reads the
JetStream account's usage and limits and each stream's with a byte limit, and exports them, so
that the alerts warn while there is room left. Against a real nats-server whose account may store
4 MB, filled past 80%."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.nats.connection import connect, disconnect
from services.scheduler.app import SchedulerApp
from tests.nats_auth import PerServiceNats
from tests.test_metrics_scrape import Samples, free_port, scrape

pytestmark = pytest.mark.timeout(120)
ACCOUNT_FILE_BYTES = 4 * 1024 * 1024
ACCOUNT_MEMORY_BYTES = 1024 * 1024
STREAM_LIMIT_BYTES = 256 * 1024


@pytest.fixture
def users(tmp_path: Path) -> Iterator[PerServiceNats]:
    nats = PerServiceNats(tmp_path / "nats-users", account_jetstream="max_file: 4MB, max_mem: 1MB")
    nats.start()
    try:
        yield nats
    finally:
        nats.stop()


def gauge(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


async def scraped_until(port: int, done: Callable[[Samples], object], timeout_s: float = 20.0) -> Samples:
    """The scheduler's metrics once done(samples) holds (its next store round: store_usage_interval_s)."""
    async with asyncio.timeout(timeout_s):
        while not done(samples := await scrape(port)):  # noqa: ASYNC110 - another process's HTTP endpoint, no event
            await asyncio.sleep(0.05)  # the scheduler's next round, every 0.1 s here
    return samples


async def test_the_scheduler_exports_the_account_and_stream_usage_against_their_limits(
    users: PerServiceNats,
) -> None:
    port = free_port()
    base = Config().replace(
        scheduler={"port": 0, "metrics_port": port, "store_usage_interval_s": 0.1},
        logging={"level": "warning", "format": "console"},
        models=[DEMO_MODEL],
    )
    scheduler = SchedulerApp(users.config_of(base, "scheduler"))
    await scheduler.start()
    nc = await connect(users.config_of(base, "test").nats, name="test")
    try:
        js = nc.jetstream()
        idle = await scraped_until(port, lambda s: gauge(s, "asyncinfer_store_limit_bytes", storage="file"))
        assert gauge(idle, "asyncinfer_store_limit_bytes", storage="file") == ACCOUNT_FILE_BYTES
        assert gauge(idle, "asyncinfer_store_limit_bytes", storage="memory") == ACCOUNT_MEMORY_BYTES
        assert (gauge(idle, "asyncinfer_store_used_bytes", storage="file") or 0) < 0.1 * ACCOUNT_FILE_BYTES
        # No stream of the stack has a byte limit yet: none is reported.
        assert not [key for key in idle if key[0] == "asyncinfer_stream_used_bytes"], idle

        # An operator limits the dead letters to 256 KiB, and they fill to 90% of it.
        info = await js.stream_info(base.nats.dead_letter_stream)
        info.config.max_bytes = STREAM_LIMIT_BYTES
        await js.update_stream(info.config)
        for _ in range(9):
            await js.publish("asyncinfer.dead.demo", bytes(STREAM_LIMIT_BYTES // 10))
        # Other data fill the account's store to ~85% (a stream of the test's own).
        await js.add_stream(name="FILLER", subjects=["filler.>"])
        for _ in range(34):
            await js.publish("filler.x", bytes(ACCOUNT_FILE_BYTES // 40))

        dead = base.nats.dead_letter_stream
        full = await scraped_until(
            port,
            lambda s: (
                (gauge(s, "asyncinfer_stream_used_bytes", stream=dead) or 0) > 0.8 * STREAM_LIMIT_BYTES
                and (gauge(s, "asyncinfer_store_used_bytes", storage="file") or 0) > 0.8 * ACCOUNT_FILE_BYTES
            ),
        )
        assert gauge(full, "asyncinfer_stream_limit_bytes", stream=dead) == STREAM_LIMIT_BYTES
        assert (gauge(full, "asyncinfer_store_used_bytes", storage="file") or 0) < ACCOUNT_FILE_BYTES
        # Only the limited stream is reported.
        assert {dict(labels)["stream"] for name, labels in full if name == "asyncinfer_stream_used_bytes"} == {dead}

        # Its limit lifted, the stream's series go (its next full read of every stream).
        info.config.max_bytes = -1
        await js.update_stream(info.config)
        await scraped_until(port, lambda s: gauge(s, "asyncinfer_stream_limit_bytes", stream=dead) is None)
    finally:
        await disconnect(nc)
        await scheduler.stop(grace_s=0.0)
    assert users.violations() == []  # the scheduler's user may ask for all of it
