"""A scheduler killed beside a live one, and not replaced: the survivor notices its heartbeat stop
(services/scheduler/peer_watch.py) and returns the jobs it held, in seconds rather than after AckWait,
of a model it learnt at runtime too (its sweep covered only the models its file declares).
Before session 38 only a scheduler's start swept for a dead instance's jobs, so with two replicas and
one lost with its node, its jobs waited out AckWait (20-30 s after its last lease renewal)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
from nats.js.errors import NotFoundError

from asyncinfer.config import DEMO_MODEL, Config, render_default_config
from asyncinfer.contract import scheduler_key
from asyncinfer.declarations import ensure_queues_bucket
from asyncinfer.embedded_nats import NatsServerProcess, free_port
from asyncinfer.jobs import JobState
from asyncinfer.nats.connection import connect
from asyncinfer.nats.kv import KvBucket, kv_latest
from asyncinfer.nats.kv_watch import KeyUpdate, KeyWatch
from asyncinfer.v1 import job_service_pb2, job_service_pb2_grpc, tensor_pb2
from services.scheduler import instances, peer_watch
from services.scheduler.instances import SchedulerInstance
from services.scheduler.peer_watch import PeerWatch
from tests.kv_helpers import JobWrites
from tests.processes import Service, until
from tests.test_crash import crash_config
from tests.waits import WAIT_S

JOBS = 300
# Far above the survivor's sweep (~8 s after the kill): only its naks can run the jobs again in time.
ACK_WAIT_S = 25.0
BACK_WITHIN_S = 18.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(run: str, *, removed: bool = False) -> KeyUpdate:
    value = b"" if removed else f"host:1/{run}".encode()
    return KeyUpdate(key=f"scheduler.{run}", value=value, headers={}, removed=removed)


async def no_sweep() -> int:
    raise AssertionError("not swept here")


def watching(run: str, clock: Clock) -> PeerWatch:
    queues = KvBucket(name="queues", kv=None, js=None)  # type: ignore[arg-type]  # not reached here
    return PeerWatch(queues, run, no_sweep, clock=clock)


@pytest.mark.unit
def test_a_peer_silent_past_its_ttl_is_lost_once_while_our_own_beats_arrive() -> None:
    clock = Clock()
    peers = watching("b", clock)
    peers._update(beat("b"))
    peers._update(beat("c"))
    for _ in range(int(peer_watch.SILENT_AFTER_S) + 1):
        clock.now += 1.0
        peers._update(beat("b"))  # our own
        peers._update(beat("c"))
    assert peers.silent_peers() == []
    clock.now += 0.5
    peers._update(beat("b"))
    assert peers.silent_peers() == []  # c's last beat came 1.5 s ago
    for _ in range(int(peer_watch.SILENT_AFTER_S)):
        clock.now += 1.0
        peers._update(beat("b"))
    clock.now += 1.0
    peers._update(beat("b"))
    assert peers.silent_peers() == ["c"]
    assert peers.silent_peers() == []  # said once
    peers._update(beat("c"))  # it beats again: a peer again
    assert peers._peers == {"c": clock.now}


@pytest.mark.unit
def test_nobody_is_judged_while_our_own_beats_do_not_arrive() -> None:
    """A watch stalled by a NATS outage delivers no one's beats: silence counts from its return."""
    clock = Clock()
    peers = watching("a", clock)
    peers._update(beat("a"))
    peers._update(beat("b"))
    clock.now += 30.0
    assert peers.silent_peers() == []  # our own last beat is 30 s old: the watch is stalled
    peers._update(beat("a"))  # back: b's silence counts from now
    assert peers.silent_peers() == []
    for _ in range(int(peer_watch.SILENT_AFTER_S) + 1):
        clock.now += 1.0
        peers._update(beat("a"))
    assert peers.silent_peers() == ["b"]


