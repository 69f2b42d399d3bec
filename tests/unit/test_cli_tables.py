"""The CLI's tables (asyncinfer.commands.output): plain aligned text on a pipe, exactly as scripts
read it; on a terminal a rich table, here the stats screen's."""

from __future__ import annotations

import argparse
import io
import re
from typing import Any

import grpc
import pytest
from rich.console import Console

from asyncinfer.client import UnavailableError
from asyncinfer.commands.ops import stats_rows, stats_screen, stats_table
from asyncinfer.commands.output import print_table, rich_table

pytestmark = pytest.mark.unit

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

MODELS: list[dict[str, Any]] = [
    {
        "model_name": "demo",
        "paused": False,
        "draining": False,
        "state": "dispatching",
        "in_flight": 2,
        "connected_batchers": 1,
        "free_credits": 30,
        "desired_batchers": 1,
        "submitted_per_second": 12.5,
        "completed_per_second": 11.0,
        "schedulers": 2,
        "draining_schedulers": 0,
        "queues": [
            {"priority": "HIGH", "depth": 1, "oldest_age_s": 0.4},
            {"priority": "NORMAL", "depth": 4, "oldest_age_s": 1.25},
            {"priority": "LOW", "depth": 0, "oldest_age_s": None},
        ],
    },
    {
        "model_name": "flaky",
        "paused": True,
        "draining": False,
        "state": "paused",
        "in_flight": 0,
        "connected_batchers": 1,
        "free_credits": 32,
        "desired_batchers": 0,
        "submitted_per_second": 0.0,
        "completed_per_second": 0.0,
        "queues": [{"priority": "NORMAL", "depth": 30, "oldest_age_s": 12.0}],
    },
]


class Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_pipe_gets_the_plain_table_exactly() -> None:
    pipe = Pipe()
    print_table(*stats_rows(MODELS), pipe)
    assert pipe.getvalue() == stats_table(MODELS) + "\n"
    lines = pipe.getvalue().splitlines()
    assert lines[0].split() == [
        "MODEL", "QUEUED", "BY", "PRIORITY", "OLDEST", "IN", "FLIGHT", "BATCHERS", "WANTED", "CREDITS", "IN/S", "OUT/S",
    ]  # fmt: skip
    assert lines[1].split() == ["demo", "5", "H:1", "N:4", "L:0", "1.25", "s", "2", "1", "1", "30", "12.5", "11.0"]
    assert lines[2].split()[:3] == ["flaky", "(paused)", "30"]
    assert "\x1b" not in pipe.getvalue()


def test_a_terminal_gets_the_stats_table_drawn_by_rich() -> None:
    out = io.StringIO()
    Console(file=out, force_terminal=True, width=120, color_system="standard").print(rich_table(*stats_rows(MODELS)))
    drawn = out.getvalue()
    assert "\x1b[1m" in drawn  # the header in bold
    lines = ANSI.sub("", drawn).splitlines()
    assert lines[0].split()[:2] == ["MODEL", "QUEUED"]
    assert set(lines[1].strip()) == {"─"}  # the rule under the header
    demo, flaky = lines[2], lines[3]
    assert demo.split()[:2] == ["demo", "5"]
    assert flaky.startswith("flaky (paused)")
    # Numbers are right-aligned: the queue depths end where their header does.
    end = lines[0].index("QUEUED") + len("QUEUED")
    assert demo[:end].endswith(" 5")
    assert flaky[:end].endswith(" 30")


def test_the_live_stats_screen_has_its_title_then_the_table() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    console.print(stats_screen(MODELS, "127.0.0.1:50052", "12:00:00"))
    lines = ANSI.sub("", out.getvalue()).splitlines()
    assert lines[0] == "asyncinfer queues at 127.0.0.1:50052 (2 schedulers)  12:00:00  (Ctrl-C to stop)"
    assert lines[2].split()[0] == "MODEL"


def test_print_table_on_a_terminal_draws_with_rich_and_keeps_long_ids_whole() -> None:
    terminal = Terminal()
    job_id = "0193f1a2-7c3e-7d4a-9b1e-2f3a4b5c6d7e"
    print_table(["JOB_ID", "STATE", "LABELS"], [[job_id, "QUEUED", "suite=cli,run=1"]], terminal)
    text = ANSI.sub("", terminal.getvalue())
    assert "─" in text
    assert job_id in text


