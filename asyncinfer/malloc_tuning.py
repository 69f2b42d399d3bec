"""glibc malloc's settings for a serving process: large buffers are reused, not mapped afresh.

The services move tensors of megabytes (a batch chunk of the MLP is 4 MiB in and 4 MiB out, copied
several times between NATS, protobuf, numpy and gRPC). glibc serves an allocation over its mmap
threshold with a fresh mapping and returns it to the kernel when freed, and trims its heap whenever
more than its trim threshold lies free at the top; both thresholds start at 128 KiB and only grow
with what the process has freed. So a service that holds a few such buffers at once and frees them
together gives their memory back and takes it again for the next ones: every 4 KiB page of a fresh
buffer is a page fault on its first touch, about 5 us of system time each on the project's 2-core
VMs (1,024 faults, ~6 ms, per fresh 4 MiB). Measured on an MLP file batch of 100,000 records, three
rounds alternated with the code before (bench/results/batch_files_ab.md, medians): the scheduler
took 265,519 faults and 4.13 CPU-s, with these settings 31,267 and 3.27; the batcher 156,394 and
40,709. The gateway took ~73,000 faults during the 200 MB upload without them, ~8,000 with them.
Where messages are small (the no-op job bursts and round trips of bench/system/ab.py, 6 alternated
rounds, bench/results/ab_malloc_only_2.md) nothing measurable changed: with/without 0.96-1.00 in
jobs/s and round trip, 0.98-1.03 in CPU per job.

The cost: up to TRIM_THRESHOLD_BYTES of freed memory may stay in each malloc arena instead of going
back to the kernel, so a service's RSS keeps its peak after a burst of large messages (it does not
grow with the work done: what is freed is reused). Elsewhere than glibc (musl, macOS) nothing is
changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# Allocations below this come from the heap, whatever was freed before: a work message's tensors
# (up to a chunk of several MiB) are reused memory.
MMAP_THRESHOLD_BYTES = 64 * 1024 * 1024
# The heap's free top is given back to the kernel only past this.
TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024


def keep_large_buffers() -> bool:
    """Sets the thresholds above for this process; False where the C library is not glibc or
    refused a setting. Call once, at start-up (later allocations follow it)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    mmap_set = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    trim_set = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    return bool(mmap_set and trim_set)
