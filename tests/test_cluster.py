"""A 3-node nats-server cluster (each node its own process, ports and store) with every stream and
bucket replicated 3 times; gateway, scheduler and batcher run in this process, connected to all
three nodes. While a client submits a steady stream of jobs, the node leading the WORK stream is
killed with SIGKILL. Every accepted job must still succeed, and service must resume within
RECOVERY_BOUND_S: no gap longer than that between two accepted submissions, nor between two
completions.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest
import structlog
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import BadRequestError, NoStreamResponseError

from asyncinfer import backoff, snapshot_watch
from asyncinfer.config import Config
from asyncinfer.declarations import ensure_work_stream
from asyncinfer.embedded_nats import NatsServerProcess, free_port
from asyncinfer.errors import Unavailable
from asyncinfer.failure_lines import unreachable
from asyncinfer.ids import new_job_id
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobRecord, JobState, Priority
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import JetStreamContext, JetStreamError, Msg, streams
from asyncinfer.nats.connection import connect
from asyncinfer.nats.kv import open_kv_bucket
from asyncinfer.nats.streams import StreamPosition
from asyncinfer.v1 import job_pb2, job_service_pb2, tensor_pb2
from services.gateway.app import GatewayApp
from services.gateway.watch_one import watch_job
from tests.stack import StartStack

if TYPE_CHECKING:
    from structlog.typing import EventDict

    from asyncinfer.v1.job_service_pb2_grpc import JobServiceAsyncStub as JobStub

log = structlog.get_logger("test.cluster")

NODES = 3
SUBMIT_RATE_PER_S = 25.0
RUN_S = 14.0
KILL_AFTER_S = 4.0
# Service must resume within this after the kill. A leader election takes a few seconds, but with three
# nodes, the services and the client on 2 cores a second election of the jobs bucket's stream has been
# seen to stall writes for 25.8 s (once in many runs): the bound is liveness, not a speed target.
RECOVERY_BOUND_S = 45.0
# Every accepted job must have succeeded this long after the last submission.
DRAIN_BOUND_S = 30.0
SUBMIT_TIMEOUT_S = 20.0


@dataclass
class NatsCluster:
    nodes: list[NatsServerProcess]

    @property
    def urls(self) -> str:
        return ",".join(node.url for node in self.nodes)

    def node(self, server_name: str) -> NatsServerProcess:
        (found,) = [n for n in self.nodes if n.server_name == server_name]
        return found


@contextlib.contextmanager
def nats_cluster(base: Path, *, started: int = NODES) -> Iterator[NatsCluster]:
    """The cluster's nodes, the first `started` of them running (the others: `node.start()`)."""
    client_ports = [free_port() for _ in range(NODES)]
    route_ports = [free_port() for _ in range(NODES)]
    nodes = []
    for i in range(NODES):
        routes = ",".join(f"nats://127.0.0.1:{p}" for j, p in enumerate(route_ports) if j != i)
        cluster_args = (
            "--cluster_name", "asyncinfer-test",
            "--cluster", f"nats://127.0.0.1:{route_ports[i]}",
            "--routes", routes,
        )  # fmt: skip
        name = f"n{i + 1}"
        nodes.append(
            NatsServerProcess(
                store_dir=base / name,
                port=client_ports[i],
                server_name=name,
                log_file=base / f"{name}.log",
                extra_args=cluster_args,
            )
        )
    try:
        for node in nodes[:started]:
            node.start()
        yield NatsCluster(nodes)
    finally:
        for node in nodes:
            node.stop()


async def wait_for_jetstream(config: Config, timeout_s: float = 30.0) -> None:
    """Until the cluster has elected its meta leader and answers JetStream requests."""
    nc = await connect(config.nats, name="test-cluster-ready")
    try:
        js = nc.jetstream(timeout=2)
        give_up_at = time.monotonic() + timeout_s
        while True:
            try:
                await js.account_info()
                return
            except (TimeoutError, JetStreamError):
                assert time.monotonic() < give_up_at, "the cluster did not elect a JetStream leader"
                await asyncio.sleep(0.2)
    finally:
        await nc.close()


