"""The CLI's progress bar (asyncinfer.commands.output.ProgressBar, drawn by rich): drawn at once,
and a resumed run's rate counts only the work done now."""

from __future__ import annotations

import io
import re

import pytest

from asyncinfer.commands.output import ProgressBar

pytestmark = pytest.mark.unit


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True

    def last_frame(self) -> str:
        """The bar as last drawn, without its colours (rich rewrites the line after a carriage return)."""
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", self.getvalue()).rstrip("\n").split("\r")[-1]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_bar_is_drawn_before_anything_is_done() -> None:
    terminal = Terminal()
    ProgressBar("wait  ", 30, terminal, clock=Clock())
    assert terminal.last_frame().startswith("wait   ━")
    assert "0/30" in terminal.last_frame()


def test_skipped_items_show_as_done_but_not_in_the_rate() -> None:
    terminal, clock = Terminal(), Clock()
    bar = ProgressBar("submit", 2_000, terminal, clock=clock)
    bar.skip(1_500)  # done by an earlier run: skipped in no time
    clock.now += 2.0
    bar.advance(100)
    frame = terminal.last_frame()
    assert "1600/2000" in frame
    assert " 50/s" in frame  # 100 in 2 s, not 1,600
    assert "ETA 8 s" in frame  # 400 left at 50/s
    assert " 80%" in frame


def test_closing_leaves_the_last_frame_and_a_new_line() -> None:
    terminal, clock = Terminal(), Clock()
    bar = ProgressBar("wait  ", 2, terminal, clock=clock)
    clock.now += 1.0
    bar.advance(2, note="2 succeeded")
    bar.close()
    assert terminal.getvalue().endswith("\n\x1b[?25h")  # and the cursor shown again
    frame = terminal.last_frame()
    assert "2/2" in frame
    assert "100%" in frame
    assert "ETA" not in frame
    assert frame.rstrip().endswith("2 succeeded")


def test_nothing_is_written_to_a_pipe() -> None:
    pipe = io.StringIO()
    bar = ProgressBar("wait  ", 3, pipe)
    bar.advance()
    bar.close()
    assert pipe.getvalue() == ""


def test_an_upload_bar_counts_in_bytes() -> None:
    """An upload's bar says what its numbers are (it showed 12600000/48000000 and 3150000/s)."""
    terminal, clock = Terminal(), Clock()
    bar = ProgressBar("upload", 48_000_000, terminal, clock=clock, in_bytes=True)
    clock.now += 4.0
    bar.advance(12_600_000)
    frame = terminal.last_frame()
    assert "12.6/48.0 MB" in frame, frame
    assert "3.1 MB/s" in frame, frame
    assert "ETA 11 s" in frame, frame
