"""`submit -i NAME=VALUE`: values are JSON, and for a text (BYTES) input a value that is not JSON
is the text itself (`-i text=hello`), which before was 'not valid JSON'."""

from __future__ import annotations

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
