"""HTTP/2 keepalive pings on gRPC connections, so that a peer that vanished without closing its
connection (a node powered off, a partition, a NAT or load balancer dropping the flow) is noticed.

Without them such a connection looks open for ever: the kernel sends no reset, and a side that
only waits (a batcher for work orders, a scheduler for a batcher's results, a gateway for a watcher
to read, a client for its watch's next change) waits for good. A scheduler pod replaced on another
node left every batcher on the old connection, doing nothing; a batcher's node lost left its jobs
RUNNING, their leases renewed by a scheduler that still saw its stream. With pings, a peer that does
not answer one within `interval_s` is taken as gone: the connection closes, its calls end
UNAVAILABLE, and each side does what it does for a peer that crashed.

Measured on grpcio 1.85: `grpc.keepalive_timeout_ms` alone does not end the connection; the ping's
own `grpc.http2.ping_timeout_ms` (60 s by default) does, so both are set. gRPC takes the first of
two options with the same name, so a caller's own options go before these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# How often a client may ping a server of ours (gRPC's default is once in 5 minutes, and a client
# pinging more often is sent GOAWAY "too_many_pings" after two strikes), or half the server's own
# interval where that is shorter (tests ping every second).
CLIENT_MIN_PING_INTERVAL_S = 5.0


@dataclass(frozen=True, slots=True)
class Keepalive:
    """A ping after `interval_s` without one, answered within `interval_s`: a peer gone is noticed
    within twice that."""

    interval_s: float

    def _pings(self) -> list[tuple[str, Any]]:
        ms = max(1, round(self.interval_s * 1000))
        return [
            ("grpc.keepalive_time_ms", ms),
            ("grpc.keepalive_timeout_ms", ms),
            ("grpc.http2.ping_timeout_ms", ms),
            # Keep pinging while nothing else is sent (gRPC's default stops after two pings).
            ("grpc.http2.max_pings_without_data", 0),
        ]

    def client_options(self, *, without_calls: bool = False) -> list[tuple[str, Any]]:
        """Channel options; `without_calls` pings an idle connection too (a client that keeps one
        open to be ready, as a batcher's to its scheduler)."""
        return [*self._pings(), ("grpc.keepalive_permit_without_calls", int(without_calls))]

    def server_options(self) -> list[tuple[str, Any]]:
        """Server options: pings every connection (an idle one too, so a dead client's connection
        is closed), and accepts clients' pings as often as every CLIENT_MIN_PING_INTERVAL_S."""
        accepted_s = min(CLIENT_MIN_PING_INTERVAL_S, self.interval_s / 2)
        return [
            *self._pings(),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", max(1, round(accepted_s * 1000))),
        ]
