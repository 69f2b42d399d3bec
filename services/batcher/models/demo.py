"""The demo model: tiny, deterministic and fast, for tests, demos and smoke checks.

Signature (see `asyncinfer.config.DEMO_MODEL`): FP32 input `x` of shape [-1, 4] -> FP32 output `y`
of shape [-1, 4], with y = 2 * x + 1 element-wise. Two variants with the same signature let tests
exercise other paths: `build_failing_model` raises in forward (model errors), and
`build_slow_model` takes SLOW_MODEL_DELAY_S per batch (work still computing at shutdown).
"""

from __future__ import annotations

import time

import torch

FAILING_MODEL_MESSAGE = "the failing demo model always fails"
SLOW_MODEL_DELAY_S = 0.3


class AffineDemo(torch.nn.Module):
    """y = 2x + 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * x + 1.0


class FailingDemo(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(FAILING_MODEL_MESSAGE)


class SlowDemo(AffineDemo):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLOW_MODEL_DELAY_S)
        return super().forward(x)


def build_demo_model() -> torch.nn.Module:
    return AffineDemo()


def build_failing_model() -> torch.nn.Module:
    return FailingDemo()


def build_slow_model() -> torch.nn.Module:
    return SlowDemo()
