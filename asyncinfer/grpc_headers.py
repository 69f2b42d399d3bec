"""gRPC response headers (initial metadata) that the gateway sends and the SDK reads: named once,
as the proto comments name them for other clients."""

from __future__ import annotations

# WatchJobs by label selector: sent, as the stream's headers, once the watch hears every change of
# the jobs it selects (their QUEUED included). A job submitted after a client has these headers is
# seen from QUEUED on; one submitted before may show no QUEUED change. A gateway before session 29
# sends no such header (its headers come with the first message).
WATCH_READY_HEADER = "asyncinfer-watch-ready"
WATCH_READY = (WATCH_READY_HEADER, "1")