@dataclass
class Ledger:
    accepted: dict[str, float] = field(default_factory=dict)  # job ID -> when accepted (monotonic)
    refused: int = 0  # UNAVAILABLE answers the client retried
    completed: dict[str, job_pb2.Job] = field(default_factory=dict)


def demo_request(i: int) -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([float(i), 1.0, 2.0, 3.0])
    return job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[x])


async def submit_steadily(stub: JobStub, ledger: Ledger, stop_at: float) -> None:
    """SUBMIT_RATE_PER_S submissions a second until stop_at, each retried on UNAVAILABLE (a new
    job each time: an UNAVAILABLE answer means nothing was accepted)."""

    async def one(i: int) -> None:
        while True:
            try:
                response = await stub.SubmitJob(demo_request(i), timeout=SUBMIT_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                ledger.refused += 1
                await asyncio.sleep(0.2)
                continue
            ledger.accepted[response.job.job_id] = time.monotonic()
            return

    tasks: list[asyncio.Task[None]] = []
    i = 0
    try:
        while time.monotonic() < stop_at:
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            await asyncio.sleep(1 / SUBMIT_RATE_PER_S)
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_results(stub: JobStub, ledger: Ledger, submitting: asyncio.Task[None], until: float) -> None:
    """Polls GetJob for every accepted job not yet finished, until submission is over and all
    have finished, or `until` passes."""
    while time.monotonic() < until:
        submission_over = submitting.done()
        pending = [job_id for job_id in ledger.accepted if job_id not in ledger.completed]
        for start in range(0, len(pending), 64):
            answers = await asyncio.gather(
                *(stub.GetJob(job_service_pb2.GetJobRequest(job_id=j), timeout=5) for j in pending[start : start + 64]),
                return_exceptions=True,
            )
            for answer in answers:
                if isinstance(answer, job_service_pb2.GetJobResponse) and answer.job.state not in (
                    job_pb2.JOB_STATE_QUEUED,
                    job_pb2.JOB_STATE_RUNNING,
                ):
                    ledger.completed[answer.job.job_id] = answer.job
        if submission_over and len(ledger.completed) == len(ledger.accepted):
            return
        await asyncio.sleep(0.25)


def longest_gap(moments: list[float], start: float, end: float) -> float:
    """The longest interval within [start, end] without any of `moments`."""
    points = [start, *sorted(m for m in moments if start <= m <= end), end]
    return max(b - a for a, b in itertools.pairwise(points))


async def assert_feeds_recovered(gateway: GatewayApp, nc: NatsClient, config: Config, *, since: float) -> None:
    """The gateway's KV feeds (queue snapshots, WatchJob updates) run on ordered consumers that
    may have lived on the killed node: they must be delivering again."""
    view = gateway.queue_view
    give_up_at = time.monotonic() + RECOVERY_BOUND_S
    while (snapshot := view.snapshot("demo")) is None or snapshot.updated_at < since + 1:
        assert time.monotonic() < give_up_at, "no queue snapshot reached the gateway after the kill"
        await asyncio.sleep(0.1)

    # A record only this test writes (no work message: the scheduler never sees it), watched
    # while the test changes it.
    store = JobStore(await open_kv_bucket(nc.jetstream(), config.nats.jobs_bucket), work_stream=config.nats.work_stream)
    now = time.time()
    record = await store.create(
        JobRecord(
            job_id=new_job_id(),
            tenant=config.gateway.default_tenant,
            model_name="demo",
            model_version="1",
            state=JobState.QUEUED,
            priority=Priority.NORMAL,
            create_time=now,
            update_time=now,
            max_attempts=1,
            result_retention_s=60,
        )
    )
    # The watch reads the record first; a read the cluster answers 503 "JetStream system temporarily
    # unavailable" (a node's view still catching up after the elections) is the gateway's UNAVAILABLE,
    # which a client retries (session 33's CI2 met it here, the record's create answered): opened again.
    while True:
        updates = watch_job(gateway.watch_hub, record.tenant, record.job_id)
        try:
            first = await anext(updates)
            break
        except Unavailable:
            await updates.aclose()
            assert time.monotonic() < give_up_at, "the record's watch was still refused after the kill"
            await asyncio.sleep(0.1)
    try:
        assert first.state is JobState.QUEUED
        await store.replace(record.evolve(state=JobState.CANCELED, end_time=time.time()))
        changed = await asyncio.wait_for(anext(updates), RECOVERY_BOUND_S)
        assert changed.state is JobState.CANCELED
    finally:
        await updates.aclose()


@pytest.fixture
def errors_logged() -> Iterator[list[tuple[str, BaseException | None]]]:
    """The error lines the test's process logs (event, and the exception each carried), still
    rendered as before."""
    seen: list[tuple[str, BaseException | None]] = []

    def record(_logger: object, method: str, event_dict: EventDict) -> EventDict:
        if method in ("error", "critical"):
            exc_info = event_dict.get("exc_info")
            if exc_info is True:
                exc_info = sys.exc_info()  # logged in its `except`: this runs there too
            error = exc_info if isinstance(exc_info, BaseException) else None
            if isinstance(exc_info, tuple):
                error = exc_info[1]
            seen.append((str(event_dict.get("event")), error))
        return event_dict

    saved = structlog.get_config()["processors"]
    structlog.configure(processors=[record, *saved])
    try:
        yield seen
    finally:
        structlog.configure(processors=saved)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[NatsCluster]:
    with nats_cluster(tmp_path) as running:
        yield running


@pytest.mark.timeout(150)
async def test_killing_the_stream_leader_loses_no_job(
    errors_logged: list[tuple[str, BaseException | None]], cluster: NatsCluster, config: Config, start_stack: StartStack
) -> None:
    config = config.replace(
        nats={"url": cluster.urls, "replicas": 3},
        scheduler={"ack_wait_s": 5.0, "lease_renew_interval_s": 1.0, "queue_stats_interval_s": 1.0},
    )
    await wait_for_jetstream(config)
    stack = await start_stack(config)
    gateway, nc = stack.gateway, stack.nc
    ledger = Ledger()
    stub: JobStub = stack.jobs
    started = time.monotonic()
    submitting = asyncio.create_task(submit_steadily(stub, ledger, stop_at=started + RUN_S))
    collecting = asyncio.create_task(collect_results(stub, ledger, submitting, until=started + RUN_S + DRAIN_BOUND_S))

    await asyncio.sleep(KILL_AFTER_S)
    info = await nc.jetstream().stream_info(config.nats.work_stream)
    assert info.config.num_replicas == 3
    assert info.cluster is not None
    assert info.cluster.leader
    leader = cluster.node(info.cluster.leader)
    accepted_before_kill = len(ledger.accepted)
    killed_at = time.monotonic()
    leader.kill()
    log.warning("node_killed", node=leader.server_name, accepted_so_far=accepted_before_kill)

    await submitting
    submitted_until = time.monotonic()
    await collecting

    # Zero accepted jobs lost: every one of them succeeded.
    states = {job_id: ledger.completed[job_id].state for job_id in ledger.completed}
    unfinished = [job_id for job_id in ledger.accepted if job_id not in states]
    assert not unfinished, f"{len(unfinished)} of {len(ledger.accepted)} accepted jobs never finished"
    assert set(states.values()) == {job_pb2.JOB_STATE_SUCCEEDED}, states
    accepted_after_kill = [t for t in ledger.accepted.values() if t > killed_at]
    assert accepted_after_kill, "no job was accepted after the kill"

    # Service resumed: no long stall of acceptances (from the kill to the end of submission)
    # nor of completions (from the kill until the last job finished).
    accept_stall = longest_gap(list(ledger.accepted.values()), killed_at, submitted_until)
    end_times = [j.end_time.ToNanoseconds() / 1e9 for j in ledger.completed.values()]
    killed_wall = time.time() - (time.monotonic() - killed_at)
    completion_stall = longest_gap(end_times, killed_wall, max(end_times))
    print(
        f"\ncluster: killed {leader.server_name} (WORK leader) at {KILL_AFTER_S:.0f} s; "
        f"{len(ledger.accepted)} jobs accepted ({accepted_before_kill} before the kill), all succeeded; "
        f"{ledger.refused} UNAVAILABLE answers retried by the client; "
        f"longest stall after the kill: submissions {accept_stall:.2f} s, completions {completion_stall:.2f} s "
        f"(bound {RECOVERY_BOUND_S:.0f} s)"
    )
    assert accept_stall < RECOVERY_BOUND_S
    assert completion_stall < RECOVERY_BOUND_S
    await assert_feeds_recovered(gateway, nc, config, since=killed_wall)
    # NATS out of reach through the elections is said in warning lines: an error with its
    # traceback per job (65 dispatch_failed in one CI run) held the whole process for 100 s.
    nats_errors = [(event, repr(error)) for event, error in errors_logged if error and unreachable(error)]
    assert not nats_errors, nats_errors


# nats-py, leaving a stale connection, closes its transport but not the StreamWriter over it, whose
# __del__ then warns (the socket is closed all the same).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.timeout(120)
async def test_a_hung_node_is_left_for_another_within_seconds(
    cluster: NatsCluster, config: Config, start_stack: StartStack
) -> None:
    """A node that hangs (SIGSTOP: a stalled disk, a frozen VM) closes no connection. The services
    ping their node and move to another when it stops answering; before, with nats-py's pings
    every 120 s, every service on the hung node stopped for as long as it hung (60 s in the
    failover pass of session 25, while the other two nodes served)."""
    first = cluster.nodes[0]
    config = config.replace(nats={"url": first.url, "replicas": 3, "ping_interval_s": 1.0})
    await wait_for_jetstream(config.replace(nats={"url": cluster.urls}))
    stack = await start_stack(config)
    stub: JobStub = stack.jobs
    await stub.SubmitJob(demo_request(0), timeout=SUBMIT_TIMEOUT_S)
    assert first.process is not None
    first.process.send_signal(signal.SIGSTOP)
    hung_at = time.monotonic()
    try:
        accepted = await submit_until_accepted(stub, demo_request(1), give_up_after_s=40.0)
        accepted_in = time.monotonic() - hung_at
        done = await wait_until_done(stub, accepted.job.job_id, timeout_s=30.0)
    finally:
        first.process.send_signal(signal.SIGCONT)
    assert done.state == job_pb2.JOB_STATE_SUCCEEDED
    print(f"\ncluster: a submit was accepted {accepted_in:.1f} s after the services' node hung")
    assert accepted_in < 30.0


async def submit_until_accepted(
    stub: JobStub, request: job_service_pb2.SubmitJobRequest, *, give_up_after_s: float
) -> job_service_pb2.SubmitJobResponse:
    """Submits, and again after each UNAVAILABLE or DEADLINE_EXCEEDED."""
    give_up_at = time.monotonic() + give_up_after_s
    while True:
        try:
            return await stub.SubmitJob(request, timeout=5.0)
        except grpc.aio.AioRpcError as error:
            retriable = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            if error.code() not in retriable or time.monotonic() > give_up_at:
                raise
            await asyncio.sleep(0.2)


async def wait_until_done(stub: JobStub, job_id: str, *, timeout_s: float) -> job_pb2.Job:
    """Polls the job until it ends (a read refused UNAVAILABLE while leaders are elected is asked again)."""
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                job = (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id), timeout=5.0)).job
            except grpc.aio.AioRpcError as error:
                if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                await asyncio.sleep(0.2)
                continue
            if job.state in (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED):
                return job
            await asyncio.sleep(0.1)


