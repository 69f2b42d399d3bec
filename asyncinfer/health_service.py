"""The gRPC health service (grpc.health.v1.Health) every server here answers: the protocol of
grpc_health's aio servicer, with two things that one lacks.

- A name can go away (`clear`): a batcher's per-model names (`<model>`, `<model>/<version>`)
  follow what it serves, and a name a hot update removed answers as a name never set does, as
  the health protocol says of an unknown service: Check NOT_FOUND, Watch SERVICE_UNKNOWN (the
  stream stays open, and says the status again if the name comes back). grpc-java's
  HealthStatusManager.clearStatus does the same. grpc_health's servicer (grpcio-health-checking)
  has no removal, only its private status map: a name set once was answered for good.
- Every watcher hears every change. grpc_health's Watch deletes its name's condition when it ends,
  though other watches of the name may still wait on that condition: they heard nothing more (two
  watches of one name, one cancelled, and the other stayed on its last status whatever was set
  after). It also writes under the condition, so a change waited on a watcher's write (a slow
  client's flow control). Here a change replaces the name's status and sets the event its
  watchers wait on: `set` and `clear` never wait.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self._statuses: dict[str, int] = {"": SERVING}
        # Per name watched now: the event its watches wait on (set at the name's next change, then
        # dropped), and how many watch it (the entries go with the last watch).
        self._changes: dict[str, asyncio.Event] = {}
        self._watches: dict[str, int] = {}
        self._shutting_down = False

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:
        status = self._statuses.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service[:200]!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        """The name's status now, then each change (only when it differs from the last sent: a
        watcher wants the latest, not every step), until the caller goes."""
        name = request.service
        self._watches[name] = self._watches.get(name, 0) + 1
        last: int | None = None
        try:
            while True:
                # Taken before the status is read: a change while the write below awaits sets it.
                changed = self._changes.setdefault(name, asyncio.Event())
                status = self._statuses.get(name, SERVICE_UNKNOWN)
                if status != last:
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                    last = status
                await changed.wait()
        finally:
            self._watches[name] -= 1
            if not self._watches[name]:
                del self._watches[name]
                self._changes.pop(name, None)

    def set(self, service: str, status: int) -> None:
        """The name's status; ignored once a graceful shutdown began (every name NOT_SERVING)."""
        if self._shutting_down:
            return
        self._statuses[service] = status
        self._changed(service)

    def clear(self, service: str) -> None:
        """The name answers as one never set (Check NOT_FOUND, Watch SERVICE_UNKNOWN); ignored once
        a graceful shutdown began, as `set` is (grpc-java's terminal health service does the same)."""
        if self._shutting_down or self._statuses.pop(service, None) is None:
            return
        self._changed(service)

    def enter_graceful_shutdown(self) -> None:
        """Every name NOT_SERVING, for good: later `set` and `clear` calls are ignored."""
        if self._shutting_down:
            return
        for service in self._statuses:
            self._statuses[service] = NOT_SERVING
            self._changed(service)
        self._shutting_down = True

    def _changed(self, service: str) -> None:
        event = self._changes.pop(service, None)
        if event is not None:
            event.set()
