"""SharedRuns (services/gateway/shared_runs.py), pure asyncio: identical concurrent calls answered
by one run that starts after each of them arrived; a caller that leaves leaves the run to the
others; nothing kept after a run."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.shared_runs import SharedRuns

pytestmark = pytest.mark.unit

WAIT_S = 5.0


class Source:
    """A value that changes; each run reads it once it starts and, when `gate` is set, answers only
    once the test opens it."""

    def __init__(self) -> None:
        self.value = 0
        self.runs = 0
        self.started = asyncio.Event()
        self.gate: asyncio.Event | None = None

    async def read(self) -> int:
        self.runs += 1
        value = self.value
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        return value


async def test_identical_calls_of_one_turn_share_one_run() -> None:
    shared: SharedRuns[str, int] = SharedRuns()
    source = Source()
    source.value = 7
    answers = await asyncio.wait_for(asyncio.gather(*(shared.run("k", source.read) for _ in range(20))), WAIT_S)
    assert answers == [7] * 20
    assert source.runs == 1
    assert shared.in_flight == 0


async def test_a_call_that_comes_while_a_run_is_under_way_gets_a_run_that_starts_after_it() -> None:
    """The run under way read before the change; the calls after the change share the next run,
    which reads after it (and starts only once the first ended: one run at a time per key)."""
    shared: SharedRuns[str, int] = SharedRuns()
    source = Source()
    source.gate = asyncio.Event()
    first = asyncio.create_task(shared.run("k", source.read))
    await asyncio.wait_for(source.started.wait(), WAIT_S)
    source.value = 1  # e.g. a job submitted after the first listing read
    later = [asyncio.create_task(shared.run("k", source.read)) for _ in range(5)]
    await asyncio.sleep(0.01)  # room for a second run to start early, if it did
    assert source.runs == 1, "one run at a time per key"
    source.gate.set()
    assert await asyncio.wait_for(first, WAIT_S) == 0
    assert await asyncio.wait_for(asyncio.gather(*later), WAIT_S) == [1] * 5
    assert source.runs == 2


async def test_different_keys_run_apart() -> None:
    shared: SharedRuns[str, str] = SharedRuns()

    async def named(key: str) -> str:
        return key

    answers = await asyncio.gather(*(shared.run(key, lambda key=key: named(key)) for key in ("a", "b", "a", "c")))
    assert answers == ["a", "b", "a", "c"]


async def test_a_caller_that_leaves_does_not_cancel_the_run_of_the_others() -> None:
    shared: SharedRuns[str, int] = SharedRuns()
    source = Source()
    source.value = 3
    source.gate = asyncio.Event()
    leaving = asyncio.create_task(shared.run("k", source.read))
    staying = asyncio.create_task(shared.run("k", source.read))
    await asyncio.wait_for(source.started.wait(), WAIT_S)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    source.gate.set()
    assert await asyncio.wait_for(staying, WAIT_S) == 3
    assert source.runs == 1


async def test_the_last_caller_to_leave_cancels_the_run_and_the_next_call_runs_anew() -> None:
    """A listing whose callers all left (their deadlines passed) would otherwise hold up every later
    identical call (one run at a time per key), for ever when it hangs."""
    shared: SharedRuns[str, int] = SharedRuns()
    hung = asyncio.Event()
    cancelled = asyncio.Event()

    async def hangs() -> int:
        try:
            hung.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 0

    leaving = [asyncio.create_task(shared.run("k", hangs)) for _ in range(2)]
    await asyncio.wait_for(hung.wait(), WAIT_S)
    leaving[0].cancel()
    await asyncio.sleep(0)
    assert not cancelled.is_set(), "one caller still waits"
    leaving[1].cancel()
    await asyncio.wait_for(cancelled.wait(), WAIT_S)
    source = Source()
    source.value = 4
    assert await asyncio.wait_for(shared.run("k", source.read), WAIT_S) == 4
    assert shared.in_flight == 0


async def test_a_failed_run_fails_each_of_its_callers_and_the_next_call_runs_anew() -> None:
    shared: SharedRuns[str, int] = SharedRuns()
    failures = 0

    async def fail_once() -> int:
        nonlocal failures
        failures += 1
        if failures == 1:
            raise ValueError("the store is down")
        return 5

    results = await asyncio.gather(*(shared.run("k", fail_once) for _ in range(3)), return_exceptions=True)
    assert [type(result) for result in results] == [ValueError] * 3
    assert await shared.run("k", fail_once) == 5


async def test_past_max_runs_a_call_runs_alone_and_close_ends_the_runs_in_flight() -> None:
    shared: SharedRuns[str, int] = SharedRuns(max_runs=1)
    source = Source()
    source.gate = asyncio.Event()
    held = asyncio.create_task(shared.run("a", source.read))
    await asyncio.wait_for(source.started.wait(), WAIT_S)
    alone = asyncio.create_task(shared.run("b", source.read))
    await asyncio.sleep(0)
    assert shared.in_flight == 1  # "b" is not a shared run: it runs in its caller
    source.gate.set()
    assert await asyncio.wait_for(asyncio.gather(held, alone), WAIT_S) == [0, 0]
    assert shared.in_flight == 0

    never = asyncio.Event()

    async def hangs() -> int:
        await never.wait()
        return 0

    hanging = asyncio.create_task(shared.run("c", hangs))
    await asyncio.sleep(0.01)
    await asyncio.wait_for(shared.close(), WAIT_S)
    with pytest.raises(asyncio.CancelledError):
        await hanging
    assert shared.in_flight == 0
    assert await shared.run("c", source.read) == 0  # closed: alone