@pytest.mark.timeout(120)
async def test_keyed_submits_wait_out_the_election_of_the_idempotency_buckets_leader(
    cluster: NatsCluster, config: Config, start_stack: StartStack
) -> None:
    """A submit with an idempotency key (every SDK submit has one) claims its key before its job is
    queued. The claim was written once: while the bucket's leader was elected (~5 s) every keyed
    submit was refused UNAVAILABLE at once, where one without a key waited (the failover pass of
    session 25: up to 437 bulk items refused per event). It now waits as a job's publish does, and
    each key is still one job."""
    config = config.replace(nats={"url": cluster.urls, "replicas": 3})
    await wait_for_jetstream(config)
    stack = await start_stack(config)
    stub: JobStub = stack.jobs
    info = await stack.nc.jetstream().stream_info(f"KV_{config.nats.idempotency_bucket}")
    assert info.cluster is not None
    assert info.cluster.leader
    requests = [demo_request(i) for i in range(5)]
    for i, request in enumerate(requests):
        request.idempotency_key = f"election-{i}"
    cluster.node(info.cluster.leader).kill()
    accepted = await asyncio.gather(*(stub.SubmitJob(r, timeout=SUBMIT_TIMEOUT_S) for r in requests))
    again = await asyncio.gather(*(stub.SubmitJob(r, timeout=SUBMIT_TIMEOUT_S) for r in requests))
    assert [a.job.job_id for a in again] == [a.job.job_id for a in accepted]
    assert all(a.deduplicated for a in again)


