"""Reading standard input from a command without holding up Ctrl-C.

A read on the event loop's thread (a `[y/N]` prompt, `submit -f -` on a terminal) left the first
Ctrl-C to cancel a task the read was not part of: it took a second one. `asyncio.to_thread` frees
the loop, but asyncio.run waits for its worker at the end, and that worker waits for input: `bulk -`
on a terminal did not stop at any Ctrl-C. So the read runs in a daemon thread of its own, which
the process does not wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def read_stdin(read: Callable[[], T]) -> T:
    """`read()` (a blocking read of standard input) in a daemon thread; a cancelled wait leaves it."""
    loop = asyncio.get_running_loop()
    answered: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not answered.done():
            outcome()

    def run() -> None:
        deliver: Callable[[], None]
        try:
            deliver = functools.partial(answered.set_result, read())
        except BaseException as exc:  # handed to the waiting coroutine, whatever it is
            deliver = functools.partial(answered.set_exception, exc)
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(settle, deliver)

    threading.Thread(target=run, name="asyncinfer-stdin", daemon=True).start()
    return await answered
