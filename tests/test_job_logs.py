"""What the services log about jobs, on a real stack (real NATS, the three services in this process):
at the default level (info) a job that succeeded writes no line of its own and `jobs_summary`
counts it, per service and model, every `logging.summary_interval_s`; at debug each job writes its
lifecycle lines; a job that failed still writes one at info, with its ID and why. A webhook
delivered writes no line at info; an attempt that failed does, and one that gave up at warning.

The services log through structlog, filtered as configure_logging filters (a level, set before the
services start); the lines are captured rather than rendered."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import structlog
from structlog.testing import LogCapture

from asyncinfer.config import DEMO_MODEL, FLAKY_MODEL, Config
from asyncinfer.v1 import job_pb2, job_service_pb2
from services.batcher.models.demo import FLAKY_MODEL_MESSAGE
from tests.stack import StartStack
from tests.test_end_to_end import demo_request
from tests.webhook_receiver import Receiver, receiver, webhook_config

__all__ = ["receiver"]  # the fixture, used by name

LIFECYCLE = {"job_submitted", "job_dispatched", "job_finished"}
SUMMARY_INTERVAL_S = 0.2


@contextlib.contextmanager
def logs_at(level: int) -> Iterator[list[dict[str, Any]]]:
    """The lines logged at `level` and above while it lasts (each with its `log_level`)."""
    saved = structlog.get_config()
    capture = LogCapture()
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, capture],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=False,
    )
    try:
        yield capture.entries
    finally:
        structlog.configure(**saved)


async def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def summed(lines: list[dict[str, Any]], model: str) -> Counter[str]:
    """The counts of every jobs_summary line about `model`, added up (a burst may span several)."""
    total: Counter[str] = Counter()
    for line in lines:
        if line["event"] == "jobs_summary" and line["model"] == model:
            assert line["log_level"] == "info"
            total.update({k: v for k, v in line.items() if isinstance(v, int)})
    return total


async def finished(jobs: Any, job_id: str) -> job_pb2.Job:
    async for _update in jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=job_id)):
        pass
    return (await jobs.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job


async def test_at_info_a_job_that_succeeded_has_no_line_and_the_summary_counts_it(
    config: Config, start_stack: StartStack
) -> None:
    assert Config().logging.level == "info"  # what these lines are filtered at by default
    with logs_at(logging.INFO) as lines:
        stack = await start_stack(config.replace(logging={"summary_interval_s": SUMMARY_INTERVAL_S}))
        ids = [(await stack.jobs.SubmitJob(demo_request([[float(i)] * 4]))).job.job_id for i in range(5)]
        for job_id in ids:
            assert (await finished(stack.jobs, job_id)).state == job_pb2.JOB_STATE_SUCCEEDED

        def counted() -> bool:
            total = summed(lines, "demo")
            return total["accepted"] >= 5 and total["succeeded"] >= 5

        await wait_for(counted, "the summaries to count the five jobs")
        total = summed(lines, "demo")
        # The gateway's lines count the accepted, the scheduler's the dispatched and the ended.
        assert {k: total[k] for k in ("accepted", "dispatched", "succeeded")} == {
            "accepted": 5,
            "dispatched": 5,
            "succeeded": 5,
        }, total
        assert set(total) == {"accepted", "dispatched", "succeeded"}, total
        about_the_jobs = [line for line in lines if line.get("job_id") in ids]
        assert about_the_jobs == [], "a job that succeeded writes no line at info"


async def test_at_debug_each_job_writes_its_lifecycle_lines(config: Config, start_stack: StartStack) -> None:
    with logs_at(logging.DEBUG) as lines:
        stack = await start_stack()
        job_id = (await stack.jobs.SubmitJob(demo_request([[1, 2, 3, 4]]))).job.job_id
        assert (await finished(stack.jobs, job_id)).state == job_pb2.JOB_STATE_SUCCEEDED
        # job_finished follows the terminal write the watch saw.
        await wait_for(lambda: any(line["event"] == "job_finished" for line in lines), "job_finished")
        about = [line for line in lines if line.get("job_id") == job_id]
        assert {line["event"] for line in about} >= LIFECYCLE
        assert {line["log_level"] for line in about if line["event"] in LIFECYCLE} == {"debug"}


async def test_a_job_that_failed_is_logged_at_info_with_its_id_and_why(config: Config, start_stack: StartStack) -> None:
    flaky = config.replace(
        models=[DEMO_MODEL.model_dump(), FLAKY_MODEL.model_dump()], logging={"summary_interval_s": SUMMARY_INTERVAL_S}
    )
    with logs_at(logging.INFO) as lines:
        stack = await start_stack(flaky)
        request = demo_request([[-1, 2, 3, 4]])  # flaky fails a row starting below 0, on each attempt
        request.model_name = "flaky"
        job_id = (await stack.jobs.SubmitJob(request)).job.job_id
        assert (await finished(stack.jobs, job_id)).state == job_pb2.JOB_STATE_FAILED
        await wait_for(lambda: summed(lines, "flaky")["failed"] == 1, "the summary to count the failed job")
        (line,) = [line for line in lines if line["event"] == "job_finished"]
        assert (line["log_level"], line["job_id"], line["state"]) == ("info", job_id, "FAILED")
        assert line["reason"] == "MODEL_ERROR"
        assert FLAKY_MODEL_MESSAGE in line["error"]
        # Its attempts: dispatched twice, requeued after the first failure, then failed for good.
        total = summed(lines, "flaky")
        assert {k: total[k] for k in ("accepted", "dispatched", "requeued", "failed")} == {
            "accepted": 1,
            "dispatched": 2,
            "requeued": 1,
            "failed": 1,
        }, total


async def test_a_webhook_delivered_has_no_line_at_info_one_that_failed_or_gave_up_has(
    config: Config, receiver: Receiver, start_stack: StartStack
) -> None:
    settings = webhook_config(config, retry_horizon_s=0.8, backoff_base_s=0.1, backoff_max_s=0.2)
    receiver.scripts["/flaky"] = [(500, {})]  # then 200
    receiver.scripts["/down"] = [(503, {})] * 100
    with logs_at(logging.INFO) as lines:
        stack = await start_stack(settings)
        flaky_id = await submit_with_webhook(stack.jobs, receiver.url("/flaky"))
        down_id = await submit_with_webhook(stack.jobs, receiver.url("/down"))

        def attempts_of(job_id: str) -> list[dict[str, Any]]:
            return [line for line in lines if line["event"] == "webhook_attempted" and line["job_id"] == job_id]

        await receiver.wait_for("/flaky", 2)
        # /down gives up at its horizon (0.8 s), well after /flaky's second attempt (within 0.2 s).
        await wait_for(lambda: any(a["state"] == "FAILED" for a in attempts_of(down_id)), "the delivery to give up")
        # The 500 is said, with its retry; the delivery that followed is not.
        (failed,) = attempts_of(flaky_id)
        assert (failed["log_level"], failed["status_code"], failed["state"]) == ("info", 500, "PENDING")
        assert failed["retry_in_s"] is not None
        *retried, gave_up = attempts_of(down_id)
        assert retried
        assert {(a["log_level"], a["state"]) for a in retried} == {("info", "PENDING")}
        assert (gave_up["log_level"], gave_up["status_code"], gave_up["state"]) == ("warning", 503, "FAILED")


async def submit_with_webhook(jobs: Any, url: str) -> str:
    x = demo_request([[1, 2, 3, 4]])
    x.callback.url = url
    return str((await jobs.SubmitJob(x)).job.job_id)


async def test_a_webhook_endpoint_that_is_down_for_every_job_is_said_once_not_a_line_a_job(
    config: Config, receiver: Receiver, start_stack: StartStack
) -> None:
    """Six jobs whose webhook's endpoint answers 503 until each delivery gives up: a
    `webhook_attempted` line per attempt and job at info, and one per job at warning (an endpoint
    down at 100 jobs a second wrote hundreds a second). Now the first of each kind is said whole,
    naming its job, and the rest within the interval are at debug, each still there."""
    settings = webhook_config(config, retry_horizon_s=0.5, backoff_base_s=0.1, backoff_max_s=0.2)
    receiver.scripts["/down"] = [(503, {})] * 1000
    with logs_at(logging.DEBUG) as lines:
        stack = await start_stack(settings)
        jobs = {await submit_with_webhook(stack.jobs, receiver.url("/down")) for _ in range(6)}

        def gave_up() -> set[str]:
            return {
                line["job_id"] for line in lines if line["event"] == "webhook_attempted" and line["state"] == "FAILED"
            }

        await wait_for(lambda: gave_up() == jobs, "every delivery to give up")
    attempted = [line for line in lines if line["event"] == "webhook_attempted"]
    said = [(line["log_level"], line["state"]) for line in attempted if line["log_level"] != "debug"]
    assert sorted(said) == [("info", "PENDING"), ("warning", "FAILED")], said
    first = next(line for line in attempted if line["log_level"] != "debug")
    assert (first["job_id"] in jobs, first["status_code"]) == (True, 503)
    assert len([line for line in attempted if line["state"] == "FAILED"]) == 6, "each still there, at debug"
