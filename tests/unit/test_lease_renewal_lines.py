"""A renewal round while NATS is away: a line per job in flight, every round."""

from __future__ import annotations

from typing import Any, cast

import pytest
import structlog
from structlog.testing import capture_logs

from services.scheduler.leases import InFlightJob, Leases

pytestmark = pytest.mark.unit


class RefusedMessage:
    """A message whose in-progress ack NATS refuses (away, or a leader elected)."""

    def __init__(self) -> None:
        self.acks_tried = 0

    async def in_progress(self) -> None:
        self.acks_tried += 1
        raise ConnectionError("nats: connection closed")


async def test_a_renewal_round_nats_refuses_says_so_once_not_a_line_a_job() -> None:
    """Twenty jobs in flight, two renewal rounds NATS refuses: a `lease_renewal_failed` warning per
    job per round (a thousand jobs in flight wrote a thousand lines a round). Now the first names its
    job; the rest within the interval are at debug, each still there."""
    leases = Leases()
    messages = [RefusedMessage() for _ in range(20)]
    for n, message in enumerate(messages):
        job_id = f"job-{n}"
        leases.jobs[job_id] = InFlightJob(
            job_id=job_id,
            attempt=1,
            model_name="demo",
            session=cast(Any, None),  # not used by a renewal
            msg=cast(Any, message),
            record=cast(Any, None),
            log=structlog.get_logger("asyncinfer.scheduler").bind(job_id=job_id, model="demo"),
        )
    with capture_logs() as logs:
        await leases.renew()
        await leases.renew()
    assert [m.acks_tried for m in messages] == [2] * 20  # every lease still tried, each round
    said = [e for e in logs if e["event"] == "lease_renewal_failed" and e["log_level"] != "debug"]
    assert [(e["log_level"], e["job_id"]) for e in said] == [("warning", "job-0")]
    assert "nats: connection closed" in said[0]["error"]
    held = [e for e in logs if e["event"] == "lease_renewal_failed" and e["log_level"] == "debug"]
    assert len(held) == 39
