"""A nats-server with one NKey user per service (asyncinfer.nats_users' permissions), for tests:
`PerServiceNats` writes the server's configuration and each service's seed file, starts the
server, and hands out each service's NATS settings. Its `test` user may do anything (the test's
own connection reads what it checks); a `stranger` user (password) has rights to nothing of the
stack's, as a batcher pod's or a tenant's stolen NATS login would."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from asyncinfer.config import Config, NatsConfig
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.nats_users import (
    INBOX_PREFIXES,
    NatsUser,
    Permissions,
    authorization_block,
    new_user_nkey,
    service_permissions,
)

STRANGER, STRANGER_PASSWORD = "stranger", "stranger-password"
ANYTHING = Permissions(publish=(">",), subscribe=(">",))
# What a logged-in user of no service gets: its own inbox, nothing of the stack's.
NOTHING_OF_OURS = Permissions(publish=("stranger.>",), subscribe=("_INBOX.>", "stranger.>"))


@dataclass
class PerServiceNats:
    directory: Path
    nats: NatsConfig = field(default_factory=NatsConfig)
    extra_config: str = ""
    # With it, the users are one account's with these JetStream limits (e.g. "max_file: 4MB"), not
    # the global account's (whose limits JetStream's API reports as none).
    account_jetstream: str = ""
    monitor_port: int = 0  # its HTTP monitoring port (/jsz); 0: off
    server: NatsServerProcess | None = field(default=None, init=False)
    seed_files: dict[str, Path] = field(default_factory=dict, init=False)

    def write_config(self) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        users: dict[str, NatsUser] = {}
        for service, permissions in {**service_permissions(self.nats, batcher=True), "test": ANYTHING}.items():
            seed, public = new_user_nkey()
            seed_file = self.directory / f"{service}.nk"
            seed_file.write_text(seed + "\n")
            seed_file.chmod(0o600)
            self.seed_files[service] = seed_file
            users[service] = NatsUser(nkey=public, permissions=permissions)
        users[STRANGER] = NatsUser(user=STRANGER, password=STRANGER_PASSWORD, permissions=NOTHING_OF_OURS)
        path = self.directory / "nats.conf"
        path.write_text(
            (self._account(users) if self.account_jetstream else authorization_block(users)) + self.extra_config
        )
        return path

    def _account(self, users: dict[str, NatsUser]) -> str:
        entries = "\n".join(f"      {user.as_config()}" for user in users.values())
        return f"accounts {{\n  STACK {{\n    jetstream {{ {self.account_jetstream} }}\n    users = [\n{entries}\n    ]\n  }}\n}}\n"

    def start(self) -> NatsServerProcess:
        path = self.write_config()
        self.server = NatsServerProcess(
            store_dir=self.directory / "store",
            log_file=self.directory / "nats.log",
            monitor_port=self.monitor_port,
            extra_args=("-c", str(path)),
        )
        self.server.start()
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def settings(self, service: str) -> dict[str, object]:
        """The `[nats]` settings of one service (or of `test`)."""
        assert self.server is not None, "start it first"
        settings: dict[str, object] = {"url": self.server.url, "nkey_seed_file": str(self.seed_files[service])}
        if service in INBOX_PREFIXES:
            settings["inbox_prefix"] = INBOX_PREFIXES[service]
        return settings

    def config_of(self, base: Config, service: str) -> Config:
        return base.replace(nats=self.settings(service))

    def violations(self) -> list[str]:
        """The server's log lines of refused publishes and subscriptions."""
        log = self.directory / "nats.log"
        return [line for line in log.read_text().splitlines() if "Violation" in line] if log.exists() else []

    async def violation(self, text: str, timeout_s: float = 10.0) -> str:
        """The first logged violation holding `text`, once the server has logged it. A refused
        publish is logged when the server reads it, which a client's flush does not wait for:
        nats-py writes its PING straight to the socket, ahead of the publishes still queued for
        its flusher, so the PONG can come first (CI once read the log in between)."""
        async with asyncio.timeout(timeout_s):
            while not (found := [line for line in self.violations() if text in line]):  # noqa: ASYNC110 - a log file, no event
                await asyncio.sleep(0.05)
        return found[0]
