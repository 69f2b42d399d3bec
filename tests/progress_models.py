"""A model that reports progress and computes until its job is cancelled, loaded by an in-process
batcher (tests/test_pipelines.py): a call for jobs sets STARTED, and ends once every row's job was
cancelled (`progress.cancelled`), setting STOPPED, or once RELEASE is set (a call never told)."""

from __future__ import annotations

import threading

import torch

from services.batcher.progress import ProgressReporter

# Set by a call for jobs (one given a reporter) as it starts. Not by the batcher's warm-up at load,
# which calls without one: that set it before the test's job was even dispatched, and a test that
# waited for it cancelled the job while queued, so no model was there to be told.
STARTED = threading.Event()
# Set by a call that saw every row's job cancelled.
STOPPED = threading.Event()
# Lets a call that is never told return (the test sets it when it ends).
RELEASE = threading.Event()


class UntilCancelled(torch.nn.Module):
    """y = 2x + 1, after reporting a step every 5 ms until its rows' jobs are cancelled."""

    def forward(self, x: torch.Tensor, progress: ProgressReporter | None = None) -> torch.Tensor:
        if progress is not None:
            STARTED.set()
        step = 0
        while progress is not None and not RELEASE.wait(0.005):
            if all(progress.cancelled(row) for row in range(x.shape[0])):
                STOPPED.set()
                break
            step += 1
            progress.report_all(message=f"step {step}")
        return 2.0 * x + 1.0


def build_until_cancelled_model() -> torch.nn.Module:
    return UntilCancelled()


class StartsAtZero(torch.nn.Module):
    """y = 2x + 1, reporting each row at 0 (and nothing else) before it computes: a model that says
    it started."""

    def forward(self, x: torch.Tensor, progress: ProgressReporter | None = None) -> torch.Tensor:
        if progress is not None:
            progress.report_all(fraction=0.0)
        return 2.0 * x + 1.0


def build_starts_at_zero_model() -> torch.nn.Module:
    return StartsAtZero()
