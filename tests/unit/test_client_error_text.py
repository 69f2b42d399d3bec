"""What an SDK error reads as (its str: the last line of a traceback, a log's message)."""

from __future__ import annotations

import grpc
import pytest

from asyncinfer.client.errors import FieldViolation, InvalidArgumentError

pytestmark = pytest.mark.unit


def test_a_violation_the_message_already_says_is_not_said_again() -> None:
    """The first-hour pass, session 32: `client.run("demo", {"x": [1, 2, 3]})` raised
    `INVALID_ARGUMENT: invalid request: inputs[0].shape: input 'x' must have shape [-1, 4] (-1: any),
    got [3]` and then the same `inputs[0].shape: ...` again on its own line, as the CLI did before
    session 28 (report_error says each once). The violations the message does not say still follow."""
    message = "invalid request: inputs[0].name: unknown input 'y'; the model takes: x"
    error = InvalidArgumentError(
        message,
        code=grpc.StatusCode.INVALID_ARGUMENT,
        violations=(
            FieldViolation("inputs[0].name", "unknown input 'y'; the model takes: x"),
            FieldViolation("inputs", "missing input 'x' (FP32 of shape [-1, 4])"),
        ),
    )
    assert str(error) == f"INVALID_ARGUMENT: {message}\n  inputs: missing input 'x' (FP32 of shape [-1, 4])"
    assert len(error.violations) == 2  # the fields themselves are all kept


def test_a_violation_whose_description_the_message_is_said_once() -> None:
    """A refused page token: the gateway's message is the violation's description, which names
    the field (`invalid page_token: not a token from ListJobs`, field page_token); the text said
    it again as `page_token: invalid page_token: not a token from ListJobs` on a line of its own.
    A description the message holds without naming the field still follows, with its field."""
    message = "invalid page_token: not a token from ListJobs"
    error = InvalidArgumentError(
        message,
        code=grpc.StatusCode.INVALID_ARGUMENT,
        reason="INVALID_PAGE_TOKEN",
        violations=(FieldViolation("page_token", message),),
    )
    assert str(error) == f"INVALID_ARGUMENT INVALID_PAGE_TOKEN: {message}"
    unnamed = InvalidArgumentError(
        "must be positive",
        code=grpc.StatusCode.INVALID_ARGUMENT,
        violations=(FieldViolation("page_size", "must be positive"),),
    )
    assert str(unnamed) == "INVALID_ARGUMENT: must be positive\n  page_size: must be positive"
