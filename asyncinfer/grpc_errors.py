"""The one place where asyncinfer errors become gRPC statuses (and back).

Servers install `ErrorInterceptor`, so servicers simply raise `AsyncInferError` kinds. The status
carries `google.rpc` details: `ErrorInfo` always, `BadRequest` field violations for invalid input,
`RetryInfo` for RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc import aio
from grpc_status import rpc_status

from asyncinfer.errors import AsyncInferError, InvalidArgument, ResourceExhausted

ERROR_DOMAIN = "asyncinfer.dev"
log = structlog.get_logger("asyncinfer.grpc")


def to_status(error: AsyncInferError) -> grpc.Status:
    details: list[any_pb2.Any] = []
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN, metadata=error.metadata)
    details.append(_pack(info))
    if isinstance(error, InvalidArgument) and error.violations:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in error.violations
            ]
        )
        details.append(_pack(bad))
    if isinstance(error, ResourceExhausted):
        seconds = max(error.retry_after_s, 0.0)
        whole = math.floor(seconds)
        delay = duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    status = status_pb2.Status(code=error.code.value[0], message=error.message, details=details)
    return rpc_status.to_status(status)


def _pack(message: Any) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def status_details(error: aio.AioRpcError | grpc.RpcError) -> status_pb2.Status | None:
    """The rich status of a failed call, for clients and tests."""
    return rpc_status.from_call(error)  # type: ignore[arg-type]


def unpack_details(status: status_pb2.Status) -> dict[str, Any]:
    """The known detail messages of a status, keyed by their short type name."""
    found: dict[str, Any] = {}
    for detail in status.details:
        for cls in (error_details_pb2.ErrorInfo, error_details_pb2.BadRequest, error_details_pb2.RetryInfo):
            if detail.Is(cls.DESCRIPTOR):
                message = cls()
                detail.Unpack(message)
                found[cls.DESCRIPTOR.name] = message
    return found


_INTERNAL = code_pb2.INTERNAL


async def _abort(context: aio.ServicerContext[Any, Any], error: AsyncInferError) -> None:
    status = to_status(error)
    # abort_with_status exists on aio contexts; grpc-stubs lacks it.
    await context.abort_with_status(status)  # type: ignore[attr-defined]


def _wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        try:
            return await behavior(request, context)
        except AsyncInferError as error:
            await _abort(context, error)

    return wrapper


def _wrap_stream(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def wrapper(request: Any, context: aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        try:
            async for response in behavior(request, context):
                yield response
        except AsyncInferError as error:
            await _abort(context, error)

    return wrapper


class ErrorInterceptor(aio.ServerInterceptor):  # type: ignore[type-arg]
    """Maps AsyncInferError raised by any servicer method to a rich gRPC status."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),  # type: ignore[arg-type]
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream),  # type: ignore[arg-type]
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
