"""Runs an asyncinfer service (`python -m services.cli ...` of the tree in the working directory)
under cProfile, off until SIGUSR1, written to the path given on SIGUSR2 (used by
bench/batcher_cpu_per_job.py to profile the measured jobs only; the event loop's thread alone).

    python bench/profiled_service.py OUT.prof batcher --config batcher.toml
"""

from __future__ import annotations

import cProfile
import os
import runpy
import signal
import sys

profile = cProfile.Profile()
out = sys.argv[1]


def start(*_: object) -> None:
    profile.enable()


def stop(*_: object) -> None:
    profile.disable()
    profile.dump_stats(f"{out}.part")
    os.replace(f"{out}.part", out)  # whole when its reader sees it


signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, stop)
# The tree in the working directory, not this file's folder, is what runs.
sys.path[0] = os.getcwd()
sys.argv = ["services.cli", *sys.argv[2:]]
runpy.run_module("services.cli", run_name="__main__", alter_sys=True)
