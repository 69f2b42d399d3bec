"""RPC server metrics for every gRPC server: calls handled by service, method and canonical status
code, and their handling time, in the style of go-grpc-prometheus:

    asyncinfer_rpc_server_handled_total{service="asyncinfer.v1.JobService", method="SubmitJob", code="OK"}
    asyncinfer_rpc_server_handling_seconds_bucket{service=..., method=..., le=...}

Like the error mapping (asyncinfer.grpc_errors), each method handler is wrapped once, when it is
registered (`GrpcServer` does it), not per call by an `aio.ServerInterceptor`: grpc's aio server
runs interceptors on every call. `RpcMetricsInterceptor` is for servers not built by
`GrpcServer`. A streaming call is timed from its start to its last message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio
from prometheus_client import CollectorRegistry, Counter, Histogram

from asyncinfer.grpc_handlers import rewrap

_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0, 300.0)
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def _code_name(context: aio.ServicerContext[Any, Any]) -> str:
    """The status the handler set (abort or set_code); OK when it set none."""
    code = context.code()
    if code is None:
        return "OK"
    if isinstance(code, grpc.StatusCode):
        return code.name
    return _CODE_NAMES.get(int(code), "UNKNOWN")


class RpcMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.handled = Counter(
            "asyncinfer_rpc_server_handled",
            "RPCs completed on the server, by service, method and canonical status code.",
            ["service", "method", "code"],
            registry=registry,
        )
        self.handling_seconds = Histogram(
            "asyncinfer_rpc_server_handling_seconds",
            "Time from an RPC's start to its status on the server (a stream's whole life).",
            ["service", "method"],
            buckets=_SECONDS_BUCKETS,
            registry=registry,
        )

    def wrap(self, full_method: str, handler: Any) -> Any:
        """The same method handler (or None), counting its calls; full_method is /package.Service/Method."""
        if handler is None:
            return None
        service, _, method = full_method.lstrip("/").partition("/")
        record = _Recorder(self, service, method)
        return rewrap(
            handler, lambda behavior, _requests, responses: (record.stream if responses else record.unary)(behavior)
        )


class _Recorder:
    """One method's metric children, looked up once (a label lookup per call costs)."""

    def __init__(self, metrics: RpcMetrics, service: str, method: str) -> None:
        self._metrics = metrics
        self._service = service
        self._method = method
        self._seconds = metrics.handling_seconds.labels(service=service, method=method)
        self._handled: dict[str, Any] = {}

    def done(self, code: str, started: float) -> None:
        self._seconds.observe(time.perf_counter() - started)
        child = self._handled.get(code)
        if child is None:
            child = self._metrics.handled.labels(service=self._service, method=self._method, code=code)
            self._handled[code] = child
        child.inc()

    def unary(self, behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def wrapper(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
            started = time.perf_counter()
            code = "UNKNOWN"
            try:
                response = await behavior(request, context)
                code = _code_name(context)
                return response
            except aio.AbortError:
                code = _code_name(context)
                raise
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            finally:
                self.done(code, started)

        return wrapper

    def stream(self, behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def wrapper(request: Any, context: aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            started = time.perf_counter()
            code = "UNKNOWN"
            try:
                async for response in behavior(request, context):
                    yield response
                code = _code_name(context)
            except aio.AbortError:
                code = _code_name(context)
                raise
            except (asyncio.CancelledError, GeneratorExit):
                code = "CANCELLED"
                raise
            finally:
                self.done(code, started)

        return wrapper


class MetricsGenericHandler(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """A generic handler whose method handlers are counted; each is wrapped once and reused."""

    def __init__(self, inner: grpc.GenericRpcHandler[Any, Any], metrics: RpcMetrics) -> None:
        self._inner = inner
        self._metrics = metrics
        self._wrapped: dict[str, Any] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        method = handler_call_details.method
        handler = self._wrapped.get(method)
        if handler is None:
            handler = self._metrics.wrap(method, self._inner.service(handler_call_details))
            if handler is not None:
                self._wrapped[method] = handler
        return handler