class Stop(Exception):
    """Ends the endless stats loop from its fake scheduler (as Ctrl-C would)."""


async def test_the_live_stats_screen_redraws_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncinfer.commands import ops
    from asyncinfer.commands.options import Options
    from asyncinfer.v1 import job_pb2, ops_service_pb2

    depths = iter([3, 7])

    async def fake_call(options: Options, call: Any, say: Any = None) -> ops_service_pb2.GetQueueStatsResponse:
        depth = next(depths, None)
        if depth is None:
            raise Stop
        if depth == 7:  # the scheduler did not answer at once: the retry is said in the screen
            assert say is not None, "the live screen says a retry itself"
            say(UnavailableError("connection refused", code=grpc.StatusCode.UNAVAILABLE), 0.1)
        priority = ops_service_pb2.PriorityQueueStats(priority=job_pb2.PRIORITY_NORMAL, depth=depth)
        return ops_service_pb2.GetQueueStatsResponse(
            models=[ops_service_pb2.ModelQueueStats(model_name="demo", priorities=[priority])]
        )

    terminal = Terminal()
    monkeypatch.setattr(ops, "_ops_call", fake_call)
    monkeypatch.setattr(ops.sys, "stdout", terminal)
    options = Options.from_args(argparse.Namespace(scheduler="127.0.0.1:50052", json=False))
    with pytest.raises(Stop):
        await ops.stats_command(argparse.Namespace(interval=0.01, model="", once=False), options)
    drawn = terminal.getvalue()
    first, _, second = drawn.partition("\x1b[2K\x1b[1A")  # the second frame starts by going back up over the first
    assert second, drawn
    assert "\x1b[2J" not in drawn  # in place, not by clearing the screen
    assert re.search(r"demo\s+3\s", ANSI.sub("", first))
    assert re.search(r"demo\s+7\s", ANSI.sub("", second))
    # The retry's frame, in place between the two: the last counts, under a title that says so.
    frames = [ANSI.sub("", frame) for frame in re.split(r"(?:\x1b\[2K\x1b\[1A)+\x1b\[2K", drawn)]
    assert "127.0.0.1:50052 does not answer; trying again" in frames[1], frames
    assert re.search(r"demo\s+3\s", frames[1])
    assert re.search(r"demo\s+7\s", frames[2])
    assert "trying again" not in frames[0] + frames[2]  # (the last frame again at the stop)
    assert drawn.endswith("\x1b[?25h")  # the cursor shown again when it stops


def test_a_narrow_terminal_keeps_job_ids_and_headers_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 80 columns `list` cut the job ID (the one thing a user copies) and `batch list` broke its
    header as RECOR / DS/S: too narrow for the rich table, the plain one is printed, every cell whole."""
    job_id = "01a249bf-1e8a-71f0-a661-1de997fd6a5b"
    headers = ["JOB_ID", "MODEL", "STATE", "PRIORITY", "CREATED", "LABELS"]
    rows = [[job_id, "minilm-l6-doc-pipeline", "SUCCEEDED", "NORMAL", "2026-12-06 05:06:31", "suite=sdk"]]
    for width in (80, 200):
        out = Terminal()
        monkeypatch.setenv("COLUMNS", str(width))
        print_table(headers, rows, out)
        text = ANSI.sub("", out.getvalue())
        assert job_id in text
        assert "2026-12-06 05:06:31" in text
        assert text.split()[:2] == ["JOB_ID", "MODEL"]
    batch = ["BATCH", "STATE", "MODEL", "DONE", "FAILED", "RECORDS/S"]
    out = Terminal()
    monkeypatch.setenv("COLUMNS", "80")
    print_table(batch, [[job_id, "IN_PROGRESS", "demo", "1", "0", "9.5"]], out)
    assert "RECORDS/S" in out.getvalue()


def test_other_schedulers_draining_show_beside_the_model() -> None:
    """GetQueueStats answers for every scheduler; `draining` is the answering one's own."""
    others = {**MODELS[0], "draining_schedulers": 1}
    assert stats_rows([others])[1][0][0] == "demo (1/2 draining)"
    own = {**others, "draining": True, "state": "draining"}
    assert stats_rows([own])[1][0][0] == "demo (draining)"
    assert stats_rows([MODELS[1]])[1][0][0] == "flaky (paused)"  # a release before's: says neither
