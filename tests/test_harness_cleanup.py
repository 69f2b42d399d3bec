"""The test harness's own cleanup (tests/stack.py, tests/conftest.py): a failure to stop one part
leaves none of the others running. A part left running outlives the test's event loop: its
sockets and transports, finalised by the garbage collector during some later test on the same
xdist worker, fail that one (pytest's unraisable-exception warnings are errors here)."""

from __future__ import annotations

import pytest

from asyncinfer.config import Config
from services.scheduler.app import SchedulerApp
from tests.stack import GRACE_S, Stack, run_every


async def test_a_stack_whose_scheduler_fails_to_stop_still_stops_its_gateway_and_connections(
    config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = Stack(config)
    await stack.start(batcher=False)
    try:

        async def failing_stop(grace_s: float = GRACE_S) -> None:
            raise RuntimeError("the scheduler did not stop")

        monkeypatch.setattr(stack.scheduler, "stop", failing_stop)
        with pytest.raises(RuntimeError, match="did not stop"):
            await stack.stop()
        assert stack.gateway._stopped, "the gateway is stopped after the scheduler's failure"
        assert stack.closed, "and the test's channel and connection closed"
    finally:
        monkeypatch.undo()
        await SchedulerApp.stop(stack.scheduler, GRACE_S)
        await stack.stop()


@pytest.mark.unit
async def test_every_step_runs_and_the_first_failure_is_raised() -> None:
    ran: list[str] = []

    async def step(name: str, error: BaseException | None = None) -> None:
        ran.append(name)
        if error is not None:
            raise error

    with pytest.raises(RuntimeError, match="first"):
        await run_every(
            [
                lambda: step("a"),
                lambda: step("b", RuntimeError("first")),
                lambda: step("c", ValueError("second")),
                lambda: step("d"),
            ]
        )
    assert ran == ["a", "b", "c", "d"]