@pytest.mark.unit
def test_a_peer_that_stopped_in_order_is_not_swept_and_the_smallest_run_sweeps() -> None:
    clock = Clock()
    peers = watching("b", clock)
    for run in ("b", "a", "c"):
        peers._update(beat(run))
    assert not peers.sweeps()  # a is live and smaller
    peers._update(beat("a", removed=True))  # a stopped in order: its key deleted
    assert peers.sweeps()
    for _ in range(int(peer_watch.SILENT_AFTER_S) + 1):
        clock.now += 1.0
        peers._update(beat("b"))
        peers._update(beat("c"))
    assert peers.silent_peers() == []  # a is not silent: it left


@pytest.mark.e2e
@pytest.mark.timeout(400)
async def test_a_live_scheduler_returns_the_jobs_of_a_killed_peer_in_seconds(
    nats_server: NatsServerProcess, tmp_path: Path
) -> None:
    ports = {name: free_port() for name in ("gateway", "scheduler-a", "batcher-a", "scheduler-b", "batcher-b")}
    services: dict[str, Service] = {}
    for side in ("a", "b"):
        config = crash_config(
            nats_server.url,
            {"gateway": ports["gateway"], "scheduler": ports[f"scheduler-{side}"], "batcher": ports[f"batcher-{side}"]},
        ).replace(scheduler={"ack_wait_s": ACK_WAIT_S}, logging={"level": "info", "format": "json"})
        folder = tmp_path / side
        folder.mkdir()
        config_file = folder / "asyncinfer.toml"
        config_file.write_text(render_default_config(config))
        if side == "a":  # the survivor's file declares another model: it learns the batcher's at runtime
            other = config.replace(models=[DEMO_MODEL.model_copy(update={"name": "other"})])
            (folder / "scheduler.toml").write_text(render_default_config(other))
            services["scheduler-a"] = Service("scheduler", folder / "scheduler.toml", folder, ports["scheduler-a"])
        for name in ("batcher",) + (("scheduler", "gateway") if side == "b" else ()):
            port = ports["gateway"] if name == "gateway" else ports[f"{name}-{side}"]
            services[f"{name}-{side}"] = Service(name, config_file, folder, port)
    nc = await connect(Config().replace(nats={"url": nats_server.url}).nats, name="peer-watch-test")
    jobs_bucket = JobWrites(nc)

    b_instance = f"{socket.gethostname()}:{ports['scheduler-b']}/"  # services.scheduler.instances

    def held_by_b() -> list[str]:
        return [key for key in jobs_bucket.keys_in(JobState.RUNNING) if held_by(key, b_instance)]

    def held_by(key: str, instance: str) -> bool:
        record = jobs_bucket.latest(key)
        return record is not None and record.dispatched_by.startswith(instance)

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{ports['gateway']}")
    try:
        for name in ("gateway-b", "scheduler-a", "scheduler-b", "batcher-a", "batcher-b"):
            await services[name].start()
        await jobs_bucket.start()
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
        x.contents.fp32_contents.extend([1, 2, 3, 4])
        request = job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[x])
        jobs = [(await stub.SubmitJob(request, timeout=10)).job.job_id for _ in range(JOBS)]
        await until(lambda: len(held_by_b()) >= 8, WAIT_S)
        killed = time.monotonic()
        services["scheduler-b"].kill()  # its node lost: the scheduler and its batcher, not replaced
        services["batcher-b"].kill()
        stranded = held_by_b()
        await until(lambda: jobs_bucket.all_ran_again(stranded, killed), BACK_WITHIN_S)
        slowest = jobs_bucket.slowest_again(stranded, killed)
        keys = [f"default.{job_id}" for job_id in jobs]
        await until(lambda: jobs_bucket.all_terminal(keys), 90)
    finally:
        await channel.close(None)
        for service in services.values():
            service.stop()
        await jobs_bucket.stop()
        await nc.close()
    print(f"peer lost: {len(stranded)} RUNNING on it, the slowest ran again {slowest:.2f} s after the kill")
    lines = (tmp_path / "a" / "scheduler-1.log").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    returned = {entry["job_id"] for entry in events if entry.get("event") == "lease_returned"}
    assert {key.partition(".")[2] for key in stranded} <= returned
    (lost,) = [entry for entry in events if entry.get("event") == "peer_scheduler_lost"]
    assert [peer.startswith(b_instance) for peer in lost["peers"]] == [True], lost
    assert lost["jobs_returned"] >= len(stranded)
    assert slowest < BACK_WITHIN_S < ACK_WAIT_S
    final = Counter(record.state.name for key in keys if (record := jobs_bucket.latest(key)) is not None)
    assert final == {"SUCCEEDED": JOBS}, final
    assert max(sum(record.state.is_terminal for _, record in jobs_bucket.writes[key]) for key in keys) == 1


