"""A model table given as JSON: KServe's RepositoryModelLoad `parameters.config`, OpsService
LoadModel's `config_json`. Parsed where it arrives (the scheduler refuses a bad one at once, rather
than each batcher answering it), and by the batcher that loads it."""

from __future__ import annotations

import json
from typing import Any

from asyncinfer.errors import FieldViolation, InvalidArgument


def parse_model_json(text: str, field: str = "config") -> dict[str, Any]:
    """The JSON object `text` holds; InvalidArgument naming `field` when it holds none."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{field} is not JSON: {exc}", [FieldViolation(field, str(exc))]) from None
    except (ValueError, RecursionError) as exc:
        # Valid JSON that Python will not read: an integer of more than 4,300 digits, or arrays
        # nested some thousand deep (both escaped as UNKNOWN, and left a LoadModel unanswered).
        # Python's own message for the integer advises sys.set_int_max_str_digits(), which is no
        # advice to the caller of an API.
        reason = "nested too deeply" if isinstance(exc, RecursionError) else "holds a number too long to read"
        raise InvalidArgument(f"{field} cannot be read: {reason}", [FieldViolation(field, reason)]) from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{field} must be a JSON object", [FieldViolation(field, "give a model table")])
    return data
