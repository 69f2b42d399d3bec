"""The deadline a work message carries in its DEADLINE_HEADER (asyncinfer.codecs.envelope), read
by the scheduler's deadline sweep from the raw header block (asyncinfer.nats.streams)."""

from __future__ import annotations

import heapq
import math

import pytest

from asyncinfer.codecs.envelope import deadline_header, deadline_of_headers
from asyncinfer.contract import DEADLINE_HEADER
from asyncinfer.nats.streams import _parse_header_block
from services.scheduler.deadline_sweep import _ModelScan

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("deadline", [1_796_600_653.2046754, 0.1 + 0.2, 1e9, 1_700_000_000.0])
def test_a_deadline_reads_back_as_the_same_float(deadline: float) -> None:
    assert deadline_of_headers(deadline_header(deadline)) == deadline


def test_no_deadline_no_header_and_a_bad_one_reads_as_none() -> None:
    assert deadline_header(None) == {}
    assert deadline_of_headers(None) is None
    assert deadline_of_headers({}) is None
    for bad in ("soon", "", "nan", "inf"):
        assert deadline_of_headers({DEADLINE_HEADER: bad}) is None
    assert math.isclose(deadline_of_headers({DEADLINE_HEADER: " 12.5"}) or 0.0, 12.5)


def test_the_raw_header_block_is_parsed_as_nats_writes_it() -> None:
    block = b"NATS/1.0\r\nAsyncinfer-Tenant: t1\r\nAsyncinfer-Deadline: 12.5\r\nNats-Msg-Id: a:b\r\n\r\n"
    assert _parse_header_block(block) == {
        "Asyncinfer-Tenant": "t1",
        "Asyncinfer-Deadline": "12.5",
        "Nats-Msg-Id": "a:b",
    }
    assert _parse_header_block(b"") == {}


def test_a_scan_hands_out_the_due_deadlines_earliest_first_and_at_most_as_asked() -> None:
    scan = _ModelScan()
    for entry in [(5.0, 1), (1.0, 2), (3.0, 3), (9.0, 4)]:
        heapq.heappush(scan.deadlines, entry)
    assert scan.take_due(4.0, most=1) == [(1.0, 2)]
    assert scan.take_due(5.0, most=10) == [(3.0, 3), (5.0, 1)]
    assert scan.take_due(5.0, most=10) == []
    assert scan.deadlines == [(9.0, 4)]
