"""The one place where asyncinfer errors become gRPC statuses (and back).

Servicers simply raise `AsyncInferError` kinds; `GrpcServer` wraps every method handler once, at
registration (`wrap_method_handler`, `ErrorMappingGenericHandler`), so that the error becomes a
rich status. The status carries `google.rpc` details: `ErrorInfo` always, `BadRequest` field
violations for invalid input, `RetryInfo` for RESOURCE_EXHAUSTED.

Wrapping at registration rather than with an `aio.ServerInterceptor` matters for speed: grpc's
aio server runs interceptors on every call, and an interceptor that wraps builds a new handler
per call (about a tenth of a millisecond a call on a small machine). `ErrorInterceptor` remains
for servers that are not built by `GrpcServer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc import aio
from grpc_status import rpc_status

from asyncinfer.error_bounds import clip_error
from asyncinfer.errors import AsyncInferError, InvalidArgument, ResourceExhausted, Unimplemented
from asyncinfer.grpc_handlers import rewrap

ERROR_DOMAIN = "asyncinfer.dev"


def to_status(error: AsyncInferError) -> grpc.Status:
    # Bounded here, for every RPC of every service: errors quote what callers sent (see error_bounds).
    error = clip_error(error)
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


# Before a request stream is ended with an error, what its client still sends is read and dropped
# until it half-closes, pauses DRAIN_GAP_S, or DRAIN_MAX_S passed. grpc's aio client reports a write
# that fails because the call ended as INTERNAL "Internal error from Core", overwriting the status
# the server sent (grpc/grpc#36066, open): a bulk submit or an upload with a wrong API key was
# refused INTERNAL most times, not UNAUTHENTICATED. A client waiting for answers (the SDK's bulk past
# its window) pauses, so its refusal comes DRAIN_GAP_S later.
DRAIN_GAP_S = 0.1
DRAIN_MAX_S = 2.0


async def _drain(requests: AsyncIterator[Any]) -> None:
    deadline = time.monotonic() + DRAIN_MAX_S
    # StopAsyncIteration (half-closed), TimeoutError (a pause), or a call already broken.
    with contextlib.suppress(Exception):
        while (left := deadline - time.monotonic()) > 0:
            async with asyncio.timeout(min(DRAIN_GAP_S, left)):
                await anext(requests)


async def _abort(
    context: aio.ServicerContext[Any, Any], error: AsyncInferError, requests: AsyncIterator[Any] | None = None
) -> None:
    if requests is not None:
        await _drain(requests)
    status = to_status(error)
    # abort_with_status exists on aio contexts; grpc-stubs lacks it.
    await context.abort_with_status(status)  # type: ignore[attr-defined]


class _Undecodable:
    """What a request deserializer returns for bytes that are not the expected message: gRPC
    would answer UNKNOWN for a raising deserializer; the wrappers answer INVALID_ARGUMENT."""

    __slots__ = ("error",)

    def __init__(self, error: InvalidArgument) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, or whatever the protobuf backend raises
            what = getattr(getattr(deserializer, "__self__", None), "__name__", "request message")
            return _Undecodable(InvalidArgument(f"the request is not a valid {what}: {exc}"[:300]))

    return deserialize


def _checked(request: Any) -> Any:
    if isinstance(request, _Undecodable):
        raise request.error
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _checked(request)


# What a server says for an exception its handlers did not map themselves (a NATS failure, in the
# services that use NATS: asyncinfer.nats.failures), or None to let it be UNKNOWN with a traceback.
Translate = Callable[[Exception], AsyncInferError | None]


def _translated(exc: Exception, translate: Translate | None) -> AsyncInferError:
    if isinstance(exc, NotImplementedError):
        # A generated servicer's default for a method the service does not implement (KServe's
        # shared memory, statistics, trace and log settings): UNIMPLEMENTED, as gRPC says it, with
        # ErrorInfo and no traceback (each call logged one at error level, and answered
        # "Unexpected <class 'NotImplementedError'>").
        return Unimplemented("this server does not implement this method")
    error = translate(exc) if translate is not None else None
    if error is None:
        raise exc
    return error


def _wrap_unary(
    behavior: Callable[..., Awaitable[Any]], *, streaming_requests: bool, translate: Translate | None = None
) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        stream = request if streaming_requests else None
        try:
            request = _checked_stream(request) if streaming_requests else _checked(request)
            return await behavior(request, context)
        except AsyncInferError as error:
            await _abort(context, error, stream)
        except Exception as exc:
            await _abort(context, _translated(exc, translate), stream)

    return wrapper


def _wrap_stream(
    behavior: Callable[..., AsyncIterator[Any]], *, streaming_requests: bool, translate: Translate | None = None
) -> Callable[..., AsyncIterator[Any]]:
    async def wrapper(request: Any, context: aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        stream = request if streaming_requests else None
        try:
            request = _checked_stream(request) if streaming_requests else _checked(request)
            async for response in behavior(request, context):
                yield response
        except AsyncInferError as error:
            await _abort(context, error, stream)
        except Exception as exc:
            await _abort(context, _translated(exc, translate), stream)

    return wrapper


def wrap_method_handler(handler: Any, translate: Translate | None = None) -> Any:
    """The same method handler (or None), its behaviour mapping AsyncInferError (and what
    `translate` maps) to a rich status."""
    if handler is None:
        return None

    def wrap(behavior: Any, streaming_requests: bool, streaming_responses: bool) -> Any:
        wrapper = _wrap_stream if streaming_responses else _wrap_unary
        return wrapper(behavior, streaming_requests=streaming_requests, translate=translate)

    return rewrap(handler, wrap, request_deserializer=_tolerant(handler.request_deserializer))


class ErrorMappingGenericHandler(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """A generic handler whose method handlers map AsyncInferError to rich statuses; each
    method's wrapped handler is built once and reused."""

    def __init__(self, inner: grpc.GenericRpcHandler[Any, Any], translate: Translate | None = None) -> None:
        self._inner = inner
        self._translate = translate
        self._wrapped: dict[str, Any] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        method = handler_call_details.method
        handler = self._wrapped.get(method)
        if handler is None:
            handler = wrap_method_handler(self._inner.service(handler_call_details), self._translate)
            if handler is not None:
                self._wrapped[method] = handler
        return handler


class ErrorInterceptor(aio.ServerInterceptor):  # type: ignore[type-arg]
    """Maps AsyncInferError raised by any servicer method to a rich gRPC status, for servers
    not built by GrpcServer (which wraps handlers once, at registration, instead)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        return wrap_method_handler(await continuation(handler_call_details))  # type: ignore[no-any-return]
