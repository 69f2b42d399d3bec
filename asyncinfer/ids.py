"""Time-sortable job IDs (UUIDv7, RFC 9562): 48 bits of Unix milliseconds, then randomness.

IDs sort by creation time as strings, so "newest first" listings and NATS key order need no
extra index. A counter in the random bits keeps IDs made in the same millisecond ordered.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

_lock = threading.Lock()
_last_ms = 0
_counter = 0
# Random bytes drawn from the OS a few kilobytes at a time rather than twice per ID: each draw is
# a system call, and on a busy gateway a system call is where its thread gives way to another.
_POOL_BYTES = 4096
_pool = b""
_pool_at = 0


def _reset_pool() -> None:
    """A forked child draws its own bytes (it must not make the IDs its parent makes)."""
    global _pool, _pool_at
    _pool, _pool_at = b"", 0


os.register_at_fork(after_in_child=_reset_pool)


def _random_int(size: int) -> int:
    """`size` random bytes as an int (under _lock)."""
    global _pool, _pool_at
    if _pool_at + size > len(_pool):
        _pool, _pool_at = os.urandom(_POOL_BYTES), 0
    start, _pool_at = _pool_at, _pool_at + size
    return int.from_bytes(_pool[start:_pool_at], "big")


def new_job_id() -> str:
    global _last_ms, _counter
    with _lock:
        now_ms = time.time_ns() // 1_000_000
        if now_ms > _last_ms:
            _last_ms = now_ms
            _counter = _random_int(2) & 0x7FF  # leave room to count up
        else:
            _counter += 1
            if _counter > 0xFFF:  # 4096 IDs in one millisecond: borrow the next one
                _last_ms += 1
                _counter = 0
        ms, counter = _last_ms, _counter
        rand_b = _random_int(8) & ((1 << 62) - 1)
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | counter << 64 | 0b10 << 62 | rand_b
    # str(uuid.UUID(int=value)), without UUID's validation (the value is well formed by construction).
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def is_job_id(text: str) -> bool:
    try:
        parsed = uuid.UUID(text)
    except ValueError:
        return False
    return parsed.version == 7 and str(parsed) == text


def job_id_time_ms(job_id: str) -> int:
    return uuid.UUID(job_id).int >> 80
