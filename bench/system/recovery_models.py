"""The recovery section's model: y = 2x + 1 on FP32 [-1, 4] that sleeps SLEEP_S per batch, so jobs are
still in flight on a batcher (or a scheduler) when the bench kills it."""

from __future__ import annotations

import time

import torch

SLEEP_S = 0.2


class SleepyAffine(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_S)
        return 2.0 * x + 1.0


def build_sleep_model() -> torch.nn.Module:
    return SleepyAffine()