@pytest.mark.timeout(150)
async def test_the_services_start_while_a_node_is_lost_and_its_leaders_elected(
    cluster: NatsCluster, config: Config, start_stack: StartStack
) -> None:
    """A pod restarted during a failover: a gateway started 3 s after a node was killed (with every
    URL, the dead node's first) died with a traceback in 2 runs of 5 (the failover pass, session
    25): its declarations had 5 s, its watches no retry. (Rare enough on the old code that this
    test does not fail there reliably.)"""
    config = config.replace(nats={"url": cluster.urls, "replicas": 3})
    await wait_for_jetstream(config)
    first = await start_stack(config)  # the streams and buckets exist, with leaders spread over the nodes
    await first.stop()
    cluster.nodes[0].kill()
    await asyncio.sleep(3.0)
    stack = await start_stack(config)
    accepted = await submit_until_accepted(stack.jobs, demo_request(1), give_up_after_s=60.0)
    done = await wait_until_done(stack.jobs, accepted.job.job_id, timeout_s=60.0)
    assert done.state == job_pb2.JOB_STATE_SUCCEEDED


# What the services ask JetStream for as they start: each answers as a stream without a leader the
# first time it is asked for each thing (a stream, a bucket, a consumer, a watch's subject).
STARTING_CALLS = (
    "stream_info",
    "add_stream",
    "key_value",
    "create_key_value",
    "create_object_store",
    "add_consumer",
    "subscribe",
)


