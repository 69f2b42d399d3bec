"""Building gRPC servers the same way in every service: health checking, reflection (so grpcurl
works without proto files), AsyncInferError mapped to rich statuses, TLS when credentials are
given, API key roles checked by an AccessGuard (asyncinfer.access; health and reflection stay
open), and an ordered, idempotent stop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, cast

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from asyncinfer.access import AccessGuard
from asyncinfer.grpc_errors import ErrorMappingGenericHandler, Translate, wrap_method_handler
from asyncinfer.grpc_keepalive import Keepalive
from asyncinfer.health_service import NOT_SERVING, SERVING, HealthServicer
from asyncinfer.rpc_metrics import MetricsGenericHandler, RpcMetrics

# Keep messages within what the gateway's limits allow, plus room for framing.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The health service name a liveness probe asks for: SERVING from the start until a stop begins,
# whatever `set_serving` says of the server (service ""), which a readiness probe asks for. A
# gateway whose store is full says NOT_SERVING to readiness (send traffic elsewhere), and a restart
# would not help it: Kubernetes restarted gateways every 30 s while the store stayed full.
LIVENESS_SERVICE = "asyncinfer.liveness"


class GrpcServer:
    """An aio server with health and reflection for the given services.

    `add_servicers` receives the raw aio.Server to register generated servicers on;
    `service_names` are the full names reported by health and reflection."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        add_servicers: Callable[[aio.Server], None],
        service_names: Iterable[str],
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        interceptors: Iterable[aio.ServerInterceptor[Any, Any]] = (),
        rpc_metrics: RpcMetrics | None = None,
        credentials: grpc.ServerCredentials | None = None,
        guard: AccessGuard | None = None,
        translate: Translate | None = None,
        keepalive: Keepalive | None = None,
    ) -> None:
        self._host = host
        self._credentials = credentials
        self._requested_port = port
        self._service_names = tuple(service_names)
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
            # gRPC core cancels calls beyond 1000 waiting to be picked up (the Python server takes
            # them one at a time): a burst of watches or reconnecting clients would be CANCELLED.
            ("grpc.server.max_pending_requests", 20_000),
            ("grpc.server.max_pending_requests_hard_limit", 40_000),
            *(keepalive.server_options() if keepalive is not None else ()),
        ]
        interceptors = tuple(interceptors)
        self.server = aio.server(interceptors=interceptors or None, options=options)
        self.health = HealthServicer()
        # Handlers are wrapped once here, not per call by an interceptor (see grpc_errors).
        add_servicers(cast(aio.Server, _ErrorMappingRegistrar(self.server, rpc_metrics, guard, translate)))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        self.port = 0
        self._stopped = False

    @property
    def address(self) -> str:
        return f"{self._host}:{self.port}"

    async def start(self) -> None:
        address = f"{self._host}:{self._requested_port}"
        if self._credentials is not None:
            self.port = self.server.add_secure_port(address, self._credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind {self._host}:{self._requested_port}")
        await self.server.start()
        self.health.set(LIVENESS_SERVICE, SERVING)
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        """The server's health ("" and each of its services'), not LIVENESS_SERVICE's."""
        status = SERVING if serving else NOT_SERVING
        self.health.set("", status)
        for name in self._service_names:
            self.health.set(name, status)

    async def set_serving_of(self, name: str, serving: bool) -> None:
        """The health of one more name than the server's own (a batcher's models: `set_serving`
        leaves them as they are); once a stop began, every name stays NOT_SERVING."""
        self.health.set(name, SERVING if serving else NOT_SERVING)

    async def forget_serving_of(self, name: str) -> None:
        """A name of `set_serving_of` goes: it answers as one never set (Check NOT_FOUND, Watch
        SERVICE_UNKNOWN); once a stop began, it stays NOT_SERVING."""
        self.health.clear(name)

    async def begin_shutdown(self) -> None:
        """Health NOT_SERVING (for good), the server still answering: for a service that has
        work to finish before it stops its server, so that probes and load balancers move on at
        the start of its stop, not at its end."""
        self.health.enter_graceful_shutdown()

    async def stop(self, grace_s: float, *, once_closed: Callable[[], Awaitable[None]] | None = None) -> None:
        """Stops intake (health NOT_SERVING, then no new RPCs: GOAWAY on every connection, the port
        closed), lets running RPCs finish within grace_s, then cancels them. `once_closed` runs
        when no new RPC can reach this server, within the grace: a service ends its endless streams
        there, so that a client reopening one goes to the next server, not back to this one.
        Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.health.enter_graceful_shutdown()
        stopping = asyncio.ensure_future(self.server.stop(grace_s))
        try:
            # grpc.aio's stop shuts the core server down (GOAWAY, listeners closed) in its first
            # step, before anything it awaits: one turn of the loop and no new call comes.
            await asyncio.sleep(0)
            if once_closed is not None:
                await once_closed()
        finally:
            await stopping


class _ErrorMappingRegistrar:
    """Stands in for the aio.Server while servicers register: every method handler they add
    is wrapped (once) so that AsyncInferError becomes a rich status, and counted in the RPC
    metrics (outside the mapping, so that they see the status it sets)."""

    def __init__(
        self,
        server: aio.Server,
        rpc_metrics: RpcMetrics | None,
        guard: AccessGuard | None,
        translate: Translate | None = None,
    ) -> None:
        self._server = server
        self._metrics = rpc_metrics
        self._guard = guard
        self._translate = translate

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler[Any, Any]]) -> None:
        # The key check innermost, then the error mapping, then the metrics (which see the final code).
        guard = self._guard
        guarded = [guard.wrap_generic(h) for h in handlers] if guard is not None else list(handlers)
        mapped: list[grpc.GenericRpcHandler[Any, Any]] = [
            ErrorMappingGenericHandler(h, self._translate) for h in guarded
        ]
        if self._metrics is not None:
            mapped = [MetricsGenericHandler(h, self._metrics) for h in mapped]
        self._server.add_generic_rpc_handlers(mapped)

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict[str, Any]) -> None:
        guard = self._guard
        wrapped = {
            name: wrap_method_handler(
                guard.wrap(service_name, name, handler) if guard is not None else handler, self._translate
            )
            for name, handler in method_handlers.items()
        }
        if self._metrics is not None:
            metrics = self._metrics
            wrapped = {name: metrics.wrap(f"/{service_name}/{name}", h) for name, h in wrapped.items()}
        self._server.add_registered_method_handlers(service_name, wrapped)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)
