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


def new_job_id() -> str:
    global _last_ms, _counter
    with _lock:
        now_ms = time.time_ns() // 1_000_000
        if now_ms > _last_ms:
            _last_ms = now_ms
            _counter = int.from_bytes(os.urandom(2), "big") & 0x7FF  # leave room to count up
        else:
            _counter += 1
            if _counter > 0xFFF:  # 4096 IDs in one millisecond: borrow the next one
                _last_ms += 1
                _counter = 0
        ms, counter = _last_ms, _counter
    rand_b = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
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
