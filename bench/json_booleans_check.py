"""What the look for booleans among a JSONL line's numbers (asyncinfer.tensors.booleans_misplaced,
called by batch_inputs._typed) adds to a line's parse (batch_inputs.parse_line), against the same
parse with the look switched off, alternated in one process. Lines of one FP32 input of N values:
random floats (no 0 or 1, so the converted array alone clears them), and 0.0 and 1.0 alone (each
value is walked). Process CPU time per line, the best of R repeats each way.

    .venv/bin/python -m bench.json_booleans_check [--values 4,512,4096] [--repeats 7]

The figures docs/BATCHES.md quotes: bench/results/json_booleans_check.txt.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from unittest import mock

import numpy as np

from asyncinfer import batch_inputs
from asyncinfer.tensors import ModelSignature, TensorSpec


def _never(*_args: object) -> str:
    """The look switched off (a plain function: a MagicMock's call costs more than the look)."""
    return ""


def per_line_us(parse: Callable[[], object], lines: int) -> float:
    start = time.process_time()
    for _ in range(lines):
        parse()
    return (time.process_time() - start) / lines * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--values", default="4,512,4096", help="values per line, comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for size in (int(v) for v in args.values.split(",")):
        signature = ModelSignature(inputs=(TensorSpec("x", "FP32", (-1, size)),), outputs=())
        contents = {
            "floats": rng.standard_normal(size).tolist(),
            "zeros and ones": [float(i % 2) for i in range(size)],
        }
        lines = max(200_000 // size, 50)
        for name, values in contents.items():
            text = json.dumps({"custom_id": "a", "inputs": {"x": [values]}}).encode()

            def parse(text: bytes = text, signature: ModelSignature = signature) -> object:
                return batch_inputs.parse_line(1, text, signature)

            with_look, without = [], []
            for _ in range(args.repeats):
                with_look.append(per_line_us(parse, lines))
                with mock.patch.object(batch_inputs, "booleans_misplaced", new=_never):
                    without.append(per_line_us(parse, lines))
            best_with, best_without = min(with_look), min(without)
            print(
                f"{size:5d} values, {name:<14} parse {best_without:8.1f} us a line without the look, "
                f"{best_with:8.1f} with it: +{best_with - best_without:6.1f} us "
                f"({(best_with / best_without - 1) * 100:+.0f}%)"
            )


if __name__ == "__main__":
    main()
