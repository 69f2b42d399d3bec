"""A model whose every row's output is 17 M floats (68 MB), past what one WorkerService stream
message may carry with the default limits (tests/test_batcher_results.py)."""

from __future__ import annotations

import torch

ROW_FLOATS = 17 * 1024 * 1024


class HugeOutput(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros((x.shape[0], ROW_FLOATS), dtype=torch.float32)


def build_huge_output_model() -> torch.nn.Module:
    return HugeOutput()
