"""The one way a measured duration is written for a person: the CLI's text (`get`, `stats`, `watch`,
the batch lines and progress bars) and the console's pages.

The rule (README, "The command line"), by the duration rounded as shown:
- under 10 ms: milliseconds to a tenth (`0.4 ms`, `7.5 ms`); under 1 s: whole milliseconds (`650 ms`);
- under 10 s: seconds to a hundredth (`6.25 s`); under a minute: to a tenth (`42.5 s`), so three
  significant figures below a minute, where a person compares runs;
- under an hour: minutes and seconds (`1m 05s`); under a day: hours and minutes (`2h 03m`); then
  days and hours (`3d 04h`): two units, the second zero-padded, the rest rounded off.
An estimate (a time left, an ETA) claims no more than the second: under a minute it is whole seconds
(`8 s`), then as above. None (not known) is `-`; a negative duration (clocks apart) is 0. The CLI's --json keeps seconds as
numbers, and a setting echoed back (`--timeout 30 s`, `retry after 5 s`) is written as it was given:
the rule is for durations measured or estimated.
"""

from __future__ import annotations

MINUTE_S = 60
HOUR_S = 60 * MINUTE_S
DAY_S = 24 * HOUR_S


def duration_text(seconds: float | None, *, estimate: bool = False) -> str:
    """`seconds` as the CLI and the console write a duration (the module's rule); `estimate`: one
    foreseen (a time left), to the whole second under a minute."""
    if seconds is None:
        return "-"
    value = max(float(seconds), 0.0)
    whole = round(value)
    if estimate:
        if whole < MINUTE_S:
            return f"{whole} s"
    elif round(value, 1) < MINUTE_S:
        ms = value * 1000
        if round(ms, 1) < 10:
            return f"{ms:.1f} ms"
        if round(ms) < 1000:
            return f"{ms:.0f} ms"
        return f"{value:.2f} s" if round(value, 2) < 10 else f"{value:.1f} s"
    if whole < HOUR_S:
        return f"{whole // MINUTE_S}m {whole % MINUTE_S:02d}s"
    minutes = round(value / MINUTE_S)
    if minutes < DAY_S // MINUTE_S:
        return f"{minutes // 60}h {minutes % 60:02d}m"
    hours = round(value / HOUR_S)
    return f"{hours // 24}d {hours % 24:02d}h"
