"""Whether the ports a process is about to listen on are free, checked before anything starts.

`asyncinfer up` starts a nats-server and three services on a dozen fixed ports; one that is taken
(by a second `up`, say) would otherwise show up half-way through start-up, as a nats-server that
exits or a gRPC bind traceback, after the rest has started. Each port is checked by binding it, as
the servers will: with SO_REUSEADDR, as nats-server, gRPC and the metrics server all bind, so a port
a listener holds is refused while one left in TIME_WAIT by a stack that just stopped is not (Linux
refuses a listening port whatever the flag says). All the sockets are held until every port has
been tried, so a port configured twice is found too.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PortUse:
    """A port a server will listen on, and the setting it comes from (for the message)."""

    setting: str  # e.g. "gateway.port"
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port} ({self.setting})"


IN_USE = "in use"


@dataclass(frozen=True, slots=True)
class BusyPort:
    use: PortUse
    why: str  # IN_USE, "configured twice (also gateway.port)", or the OS error

    def __str__(self) -> str:
        return f"{self.use} {self.why}"


def busy_ports(uses: Sequence[PortUse]) -> list[BusyPort]:
    """The ports of `uses` that cannot be listened on; port 0 (any free port) is never busy."""
    held: list[socket.socket] = []
    taken: dict[tuple[str, int], PortUse] = {}
    busy: list[BusyPort] = []
    try:
        for use in uses:
            if use.port == 0:
                continue
            first = taken.get((use.host, use.port))
            if first is not None:
                busy.append(BusyPort(use, f"configured twice (also {first.setting})"))
                continue
            family = socket.AF_INET6 if ":" in use.host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            held.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((use.host, use.port))
                sock.listen(1)
            except OSError as exc:
                why = IN_USE if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
                busy.append(BusyPort(use, why))
                continue
            taken[(use.host, use.port)] = use
    finally:
        for sock in held:
            sock.close()
    return busy


def free_alternatives(uses: Sequence[PortUse], busy: Sequence[BusyPort], *, search: int = 1000) -> dict[PortUse, int]:
    """For each port of `busy` that another listener holds, the next port above it that is free
    and that no other use names: what to give a second `up` (the message's line, ready to paste)."""
    claimed = {(use.host, use.port) for use in uses}
    found: dict[PortUse, int] = {}
    for port in busy:
        if port.why != IN_USE:
            continue
        host = port.use.host
        for candidate in range(port.use.port + 1, min(port.use.port + search, 65536)):
            if (host, candidate) in claimed:
                continue
            if not busy_ports([PortUse(port.use.setting, host, candidate)]):
                found[port.use] = candidate
                claimed.add((host, candidate))
                break
    return found
