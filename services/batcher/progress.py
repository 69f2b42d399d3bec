"""Progress and partial outputs of running items: what a model reports while a batch computes, and
how it reaches the work stream without one message per step.

A model that reports progress takes a `ProgressReporter` (a torch module whose `forward` has a
`progress` parameter gets one; see TorchBackend) and calls `progress.report(row, fraction=...,
message=..., outputs={...})` for any row of its batch, as often as it likes, from its worker
thread. Each row belongs to one item (one job), and items report independently: an item of
several rows reports the mean of its rows' latest fractions, with the message and partial outputs
of its latest report. Partial outputs are the outputs so far: each report replaces the last (a
model that streams pieces reports everything it has, as minilm-l6-doc reports every window's
embedding so far), so whatever report a reader gets is whole.

Cancellation: a job cancelled while its batch runs cannot be taken out of the batch, but a model
that reports progress can stop working on it: `progress.cancelled(row)` turns True once the row's
item was cancelled or timed out (its channel's `cancel`: from the work session on the scheduler's
cancel, from the model's queue at the item's execution timeout), as Triton's Python backend
offers `request.is_cancelled()`. The row's outputs are then dropped, so a model that stops early
may leave them as they are.

Rate limit: an item's reports go to its channel (`ItemProgress`), which keeps only the latest and
hands it on, on the event loop, at most once per `interval_s`; the one waiting when the item ends
goes at once, before its result (`close`). A report costs the model's thread a lock and, at most
once per interval, a call_soon_threadsafe. Partial outputs over `batcher.progress_max_bytes` are left
out of the report, which the batcher logs at most once a minute (`LeftOutLog`); a pipeline step's
are left out always (they are not the pipeline's outputs), unlogged. A re-run of the item (poison isolation re-runs a failed
batch in halves) reports again from the start.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from asyncinfer.log_throttle import Throttle
from asyncinfer.tensors import Tensor

log = structlog.get_logger("asyncinfer.batcher.progress")

# A report's message is a status line: longer ones are cut to this many characters. A 6 MB message
# rode into the job's record and made it unreadable (GetJob over gRPC's 4 MiB), and a 9 MB one
# (over NATS's max_payload) failed the terminal write until the job's lease lapsed: a computed
# result lost. Partial outputs have their own limit (`batcher.progress_max_bytes`).
MAX_MESSAGE_CHARS = 1024
# Partial outputs left out (too large) are said at most once per this long (`LeftOutLog`).
LEFT_OUT_LOG_S = 60.0


class LeftOutLog:
    """The line saying that partial outputs were left out (past batcher.progress_max_bytes), at
    most once per LEFT_OUT_LOG_S with how many items' were held back: a model whose outputs are
    always too large logged it once per job, at the batcher's throughput."""

    def __init__(self, interval_s: float = LEFT_OUT_LOG_S) -> None:
        self._throttle = Throttle(interval_s)
        self._lock = threading.Lock()  # called from the models' threads

    def __call__(self, max_bytes: int) -> None:
        with self._lock:
            held_back = self._throttle.allow(max_bytes)
        if held_back is not None:
            more = {"more_since_last": held_back} if held_back else {}
            log.warning("progress_outputs_left_out", max_bytes=max_bytes, **more)


@dataclass(frozen=True, slots=True)
class ProgressUpdate:
    """One report as it leaves the batcher: `step` counts the item's reports sent, from 1."""

    step: int
    fraction: float | None
    message: str
    outputs: tuple[Tensor, ...]


Deliver = Callable[[ProgressUpdate], None]


class ItemProgress:
    """One item's progress channel: the latest report waits here and goes to `deliver` (called
    on the event loop) at most once per `interval_s`."""

    __slots__ = (
        "_cancelled",
        "_closed",
        "_deliver",
        "_interval_s",
        "_last_sent",
        "_left_out",
        "_lock",
        "_loop",
        "_max_bytes",
        "_parent",
        "_pending",
        "_scheduled",
        "_step",
        "_timer",
        "_warned",
    )

    def __init__(
        self,
        deliver: Deliver,
        *,
        interval_s: float,
        max_bytes: int,
        loop: asyncio.AbstractEventLoop | None = None,
        parent: ItemProgress | None = None,
        left_out: Callable[[int], None] | None = None,
    ) -> None:
        self._deliver = deliver
        # Told (once per item, with max_bytes) that a report's partial outputs were left out, from the
        # model's thread; None: left out silently (a pipeline step's, which are not the pipeline's).
        self._left_out = left_out
        # A pipeline step's channel: cancelled when the pipeline's item is.
        self._parent = parent
        self._cancelled = False
        self._interval_s = interval_s
        self._max_bytes = max_bytes
        self._loop = loop or asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._pending: tuple[float | None, str, tuple[Tensor, ...]] | None = None
        self._scheduled = False
        self._closed = False
        self._step = 0
        self._last_sent = -float("inf")
        self._timer: asyncio.TimerHandle | None = None
        self._warned = False

    @property
    def steps_sent(self) -> int:
        return self._step

    @property
    def cancelled(self) -> bool:
        """Whether the item was cancelled while it runs (read from the model's thread: a plain
        attribute, set once)."""
        return self._cancelled or (self._parent is not None and self._parent.cancelled)

    def cancel(self) -> None:
        """The item's job was cancelled, or ran past its execution timeout, while its batch runs
        (on the event loop)."""
        self._cancelled = True

    def offer(self, fraction: float | None, message: str, outputs: tuple[Tensor, ...]) -> None:
        """Keeps the report as the latest (any thread); schedules its sending if none is."""
        if outputs and sum(t.nbytes for t in outputs) > self._max_bytes:
            if not self._warned and self._left_out is not None:
                self._warned = True
                self._left_out(self._max_bytes)
            outputs = ()
        with self._lock:
            if self._closed:
                return
            self._pending = (fraction, message, outputs)
            if self._scheduled:
                return
            self._scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: the batcher is gone
            self._loop.call_soon_threadsafe(self._schedule)

    def _schedule(self) -> None:
        if self._closed:
            return
        delay_s = self._last_sent + self._interval_s - self._loop.time()
        if delay_s > 0:
            self._timer = self._loop.call_later(delay_s, self._flush)
        else:
            self._flush()

    def _flush(self) -> None:
        self._timer = None
        with self._lock:
            pending, self._pending = self._pending, None
            self._scheduled = False
        if pending is None:
            return
        self._step += 1
        self._last_sent = self._loop.time()
        fraction, message, outputs = pending
        try:
            self._deliver(ProgressUpdate(self._step, fraction, message, outputs))
        except Exception:
            log.exception("progress_delivery_failed")

    def close(self) -> None:
        """The item ended: the report still waiting goes now (on the event loop), later ones are
        dropped. Idempotent."""
        if self._closed:
            return
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._closed = True
        self._flush()


