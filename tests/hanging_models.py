"""A model that misbehaves on some inputs, loaded by a batcher in a process of its own
(tests/test_services_cli.py, tests/test_model_stuck.py): a row starting with 777 waits an hour (or
for RELEASE), one starting with 555 computes for SLOW_S, one starting with 666
crashes the process (a segfault, as a native extension's bug would), others compute 2x + 1. The
poisoned one (build_poisoned_model) also raises for a whole batch that holds a row starting with
POISON_VALUE, and keeps the first values of every batch it is called with. build_held_loading_model
is a loader held until an in-process test sets LOAD_RELEASE."""

from __future__ import annotations

import ctypes
import threading
import time

import torch

HANG_VALUE = 777.0
CRASH_VALUE = 666.0
SLOW_VALUE = 555.0
SLOW_S = 1.5
# Set by an in-process test to let a hung call return (in a process of its own, nothing sets it).
RELEASE = threading.Event()


class HangingDemo(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] == HANG_VALUE).any()):
            RELEASE.wait(3600)
        if bool((x[:, 0] == SLOW_VALUE).any()):
            time.sleep(SLOW_S)
        if bool((x[:, 0] == CRASH_VALUE).any()):
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        return 2.0 * x + 1.0


def build_hanging_model() -> torch.nn.Module:
    return HangingDemo()


POISON_VALUE = 999.0
# The first values of the rows of each batch the poisoned model was called with, in this process.
POISONED_CALLS: list[list[float]] = []


class PoisonedDemo(HangingDemo):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        POISONED_CALLS.append([float(v) for v in x[:, 0]])
        if bool((x[:, 0] == POISON_VALUE).any()):
            raise ValueError("a poison row in this batch")
        return super().forward(x)


def build_poisoned_model() -> torch.nn.Module:
    return PoisonedDemo()


SLOW_LOAD_S = 0.4


def build_slow_loading_model() -> torch.nn.Module:
    time.sleep(SLOW_LOAD_S)  # a loader reading large weights
    return HangingDemo()


# A loader held until an in-process test sets LOAD_RELEASE (LOAD_ENTERED says it is held).
LOAD_RELEASE = threading.Event()
LOAD_ENTERED = threading.Event()
LOAD_WAIT_S = 60.0


def build_held_loading_model() -> torch.nn.Module:
    LOAD_ENTERED.set()
    LOAD_RELEASE.wait(LOAD_WAIT_S)
    return HangingDemo()
