"""Which scheduler instances run: each names itself "<name>/<run>" (its stable name: the
configured scheduler_id, else host and port; and a run ID new at every start) on the RUNNING
records it writes, and keeps a heartbeat key `scheduler.<run>` in the queues bucket that the server
removes HEARTBEAT_TTL_S after its last write (a graceful stop deletes it).

An instance named on a record no longer runs when it has this instance's name and another run (it
is the process this one replaced: same host and port, or same configured ID), or when its
heartbeat is gone. Neither misjudges a running one: a name is one process's at a time (a port is),
and a heartbeat is rewritten well within its TTL.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket

import structlog

from asyncinfer.config import Config
from asyncinfer.contract import scheduler_key
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.nats.kv import KvBucket, kv_delete_with_ttl, kv_latest, kv_put_with_ttl
from asyncinfer.supervision import end_if_cancelled

log = structlog.get_logger("asyncinfer.scheduler.instances")

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_S = 5  # whole seconds: the Nats-TTL header's unit
# How long the delete marker of a heartbeat ended in order stays: long enough for every watcher
# (services.scheduler.peer_watch) to hear of it, even one reconnecting after a short outage.
DELETED_HEARTBEAT_TTL_S = 300


def stable_name(config: Config) -> str | None:
    """The name a restarted scheduler has again: its configured ID, else host and port; None for
    port 0 (a new port at every start, so no restart shares it)."""
    settings = config.scheduler
    if settings.scheduler_id:
        return settings.scheduler_id
    return f"{socket.gethostname()}:{settings.port}" if settings.port else None


def new_run() -> str:
    """A run ID, new at every start."""
    return secrets.token_hex(8)


def instance_name(config: Config, run: str) -> str:
    """A scheduler process's one name: its stable name, else (port 0) host, process ID and `run`.
    Its snapshots, RUNNING records (`<name>/<run>`), heartbeat value and Drain answers carry it, and
    its logs, NATS connection, welcomes to batchers and pauses say it. It stays what the stored keys
    had: a restart in place must find its previous run's records and snapshots under the same name,
    which a process ID would not give. Logs and welcomes said `scheduler-<host>-<pid>` before (their
    readers print it, none matches it), a name no stored key could be matched with."""
    return stable_name(config) or f"{socket.gethostname()}:{os.getpid()}:{run}"


class SchedulerInstance:
    def __init__(self, name: str, run: str, queues: KvBucket) -> None:
        self.run = run
        self.name = name
        self.id = f"{self.name}/{self.run}"
        self._queues = queues

    async def beat(self) -> None:
        await kv_put_with_ttl(self._queues, scheduler_key(self.run), self.id.encode(), ttl_s=HEARTBEAT_TTL_S)

    async def heartbeat(self) -> None:
        """Beats until cancelled (a failed beat is retried at the next interval)."""
        while True:
            try:
                await self.beat()
            except NATS_FAILURES as exc:
                log.warning("scheduler_heartbeat_failed", error=str(exc))
            end_if_cancelled()  # a stop's cancellation that the beat's NATS request lost
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def end(self) -> None:
        """A graceful stop: the heartbeat goes now, not after its TTL."""
        try:  # its marker expires: one per run would stay in the bucket for ever (each start's watches read them)
            await kv_delete_with_ttl(self._queues, scheduler_key(self.run), ttl_s=DELETED_HEARTBEAT_TTL_S)
        except NATS_FAILURES as exc:
            log.warning("scheduler_heartbeat_not_deleted", error=str(exc))

    async def is_gone(self, instance_id: str) -> bool:
        """Whether the instance named on a record no longer runs ("" or unreadable: unknown, so
        not gone: its job waits out AckWait as before)."""
        name, _, run = instance_id.rpartition("/")
        if not name or not run:
            return False
        if run == self.run:
            return False
        if name == self.name:
            return True
        return await kv_latest(self._queues, scheduler_key(run)) is None