class ProgressReporter:
    """What a model gets for one batch: `report(row, ...)` for a row of it. Rows of items that no
    one listens to (standalone inference) cost a lookup."""

    __slots__ = ("_fractions", "_rows")

    def __init__(self, items: Sequence[tuple[ItemProgress | None, int]]) -> None:
        # Per row: its item's channel, the item's first row in this batch, and its row count.
        self._rows: list[tuple[ItemProgress | None, int, int]] = []
        for channel, rows in items:
            first = len(self._rows)
            self._rows.extend((channel, first, rows) for _ in range(rows))
        self._fractions = [0.0] * len(self._rows)

    @property
    def rows(self) -> int:
        return len(self._rows)

    def report(
        self,
        row: int,
        fraction: float | None = None,
        message: str = "",
        outputs: Mapping[str, Any] | None = None,
    ) -> None:
        """Reports `row`'s progress: `fraction` 0..1 (None: unknown), a short message, and its
        partial outputs so far (name -> tensor or array, this row's alone, any shape)."""
        # Checked here, in the model's thread, so that a mistake fails the model's call with what
        # is wrong (it was a traceback on the event loop per report, or a bare IndexError).
        if isinstance(row, bool) or not isinstance(row, int | np.integer) or not 0 <= row < len(self._rows):
            raise IndexError(f"progress.report: row {row!r} is not a row of this batch (0 to {len(self._rows) - 1})")
        if not isinstance(message, str):
            raise TypeError(f"progress.report: message must be a str, not {type(message).__name__}")
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 1] + "\u2026"
        channel, first, rows = self._rows[row]
        if channel is None:
            return
        if fraction is not None:
            fraction = _fraction(fraction)
            if rows > 1:
                self._fractions[row] = fraction
                fraction = sum(self._fractions[first : first + rows]) / rows
        tensors = tuple(Tensor.from_numpy(name, _output_array(name, value)) for name, value in (outputs or {}).items())
        channel.offer(fraction, message, tensors)

    def cancelled(self, row: int) -> bool:
        """Whether `row`'s job was cancelled while this batch runs: a model may stop working on it
        (its outputs are dropped). False for rows no one listens to."""
        channel = self._rows[row][0]
        return channel is not None and channel.cancelled

    def report_all(self, fraction: float | None = None, message: str = "") -> None:
        """The same progress for every row (a model whose rows advance together)."""
        for row in range(len(self._rows)):
            self.report(row, fraction, message)


def _fraction(value: Any) -> float:
    """A reported fraction as a float clamped to 0..1. Text is refused though float() parses it
    ("0.5" is a mistake in the model, not a number), and NaN, which the clamp keeps (max and min
    compare False with it): it went out as it was, read as unknown, and one NaN row made its job's
    mean of rows unknown until that row reported again."""
    if isinstance(value, str | bytes | bytearray):
        raise TypeError(f"progress.report: fraction must be a number, not {value!r:.40}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"progress.report: fraction must be a number, not {value!r:.40}") from None
    if math.isnan(number):
        raise ValueError("progress.report: fraction must be a number from 0 to 1, not nan")
    return min(max(number, 0.0), 1.0)


def _host_array(value: Any) -> np.ndarray[Any, Any]:
    """A numpy copy of a torch tensor (on any device) or array-like, read now: the model may
    change its own buffers after it reports."""
    detach = getattr(value, "detach", None)
    if detach is not None:
        return np.array(detach().to("cpu").numpy())
    return np.array(value)


def _output_array(name: str, value: Any) -> np.ndarray[Any, Any]:
    """`_host_array`, refusing what no output type holds (an object that is not text arrived as
    its repr, b'<object object at 0x...>')."""
    array = _host_array(value)
    if array.dtype == object and not all(isinstance(element, str | bytes) for element in array.flat):
        raise TypeError(f"progress.report: output {name!r} must be numbers or text, not {type(value).__name__}")
    return array