async def test_a_heartbeat_ended_in_order_leaves_nothing_in_the_bucket(
    nats_server: NatsServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop in order deletes its heartbeat key; KeyValue.delete's marker stayed in the queues
    bucket for good, one per scheduler run, and every watch of the heartbeats (each scheduler's,
    at its start) read them all. The marker now expires, once watchers have heard of it."""
    monkeypatch.setattr(instances, "DELETED_HEARTBEAT_TTL_S", 1)
    config = Config().replace(nats={"url": nats_server.url})
    nc = await connect(config.nats, name="heartbeat-test")
    try:
        js = nc.jetstream()
        queues = KvBucket(name=config.nats.queues_bucket, kv=await ensure_queues_bucket(js, config.nats), js=js)
        instance = SchedulerInstance("scheduler-test", "run1", queues)
        heard: list[KeyUpdate] = []
        beat_heard = asyncio.Event()
        ended = asyncio.Event()

        def update(change: KeyUpdate) -> None:
            heard.append(change)
            (ended if change.removed else beat_heard).set()

        watch = KeyWatch(js, config.nats.queues_bucket, update, keys="scheduler.*", name="test")
        await watch.start()
        try:
            await instance.beat()
            # Heard before the stop: the bucket keeps one message per key, so a beat the delete
            # replaced before the watch's consumer reached it is never delivered (CI under load).
            await asyncio.wait_for(beat_heard.wait(), WAIT_S)
            await instance.end()
            await asyncio.wait_for(ended.wait(), WAIT_S)  # watchers hear of the stop
        finally:
            await watch.stop()
        assert [change.removed for change in heard] == [False, True]
        assert await kv_latest(queues, scheduler_key("run1")) is None

        async def left() -> bool:
            try:
                await js.get_last_msg(queues.stream, queues.subject_prefix + scheduler_key("run1"))
            except NotFoundError:
                return False
            return True

        deadline = time.monotonic() + 10
        while await left():
            assert time.monotonic() < deadline, "the deleted heartbeat's marker is still in the bucket"
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


async def test_the_lasting_markers_of_past_runs_leave_the_bucket(
    nats_server: NatsServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release before session 38 deleted its heartbeat key at every stop with a marker that stays
    for good: a scheduler's peer watch deletes each such key again with a marker that expires."""
    monkeypatch.setattr(peer_watch, "DELETED_HEARTBEAT_TTL_S", 1)
    monkeypatch.setattr(peer_watch, "CHECK_INTERVAL_S", 0.05)
    config = Config().replace(nats={"url": nats_server.url})
    nc = await connect(config.nats, name="markers-test")
    try:
        js = nc.jetstream()
        queues = KvBucket(name=config.nats.queues_bucket, kv=await ensure_queues_bucket(js, config.nats), js=js)
        for run in ("old1", "old2"):  # as the release before ended its runs
            await queues.kv.put(scheduler_key(run), f"host:1/{run}".encode())
            await queues.kv.delete(scheduler_key(run))
        await queues.kv.put(scheduler_key("live"), b"host:2/live")

        async def left() -> list[str]:
            info = await js.stream_info(queues.stream, subjects_filter=queues.subject_prefix + "scheduler.*")
            return sorted((info.state.subjects or {}).keys())

        assert len(await left()) == 3
        watch = asyncio.create_task(PeerWatch(queues, "me", no_sweep).run())
        try:
            deadline = time.monotonic() + 10
            while await left() != [queues.subject_prefix + scheduler_key("live")]:
                assert time.monotonic() < deadline, await left()
                await asyncio.sleep(0.1)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        assert await kv_latest(queues, scheduler_key("live")) is not None
    finally:
        await nc.close()
