"""What the CLI's request values (-i, a request file, a bulk line) are refused for, and in what words.

A null (JSON's null, Python's None) where an input takes numbers or booleans is refused, naming
the input and what it takes, in the CLI's -i (and a request file's and a bulk line's inputs, which
the same conversion types), a JSONL batch line and the SDK alike. The CLI's numpy conversion made it
NaN for FP32 and False for BOOL: `asyncinfer submit demo -i 'x=[[1,2,3,null]]'` queued a job that
ran on NaN (exit 0), where a JSONL batch line refused it ("must be FP32 numbers within its range")
and the SDK said "holds no one numpy type". Found by a first-hour pass (session 38), with numpy's
own words for the CLI's other values it cannot convert, which now say what the input takes too, and
Python's for a request file's fields ("bad request field: 'URGENT' is not a valid Priority"), which
now name the field, its value and what it takes."""

from __future__ import annotations

import numpy as np
import pytest

from asyncinfer.batch_inputs import ErrorLine, parse_line
from asyncinfer.commands.inputs import Signatures, request_from_json, to_array
from asyncinfer.commands.output import UsageError
from asyncinfer.jobs import Priority
from asyncinfer.tensors import ModelSignature, TensorSpec, untyped_reason

pytestmark = pytest.mark.unit

FLOATS = TensorSpec("x", "FP32", (-1, 4))
FLAGS = TensorSpec("on", "BOOL", (-1, 2))


def refusal(name: str, value: object, spec: TensorSpec, datatype: str | None = None) -> str:
    with pytest.raises(UsageError) as refused:
        to_array(name, value, spec=spec, datatype=datatype)
    return str(refused.value)


def test_the_cli_refuses_a_null_for_numbers_or_booleans_naming_what_the_input_takes() -> None:
    assert refusal("x", [[1, 2, 3, 4], [1, 2, 3, None]], FLOATS) == (
        "input 'x' has a null (None in Python), which FP32 cannot hold: give numbers; "
        "the model takes x: FP32 of shape [-1, 4]"
    )
    assert refusal("x", None, FLOATS).startswith("input 'x' has a null (None in Python), which FP32 cannot hold")
    assert refusal("x", [[1, 2, 3, None]], FLOATS, datatype="INT64").startswith(
        "input 'x' has a null (None in Python), which INT64 cannot hold: give numbers; it is given as INT64"
    )
    assert refusal("on", [[True, None]], FLAGS) == (
        "input 'on' has a null (None in Python), which BOOL cannot hold: give booleans (true or false); "
        "the model takes on: BOOL of shape [-1, 2]"
    )
    # What fits is converted as before.
    assert to_array("x", [[1, 2, 3, 4]], spec=FLOATS).tolist() == [[1.0, 2.0, 3.0, 4.0]]


def test_the_clis_other_unconvertible_values_say_what_the_input_takes() -> None:
    """numpy's words alone before: "could not convert string to float: 'a'", and for rows of
    different lengths "setting an array element with a sequence. The requested array has an
    inhomogeneous shape after 1 dimensions. The detected shape was (2,) + inhomogeneous part." """
    takes = "; the model takes x: FP32 of shape [-1, 4]"
    assert refusal("x", [["a", "b", "c", "d"]], FLOATS) == f"input 'x': could not convert string to float: 'a'{takes}"
    assert refusal("x", [[1, 2], [3]], FLOATS) == (
        f"input 'x' is not a rectangular array: its rows are not all the same length{takes}"
    )


def test_a_batch_line_and_the_sdk_name_the_null_in_the_same_words() -> None:
    signature = ModelSignature(inputs=(FLOATS,), outputs=())
    line = parse_line(1, b'{"inputs": {"x": [[1, 2, 3, null]]}}', signature)
    assert isinstance(line, ErrorLine)
    assert line.message == (
        "input 'x' has a null (None in Python), which FP32 cannot hold: give numbers; "
        "the model takes x: FP32 of shape [-1, 4]"
    )
    assert untyped_reason(np.asarray([[1, 2, 3, None]]), "FP32") == (
        "has a null (None in Python), which FP32 cannot hold: give numbers"
    )


def test_a_request_files_field_that_does_not_convert_is_named_with_what_it_takes() -> None:
    def refused(**fields: object) -> str:
        with pytest.raises(UsageError) as refusal:
            request_from_json({"model": "demo", **fields}, signatures=Signatures({}))
        return str(refusal.value)

    assert refused(priority="urgent") == (
        'request field "priority" is "urgent": it takes one of HIGH, NORMAL, LOW (any case)'
    )
    assert refused(queue_ttl_s="abc") == 'request field "queue_ttl_s" is "abc": it takes seconds, a number'
    assert refused(deadline="tomorrow") == (
        'request field "deadline" is "tomorrow": it takes an ISO 8601 time, like 2026-12-07T14:03:21Z'
    )
    # int(2.5) is 2: it was sent as 2 attempts.
    assert refused(max_attempts=2.5) == 'request field "max_attempts" is 2.5: it takes a whole number'
    assert refused(input={"x": [[1, 2, 3, 4]]}).startswith(
        "unknown request fields: input; did you mean 'inputs'? (known: "
    )
    # What converts, as before (a number written as a string too).
    request = request_from_json(
        {"model": "demo", "priority": "high", "queue_ttl_s": "60", "max_attempts": 3.0}, signatures=Signatures({})
    )
    assert (request.priority, request.queue_ttl_s, request.max_attempts) == (Priority.HIGH, 60.0, 3)
