"""Rewrapping a gRPC method handler's behaviour, whatever its kind: the one dispatch over the four
kinds (unary or streaming requests and responses) that the error mapping, the key check and the
RPC metrics each wrap handlers with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

# (the handler's attribute, the factory that makes one of that kind, whether requests stream,
# whether responses stream)
KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler, False, False),
    ("stream_unary", grpc.stream_unary_rpc_method_handler, True, False),
    ("unary_stream", grpc.unary_stream_rpc_method_handler, False, True),
    ("stream_stream", grpc.stream_stream_rpc_method_handler, True, True),
)

# wrap(behaviour, requests stream, responses stream) -> the new behaviour
Wrap = Callable[[Any, bool, bool], Any]


def rewrap(handler: Any, wrap: Wrap, *, request_deserializer: Callable[[Any], Any] | None = None) -> Any:
    """The same method handler with wrap(behaviour, ...) as its behaviour (None stays None), and
    request_deserializer in place of its own when given."""
    if handler is None:
        return None
    for attr, make, streaming_requests, streaming_responses in KINDS:
        behavior = getattr(handler, attr)
        if behavior:
            return make(
                wrap(behavior, streaming_requests, streaming_responses),
                request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler
