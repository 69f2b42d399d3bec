"""Errors small enough to travel: a refusal quotes what the caller sent (a model name, a datatype,
a shape), and a request can hold thousands of bad tensors or labels. gRPC carries the status in
trailers (grpc-message, and the details base64-encoded in grpc-status-details-bin), and a client
drops trailers over its metadata limit (8 KiB soft, 16 KiB hard by default): the caller would see
a bare RESOURCE_EXHAUSTED "Stream removed" instead of what was wrong. So every error answered (by
grpc_errors.to_status, and per item of a stream) is
clipped to well under that: the first violations, each clipped, and a count of the rest.
"""

from __future__ import annotations

from collections.abc import Mapping

from asyncinfer.errors import AsyncInferError, FieldViolation, InvalidArgument

MAX_MESSAGE_BYTES = 320
MAX_VIOLATIONS = 8
MAX_FIELD_BYTES = 100
MAX_DESCRIPTION_BYTES = 200
MAX_METADATA_ENTRIES = 16
MAX_METADATA_VALUE_BYTES = 128


def clip_text(text: str, limit_bytes: int) -> str:
    """`text` cut to at most `limit_bytes` of UTF-8 (on a character boundary), marked when cut."""
    encoded = text.encode("utf-8", "surrogatepass")
    if len(encoded) <= limit_bytes:
        return text
    return encoded[: limit_bytes - 3].decode("utf-8", "ignore") + "..."


def bounded_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """The first MAX_METADATA_ENTRIES entries, keys and values clipped."""
    return {
        clip_text(key, MAX_METADATA_VALUE_BYTES): clip_text(value, MAX_METADATA_VALUE_BYTES)
        for key, value in list(metadata.items())[:MAX_METADATA_ENTRIES]
    }


def clip_error(error: AsyncInferError) -> AsyncInferError:
    """The same error (changed in place) with its message, violations and metadata bounded."""
    error.message = clip_text(error.message, MAX_MESSAGE_BYTES)
    error.metadata = bounded_metadata(error.metadata)
    if isinstance(error, InvalidArgument) and error.violations:
        violations = error.violations
        kept = [
            FieldViolation(clip_text(v.field, MAX_FIELD_BYTES), clip_text(v.description, MAX_DESCRIPTION_BYTES))
            for v in violations[: MAX_VIOLATIONS if len(violations) <= MAX_VIOLATIONS else MAX_VIOLATIONS - 1]
        ]
        if len(violations) > MAX_VIOLATIONS:
            rest = len(violations) - len(kept)
            field = violations[len(kept)].field.split(".")[0].split("[")[0]
            kept.append(
                FieldViolation(clip_text(field, MAX_FIELD_BYTES), f"... and {rest} more violations, not listed")
            )
        error.violations = tuple(kept)
    return error
