"""What a ListJobs page without filters costs when the tenant's newest jobs are chunk jobs, which
such a page leaves out (services/gateway/list_jobs.py), outside the stack: a fresh nats-server, one
tenant with PLAIN_JOBS plain jobs and then CHUNK_JOBS newer chunk jobs of one batch (SUCCEEDED
records in the jobs bucket), another with PLAIN_JOBS plain jobs alone (the control). Each page is
read two ways, alternated round by round: `needed` records a read (the page before: what it still
needs, however many it skipped) and READ_CHUNK once it has skipped one (list_jobs.read_size now).
A listing of a tenant's newest page_size jobs follows the pages' tokens until it has them (a page
reads at most MAX_RECORDS_READ_PER_PAGE records, and past as many chunk jobs answers none, with a
token). Wall time (the median of the rounds), records read and pages; the key index is warm.

    .venv/bin/python -m bench.list_skipped_jobs_cost [--chunk-jobs 5000] [--rounds 5]

Figures: the commit that made read_size adaptive, and docs/ARCHITECTURE.md (ListJobs).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from asyncinfer.config import LoggingConfig
from asyncinfer.declarations import ensure_jobs_bucket, ensure_work_stream
from asyncinfer.ids import new_job_id
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import BATCH_LABEL, CHUNK_LABEL, JobRecord, JobState, Priority
from asyncinfer.logs import configure_logging
from asyncinfer.nats.connection import connect
from bench.system.common import bench_config, run_against_a_nats_server
from services.gateway import list_jobs
from services.gateway.list_jobs import READ_CHUNK, JobLister, ListQuery
from services.gateway.transitions import Expiry

CHUNK_JOBS = 5_000
PLAIN_JOBS = 200
ROUNDS = 5
PAGE_SIZES = (1, 10, 50)
CREATES_AT_ONCE = 256


def before(needed: int, *, filtered: bool, skipped: bool) -> int:
    """The page's read size before: READ_CHUNK with filters, else what it still needs."""
    return READ_CHUNK if filtered else min(needed, READ_CHUNK)


class CountedReads(JobStore):
    reads = 0

    async def get(self, key: str) -> JobRecord | None:
        CountedReads.reads += 1
        return await super().get(key)


def record(tenant: str, labels: dict[str, str]) -> JobRecord:
    now = time.time()
    return JobRecord(
        job_id=new_job_id(),
        tenant=tenant,
        model_name="demo",
        model_version="",
        state=JobState.SUCCEEDED,
        priority=Priority.NORMAL,
        create_time=now,
        update_time=now,
        end_time=now,
        max_attempts=1,
        result_retention_s=3600.0,
        labels=labels,
    )


async def write(store: JobStore, records: list[JobRecord]) -> None:
    for first in range(0, len(records), CREATES_AT_ONCE):
        await asyncio.gather(*(store.create(r) for r in records[first : first + CREATES_AT_ONCE]))


async def first_jobs(lister: JobLister, tenant: str, page_size: int) -> tuple[list[JobRecord], int]:
    """The tenant's newest `page_size` jobs a listing without filters shows, and the pages it took
    (a page reads at most MAX_RECORDS_READ_PER_PAGE records: past as many chunk jobs it is empty,
    with a token, and the client asks again)."""
    found: list[JobRecord] = []
    token, pages = "", 0
    while len(found) < page_size:
        page = await lister.page(tenant, ListQuery(page_size=page_size - len(found), page_token=token))
        found += page.records
        pages += 1
        token = page.next_page_token
        if not token:
            break
    return found, pages


async def measure(url: str, _nats_pid: int, chunk_jobs: int, rounds: int) -> None:
    config = bench_config(url)
    nc = await connect(config.nats, name="list-skipped-jobs-cost")
    js = nc.jetstream()
    await ensure_work_stream(js, config.nats)
    store = CountedReads(await ensure_jobs_bucket(js, config.nats), work_stream=config.nats.work_stream)
    await write(store, [record("batchy", {}) for _ in range(PLAIN_JOBS)])
    batch = {BATCH_LABEL: new_job_id()}
    await write(store, [record("batchy", {**batch, CHUNK_LABEL: f"{i}-{i + 1}"}) for i in range(chunk_jobs)])
    await write(store, [record("plain", {}) for _ in range(PLAIN_JOBS)])
    lister = JobLister(
        nc,
        store,
        Expiry(store),
        bucket=config.nats.jobs_bucket,
        work_stream=config.nats.work_stream,
        max_page_bytes=4 << 20,
    )
    ways = {"before (needed a read)": before, "now (READ_CHUNK once skipped)": list_jobs.read_size}
    print(
        f"tenant 'batchy': {PLAIN_JOBS} plain jobs, then {chunk_jobs} newer chunk jobs; tenant 'plain': "
        f"{PLAIN_JOBS} plain jobs. A first page without filters, median of {rounds} rounds, alternated:",
        flush=True,
    )
    for tenant in ("batchy", "plain"):
        await lister.page(tenant, ListQuery(page_size=1))  # the key index's first scan, not measured
        for page_size in PAGE_SIZES:
            results: dict[str, list[tuple[float, int, int]]] = {name: [] for name in ways}
            for round_number in range(rounds):
                order = list(ways.items()) if round_number % 2 == 0 else list(reversed(ways.items()))
                for name, rule in order:
                    list_jobs.read_size = rule
                    CountedReads.reads = 0
                    started = time.perf_counter()
                    found, pages = await first_jobs(lister, tenant, page_size)
                    results[name].append((1000 * (time.perf_counter() - started), CountedReads.reads, pages))
                    assert len(found) == page_size
                    assert all(not r.labels for r in found)
            for name, rows in results.items():
                wall = statistics.median(row[0] for row in rows)
                print(
                    f"  {tenant:6s} page_size {page_size:3d}  {name:30s} {wall:7.1f} ms "
                    f"(rounds {', '.join(f'{row[0]:.0f}' for row in rows)}), {rows[0][1]} records read, "
                    f"{rows[0][2]} page{'s' if rows[0][2] > 1 else ''}",
                    flush=True,
                )
    await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk-jobs", type=int, default=CHUNK_JOBS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    configure_logging(LoggingConfig(level="warning"), service="bench")
    run_against_a_nats_server(lambda url, pid: measure(url, pid, args.chunk_jobs, args.rounds))


if __name__ == "__main__":
    main()
