"""`submit -i NAME=VALUE`: values are JSON, and for a text (BYTES) input a value that is not JSON
is the text itself (`-i text=hello`), which before was 'not valid JSON'."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import pytest

from asyncinfer.commands.inputs import Signatures, inputs_from_arguments, request_from_json
from asyncinfer.commands.jobs import build_request
from asyncinfer.commands.output import UsageError
from asyncinfer.tensors import ModelSignature, TensorSpec

pytestmark = pytest.mark.unit

SIGNATURES = Signatures(
    {
        "embed": ModelSignature(
            inputs=(TensorSpec("text", "BYTES", (-1,)),), outputs=(TensorSpec("e", "FP32", (-1, 3)),)
        ),
        "demo": ModelSignature(inputs=(TensorSpec("x", "FP32", (-1, 4)),), outputs=(TensorSpec("y", "FP32", (-1, 4)),)),
    }
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("hello world", [b"hello world"]),
        ('"quoted"', [b"quoted"]),
        ('["a", "b"]', [b"a", b"b"]),
        ("{not json", [b"{not json"]),
    ],
)
def test_a_text_input_takes_plain_text_or_json(value: str, expected: list[bytes]) -> None:
    arrays = inputs_from_arguments("embed", [f"text={value}"], signatures=SIGNATURES)
    assert arrays["text"].tolist() == expected


def test_plain_text_is_text_only_for_a_text_input() -> None:
    with pytest.raises(UsageError, match="--input x is not valid JSON"):
        inputs_from_arguments("demo", ["x=hello"], signatures=SIGNATURES)
    arrays = inputs_from_arguments("unknown-model", ["t=hello"], signatures=SIGNATURES, datatypes=["t=BYTES"])
    assert arrays["t"].reshape(-1).tolist() == [b"hello"]  # --datatype BYTES says it is text
    assert np.array_equal(inputs_from_arguments("demo", ["x=[1, 2, 3, 4]"], signatures=SIGNATURES)["x"], [[1, 2, 3, 4]])


def test_a_text_file_is_one_text_for_a_text_input(tmp_path: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("a long document\nof two lines")
    arrays = inputs_from_arguments("embed", [f"text=@{doc}"], signatures=SIGNATURES)
    assert arrays["text"].tolist() == [b"a long document\nof two lines"]
    listed = tmp_path / "texts.json"
    listed.write_text('["a", "b"]')
    assert inputs_from_arguments("embed", [f"text=@{listed}"], signatures=SIGNATURES)["text"].tolist() == [b"a", b"b"]
    with pytest.raises(UsageError, match="cannot read"):
        inputs_from_arguments("embed", [f"text=@{tmp_path / 'missing.txt'}"], signatures=SIGNATURES)


def test_booleans_and_numbers_are_not_made_one_another() -> None:
    """np.array([true, 2.5], dtype=float32) is [1.0, 2.5] and np.array([2, 0], dtype=bool) is
    [True, False]: `-i x=[true, 2.5, 0, 1]` ran the model on 1.0, and numbers went to a BOOL input
    as booleans. Both are usage errors now, naming the input; what fits still converts."""
    flags = Signatures(
        {
            "flags": ModelSignature(
                inputs=(TensorSpec("on", "BOOL", (-1, 2)),), outputs=(TensorSpec("y", "FP32", (-1,)),)
            )
        }
    )
    mixed = "input 'x' mixes booleans (true/false) with numbers, which would run as 1 and 0: FP32 takes numbers only"
    with pytest.raises(UsageError, match=f"^{re.escape(mixed)}$"):
        inputs_from_arguments("demo", ["x=[true, 2.5, 0, 1]"], signatures=SIGNATURES)
    with pytest.raises(UsageError, match=r"^input 'x' is FP32: give numbers, not booleans"):
        inputs_from_arguments("demo", ["x=[true, false, true, true]"], signatures=SIGNATURES)
    with pytest.raises(UsageError, match=r"^input 'on' is BOOL: give booleans"):
        inputs_from_arguments("flags", ["on=[2, 0]"], signatures=flags)
    with pytest.raises(UsageError, match=r"^input 'n' is INT64: give numbers"):
        inputs_from_arguments("unknown-model", ["n=[true, false]"], signatures=SIGNATURES, datatypes=["n=INT64"])
    assert inputs_from_arguments("flags", ["on=[true, false]"], signatures=flags)["on"].tolist() == [[True, False]]
    assert inputs_from_arguments("demo", ["x=[1, 0, 2.5, 1]"], signatures=SIGNATURES)["x"].tolist() == [[1, 0, 2.5, 1]]


def test_a_value_its_datatype_would_change_is_refused_naming_the_input_and_what_the_model_takes() -> None:
    """numpy's cast changed what the input's datatype cannot hold, and the CLI sent it as typed:
    `-i 'x=[[1.5,2,3,4]]'` for an INT64 input went as [[1, 2, 3, 4]], 300 for a UINT8 one as 44, -1
    as 255, 1e300 for FP32 as inf, each accepted by the gateway. Each is a usage error now, naming
    the input, the value and what the model takes, for `-i`, a request file's or a bulk line's
    inputs (request_from_json) and a tensor object's own datatype. A whole float (2.0) for an
    integer input was taken by the CLI alone (the SDK and a JSONL batch line refuse it, as Triton's
    JSON and numpy's same_kind casting do): it is refused now too, saying how to write it. A
    float's precision (1.1 as FP32) is a float's."""
    specs = {
        "ids": ("INT64", (-1, 4)),
        "pixels": ("UINT8", (-1, 4)),
        "small": ("INT8", (-1, 4)),
        "x": ("FP32", (-1, 4)),
    }
    typed = Signatures(
        {
            "typed": ModelSignature(
                inputs=tuple(TensorSpec(n, dt, shape) for n, (dt, shape) in specs.items()),
                outputs=(TensorSpec("y", "FP32", (-1,)),),
            )
        }
    )
    refused = {
        "ids=[[1.5, 2, 3, 4]]": "input 'ids' has 1.5, not a whole number: INT64 takes whole numbers; "
        "the model takes ids: INT64 of shape [-1, 4]",
        "ids=[[1e20, 2, 3, 4]]": "input 'ids' has 1e+20, past INT64's range "
        "(-9223372036854775808 to 9223372036854775807); the model takes ids: INT64 of shape [-1, 4]",
        "ids=[[NaN, 2, 3, 4]]": "input 'ids' has nan, which INT64 cannot hold: it takes whole numbers; "
        "the model takes ids: INT64 of shape [-1, 4]",
        "pixels=[[300, 2, 3, 4]]": "input 'pixels' has 300, past UINT8's range (0 to 255); "
        "the model takes pixels: UINT8 of shape [-1, 4]",
        "pixels=[[-1, 2, 3, 4]]": "input 'pixels' has -1, past UINT8's range (0 to 255); "
        "the model takes pixels: UINT8 of shape [-1, 4]",
        "pixels=[[300.0, 2, 3, 4]]": "input 'pixels' has 300.0, past UINT8's range (0 to 255); "
        "the model takes pixels: UINT8 of shape [-1, 4]",
        "small=[[1, 2, 3, 300]]": "input 'small' has 300, past INT8's range (-128 to 127); "
        "the model takes small: INT8 of shape [-1, 4]",
        "x=[[1e300, 2, 3, 4]]": "input 'x' has 1e+300, past FP32's range (±3.4028235e+38); "
        "the model takes x: FP32 of shape [-1, 4]",
        "ids=[[2.0, 2, 3, 4]]": "input 'ids' has 2.0, a float: INT64 takes integers (write 2, not 2.0); "
        "the model takes ids: INT64 of shape [-1, 4]",
        "ids=[[1, 2, 3, 4e0]]": "input 'ids' has 4.0, a float: INT64 takes integers (write 4, not 4.0); "
        "the model takes ids: INT64 of shape [-1, 4]",
        "pixels=[[0, 255, 7.0, 1]]": "input 'pixels' has 7.0, a float: UINT8 takes integers (write 7, not 7.0); "
        "the model takes pixels: UINT8 of shape [-1, 4]",
    }
    for item, message in refused.items():
        with pytest.raises(UsageError, match=f"^{re.escape(message)}$"):
            inputs_from_arguments("typed", [item], signatures=typed)
        name, _, value = item.partition("=")
        with pytest.raises(UsageError, match=f"^{re.escape(message)}$"):  # a request file, a bulk line
            request_from_json({"model": "typed", "inputs": {name: json.loads(value)}}, signatures=typed)
    # The datatype given, not the signature's: --datatype, a tensor object's, a list of tensors.
    given = "input 'n' has 2.5, not a whole number: INT32 takes whole numbers; it is given as INT32"
    with pytest.raises(UsageError, match=f"^{re.escape(given)}"):
        inputs_from_arguments("unknown-model", ["n=[2.5]"], signatures=typed, datatypes=["n=INT32"])
    with pytest.raises(UsageError, match=f"^{re.escape(given)}"):
        inputs_from_arguments("unknown-model", ['n={"datatype": "INT32", "data": [2.5]}'], signatures=typed)
    with pytest.raises(UsageError, match=r"^input 'pixels' has 256, past UINT8's range \(0 to 255\); the model"):
        request_from_json(
            {"model": "typed", "inputs": [{"name": "pixels", "datatype": "UINT8", "shape": [1, 1], "data": [256]}]},
            signatures=typed,
        )
    # Without a signature, floats read as FP32: one past its range says how to name another.
    with pytest.raises(UsageError, match=r"^input 'v' has 1e\+300, past FP32's range .*give --datatype v=TYPE$"):
        inputs_from_arguments("unknown-model", ["v=[1e300]"], signatures=typed)
    # What fits goes as before.
    arrays = inputs_from_arguments(
        "typed",
        [
            "ids=[[2, -3, 4, 9007199254740993]]",
            "pixels=[[0, 255, 7, 1]]",
            "small=[[-128, 127, 0, 1]]",
            "x=[[1.1, 2, 3, 4]]",
        ],
        signatures=typed,
    )
    assert arrays["ids"].dtype == np.int64
    assert arrays["ids"].tolist() == [[2, -3, 4, 9007199254740993]]
    assert arrays["pixels"].dtype == np.uint8
    assert arrays["pixels"].tolist() == [[0, 255, 7, 1]]
    assert arrays["small"].tolist() == [[-128, 127, 0, 1]]
    assert arrays["x"].dtype == np.float32
    assert arrays["x"].tolist() == np.array([[1.1, 2, 3, 4]], np.float32).tolist()
    request = request_from_json({"model": "typed", "inputs": {"ids": [[1, 2, 3, 4]]}}, signatures=typed)
    assert request.inputs is not None
    assert request.inputs["ids"].tolist() == [[1, 2, 3, 4]]


def test_a_value_that_is_not_json_says_what_to_give() -> None:
    """The first-hour pass, session 32: `submit demo -i x=1,2,3,4` said only `--input x is not valid
    JSON: Extra data: line 1 column 2 (char 1)`. Now the bracketed value when that is JSON, what the
    model takes, and the file forms."""
    with pytest.raises(UsageError) as raised:
        inputs_from_arguments("demo", ["x=1,2,3,4"], signatures=SIGNATURES)
    assert str(raised.value) == (
        "--input x is not valid JSON (Extra data: line 1 column 2 (char 1)); did you mean -i 'x=[1,2,3,4]'? "
        "(model 'demo' takes x: FP32 of shape [-1, 4]; -1: any size; or a file: -i x=@array.npy, -i x=@values.json)"
    )
    with pytest.raises(UsageError) as raised:
        inputs_from_arguments("unknown-model", ["x=1 2"], signatures=SIGNATURES)
    assert str(raised.value).endswith(
        "; give a JSON value, as -i 'x=[[1, 2, 3]]' (or a file: -i x=@array.npy, -i x=@values.json)"
    ), raised.value
    assert inputs_from_arguments("demo", ["x=[1,2,3,4]"], signatures=SIGNATURES)["x"].tolist() == [[1, 2, 3, 4]]


@pytest.mark.parametrize(("request_arg", "named"), [("-", "stdin"), ("request.json", "request.json")])
def test_a_request_that_is_not_json_is_refused_naming_where_it_came_from(
    request_arg: str, named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`submit --request FILE` and `--request -` (stdin) read JSON as `-i NAME=@FILE` does."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "request.json").write_text("{not json")
    args = argparse.Namespace(request=request_arg, model="", version="")
    with pytest.raises(UsageError, match=rf"^{re.escape(named)} is not valid JSON: Expecting property name"):
        build_request(args, SIGNATURES, stdin_text="{not json")
