"""A model that fails every job until a test lets it succeed (its own module, so that the batcher's
import of the factory and the test share one event: pytest may import a test file under another
module name): a job dead-lettered while the model was broken, run again once it is fixed."""

from __future__ import annotations

import threading

import torch

# Set by the test once the model is "fixed"; cleared by it before the first job.
MAY_SUCCEED = threading.Event()
RECOVERING_MESSAGE = "the recovering model fails until the test lets it succeed"


class RecoveringDemo(torch.nn.Module):
    """y = 2x + 1 once MAY_SUCCEED is set; before, every batch raises (a MODEL_ERROR)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not MAY_SUCCEED.is_set():
            raise RuntimeError(RECOVERING_MESSAGE)
        return 2.0 * x + 1.0


def build_recovering_model() -> torch.nn.Module:
    return RecoveringDemo()
