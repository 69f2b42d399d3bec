"""A google.protobuf.Duration a caller sent, checked as the protobuf spec defines one: at most
10,000 years, nanos below one second and of the seconds' sign. `ToNanoseconds()` takes any pair,
so seconds 5 with nanos -900,000,000 (0.1 s) passed where SubmitJob refused it."""

from __future__ import annotations

from google.protobuf import duration_pb2

from asyncinfer.errors import FieldViolation

DURATION_MAX_S = 315_576_000_000
NANOS = 1_000_000_000


def checked_duration(duration: duration_pb2.Duration, field: str, violations: list[FieldViolation]) -> float | None:
    """Its seconds, or None with a violation of `field` added."""
    seconds, nanos = duration.seconds, duration.nanos
    value = seconds + nanos / 1e9
    if abs(value) > DURATION_MAX_S or abs(nanos) >= NANOS or (seconds > 0 > nanos) or (seconds < 0 < nanos):
        violations.append(
            FieldViolation(
                field,
                f"not a valid duration (seconds {seconds}, nanos {nanos}): at most {DURATION_MAX_S} s, "
                "nanos below one second and of the same sign",
            )
        )
        return None
    return value
