"""The store gauges: the scheduler, as its own NATS user (asyncinfer.nats_users), reads the
JetStream account's usage and limits and each stream's with a byte limit, and exports them, so
that the alerts warn while there is room left. Against a real nats-server whose account may store
4 MB, filled past 80%."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

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


SERVER_FILE_BYTES = 4 * 1024 * 1024
SERVER_MEMORY_BYTES = 1024 * 1024


@pytest.fixture
def global_account(tmp_path: Path) -> Iterator[PerServiceNats]:
    """The users in the global account (as `up`'s and the shipped nats.conf's), on a server whose
    own store may hold 4 MB (1 MB memory), its monitoring port on."""
    nats = PerServiceNats(
        tmp_path / "nats-users",
        extra_config="jetstream { max_file_store: 4MB, max_memory_store: 1MB }\n",
        monitor_port=free_port(),
    )
    nats.start()
    try:
        yield nats
    finally:
        nats.stop()


def stack_config(metrics_port: int, monitor_port: int, interval_s: float) -> Config:
    return Config().replace(
        scheduler={
            "port": 0,
            "metrics_port": metrics_port,
            "store_usage_interval_s": interval_s,
            "nats_monitor_urls": [f"http://127.0.0.1:{monitor_port}"],
        },
        logging={"level": "warning", "format": "console"},
        models=[DEMO_MODEL],
    )


def near_full_alert_fires(server: str, idle_used: float, full_used: float, limit: float, tmp_path: Path) -> str:
    """promtool's verdict on AsyncinferStoreNearlyFull, as shipped, over a scheduler's server gauges
    at these readings (idle for 2 minutes, then full): '' when it fires at 13 m and not at 11 m."""
    from tests.test_deploy_metrics import RULES, _alert, _write

    spec = yaml.safe_load(RULES.read_text())["spec"]
    rules = [r for g in spec["groups"] for r in g["rules"] if r.get("alert") == "AsyncinferStoreNearlyFull"]
    for rule in rules:
        rule.pop("annotations", None)
    labels = f'server="{server}",instance="s1"'
    test = _alert(
        "AsyncinferStoreNearlyFull",
        [
            (
                f'asyncinfer_nats_server_store_used_bytes{{storage="file",{labels}}}',
                f"{idle_used:.0f}x1 {full_used:.0f}x20",
            ),
            (f'asyncinfer_nats_server_store_limit_bytes{{storage="file",{labels}}}', f"{limit:.0f}x22"),
        ],
        [("11m", None), ("13m", {"server": server, "storage": "file"})],
    )
    rules_file = _write(tmp_path / "rules.yml", {"groups": [{"name": "store", "rules": rules}]})
    tests = _write(
        tmp_path / "tests.yml", {"rule_files": [str(rules_file)], "evaluation_interval": "1m", "tests": [test]}
    )
    run = subprocess.run(["promtool", "test", "rules", str(tests)], capture_output=True, text=True, check=False)
    return "" if run.returncode == 0 else run.stdout + run.stderr


async def test_in_the_global_account_the_servers_own_store_limit_is_read_and_the_alert_fires_at_80_percent(
    global_account: PerServiceNats, tmp_path: Path
) -> None:
    assert shutil.which("promtool") is not None, "promtool is missing: sudo apt-get install -y prometheus"
    port = free_port()
    base = stack_config(port, global_account.monitor_port, 0.1)
    server = f"127.0.0.1:{global_account.monitor_port}"
    scheduler = SchedulerApp(global_account.config_of(base, "scheduler"))
    await scheduler.start()
    nc = await connect(global_account.config_of(base, "test").nats, name="test")
    try:
        js = nc.jetstream()
        limit = "asyncinfer_nats_server_store_limit_bytes"
        used = "asyncinfer_nats_server_store_used_bytes"
        idle = await scraped_until(port, lambda s: gauge(s, limit, server=server, storage="file"))
        assert gauge(idle, limit, server=server, storage="file") == SERVER_FILE_BYTES
        assert gauge(idle, limit, server=server, storage="memory") == SERVER_MEMORY_BYTES
        # JetStream's API has no limit for the global account: the server's is the one.
        assert gauge(idle, "asyncinfer_store_limit_bytes", storage="file") == 0
        idle_used = gauge(idle, used, server=server, storage="file") or 0
        assert idle_used < 0.1 * SERVER_FILE_BYTES

        await js.add_stream(name="FILLER", subjects=["filler.>"])
        for _ in range(34):  # ~85% of the server's store
            await js.publish("filler.x", bytes(SERVER_FILE_BYTES // 40))
        full = await scraped_until(
            port, lambda s: (gauge(s, used, server=server, storage="file") or 0) > 0.8 * SERVER_FILE_BYTES
        )
        full_used = gauge(full, used, server=server, storage="file") or 0
        assert full_used < SERVER_FILE_BYTES
        assert gauge(full, limit, server=server, storage="file") == SERVER_FILE_BYTES
    finally:
        await disconnect(nc)
        await scheduler.stop(grace_s=0.0)
    assert global_account.violations() == []  # reading /jsz asks NATS for nothing more
    # The shipped alert, on exactly these readings: silent while idle, firing after 10 m over 80%.
    assert near_full_alert_fires(server, idle_used, full_used, SERVER_FILE_BYTES, tmp_path) == ""
    # and silent on the idle reading alone (the expression crosses 0.8 only with the store full)
    assert near_full_alert_fires(server, idle_used, idle_used, SERVER_FILE_BYTES, tmp_path) != ""


async def test_the_store_is_read_as_the_scheduler_starts_not_an_interval_later(
    global_account: PerServiceNats,
) -> None:
    port = free_port()
    base = stack_config(port, global_account.monitor_port, 3600.0)  # the next round: in an hour
    server = f"127.0.0.1:{global_account.monitor_port}"
    scheduler = SchedulerApp(global_account.config_of(base, "scheduler"))
    await scheduler.start()
    try:
        first = await scraped_until(
            port,
            lambda s: (
                gauge(s, "asyncinfer_nats_server_store_limit_bytes", server=server, storage="file")
                and gauge(s, "asyncinfer_store_used_bytes", storage="file") is not None
            ),
            timeout_s=10.0,
        )
        assert (
            gauge(first, "asyncinfer_nats_server_store_limit_bytes", server=server, storage="file") == SERVER_FILE_BYTES
        )
        assert gauge(first, "asyncinfer_dead_letters_stored", model=DEMO_MODEL.name) == 0
    finally:
        await scheduler.stop(grace_s=0.0)


async def test_a_monitoring_endpoint_that_does_not_answer_leaves_the_rest_read(
    global_account: PerServiceNats,
) -> None:
    port = free_port()
    gone = free_port()  # nothing listens there
    base = stack_config(port, global_account.monitor_port, 0.1)
    base = base.replace(
        scheduler={"nats_monitor_urls": [f"http://127.0.0.1:{gone}", f"http://127.0.0.1:{global_account.monitor_port}"]}
    )
    scheduler = SchedulerApp(global_account.config_of(base, "scheduler"))
    await scheduler.start()
    try:
        read = await scraped_until(
            port,
            lambda s: gauge(
                s,
                "asyncinfer_nats_server_store_limit_bytes",
                server=f"127.0.0.1:{global_account.monitor_port}",
                storage="file",
            ),
        )
        assert (
            gauge(read, "asyncinfer_nats_server_store_limit_bytes", server=f"127.0.0.1:{gone}", storage="file") is None
        )
        assert gauge(read, "asyncinfer_store_used_bytes", storage="file") is not None
    finally:
        await scheduler.stop(grace_s=0.0)
