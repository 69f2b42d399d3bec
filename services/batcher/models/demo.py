"""The demo model: tiny, deterministic and fast, for tests, demos and smoke checks.

Signature (see `asyncinfer.config.DEMO_MODEL`): FP32 input `x` of shape [-1, 4] -> FP32 output `y`
of shape [-1, 4], with y = 2 * x + 1 element-wise (`build_demo_v2_model`, a second version: y = 3x + 1). Variants with the same signature let tests
exercise other paths: `build_failing_model` raises in forward (model errors),
`build_flaky_model` (the `flaky` model `asyncinfer up` serves, `asyncinfer.config.FLAKY_MODEL`)
raises only when a row's first value is negative, so that anyone can make a dead letter on demand,
`build_slow_model` takes SLOW_MODEL_DELAY_S per batch (work still computing at shutdown), and
`build_gated_model` computes only while the process-wide GATE is set (tests hold a batch in
flight with it, so that the next items stay queued), and `build_progress_model` reports its
progress a thousand times per item (services.batcher.progress).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from services.batcher.progress import ProgressReporter

FAILING_MODEL_MESSAGE = "the failing demo model always fails"
FLAKY_MODEL_MESSAGE = "the flaky sample model fails on demand: a row of x starts with a negative number"
SLOW_MODEL_DELAY_S = 0.3
GATE = threading.Event()
GATE.set()
GATE_TIMEOUT_S = 30.0
# Set as a gated computation starts (tests wait for it: a batch is then in flight, not only queued).
GATE_ENTERED = threading.Event()


class AffineDemo(torch.nn.Module):
    """y = 2x + 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * x + 1.0


class FailingDemo(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(FAILING_MODEL_MESSAGE)


class FlakyDemo(AffineDemo):
    """y = 2x + 1, unless a row's first value is negative: then the batch raises (a MODEL_ERROR,
    retriable; the batcher reruns the batch's jobs apart, so only the jobs with such a row fail)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] < 0).any()):
            raise RuntimeError(FLAKY_MODEL_MESSAGE)
        return super().forward(x)


class SlowDemo(AffineDemo):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLOW_MODEL_DELAY_S)
        return super().forward(x)


class GatedDemo(AffineDemo):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        GATE_ENTERED.set()
        GATE.wait(GATE_TIMEOUT_S)
        return super().forward(x)


# Batches the counting model has computed in this process (tests: a warm-up is one of them).
COUNTED_BATCHES: list[int] = []


class CountingDemo(AffineDemo):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        COUNTED_BATCHES.append(int(x.shape[0]))
        return super().forward(x)


class AffineDemoV2(torch.nn.Module):
    """Version 2 of the demo model (docs/MODEL_VERSIONS.md): the same signature, y = 3x + 1, so
    that a job's outputs say which version ran it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 3.0 * x + 1.0


def build_demo_model() -> torch.nn.Module:
    return AffineDemo()


def build_demo_v2_model() -> torch.nn.Module:
    return AffineDemoV2()


def build_failing_model() -> torch.nn.Module:
    return FailingDemo()


def build_flaky_model() -> torch.nn.Module:
    return FlakyDemo()


def build_slow_model() -> torch.nn.Module:
    return SlowDemo()


def build_gated_model() -> torch.nn.Module:
    return GatedDemo()


def build_counting_model() -> torch.nn.Module:
    return CountingDemo()


PROGRESS_STEPS = 1000
PROGRESS_STEP_S = 0.001


class ProgressDemo(AffineDemo):
    """y = 2x + 1, computed in PROGRESS_STEPS steps of about PROGRESS_STEP_S each, reporting every
    row's progress at every step with a partial output `step` (INT64 [1]): a model that reports far
    more often than progress is sent (tests count what reaches a watcher). It stops early once
    every row's job was cancelled (`progress.cancelled`)."""

    def forward(self, x: torch.Tensor, progress: ProgressReporter | None = None) -> torch.Tensor:
        for step in range(1, PROGRESS_STEPS + 1):
            time.sleep(PROGRESS_STEP_S)
            if progress is not None and all(progress.cancelled(row) for row in range(x.shape[0])):
                break
            if progress is not None:
                done = np.array([step], dtype=np.int64)
                for row in range(x.shape[0]):
                    progress.report(
                        row,
                        fraction=step / PROGRESS_STEPS,
                        message=f"step {step} of {PROGRESS_STEPS}",
                        outputs={"step": done},
                    )
        return super().forward(x)


def build_progress_model() -> torch.nn.Module:
    return ProgressDemo()
