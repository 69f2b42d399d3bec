"""Encode + decode time of the stored types that every job writes: a job record and a work
envelope, with a small inline tensor and with a 1 MB one.

    PYTHONPATH=. python bench/codec_bench.py

Prints one row per case: payload bytes, microseconds per encode, per decode, per both (the best
of several rounds of many calls, so a busy machine shows less noise). Only the public functions
(asyncinfer.jobs.encode_record, ...) are timed, so the same script measures any version of them.

Then what finding a work message's tenant costs the scheduler's fairness: json-loading the whole
message (as it did before the routing headers), reading the header, and the fallback for a message
without the header (the envelope's tenant alone, the rest skipped).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from asyncinfer.codecs.envelope import decode_envelope, encode_envelope
from asyncinfer.codecs.record import decode_record, encode_record
from asyncinfer.jobs import BatchInfo, CallbackSpec, JobRecord, JobState, Priority, WorkEnvelope
from asyncinfer.tensors import Tensor

SMALL = Tensor("x", "FP32", (1, 16), bytes(range(64)))
LARGE = Tensor("x", "FP32", (1, 262144), bytes(1 << 20))  # 1 MiB


def record(outputs: tuple[Tensor, ...]) -> JobRecord:
    return JobRecord(
        job_id="0190a3b4-0000-7000-8000-000000000001",
        tenant="acme",
        model_name="demo",
        model_version="1",
        state=JobState.SUCCEEDED,
        priority=Priority.NORMAL,
        create_time=1_700_000_000.125,
        update_time=1_700_000_000.5,
        max_attempts=3,
        result_retention_s=86400.0,
        attempt=1,
        labels={"team": "search"},
        start_time=1_700_000_000.25,
        end_time=1_700_000_000.5,
        queue_duration_s=0.125,
        run_duration_s=0.25,
        execution_timeout_s=30.0,
        batch=BatchInfo("batcher-1", 8, 0.01),
        outputs=outputs,
        callback=CallbackSpec("https://example.com/hook", ()),
        batcher_id="batcher-1",
    )


def envelope(inputs: tuple[Tensor, ...]) -> WorkEnvelope:
    return WorkEnvelope(
        job_id="0190a3b4-0000-7000-8000-000000000001",
        tenant="acme",
        model_name="demo",
        model_version="1",
        priority=Priority.NORMAL,
        create_time=1_700_000_000.125,
        max_attempts=3,
        inputs=inputs,
        execution_timeout_s=30.0,
    )


def best_us(call: Callable[[], Any], calls: int, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    cases: list[tuple[str, Callable[[], bytes], Callable[[bytes], object], int]] = []
    for label, tensor, calls in (("small tensor", SMALL, 20_000), ("1 MB tensor", LARGE, 30)):
        rec, env = record((tensor,)), envelope((tensor,))
        cases.append((f"record, {label}", lambda rec=rec: encode_record(rec), decode_record, calls))
        cases.append((f"envelope, {label}", lambda env=env: encode_envelope(env), decode_envelope, calls))
    print(f"{'case':<26} {'bytes':>9} {'encode µs':>10} {'decode µs':>10} {'both µs':>10}")
    for name, encode, decode, calls in cases:
        data = encode()
        encode_us = best_us(encode, calls)
        decode_us = best_us(lambda data=data, decode=decode: decode(data), calls)
        print(f"{name:<26} {len(data):>9} {encode_us:>10.2f} {decode_us:>10.2f} {encode_us + decode_us:>10.2f}")
    tenants()


def tenants() -> None:
    try:
        from asyncinfer.codecs.envelope import tenant_of_envelope
        from asyncinfer.contract import TENANT_HEADER, routing_headers
    except ImportError:  # a version from before the routing headers
        return
    print()
    print(f"{'tenant of a work message':<26} {'bytes':>9} {'json µs':>10} {'header µs':>10} {'fallback µs':>11}")
    for label, tensor, calls in (("small tensor", SMALL, 20_000), ("1 MB tensor", LARGE, 100)):
        env = envelope((tensor,))
        data = encode_envelope(env)
        headers = routing_headers(tenant=env.tenant, job_id=env.job_id, priority=env.priority, model_name="demo")
        json_us = best_us(lambda data=data: json.loads(data)["tenant"], calls)
        header_us = best_us(lambda headers=headers: headers.get(TENANT_HEADER), calls)
        fallback_us = best_us(lambda data=data: tenant_of_envelope(data), calls)
        print(f"{'envelope, ' + label:<26} {len(data):>9} {json_us:>10.2f} {header_us:>10.2f} {fallback_us:>11.2f}")


if __name__ == "__main__":
    main()
