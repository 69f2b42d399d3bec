"""What one logged traceback costs the console renderer, each way it can draw one: the CPU of a
`log.exception` line rendered by structlog's ConsoleRenderer with Rich's traceback and every frame's
locals (structlog's default, and configure_logging's before), with Rich's traceback without locals,
and with the standard library's plain traceback (configure_logging's now). The exception is a real
one: the store's Unavailable from a record write that a fresh nats-server answered "no responders"
(the jobs bucket's stream moved off its subjects, as while its leader is elected), caught a few
frames up as the scheduler's dispatch caught it.

    .venv/bin/python -m bench.traceback_render_cost

The figures docs/ARCHITECTURE.md ("A NATS node killed") quotes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

from asyncinfer.config import LoggingConfig
from asyncinfer.declarations import ensure_jobs_bucket, ensure_work_stream
from asyncinfer.errors import Unavailable
from asyncinfer.ids import new_job_id
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobRecord, JobState, Priority
from asyncinfer.logs import TRACEBACKS, configure_logging
from asyncinfer.nats.connection import connect
from bench.system.common import bench_config, load_average, run_against_a_nats_server

RENDERS = 20

FORMATTERS: dict[str, Callable[..., Any]] = {
    "rich, with locals (structlog's default)": structlog.dev.RichTracebackFormatter(color_system=None),
    "rich, without locals": structlog.dev.RichTracebackFormatter(color_system=None, show_locals=False),
    "plain (configure_logging's)": TRACEBACKS,
}


async def refused_write(url: str) -> Unavailable:
    config = bench_config(url)
    nc = await connect(config.nats, name="traceback-render-cost")
    js = nc.jetstream()
    await ensure_work_stream(js, config.nats)
    store = JobStore(await ensure_jobs_bucket(js, config.nats), work_stream=config.nats.work_stream)
    now = time.time()
    record = JobRecord(
        job_id=new_job_id(),
        tenant="bench",
        model_name="demo",
        model_version="",
        state=JobState.QUEUED,
        priority=Priority.NORMAL,
        create_time=now,
        update_time=now,
        max_attempts=3,
        result_retention_s=3600.0,
    )
    record = await store.create(record)
    info = await js.stream_info(f"KV_{config.nats.jobs_bucket}")
    info.config.subjects = [f"elsewhere.{config.nats.jobs_bucket}.>"]
    await js.update_stream(info.config)
    try:
        await store.transition(record, lambda r: r.evolve(state=JobState.RUNNING, attempt=1))
    except Unavailable as exc:
        return exc
    finally:
        await nc.close()
    raise AssertionError("the write was not refused")


def main() -> None:
    configure_logging(LoggingConfig(level="warning"), service="bench")
    refused: list[Unavailable] = []

    async def measure(url: str, _nats_pid: int) -> None:
        refused.append(await refused_write(url))

    run_against_a_nats_server(measure)
    (error,) = refused
    exc_info = (type(error), error, error.__traceback__)
    print(f"{error.message!r}, {len(list(_frames(error)))} frames (with its cause's); load {load_average()[0]:.1f}")
    for label, formatter in FORMATTERS.items():
        renderer = structlog.dev.ConsoleRenderer(colors=False, exception_formatter=formatter)
        renderer(None, "error", {"event": "dispatch_failed", "exc_info": exc_info})  # imports, caches
        started = time.process_time()
        for _ in range(RENDERS):
            text = renderer(None, "error", {"event": "dispatch_failed", "exc_info": exc_info})
        cpu_ms = 1000 * (time.process_time() - started) / RENDERS
        print(f"{label}: {cpu_ms:.1f} CPU-ms a line, {text.count(chr(10)) + 1} lines of text")


def _frames(error: BaseException) -> Any:
    seen: BaseException | None = error
    while seen is not None:
        tb = seen.__traceback__
        while tb is not None:
            yield tb
            tb = tb.tb_next
        seen = seen.__cause__ or seen.__context__


if __name__ == "__main__":
    main()
