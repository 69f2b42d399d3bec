"""Background loops under one owner (asyncinfer.supervision): a loop that dies is reported at once
and ends run_until_stopped with a failure exit code; stopping is ordered and bounded. The last
two tests break a loop inside a real scheduler, in this process and as the `asyncinfer scheduler`
command."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NatsClient
from structlog.testing import capture_logs

from asyncinfer.config import Config
from asyncinfer.queues import paused_key
from asyncinfer.runner import (
    EXIT_LOOP_DIED,
    EXIT_MODEL_HUNG,
    EXIT_STOPPED,
    EXIT_UNAVAILABLE,
    StopSignal,
    run_until_stopped,
)
from asyncinfer.supervision import LoopDied, Supervisor, failure_logged
from services.scheduler import blobs as scheduler_blobs
from services.scheduler.app import SchedulerApp
from services.scheduler.pauses import PauseState
from services.scheduler.store_usage import StoreUsage, StoreUsageReader
from tests.waits import START_S, WAIT_S

REPO = Path(__file__).resolve().parent.parent


class Broken(Exception):
    pass


async def test_a_loop_that_raises_is_reported_at_once_with_its_name() -> None:
    supervisor = Supervisor("test")
    heard: list[LoopDied] = []
    supervisor.on_failure(heard.append)
    go = asyncio.Event()

    async def dies() -> None:
        await go.wait()
        raise Broken("the bug")

    with capture_logs() as logs:
        task = supervisor.start("dies", dies())
        go.set()
        failure = await asyncio.wait_for(supervisor.wait_failed(), WAIT_S)
    assert (failure.owner, failure.loop, str(failure.error)) == ("test", "dies", "the bug")
    assert heard == [failure]
    assert supervisor.failure is failure
    assert task.done()
    assert task.exception() is None
    died = [entry for entry in logs if entry["event"] == "loop_died"]
    assert len(died) == 1
    assert died[0]["loop"] == "dies"
    assert died[0]["log_level"] == "error"
    assert isinstance(died[0]["exc_info"], Broken)  # rendered as a traceback by the log processors
    late: list[LoopDied] = []
    supervisor.on_failure(late.append)  # a listener that comes later hears of it at once
    assert late == [failure]
    await supervisor.stop()


async def test_stop_cancels_in_reverse_order_of_start() -> None:
    supervisor = Supervisor("test")
    started: list[str] = []
    cancelled: list[str] = []
    all_started = asyncio.Event()

    async def runs(name: str) -> None:
        started.append(name)
        if len(started) == 3:
            all_started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    for name in ("first", "second", "third"):
        supervisor.start(name, runs(name))
    await asyncio.wait_for(all_started.wait(), WAIT_S)
    assert supervisor.loop_names == ["first", "second", "third"]
    await supervisor.stop()
    assert cancelled == ["third", "second", "first"]
    assert supervisor.loop_names == []
    assert supervisor.failure is None
    await supervisor.stop()  # idempotent
    with pytest.raises(RuntimeError, match="stopping"):
        supervisor.start("late", runs("late"))


async def test_stop_is_bounded_when_a_loop_ignores_cancellation() -> None:
    supervisor = Supervisor("test", stop_timeout_s=0.2)
    release = asyncio.Event()
    running = asyncio.Event()

    async def stubborn() -> None:
        running.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # a bug: swallows the cancellation

    task = supervisor.start("stubborn", stubborn())
    await asyncio.wait_for(running.wait(), WAIT_S)
    with capture_logs() as logs:
        await asyncio.wait_for(supervisor.stop(), WAIT_S)
    assert not task.done()
    assert [entry["loop"] for entry in logs if entry["event"] == "loop_did_not_stop"] == ["stubborn"]
    release.set()
    await task


async def test_stop_cancels_again_a_loop_that_lost_its_first_cancellation() -> None:
    # As a loop inside Python 3.11's asyncio.wait_for does when the awaited future completes at
    # the moment of the cancel (gh-86296): the lease reclaimer's NATS request once did, and the
    # scheduler's stop waited out the whole timeout with the loop still running.
    supervisor = Supervisor("test", stop_timeout_s=3.0)
    running = asyncio.Event()
    cancels: list[int] = []

    async def loses_one() -> None:
        running.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancels.append(1)  # the first one is lost: the loop goes on
        await asyncio.Event().wait()

    task = supervisor.start("loses-one", loses_one())
    await asyncio.wait_for(running.wait(), WAIT_S)
    with capture_logs() as logs:
        await asyncio.wait_for(supervisor.stop(), WAIT_S)
    assert task.done()
    assert cancels == [1]
    assert supervisor.loop_names == []
    assert not [entry for entry in logs if entry["event"] == "loop_did_not_stop"]


async def test_the_blob_sweeper_stops_though_a_sweep_lost_its_cancellation(monkeypatch: pytest.MonkeyPatch) -> None:
    # The sweeper makes several NATS requests every interval (every 50 ms in tests); one whose
    # answer came as it was cancelled lost the cancellation (gh-86296), the loop went on, and the
    # scheduler's stop waited on it until CI's 120 s timeout. Its stop cancels until it ends.
    sweeping = asyncio.Event()
    cancels: list[int] = []

    async def sweep_losing_a_cancel(store: Any, **options: Any) -> int:
        sweeping.set()
        if cancels:
            await asyncio.Event().wait()  # the next cancellation is not lost
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancels.append(1)  # lost, as in wait_for when its future completes at that moment
        return 0

    monkeypatch.setattr(scheduler_blobs, "sweep", sweep_losing_a_cancel)
    supervisor = Supervisor("test")
    sweeper = scheduler_blobs.BlobSweeper(None, supervisor, interval_s=0.01)  # type: ignore[arg-type]
    sweeper.start()
    await asyncio.wait_for(sweeping.wait(), WAIT_S)
    stopping = asyncio.create_task(sweeper.stop())
    await asyncio.wait({stopping}, timeout=WAIT_S)
    assert stopping.done(), "the stop waits on a sweep loop that goes on"
    assert cancels == [1]
    assert supervisor.loop_names == []


async def test_a_schedulers_repeating_loop_that_lost_its_cancellation_runs_no_further_round(
    config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The store-usage read a scheduler makes as it starts lost a stop's cancellation in a NATS
    # request (gh-86296): its loop went on to more rounds until the stop cancelled it again
    # (RECANCEL_S, 0.1 s, later: the stop took that much longer). It ends before its next round.
    reads: list[int] = []
    reading = asyncio.Event()
    read = StoreUsageReader.read

    async def read_losing_a_cancel(self: StoreUsageReader) -> StoreUsage:
        reads.append(1)
        if len(reads) == 1:
            reading.set()
            # Lost, as in wait_for when its future completes at that moment.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
        return await read(self)

    monkeypatch.setattr(StoreUsageReader, "read", read_losing_a_cancel)
    # A round every millisecond: one after the lost cancellation would come long before a second.
    scheduler = SchedulerApp(config.replace(scheduler={"store_usage_interval_s": 0.001}))
    await scheduler.start()
    try:
        await asyncio.wait_for(reading.wait(), WAIT_S)
    finally:
        await asyncio.wait_for(scheduler.stop(grace_s=0.0), WAIT_S)
    assert reads == [1], f"{len(reads) - 1} rounds after the stop's cancellation"


class LosesTheFirstCancel:
    """A loop's round (its NATS request): the first call loses the cancellation that meets it, as
    Python 3.11's asyncio.wait_for does when its future completes at that moment (gh-86296; every
    nats-py request waits so); each call is a round."""

    def __init__(self, returns: Any = None) -> None:
        self.rounds = 0
        self.in_first = asyncio.Event()
        self.second = asyncio.Event()
        self._returns = returns

    async def __call__(self, *_args: Any, **_kwargs: Any) -> Any:
        self.rounds += 1
        if self.rounds == 1:
            self.in_first.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
        else:
            self.second.set()
        return self._returns


def _stranded_messages(monkeypatch: pytest.MonkeyPatch, rounds: LosesTheFirstCancel) -> Any:
    from services.scheduler.stranded_messages import StrandedMessages

    loop = StrandedMessages(None, None, None, Config(), list, interval_s=0.001)  # type: ignore[arg-type]
    monkeypatch.setattr(loop, "check", rounds)
    return loop.run()


def _blob_sweeper(monkeypatch: pytest.MonkeyPatch, rounds: LosesTheFirstCancel) -> Any:
    monkeypatch.setattr(scheduler_blobs, "sweep", rounds)
    rounds._returns = 0
    return scheduler_blobs.BlobSweeper(None, Supervisor("test"), interval_s=0.001)._run()  # type: ignore[arg-type]


def _heartbeat(monkeypatch: pytest.MonkeyPatch, rounds: LosesTheFirstCancel) -> Any:
    from services.scheduler import instances

    monkeypatch.setattr(instances, "HEARTBEAT_INTERVAL_S", 0.001)
    instance = instances.SchedulerInstance("scheduler", "run", None)  # type: ignore[arg-type]
    monkeypatch.setattr(instance, "beat", rounds)
    return instance.heartbeat()


def _lease_reclaim(monkeypatch: pytest.MonkeyPatch, rounds: LosesTheFirstCancel) -> Any:
    from services.scheduler import lease_reclaim

    monkeypatch.setattr(lease_reclaim, "HEARTBEAT_TTL_S", -1.0)  # its second reclaim at once
    reclaimer = lease_reclaim.LeaseReclaimer(None, None, None, Config(), None, models=list)  # type: ignore[arg-type]
    rounds._returns = 0
    monkeypatch.setattr(reclaimer, "reclaim", rounds)
    return reclaimer.run()


def _peer_watch(monkeypatch: pytest.MonkeyPatch, rounds: LosesTheFirstCancel) -> Any:
    from types import SimpleNamespace

    from services.scheduler import peer_watch

    monkeypatch.setattr(peer_watch, "CHECK_INTERVAL_S", 0.001)
    watch = peer_watch.PeerWatch(SimpleNamespace(js=None, name="queues"), "run", rounds)  # type: ignore[arg-type]

    async def nothing() -> None:
        pass

    monkeypatch.setattr(watch, "_watch", SimpleNamespace(start=nothing, stop=nothing))
    watch._lasting_markers.add("marker")  # a delete marker to clear every round
    monkeypatch.setattr(watch, "_clear_lasting_markers", rounds)
    return watch.run()


def _model_registry(monkeypatch: pytest.MonkeyPatch, rounds: LosesTheFirstCancel) -> Any:
    from services.scheduler import model_registry_writer

    monkeypatch.setattr(model_registry_writer, "REFRESH_S", 0.001)
    writer = model_registry_writer.ModelRegistryWriter(None, None)  # type: ignore[arg-type]
    monkeypatch.setattr(writer, "write", rounds)
    return writer.run()


def _runtime_models(monkeypatch: pytest.MonkeyPatch, rounds: LosesTheFirstCancel) -> Any:
    from services.scheduler import runtime_models

    monkeypatch.setattr(runtime_models, "RETRY_S", 0.001)
    learner = runtime_models.RuntimeModels(Config(), None, js=None, start_dispatcher=None)  # type: ignore[arg-type]
    rounds._returns = False  # not all learnt: tried again
    monkeypatch.setattr(learner, "learn", rounds)
    learner._dirty.set()
    return learner.run()


def _store_health(monkeypatch: pytest.MonkeyPatch, rounds: LosesTheFirstCancel) -> Any:
    from services.gateway import store_health

    monkeypatch.setattr(store_health, "PROBE_INTERVAL_S", 0.001)
    health = store_health.StoreHealth(
        None,  # type: ignore[arg-type]
        work_stream="WORK",
        headroom_bytes=0,
        supervisor=Supervisor("test"),
    )
    health._full = True  # probed every interval until there is room
    monkeypatch.setattr(health, "_probe", rounds)
    return health._watch()


def _claim_lifetimes(monkeypatch: pytest.MonkeyPatch, rounds: LosesTheFirstCancel) -> Any:
    from asyncinfer.claim_lifetimes import ClaimLifetimes

    lifetimes = ClaimLifetimes(None, None, Supervisor("test"), workers=1)  # type: ignore[arg-type]
    monkeypatch.setattr(lifetimes, "apply", rounds)
    queue: asyncio.Queue[Any] = asyncio.Queue()
    for rewrite in ("first", "second"):
        queue.put_nowait(rewrite)
    return lifetimes._work(queue)


def _batch_driver(monkeypatch: pytest.MonkeyPatch, rounds: LosesTheFirstCancel) -> Any:
    from services.gateway.batch_driver import BatchDriver

    config = Config().replace(batches={"adopt_interval_s": 0.001})  # an adoption pass every round
    driver = BatchDriver(
        config,
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        records=None,  # type: ignore[arg-type]
        expiry=None,  # type: ignore[arg-type]
        submitter=None,  # type: ignore[arg-type]
        nc=None,  # type: ignore[arg-type]
    )
    monkeypatch.setattr(driver, "_adopt", rounds)
    return driver.run()


LOOPS = {
    "stranded-messages": _stranded_messages,
    "blob-sweeper": _blob_sweeper,
    "heartbeat": _heartbeat,
    "lease-reclaim": _lease_reclaim,
    "peer-watch": _peer_watch,
    "model-registry": _model_registry,
    "runtime-models": _runtime_models,
    "store-health": _store_health,
    "claim-lifetimes": _claim_lifetimes,
    "batch-driver": _batch_driver,
}


@pytest.mark.parametrize("name", list(LOOPS))
async def test_a_loop_whose_round_lost_the_stops_cancellation_ends_before_its_next_round(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop cancels a service's loops once (cancel_and_wait cancels again only RECANCEL_S later);
    a round's NATS request that lost that cancellation (gh-86296) left the loop going on to its next
    round. It ends before it: whichever of the two comes first is asserted, not when."""
    rounds = LosesTheFirstCancel()
    loop = asyncio.ensure_future(LOOPS[name](monkeypatch, rounds))
    second = asyncio.ensure_future(rounds.second.wait())
    try:
        await asyncio.wait_for(rounds.in_first.wait(), WAIT_S)
        loop.cancel()  # once: the stop's cancellation, which the round loses
        await asyncio.wait({loop, second}, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        assert rounds.rounds == 1, f"{rounds.rounds - 1} rounds after the stop's cancellation"
        assert loop.cancelled()
    finally:
        for task in (loop, second):
            task.cancel()
        await asyncio.gather(loop, second, return_exceptions=True)


async def test_a_loop_that_raises_during_shutdown_is_not_a_failure() -> None:
    supervisor = Supervisor("test")
    go = asyncio.Event()

    async def dies_on_teardown() -> None:
        await go.wait()
        raise Broken("connection drained")

    task = supervisor.start("feed", dies_on_teardown())
    supervisor.begin_stop()
    go.set()
    await task
    assert supervisor.failure is None
    await supervisor.stop()


class FakeApp:
    def __init__(self, name: str, stopped: list[str]) -> None:
        self.name = name
        self.port = 0
        self.supervisor = Supervisor(name)
        self._stopped = stopped

    async def start(self) -> None:
        pass

    async def stop(self, grace_s: float = 5.0) -> None:
        self._stopped.append(self.name)
        await self.supervisor.stop()


def _starter(app: FakeApp) -> Any:
    async def start() -> FakeApp:
        await app.start()
        return app

    return start


async def test_a_dead_loop_ends_run_until_stopped_with_a_failure_exit_code() -> None:
    stopped: list[str] = []
    first, second = FakeApp("first", stopped), FakeApp("second", stopped)
    go = asyncio.Event()

    async def dies() -> None:
        await go.wait()
        raise Broken("the bug")

    def started(_apps: Any) -> None:
        first.supervisor.start("dies", dies())
        go.set()

    code = await asyncio.wait_for(
        run_until_stopped([_starter(first), _starter(second)], grace_s=1.0, on_started=started, stop=StopSignal()),
        WAIT_S,
    )
    assert code == EXIT_LOOP_DIED
    assert stopped == ["second", "first"]  # every app stopped, in reverse order, as for a signal


async def test_a_stop_signal_ends_run_until_stopped_with_exit_code_0() -> None:
    stopped: list[str] = []
    stop = StopSignal()
    code = await asyncio.wait_for(
        run_until_stopped(
            [_starter(FakeApp("only", stopped))], grace_s=1.0, on_started=lambda _: stop.set(), stop=stop
        ),
        WAIT_S,
    )
    assert (code, stopped) == (EXIT_STOPPED, ["only"])


async def test_an_abort_stops_every_app_in_reverse_order_with_its_exit_code() -> None:
    # `asyncinfer up` aborts when its embedded nats-server exits: the loops that die of it while
    # the apps stop neither change the exit code nor log a second "stopping".
    stopped: list[str] = []
    first, second = FakeApp("first", stopped), FakeApp("second", stopped)
    stop = StopSignal()
    announced: list[str] = []

    def started(_apps: Any) -> None:
        announced.append("banner")
        stop.abort("the embedded nats-server exited (exit code -9)")
        stop.fail(LoopDied(owner="first", loop="feed", error=Broken("its connection is gone")))

    with capture_logs() as logs:
        code = await asyncio.wait_for(
            run_until_stopped([_starter(first), _starter(second)], grace_s=1.0, on_started=started, stop=stop),
            WAIT_S,
        )
    assert code == EXIT_UNAVAILABLE
    assert stopped == ["second", "first"]
    assert announced == ["banner"]
    assert [(e["event"], e["log_level"]) for e in logs if e["log_level"] == "error"] == [("stopping", "error")]


async def test_an_apps_stop_request_stops_every_app_with_its_exit_code() -> None:
    # A batcher whose model call hangs asks its process to stop (batcher.exit_after_overrun_s).
    stopped: list[str] = []
    first, second = FakeApp("first", stopped), FakeApp("second", stopped)

    def started(_apps: Any) -> None:
        second.supervisor.request_stop("a model call that does not return", EXIT_MODEL_HUNG)
        second.supervisor.request_stop("a later reason", 1)  # the first counts

    with capture_logs() as logs:
        code = await asyncio.wait_for(
            run_until_stopped([_starter(first), _starter(second)], grace_s=1.0, on_started=started, stop=StopSignal()),
            WAIT_S,
        )
    assert (code, stopped) == (EXIT_MODEL_HUNG, ["second", "first"])
    assert [e["reason"] for e in logs if e["event"] == "stopping"] == ["a model call that does not return"]


async def test_no_banner_for_a_process_stopped_while_it_started() -> None:
    stopped: list[str] = []
    stop = StopSignal()
    announced: list[str] = []

    async def start_then_signal() -> Any:
        app = FakeApp("only", stopped)
        await app.start()
        stop.set()  # Ctrl-C while it was starting (a model loading, say)
        return app

    code = await asyncio.wait_for(
        run_until_stopped([start_then_signal], grace_s=1.0, on_started=announced.append, stop=stop), WAIT_S
    )
    assert (code, stopped, announced) == (EXIT_STOPPED, ["only"], [])


async def test_a_loop_dying_in_a_real_scheduler_stops_it_with_a_failure_exit_code(
    config: Config, nc: NatsClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_set(self: PauseState, model_name: str, *, paused: bool) -> None:
        raise Broken(f"cannot note {model_name!r} as paused={paused}")

    # The scheduler's pause feed follows the queues bucket; the pause written below breaks it.
    monkeypatch.setattr(PauseState, "_set", broken_set)
    apps: list[SchedulerApp] = []

    async def start_scheduler() -> SchedulerApp:
        app = SchedulerApp(config)
        apps.append(app)
        await app.start()
        return app

    pause_written = asyncio.Event()

    def started(_apps: Any) -> None:
        async def pause_demo() -> None:
            kv = await nc.jetstream().key_value(config.nats.queues_bucket)
            await kv.put(paused_key("demo"), b'{"by": "test"}')
            pause_written.set()

        background.append(asyncio.create_task(pause_demo()))

    background: list[asyncio.Task[None]] = []
    with capture_logs() as logs:
        code = await asyncio.wait_for(
            run_until_stopped([start_scheduler], grace_s=1.0, on_started=started, stop=StopSignal()), WAIT_S
        )
    await asyncio.gather(*background)
    assert pause_written.is_set()
    assert code == EXIT_LOOP_DIED
    (scheduler,) = apps
    assert scheduler.supervisor.failure is not None
    assert scheduler.supervisor.failure.loop == "scheduler-pauses"
    died = [entry for entry in logs if entry["event"] == "loop_died"]
    assert [(entry["owner"], entry["loop"]) for entry in died] == [("scheduler", "scheduler-pauses")]
    assert any(entry["event"] == "scheduler_stopped" for entry in logs)  # stopped in order, as for a signal
    assert scheduler.supervisor.loop_names == []


# The scheduler command with the same bug planted: the process exits with EXIT_LOOP_DIED.
BROKEN_SCHEDULER = """
import sys
from services.cli import main
from services.scheduler.pauses import PauseState

def broken_set(self, model_name, *, paused):
    raise RuntimeError("planted bug")

PauseState._set = broken_set
sys.exit(main(["scheduler"]))
"""


async def test_the_scheduler_command_exits_with_exit_loop_died_when_a_loop_dies(config: Config, nc: NatsClient) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "ASYNCINFER_NATS__URL": config.nats.url,
        "ASYNCINFER_SCHEDULER__PORT": "0",
        "ASYNCINFER_SCHEDULER__METRICS_PORT": "0",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", BROKEN_SCHEDULER, cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE
    )
    assert process.stdout is not None
    serving = await asyncio.wait_for(process.stdout.readline(), START_S)
    assert b"asyncinfer scheduler serving on" in serving
    kv = await nc.jetstream().key_value(config.nats.queues_bucket)
    await kv.put(paused_key("demo"), b'{"by": "test"}')
    try:
        code = await asyncio.wait_for(process.wait(), WAIT_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert code == EXIT_LOOP_DIED


@pytest.mark.unit
async def test_a_task_awaited_only_at_its_end_says_its_failure_at_once() -> None:
    """Tasks their owners gather with return_exceptions only at the end (a work stream's result
    stores, a model version's drain, a SIGHUP reload) failed without a word until then."""

    async def broken() -> None:
        raise KeyError("a bug")

    async def fine() -> None:
        return None

    with capture_logs() as logs:
        for work in (broken(), fine()):
            task = asyncio.create_task(work, name=work.__name__)
            task.add_done_callback(failure_logged)
            await asyncio.wait([task])
    (said,) = [entry for entry in logs if entry["event"] == "background_task_failed"]
    assert said["task"] == "broken"
    assert isinstance(said["exc_info"], KeyError)
