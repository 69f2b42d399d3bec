"""The gateway with the record write taken out of the submit path: a stand-in for a one-write
submit (issue 14, item 2), to measure the most that design could save before building it.

    python -m bench.system.gateway_without_record gateway --config FILE

Runs `asyncinfer gateway` with JobStore.create answering as if the write had happened (revision
1) without sending it: the work message is published and the queued notice sent as always. Not a
working gateway (nothing can read the jobs it accepts); only bench/system/ab_one_write.py uses it.
"""

from __future__ import annotations

import sys

from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobRecord


async def _create_without_writing(self: JobStore, record: JobRecord, *, data: bytes | None = None) -> JobRecord:
    return record.evolve(revision=1)


def main() -> None:
    JobStore.create = _create_without_writing  # type: ignore[method-assign,assignment]
    from services.cli import main as cli_main

    sys.exit(cli_main())


if __name__ == "__main__":
    main()
