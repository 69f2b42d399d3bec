"""The lines under `asyncinfer bulk`'s summary that say which lines did not succeed, and why
(asyncinfer/commands/bulk_failures.py); the whole command: tests/test_cli_client.py's bulk tests."""

from __future__ import annotations

from typing import Any

import pytest

from asyncinfer.commands.bulk import SUCCEEDED, outcome_of
from asyncinfer.commands.bulk_failures import failure_lines

pytestmark = pytest.mark.unit


def invalid(line: int, message: str = "Expecting value: line 1 column 1 (char 0)") -> dict[str, Any]:
    return {"line": line, "error": {"code": "INVALID_ARGUMENT", "reason": "INVALID_LINE", "message": message}}


def test_runs_of_the_same_failure_are_one_line_and_those_past_the_first_ten_are_counted() -> None:
    entries = [
        {"line": 1, "job_id": "j1", "state": "SUCCEEDED", "outputs": {}},
        {
            "line": 2,
            "job_id": "j2",
            "state": "FAILED",
            "error": {"code": "INTERNAL", "reason": "MODEL_ERROR", "message": "boom"},
        },
        {"line": 3, "job_id": "j3", "state": "CANCELED", "error": None},
        *(invalid(n) for n in range(4, 9)),  # five lines saying the same: one
        {"line": 9, "error": {"code": "NOT_FOUND", "reason": "MODEL_NOT_FOUND", "message": "unknown model 'x'"}},
        *(invalid(n, f"bad {n}") for n in range(20, 40)),  # twenty different: six shown, fourteen counted
    ]
    printed = failure_lines(reversed(entries), outcome_of, SUCCEEDED)  # in line order, whatever the file's
    assert printed[:4] == [
        "  line 2: job FAILED, INTERNAL MODEL_ERROR: boom",
        "  line 3: job CANCELED",
        "  lines 4-8: INVALID_ARGUMENT INVALID_LINE: Expecting value: line 1 column 1 (char 0)",
        "  line 9: NOT_FOUND MODEL_NOT_FOUND: unknown model 'x'",
    ]
    assert printed[4:] == [f"  line {n}: INVALID_ARGUMENT INVALID_LINE: bad {n}" for n in range(20, 26)] + [
        "  and 14 more"
    ]
    assert failure_lines([entries[0]], outcome_of, SUCCEEDED) == []
