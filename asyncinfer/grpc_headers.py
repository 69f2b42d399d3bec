"""gRPC response headers (initial metadata) that the gateway sends and the SDK reads: named once,
as the proto comments name them for other clients."""

from __future__ import annotations

# WatchJobs by label selector: sent, as the stream's headers, once the watch hears every change of
# the jobs it selects (their QUEUED included). A job submitted after a client has these headers is
# seen from QUEUED on; one submitted before may show no QUEUED change. A gateway before session 29
# sends no such header (its headers come with the first message).
WATCH_READY_HEADER = "asyncinfer-watch-ready"
WATCH_READY = (WATCH_READY_HEADER, "1")

# Sent with WATCH_READY (from session 30): the gateway's wall clock as the watch started listening,
# Unix seconds ("1765022400.123456"). A reopened label watch's catch-up compares the listed jobs'
# times, which the services write on their clocks, with this one rather than with the client's (a
# client 60 s off the servers either missed the jobs that ended in the gap or reported old ones).
WATCH_SINCE_HEADER = "asyncinfer-watch-since"


def watch_since(now: float) -> tuple[str, str]:
    """The header that says a label watch listens since `now` (the gateway's wall clock)."""
    return (WATCH_SINCE_HEADER, f"{now:.6f}")
