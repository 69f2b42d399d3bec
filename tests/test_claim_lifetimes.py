"""Which record writes change a keyed job's claim, and to what TTL (asyncinfer.claim_lifetimes); the
rewrites themselves run against a real nats-server in test_scheduler_policies and
test_gateway_idempotency."""

from __future__ import annotations

import pytest

from asyncinfer.claim_lifetimes import REPLAYED_ATTEMPT_ALLOWANCE_S, ClaimRewrite, replayed_ttl_s, rewrite_for
from asyncinfer.contract import claim_key
from asyncinfer.idempotency_claims import KEY_TTL_SLACK_S, QUEUE_HORIZON_WITHOUT_DEADLINE_S, Claim
from asyncinfer.jobs import JobRecord, JobState, Priority

pytestmark = pytest.mark.unit


def record(
    state: JobState, *, key: str = "order-1", timeout_s: float | None = None, claim_revision: int = 0
) -> JobRecord:
    return JobRecord(
        job_id="j1",
        tenant="acme",
        model_name="m",
        model_version="1",
        state=state,
        priority=Priority.NORMAL,
        create_time=1.0,
        update_time=1.0,
        max_attempts=3,
        result_retention_s=600.5,
        idempotency_key=key,
        execution_timeout_s=timeout_s,
        claim_revision=claim_revision,
        claim_fingerprint="f" * 64 if claim_revision else "",
    )


@pytest.mark.parametrize("ended", [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELED, JobState.EXPIRED])
@pytest.mark.parametrize("before", [JobState.QUEUED, JobState.RUNNING, JobState.CANCELLING])
def test_a_job_that_ends_keeps_its_claim_for_its_retention(before: JobState, ended: JobState) -> None:
    rewrite = rewrite_for(record(before), record(ended))
    # A record from an older gateway keeps no claim: it is read first.
    assert rewrite == ClaimRewrite(claim_key("acme", "order-1"), "j1", int(601 + KEY_TTL_SLACK_S))


def test_a_job_whose_record_keeps_its_claim_has_it_rewritten_without_a_read() -> None:
    rewrite = rewrite_for(record(JobState.RUNNING, claim_revision=7), record(JobState.SUCCEEDED, claim_revision=7))
    assert rewrite is not None
    assert rewrite.written == (7, Claim("j1", "f" * 64, 1.0))  # its revision, and the claim as written
    # A revision without a fingerprint (an older scheduler's rewrite dropped it): read first, never
    # written back blank.
    blank = record(JobState.SUCCEEDED, claim_revision=7).evolve(claim_fingerprint="")
    assert (rewrite_for(record(JobState.RUNNING), blank) or rewrite).written is None


@pytest.mark.parametrize("timeout_s", [None, 30.0])
def test_a_replayed_job_gets_the_long_horizon_back(timeout_s: float | None) -> None:
    attempt_s = timeout_s or REPLAYED_ATTEMPT_ALLOWANCE_S
    ttl_s = replayed_ttl_s(record(JobState.FAILED, timeout_s=timeout_s), budget=2)
    assert ttl_s == int(QUEUE_HORIZON_WITHOUT_DEADLINE_S + 2 * attempt_s + 601 + KEY_TTL_SLACK_S)


@pytest.mark.parametrize(
    ("before", "after", "key"),
    [
        (JobState.QUEUED, JobState.RUNNING, "order-1"),  # not ended
        (JobState.RUNNING, JobState.QUEUED, "order-1"),  # a retry: its claim still has the long TTL
        (JobState.FAILED, JobState.QUEUED, "order-1"),  # a replay: renewed by the replay itself
        (JobState.RUNNING, JobState.SUCCEEDED, ""),  # no key, no claim
    ],
)
def test_other_writes_leave_the_claim(before: JobState, after: JobState, key: str) -> None:
    assert rewrite_for(record(before, key=key), record(after, key=key)) is None
