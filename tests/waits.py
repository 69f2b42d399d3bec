"""The bound on a test's wait for work that crosses processes or service rounds (a record
written, a delivery made; a service's start has START_S): there to end a hung test, never to claim
a speed. CI runs the integration tests three at a time, on machines that other work may load (5-8
times slower than quiet): a bound near the work's normal duration failed tests while nothing was
wrong.

A bound that is itself the behaviour under test (a client's own timeout_s, a sweep within a
configured TTL) is the test's own value, not this one."""

from __future__ import annotations

WAIT_S = 60.0
# A service process's start, to its "serving on" line: an interpreter and its imports (torch, for
# a batcher), seconds on a quiet machine; a start ran past 60 s at load 10 on 2 cores.
START_S = 180.0
