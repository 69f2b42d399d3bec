"""Prometheus metrics: each service serves its own registry on its own port.

Metric objects are made per service instance (not module globals), so that several services can
run in one process (as `asyncinfer up` and the tests do) without clashing in one registry.
"""

from __future__ import annotations

import functools
from importlib import metadata
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from asyncinfer.jobs import JobRecord


class MetricsServer:
    """Serves one registry over HTTP on a background thread (prometheus_client's own server)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry = registry
        self._host = host
        self._port = port
        self._server: WSGIServer | None = None

    @property
    def port(self) -> int:
        return self._server.server_port if self._server is not None else 0

    def start(self) -> None:
        if self._port == 0 and self._server is None:
            # 0 means off in the configuration; tests that want metrics pass a free port.
            return
        server, _thread = start_http_server(self._port, addr=self._host, registry=self.registry)
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


@functools.cache
def package_version() -> str:
    """The installed distribution's version ("unknown" from a source tree that is not installed).

    Read once a process: the code running is the version that was installed when it started, and
    the read (every installed distribution's metadata searched, the found one's parsed) took ~1.5
    ms, at every service's start (its build_info), 1 % of the integration tests' CPU."""
    try:
        return metadata.version("asyncinfer")
    except metadata.PackageNotFoundError:
        return "unknown"


def register_build_info(registry: CollectorRegistry, service: str) -> None:
    """`asyncinfer_build_info{service, version} 1`: joined on in queries to see what runs where."""
    Gauge(
        "asyncinfer_build_info",
        "Always 1; its labels name the service and the installed asyncinfer version.",
        ["service", "version"],
        registry=registry,
    ).labels(service=service, version=package_version()).set(1)


# From a few milliseconds (a job on an idle stack) to an hour (a deep backlog, a long deadline).
JOB_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


class JobTimings:
    """Per-model histograms of a finished job's times, by its final state (SUCCEEDED, FAILED,
    CANCELED, EXPIRED, TIMED_OUT), observed by whichever service wrote the terminal record (the
    scheduler for most, the gateway for a cancel of a queued job and an expiry found on a read):
    sum them over services. Queue time is create to the last attempt's start (or to the end, for
    job that never started); run time is the last attempt's, for jobs that ended with its result
    (not one canceled or expired while it ran)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model", "state"]
        self._queue = Histogram(
            "asyncinfer_job_queue_seconds",
            "Time finished jobs spent queued before their last attempt started (to their end if none did).",
            labels,
            buckets=JOB_SECONDS_BUCKETS,
            registry=registry,
        )
        self._run = Histogram(
            "asyncinfer_job_run_seconds",
            "Run time of the last attempt of finished jobs that ended with its result.",
            labels,
            buckets=JOB_SECONDS_BUCKETS,
            registry=registry,
        )
        self._total = Histogram(
            "asyncinfer_job_duration_seconds",
            "End-to-end time of finished jobs, create to end.",
            labels,
            buckets=JOB_SECONDS_BUCKETS,
            registry=registry,
        )

    def observe(self, record: JobRecord) -> None:
        """Counts the record if it is terminal (callers pass every record they wrote)."""
        if not record.state.is_terminal:
            return
        labels = {"model": record.model_name, "state": record.state.value}
        end = record.end_time if record.end_time is not None else record.update_time
        total = max(end - record.create_time, 0.0)
        self._total.labels(**labels).observe(total)
        if record.start_time is None:
            self._queue.labels(**labels).observe(total)
            return
        queued = record.queue_duration_s
        if queued is None:
            queued = max(record.start_time - record.create_time, 0.0)
        self._queue.labels(**labels).observe(queued)
        if record.run_duration_s is not None:
            self._run.labels(**labels).observe(record.run_duration_s)
