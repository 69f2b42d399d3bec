"""A reader's wall clock against nats-server's, measured from the times the server says: its stamp
on a message as it stored it, or its clock as it answered a request, each against the reader's wall
clock as the message or answer came. No request is made for it: the reader samples what it
receives anyway (the gateway: its queues bucket watch's first stream info and each live snapshot).

Each sample is the true offset less the message's way to the reader (the server stamped it first),
so the largest of the last SAMPLES_KEPT is the closest (the least delayed). A step of the reader's
clock is followed at once when it goes back (the offset grows) and after SAMPLES_KEPT samples when
it goes forward.
"""

from __future__ import annotations

import collections

SAMPLES_KEPT = 16


class ServerClockOffset:
    def __init__(self) -> None:
        self._samples: collections.deque[float] = collections.deque(maxlen=SAMPLES_KEPT)

    def sample(self, server_time: float, local_time: float) -> None:
        """The server's time `server_time` reached the reader at its wall clock's `local_time`."""
        self._samples.append(server_time - local_time)

    @property
    def offset_s(self) -> float:
        """The server's clock less the reader's (seconds); 0.0 before any sample."""
        return max(self._samples) if self._samples else 0.0
