"""A model that misbehaves on some inputs, loaded by a batcher in a process of its own
(tests/test_services_cli.py): a row starting with 777 sleeps for an hour, one starting with 666
crashes the process (a segfault, as a native extension's bug would), others compute 2x + 1."""

from __future__ import annotations

import ctypes
import time

import torch

HANG_VALUE = 777.0
CRASH_VALUE = 666.0


class HangingDemo(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] == HANG_VALUE).any()):
            time.sleep(3600)
        if bool((x[:, 0] == CRASH_VALUE).any()):
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        return 2.0 * x + 1.0


def build_hanging_model() -> torch.nn.Module:
    return HangingDemo()


SLOW_LOAD_S = 0.4


def build_slow_loading_model() -> torch.nn.Module:
    time.sleep(SLOW_LOAD_S)  # a loader reading large weights
    return HangingDemo()
