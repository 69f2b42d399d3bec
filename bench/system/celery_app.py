"""The Celery reference: a no-op task on a Redis broker and result backend, configured as most
teams would (JSON, defaults otherwise). The broker URL comes from BENCH_CELERY_BROKER, so that the
worker process and the benchmark agree:

    BENCH_CELERY_BROKER=redis://127.0.0.1:PORT/0 python -m celery -A bench.system.celery_app worker --pool=solo
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

BROKER = os.environ.get("BENCH_CELERY_BROKER", "redis://127.0.0.1:6379/0")

app = Celery("asyncinfer_bench", broker=BROKER, backend=BROKER)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    result_expires=3600,
)


@app.task(name="bench.noop")  # type: ignore[misc]
def noop(x: Any) -> Any:
    """Returns its input: the no-op model's counterpart."""
    return x