def asked_for(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """What a JetStreamContext call is about: its stream, bucket, consumer or subject."""
    named = [*args[:2], kwargs.get("bucket"), kwargs.get("config")]
    return "/".join(str(getattr(a, "durable_name", None) or getattr(a, "name", None) or a) for a in named if a)


async def test_every_service_starts_while_each_jetstream_request_of_its_start_meets_an_election(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test above is the real thing, and rarely fails on code that does not wait: this one
    plays the election for every JetStream request the gateway and the scheduler make as they start
    (each service's first request for each stream, bucket, consumer or watch answers as a leaderless
    stream does, or not at all), and for the stream info each snapshot watch reads first; the
    batcher's start makes none. Everything else is real. Each service starts, and the stack runs a
    job. The scheduler's first heartbeat, a KV write past nats-py's JetStreamContext, is played in
    test_scheduler.py. The retries' waits are made short: their length is not what is tested."""
    played: list[tuple[str, str]] = []
    asked: set[tuple[int, str, str]] = set()

    def first_time_unanswered(connection: object, call: str, what: str) -> None:
        if (id(connection), call, what) not in asked:
            asked.add((id(connection), call, what))
            played.append((call, what))
            raise NoStreamResponseError if len(played) % 2 else NatsTimeoutError

    def during_an_election(call: str) -> Any:
        real = getattr(JetStreamContext, call)

        @functools.wraps(real)
        async def election(self: JetStreamContext, *args: Any, **kwargs: Any) -> Any:
            first_time_unanswered(self._nc, call, asked_for(args, kwargs))
            return await real(self, *args, **kwargs)

        return election

    for call in STARTING_CALLS:
        monkeypatch.setattr(JetStreamContext, call, during_an_election(call))
    position = snapshot_watch.stream_position

    async def position_during_an_election(nc: NatsClient, stream: str, *, timeout_s: float) -> StreamPosition:
        first_time_unanswered(nc, "stream_position", stream)
        return await position(nc, stream, timeout_s=timeout_s)

    monkeypatch.setattr(snapshot_watch, "stream_position", position_during_an_election)
    monkeypatch.setattr(streams, "retry", functools.partial(backoff.retry, first_delay_s=0.002, max_delay_s=0.01))

    stack = await start_stack(config)
    monkeypatch.undo()  # the election is over

    assert {call for call, _ in played} == {*STARTING_CALLS, "stream_position"}, played
    # Per service: the gateway's and the scheduler's watches of the pauses each met it.
    assert played.count(("subscribe", f"$KV.{config.nats.queues_bucket}.paused.*")) == 2, played
    accepted = await stack.jobs.SubmitJob(demo_request(1))
    done = await wait_until_done(stack.jobs, accepted.job.job_id, timeout_s=30.0)
    assert done.state == job_pb2.JOB_STATE_SUCCEEDED
    assert stack.batcher is not None
    assert [app.supervisor.failure for app in (stack.gateway, stack.scheduler, stack.batcher)] == [None] * 3


@pytest.mark.timeout(60)
async def test_a_declaration_waits_for_the_servers_to_place_its_replicas(tmp_path: Path, config: Config) -> None:
    """A service that declared its streams while a new cluster had elected its meta leader but
    not yet heard from its third server was answered 'no suitable peers for placement' (a 400)
    for three replicas, and died: the first start of
    test_the_services_start_while_a_node_is_lost_and_its_leaders_elected did, on 2 busy cores
    (3 test workers). A declaration now waits for the servers as for a leader election. Here the
    third server starts late: the cluster refuses the placement, the declaration asks again, and
    it is done once the server has joined."""
    with nats_cluster(tmp_path, started=2) as cluster:
        config = config.replace(nats={"url": ",".join(node.url for node in cluster.nodes[:2]), "replicas": 3})
        await wait_for_jetstream(config)
        nc = await connect(config.nats, name="test-placement")
        try:
            js = nc.jetstream(timeout=2)
            with pytest.raises(BadRequestError) as refusal:
                await js.add_stream(name="PROBE", subjects=["probe.>"], num_replicas=3)
            assert refusal.value.err_code == 10005, refusal.value  # no suitable peers for placement
            asked = asyncio.Queue[bytes]()  # each create request of the WORK stream, as the server gets it

            async def heard(msg: Msg) -> None:
                await asked.put(msg.data)

            await nc.subscribe(f"$JS.API.STREAM.CREATE.{config.nats.work_stream}", cb=heard)
            await nc.flush()
            declaring = asyncio.ensure_future(ensure_work_stream(js, config.nats))
            try:
                for _ in range(2):  # asked, refused, and asked again: not given up
                    heard_again = asyncio.ensure_future(asked.get())
                    await asyncio.wait({declaring, heard_again}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
                    heard_again.cancel()
                    assert not declaring.done(), declaring.exception()
                await asyncio.to_thread(cluster.nodes[2].start)
                await asyncio.wait_for(declaring, timeout=30)
            finally:
                declaring.cancel()
            info = await js.stream_info(config.nats.work_stream)
            assert info.config.num_replicas == 3
            assert info.cluster is not None
            assert len(info.cluster.replicas or []) == 2
        finally:
            await nc.close()
