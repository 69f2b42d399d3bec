"""`submit -i NAME=VALUE`: values are JSON, and for a text (BYTES) input a value that is not JSON
is the text itself (`-i text=hello`), which before was 'not valid JSON'."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from asyncinfer.commands.inputs import Signatures, inputs_from_arguments
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
