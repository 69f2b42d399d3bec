"""malloc keeps large buffers for reuse in a serving process (asyncinfer.malloc_tuning). Each case
runs in a fresh interpreter: the settings are the whole process's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit

# Eight 4 MiB buffers alive at once, written, freed together, ten times: a work message's tensors
# copied between NATS, protobuf and gRPC, then the next message's. Prints the page faults per round.
ROUNDS = textwrap.dedent(
    """
    import resource, sys
    from asyncinfer.malloc_tuning import keep_large_buffers

    if sys.argv[1] == "tuned":
        assert keep_large_buffers()

    def one_round():
        live = [bytearray(4 << 20) for _ in range(8)]
        for buffer in live:
            buffer[::4096] = b"\\1" * (len(buffer) // 4096)
        del live

    one_round()  # the first round's pages are new in either case
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        one_round()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
    """
)

PAGES_PER_ROUND = 8 * (4 << 20) // 4096


def faults_per_round(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


def test_buffers_freed_together_are_reused_without_new_page_faults() -> None:
    assert faults_per_round("tuned") < PAGES_PER_ROUND / 20


def test_without_the_settings_each_round_faults_its_pages_again() -> None:
    # What the settings are for: glibc's own thresholds give the freed buffers back to the kernel.
    assert faults_per_round("default") > PAGES_PER_ROUND / 2
