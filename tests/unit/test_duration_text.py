"""One rule for a measured duration in the CLI's text and the console (asyncinfer.duration_text).
Before it, a job's durations were `650 ms` in `asyncinfer get` and `650.0 ms` on its console page,
`stats` wrote an oldest age as `65.0s`, `batch watch` a read's time left as `95s`, `watch` its
elapsed time as `(65.3 s)` and the progress bars `ETA 95s`: five forms for one quantity."""

from __future__ import annotations

import pytest

from asyncinfer.commands.ops import stats_rows
from asyncinfer.duration_text import duration_text
from services.console import html

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "-"),
        (-3.0, "0.0 ms"),  # clocks apart: never a negative duration
        (0.0, "0.0 ms"),
        (0.0004, "0.4 ms"),
        (0.0075, "7.5 ms"),
        (0.00996, "10 ms"),  # rounded as shown: not "10.0 ms"
        (0.65, "650 ms"),
        (0.9996, "1.00 s"),
        (6.254, "6.25 s"),
        (9.996, "10.0 s"),
        (42.46, "42.5 s"),
        (59.96, "1m 00s"),
        (65.0, "1m 05s"),
        (3599.4, "59m 59s"),
        (3599.6, "1h 00m"),
        (7384.0, "2h 03m"),
        (86_399.0, "1d 00h"),
        (273_600.0, "3d 04h"),
    ],
)
def test_a_duration_is_written_by_one_rule(seconds: float | None, text: str) -> None:
    assert duration_text(seconds) == text


@pytest.mark.parametrize("seconds", [0.0042, 0.65, 6.254, 65.0, 7384.0])
def test_the_console_writes_a_duration_as_the_cli_does(seconds: float) -> None:
    assert html.seconds(seconds) == duration_text(seconds)
    assert html.seconds(None) == "-"


def test_stats_writes_the_oldest_age_by_the_rule() -> None:
    queue = {"priority": "NORMAL", "depth": 2, "oldest_age_s": 65.0}
    model = {
        "model_name": "demo",
        "queues": [queue],
        "in_flight": 0,
        "connected_batchers": 0,
        "desired_batchers": 1,
        "free_credits": 0,
        "submitted_per_second": 0.0,
        "completed_per_second": 0.0,
        "paused": False,
        "draining": False,
    }
    headers, rows = stats_rows([model])
    assert rows[0][headers.index("OLDEST")] == "1m 05s"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.3, "0 s"), (8.0, "8 s"), (59.4, "59 s"), (59.6, "1m 00s"), (95.0, "1m 35s"), (None, "-")],
)
def test_an_estimate_claims_no_more_than_the_second(seconds: float | None, text: str) -> None:
    assert duration_text(seconds, estimate=True) == text
