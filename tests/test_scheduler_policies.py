"""Scheduler policies against a real nats-server and a real SchedulerApp, driven by fake batchers
that are real WorkerService gRPC clients: retries and dead letters (list, get, replay, purge),
poison jobs, expiry at dispatch, execution timeouts, cancellation, pause/resume, drain, queue
snapshots, the tenant counter, and priority under saturation."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timedelta, tzinfo
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import duration_pb2
from prometheus_client import generate_latest
from structlog.testing import capture_logs
from test_scheduler import FakeBatcher, enqueue, read_record, until, wait_state, work_messages

from asyncinfer.blob_meta import new_input_ref, result_ref
from asyncinfer.blobs import BlobStore, ensure_objects_bucket
from asyncinfer.claim_check_io import store_outputs
from asyncinfer.client import AsyncClient
from asyncinfer.codecs.envelope import decode_envelope
from asyncinfer.codecs.record import decode_record, encode_record
from asyncinfer.commands.ops import (
    DEAD_LETTER_COLUMNS,
    attempts_text,
    dead_letter_json,
    dead_letter_row,
    dead_letter_text,
)
from asyncinfer.commands.output import attempt_text, job_summary, job_text
from asyncinfer.config import Config, render_default_config
from asyncinfer.contract import (
    DEAD_SUBJECTS,
    JOB_ID_HEADER,
    PRIORITY_HEADER,
    TENANT_HEADER,
    claim_key,
    consumer_next_subject,
    snapshot_key,
    stream_msg_delete_subject,
    work_consumer_name,
)
from asyncinfer.declarations import ensure_queues_bucket
from asyncinfer.embedded_nats import NatsServerProcess, free_port
from asyncinfer.errors import NotFound, Unavailable
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.idempotency_claims import (
    KEY_TTL_SLACK_S,
    QUEUE_HORIZON_WITHOUT_DEADLINE_S,
    Claim,
    ClaimStore,
    ensure_idempotency_bucket,
)
from asyncinfer.ids import new_job_id
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import PRIORITIES_BY_RANK, BlobRef, JobRecord, JobState, Priority, job_key, job_work_subject
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import KeyValue, NatsTimeoutError, NoRespondersError, NotFoundError, api
from asyncinfer.nats.kv import KvBucket
from asyncinfer.nats.streams import ensure_stream
from asyncinfer.queued_notice import decode_queued_notice
from asyncinfer.queues import CancelNotice, QueueSnapshot, cancel_subject, decode_snapshot
from asyncinfer.snapshot_watch import SnapshotWatch
from asyncinfer.tensor_codec import decode_tensors, to_input_proto
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import (
    error_pb2,
    job_pb2,
    job_service_pb2,
    ops_service_pb2,
    ops_service_pb2_grpc,
    tensor_pb2,
    worker_service_pb2,
)
from services.console import pages_jobs
from services.scheduler import app as scheduler_app
from services.scheduler import dead_letters, held_pulls, job_dispatch, leases, pauses, queue_stats, version_routing
from services.scheduler.app import SchedulerApp
from services.scheduler.dead_letters import DeadLetter, DeadLetterStore, ensure_dead_letter_stream
from services.scheduler.priority import PrioritySelector, TenantRoundRobin
from services.scheduler.queue_stats import desired_batchers, waited_s
from services.scheduler.snapshot_writes import write_snapshots
from services.scheduler.stale_results import older_attempts_result, own_attempts_result
from tests.nats_probes import RequestsSeen
from tests.processes import Service
from tests.silent_proxy import SilentProxy
from tests.stack import StartStack

MODEL = "demo"
TENANT = "default"
MODEL_ERROR = error_pb2.ErrorStatus(code=13, reason="MODEL_ERROR", message="model raised: boom", retriable=True)


def tune(config: Config, **model_changes: Any) -> Config:
    model = {**config.models[0].model_dump(), "retry_backoff_base_s": 0.05, "retry_backoff_max_s": 0.2}
    return config.replace(models=[{**model, **model_changes}], scheduler={"queue_stats_interval_s": 0.2})


class ScriptedBatcher(FakeBatcher):
    """A fake batcher that also records CancelOrders, and can answer every order by itself."""

    def __init__(self, port: int, batcher_id: str) -> None:
        super().__init__(port, batcher_id)
        self.cancels: asyncio.Queue[worker_service_pb2.CancelOrder] = asyncio.Queue()
        self._auto: asyncio.Task[None] | None = None

    async def _read(self) -> None:
        async for response in self._call:
            kind = response.WhichOneof("message")
            if kind == "welcome":
                self.welcome.set_result(response.welcome)
            elif kind == "order":
                self.orders.put_nowait(response.order)
            elif kind == "cancel":
                self.cancels.put_nowait(response.cancel)

    async def next_cancel(self, timeout_s: float = 5.0) -> worker_service_pb2.CancelOrder:
        return await asyncio.wait_for(self.cancels.get(), timeout_s)

    def serve(self, decide: Callable[[worker_service_pb2.WorkOrder], Awaitable[None]]) -> None:
        """Answers every order with decide(order), then grants the credit back."""

        async def loop() -> None:
            while True:
                order = await self.orders.get()
                await decide(order)
                await self.grant(1)

        self._auto = asyncio.create_task(loop())

    async def close(self) -> None:
        if self._auto is not None:
            self._auto.cancel()
            await asyncio.gather(self._auto, return_exceptions=True)
        await super().close()


def x_of(order: worker_service_pb2.WorkOrder) -> float:
    (x,) = decode_tensors(order.inputs)
    return float(x.to_numpy().ravel()[0])


class Harness:
    def __init__(self, app: SchedulerApp, nc: NatsClient, kv: KeyValue, queues: KeyValue) -> None:
        self.app = app
        self.js = nc.jetstream()
        self.nc = nc
        self.kv = kv
        self.queues = queues
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
        self.ops = ops_service_pb2_grpc.OpsServiceStub(self.channel)
        self.batchers: list[ScriptedBatcher] = []
        self.started = time.monotonic()

    async def batcher(
        self, batcher_id: str = "b1", credits: int = 0, *, reads_claim_checks: bool = False, version: str = "1"
    ) -> ScriptedBatcher:
        batcher = ScriptedBatcher(self.app.port, batcher_id)
        self.batchers.append(batcher)
        await batcher.connect(reads_claim_checks=reads_claim_checks, version=version)
        if credits:
            await batcher.grant(credits)
        return batcher

    def one_handed_over(self, consumer: str) -> Callable[[], Awaitable[bool]]:
        """For until(): whether the work consumer has handed its one message over (to a pull) and
        holds nothing more."""

        async def handed_over() -> bool:
            info = await self.js.consumer_info(self.app.config.nats.work_stream, consumer)
            return info.num_ack_pending == 1 and info.num_pending == 0

        return handed_over

    def dispatcher(self) -> Any:
        """The dispatcher of the test's model (MODEL)."""
        return next(d for d in self.app._dispatchers.all if d.model_name == MODEL)

    async def work_empty(self) -> None:
        async def empty() -> bool:
            return await work_messages(self.js, self.app.config) == 0

        await until(empty)

    async def snapshot(self) -> QueueSnapshot | None:
        """The model's snapshot in the queues bucket (None until the first is written)."""
        try:
            entry = await self.queues.get(MODEL)
        except NotFoundError:
            return None
        return decode_snapshot(entry.value) if entry.value else None

    async def close(self) -> None:
        for batcher in self.batchers:
            await batcher.close()
        await self.channel.close(None)


Start = Callable[[Config], Awaitable[Harness]]


class StatsRounds:
    """Counts a started scheduler's stats rounds, each once its queue statistics are read (where
    consumer infos are asked; a snapshot is written after, and only when it changed or at the
    heartbeat, so writes no longer count rounds)."""

    def __init__(self, app: SchedulerApp) -> None:
        self.count = 0
        stats: Any = app._stats
        read = stats.snapshot

        async def counted(model_name: str = "") -> Any:
            result = await read(model_name)
            if not model_name:  # a round asks for every model; OpsService for one
                self.count += 1
            return result

        stats.snapshot = counted

    async def wait(self, rounds: int) -> None:
        """Until `rounds` more have read their statistics, after the one under way."""
        target = self.count + rounds + 1

        async def reached() -> bool:
            return self.count >= target

        await until(reached)


def pulls_held_on_every_priority(held: Any) -> Callable[[], Awaitable[bool]]:
    """For until(): whether a dispatcher's held pulls (its `_held`) wait on each priority's queue."""

    async def holding() -> bool:
        return all(held.holding(p) for p in (Priority.HIGH, Priority.NORMAL, Priority.LOW))

    return holding


def brought_by_held_pulls(held: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The jobs a dispatcher's held pulls (its `_held`) bring from now on, in order: each reached
    its dispatch without a round, so without waiting for a poll."""
    brought: list[str] = []
    deliver = held._deliver

    async def recorded(msg: Any, priority: Priority) -> None:
        brought.append((msg.headers or {}).get(JOB_ID_HEADER) or msg.subject.rsplit(".", 1)[-1])
        await deliver(msg, priority)

    monkeypatch.setattr(held, "_deliver", recorded)
    return brought


def pulls_out(held: Any) -> list[asyncio.Task[None]]:
    """A dispatcher's held pulls out now (its `_held`'s), each seen to its end by its own task."""
    return list(held._tasks.values())


@pytest.fixture
async def start(nc: NatsClient) -> AsyncIterator[Start]:
    started: list[Harness] = []

    async def start_app(config: Config) -> Harness:
        app = SchedulerApp(config)
        await app.start()
        js = nc.jetstream()
        harness = Harness(
            app,
            nc,
            await js.key_value(config.nats.jobs_bucket),
            await js.key_value(config.nats.queues_bucket),
        )
        started.append(harness)
        return harness

    yield start_app
    for harness in started:
        await harness.close()
        await harness.app.stop(grace_s=0.5)


# --- retries, dead letters, poison ------------------------------------------------------------


async def letters_stored(h: Harness, expected: float) -> None:
    """Once the scheduler's gauge of the model's stored dead letters reads `expected` (its next
    store round, every 0.05 s here)."""

    def read() -> float | None:
        return h.app.metrics.registry.get_sample_value("asyncinfer_dead_letters_stored", {"model": MODEL})

    async with asyncio.timeout(10.0):
        while read() != expected:  # noqa: ASYNC110 - a gauge set by the scheduler's store round, no event
            await asyncio.sleep(0.02)


@pytest.mark.nats_fallback
async def test_retries_then_dead_letter_then_replay_and_purge(start: Start, config: Config) -> None:
    h = await start(tune(config).replace(scheduler={"store_usage_interval_s": 0.05}))
    await letters_stored(h, 0.0)  # at 0 before the first letter (a series to alert on)
    batcher = await h.batcher(credits=1)
    job_id = await enqueue(h.nc, h.kv, max_attempts=2)
    for attempt in (1, 2):
        order = await batcher.next_order()
        assert (order.job_id, order.attempt) == (job_id, attempt)
        await batcher.fail(order, MODEL_ERROR)
        await batcher.grant(1)
    failed = await wait_state(h.js, job_id, JobState.FAILED)
    assert failed.error is not None
    assert failed.error.reason == "MODEL_ERROR"
    assert "gave up after 2 attempts" in failed.error.message
    await h.work_empty()  # the original message left WORK

    listed = await h.ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest(model_name=MODEL))
    (letter,) = listed.dead_letters
    assert listed.HasField("total")
    assert listed.total == 1
    assert (letter.job_id, letter.tenant, letter.model_name, letter.reason, letter.attempts) == (
        job_id,
        TENANT,
        MODEL,
        "MAX_ATTEMPTS",
        2,
    )
    assert (letter.last_error.reason, letter.last_error.code) == ("MODEL_ERROR", 13)
    assert failed.dead_letter_sequence == letter.sequence  # the record names its letter
    assert letter.original_request == b""  # only GetDeadLetter carries it
    got = (await h.ops.GetDeadLetter(ops_service_pb2.GetDeadLetterRequest(sequence=letter.sequence))).dead_letter
    assert b'"job_id":"' + job_id.encode() in got.original_request
    exposition = generate_latest(h.app.metrics.registry).decode()
    assert 'asyncinfer_dead_letters_total{model="demo",reason="MAX_ATTEMPTS"} 1.0' in exposition
    assert 'asyncinfer_retries_total{model="demo",reason="MODEL_ERROR"} 1.0' in exposition
    await letters_stored(h, 1.0)  # the backlog an operator must replay or purge

    notices: asyncio.Queue[bytes] = asyncio.Queue()

    async def heard(msg: Any) -> None:
        notices.put_nowait(msg.data)

    listening = await h.nc.subscribe("asyncinfer.queued.>", cb=heard)
    await h.nc.flush()
    replayed = await h.ops.ReplayDeadLetters(ops_service_pb2.ReplayDeadLettersRequest(sequences=[letter.sequence]))
    assert replayed.replayed == 1
    # The answer says what happened, counts present even when 0 (grpcurl prints them).
    assert list(replayed.job_ids) == [job_id]
    assert replayed.skipped == 0
    assert replayed.HasField("remaining")
    assert replayed.remaining == 0
    # The replay announces the job queued again, with the record it wrote.
    key, revision, data = decode_queued_notice(await asyncio.wait_for(notices.get(), 5.0))
    requeued = decode_record(data, revision)
    assert (key, requeued.state, requeued.attempt) == (job_key(TENANT, job_id), JobState.QUEUED, 2)
    assert requeued.dead_letter_sequence == 0  # its letter is deleted
    await listening.unsubscribe()
    order = await batcher.next_order()
    assert (order.job_id, order.attempt) == (job_id, 3)  # the fencing token keeps counting
    # The re-published message carries the routing headers (the letter kept only the payload).
    again = await h.js.get_last_msg(config.nats.work_stream, job_work_subject(MODEL, requeued.priority, TENANT, job_id))
    assert again.headers is not None
    assert again.data is not None
    assert not decode_envelope(again.data).is_record  # the record, with its history, is in the bucket
    assert (again.headers[TENANT_HEADER], again.headers[JOB_ID_HEADER]) == (TENANT, job_id)
    assert again.headers[PRIORITY_HEADER] == requeued.priority.value
    await batcher.answer(order)
    done = await wait_state(h.js, job_id, JobState.SUCCEEDED)
    assert done.max_attempts == 4  # a fresh budget of the job's own max_attempts
    assert done.last_error is not None
    assert done.last_error.reason == "MODEL_ERROR"
    assert (await h.ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest())).dead_letters == []
    await letters_stored(h, 0.0)  # replayed: no longer stored
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.ops.GetDeadLetter(ops_service_pb2.GetDeadLetterRequest(sequence=letter.sequence))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND

    # Three more dead letters (max_attempts 1): purge one by sequence, then the rest; paging.
    await batcher.grant(1)
    dead = [await enqueue(h.nc, h.kv, max_attempts=1) for _ in range(3)]
    for _ in dead:
        order = await batcher.next_order()
        await batcher.fail(order, MODEL_ERROR)
        await batcher.grant(1)
    for job in dead:
        await wait_state(h.js, job, JobState.FAILED)
    await letters_stored(h, 3.0)
    first_page = await h.ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest(page_size=2))
    assert len(first_page.dead_letters) == 2
    assert first_page.next_page_token
    second_page = await h.ops.ListDeadLetters(
        ops_service_pb2.ListDeadLettersRequest(page_size=2, page_token=first_page.next_page_token)
    )
    assert len(second_page.dead_letters) == 1
    assert not second_page.next_page_token
    sequences = [d.sequence for d in [*first_page.dead_letters, *second_page.dead_letters]]
    assert first_page.total == second_page.total == 3
    # A token this service cannot have given is INVALID_ARGUMENT (one past JetStream's range was
    # answered UNAVAILABLE, retriable; " 7", "1_000" and other scripts' digits were taken).
    for token in ("-5", "18446744073709551616", " 7", "1_000", "\u0661\u0662", "9" * 5_000):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest(page_token=token))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, token
    # A sequence given twice is one letter (the second delete was answered UNAVAILABLE).
    twice = [sequences[0], sequences[0]]
    purged = await h.ops.PurgeDeadLetters(ops_service_pb2.PurgeDeadLettersRequest(sequences=twice))
    assert purged.purged == 1
    assert purged.remaining == 2
    await letters_stored(h, 2.0)
    purged = await h.ops.PurgeDeadLetters(ops_service_pb2.PurgeDeadLettersRequest(all=True, model_name=MODEL))
    assert purged.purged == 2
    assert purged.HasField("remaining")
    assert purged.remaining == 0
    await letters_stored(h, 0.0)
    empty = await h.ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest())
    assert empty.dead_letters == []
    assert empty.HasField("total")
    assert empty.total == 0
    nothing = await h.ops.ReplayDeadLetters(ops_service_pb2.ReplayDeadLettersRequest(all=True))
    assert nothing.replayed == 0
    assert nothing.HasField("remaining")
    assert nothing.remaining == 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.ops.ReplayDeadLetters(ops_service_pb2.ReplayDeadLettersRequest())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.nats_fallback
async def test_a_purge_and_a_replay_delete_their_letters_without_a_secure_erase(start: Start, config: Config) -> None:
    """nats-py's delete_msg asks nats-server to overwrite the message in its file (6.4 ms a letter
    against 1.0 ms, bench/results/dead_letter_purge_cost.txt); nothing promises erasure
    (docs/SECURITY.md, "Deleted, not erased"), so a letter's delete asks for none (`no_erase`), and
    the letter is gone all the same."""
    h = await start(tune(config))
    batcher = await h.batcher(credits=1)
    dead = [await enqueue(h.nc, h.kv, max_attempts=1) for _ in range(2)]
    for _ in dead:
        await batcher.fail(await batcher.next_order(), MODEL_ERROR)
        await batcher.grant(1)
    for job_id in dead:
        await wait_state(h.js, job_id, JobState.FAILED)
    letters = {
        letter.job_id: letter.sequence
        for letter in (await h.ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest())).dead_letters
    }
    deletes: list[dict[str, Any]] = []

    def a_delete(_subject: str, data: bytes) -> bool:
        deletes.append(json.loads(data))
        return True

    stream = config.nats.dead_letter_stream
    seen = await RequestsSeen.on(h.nc, stream_msg_delete_subject(stream), a_delete)
    try:
        replayed = await h.ops.ReplayDeadLetters(ops_service_pb2.ReplayDeadLettersRequest(sequences=[letters[dead[0]]]))
        assert (replayed.replayed, replayed.remaining) == (1, 1)
        purged = await h.ops.PurgeDeadLetters(ops_service_pb2.PurgeDeadLettersRequest(sequences=[letters[dead[1]]]))
        assert (purged.purged, purged.remaining) == (1, 0)
        await seen.wait_for(2)
    finally:
        await seen.close()
    assert deletes == [{"seq": letters[dead[0]], "no_erase": True}, {"seq": letters[dead[1]], "no_erase": True}]
    store = DeadLetterStore(h.nc, h.js, config.nats)
    assert [await store.get(sequence) for sequence in letters.values()] == [None, None]
    assert await store.delete(letters[dead[1]]) is False  # deleted already: gone all the same


def error_info(error: grpc.aio.AioRpcError) -> Any:
    status = status_details(error)
    assert status is not None
    return unpack_details(status)["ErrorInfo"]


@pytest.mark.nats_fallback
async def test_a_purge_by_sequence_deletes_its_letters_many_at_once_and_says_which_it_could_not(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A purge of 40 letters by sequence deletes LETTERS_AT_ONCE (32) at a time, not one after the
    other (each waited out its round trip: 937 ms for 1,000 small letters, 570 ms grouped,
    bench/results/dead_letter_purge_cost.txt), and one delete that fails stops none of the others:
    the error says how many were purged and which were not. Each delete waits (up to 5 s) until 32
    are in flight: one at a time reaches 1."""
    h = await start(tune(config))
    store = DeadLetterStore(h.nc, h.js, config.nats)
    now = time.time()
    stored = await asyncio.gather(
        *(
            store.add(
                DeadLetter(
                    job_id=new_job_id(),
                    tenant=TENANT,
                    model_name=MODEL,
                    reason="MAX_ATTEMPTS",
                    attempts=1,
                    dead_time=now,
                    original=b"{}",
                )
            )
            for _ in range(40)
        )
    )
    sequences = [letter.sequence for letter in stored]
    refused = sequences[5]
    real_delete = DeadLetterStore.delete
    in_flight = peak = 0
    all_in = asyncio.Event()

    async def counted_delete(self: DeadLetterStore, sequence: int) -> bool:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            if in_flight == dead_letters.LETTERS_AT_ONCE:
                all_in.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_in.wait(), 5.0)
            all_in.set()
            if sequence == refused:
                raise NatsTimeoutError
            return await real_delete(self, sequence)
        finally:
            in_flight -= 1

    monkeypatch.setattr(DeadLetterStore, "delete", counted_delete)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.ops.PurgeDeadLetters(ops_service_pb2.PurgeDeadLettersRequest(sequences=sequences))
    assert peak == dead_letters.LETTERS_AT_ONCE
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (error_info(info.value).reason, dict(error_info(info.value).metadata)) == (
        "NATS_UNAVAILABLE",
        {"purged": "39", "not_purged": str(refused)},
    )
    assert f"39 of 40 purged, 1 not: {refused}" in (info.value.details() or "")
    assert [letter.sequence for letter in await store.all()] == [refused]


@pytest.mark.parametrize("listed", [True, False], ids=["deleted-listed", "too-many-deleted"])
@pytest.mark.nats_fallback
async def test_a_purge_by_sequence_finds_its_letters_without_reading_them(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch, listed: bool
) -> None:
    """A purge by sequence knows its letters are there from the stream's first and last sequence
    and those deleted between, not by reading each whole letter (1,000 letters of 64 KiB inputs
    read 87 MB to answer NOT_FOUND or go on): no message is read. The answer stays exact: a
    sequence deleted at the head, one deleted between, one past the last and 0 are NOT_FOUND,
    named, nothing deleted. With more deleted than the stream info should list, each letter is read
    as before, to the same answer."""
    if not listed:
        monkeypatch.setattr(dead_letters, "MOST_DELETED_LISTED", 0)
    h = await start(tune(config))
    store = DeadLetterStore(h.nc, h.js, config.nats)
    now = time.time()
    stored = [
        await store.add(
            DeadLetter(
                job_id=new_job_id(),
                tenant=TENANT,
                model_name=MODEL,
                reason="MAX_ATTEMPTS",
                attempts=1,
                dead_time=now,
                original=b"{}",
            )
        )
        for _ in range(6)
    ]
    sequences = [letter.sequence for letter in stored]
    assert await store.delete(sequences[0])
    assert await store.delete(sequences[3])
    stream = config.nats.dead_letter_stream
    requests: list[str] = []

    async def heard(msg: Any) -> None:
        requests.append(msg.subject)

    listening = await h.nc.subscribe("$JS.API.>", cb=heard)
    await h.nc.flush()
    try:
        asked = [sequences[1], sequences[3], sequences[5], sequences[5] + 10, 0, sequences[0]]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.ops.PurgeDeadLetters(ops_service_pb2.PurgeDeadLettersRequest(sequences=asked))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert (error_info(info.value).reason, dict(error_info(info.value).metadata)) == (
            "DEAD_LETTER_NOT_FOUND",
            {"missing_sequences": f"{sequences[3]},{sequences[5] + 10},0,{sequences[0]}"},
        )
        assert f"no dead letter with sequence {sequences[3]} (4 of the sequences given have none)" in (
            info.value.details() or ""
        )
        assert await store.count() == 4  # (a stream info: the test reads no letter either)
        kept = [sequences[1], sequences[2], sequences[5]]
        purged = await h.ops.PurgeDeadLetters(ops_service_pb2.PurgeDeadLettersRequest(sequences=kept))
        assert (purged.purged, purged.remaining) == (3, 1)

        async def deletes_heard() -> bool:  # one subscription, in order: the reads came before
            return sum(subject == stream_msg_delete_subject(stream) for subject in requests) == 3

        await until(deletes_heard)
    finally:
        await listening.unsubscribe()
    reads = [subject for subject in requests if subject.startswith(("$JS.API.STREAM.MSG.GET.", "$JS.API.DIRECT.GET."))]
    # The fallback reads each sequence once, but 0: five, then three.
    assert len(reads) == (0 if listed else 5 + 3)
    assert [letter.sequence for letter in await store.all()] == [sequences[4]]


@pytest.mark.nats_fallback
async def test_a_replay_by_sequence_runs_every_letter_it_can_and_says_which_it_could_not(
    start: Start, config: Config
) -> None:
    """Three letters replayed by sequence, the middle one's job record gone: the first and the last
    are replayed (QUEUED, their letters deleted), and the error (NOT_FOUND, the middle one's) says
    2 of 3 were. One at a time, the replay stopped at the middle one: the last stayed FAILED, and
    the error did not say the first had run."""
    h = await start(tune(config))
    batcher = await h.batcher(credits=1)
    dead = [await enqueue(h.nc, h.kv, max_attempts=1) for _ in range(3)]
    for _ in dead:
        await batcher.fail(await batcher.next_order(), MODEL_ERROR)
        await batcher.grant(1)
    for job_id in dead:
        await wait_state(h.js, job_id, JobState.FAILED)
    listed = (await h.ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest())).dead_letters
    sequence_of = {letter.job_id: letter.sequence for letter in listed}
    await h.kv.purge(job_key(TENANT, dead[1]))  # its retention passed: no replay
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.ops.ReplayDeadLetters(
            ops_service_pb2.ReplayDeadLettersRequest(sequences=[sequence_of[job_id] for job_id in dead])
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert (error_info(info.value).reason, dict(error_info(info.value).metadata)) == (
        "JOB_NOT_FOUND",
        {"replayed": "2", "not_replayed": str(sequence_of[dead[1]])},
    )
    assert "2 of 3 replayed" in (info.value.details() or "")
    for job_id in (dead[0], dead[2]):
        replayed = await read_record(h.js, job_id)  # queued again (the batcher's credit may run it)
        assert (replayed.state in (JobState.QUEUED, JobState.RUNNING), replayed.max_attempts) == (True, 2)
    store = DeadLetterStore(h.nc, h.js, config.nats)
    assert [letter.job_id for letter in await store.all()] == [dead[1]]


async def claim_ttl_s(js: Any, config: Config, key: str) -> tuple[int, int]:
    """The claim's Nats-TTL and revision, as stored."""
    bucket = config.nats.idempotency_bucket
    message = await js.get_last_msg(f"KV_{bucket}", f"$KV.{bucket}.{key}")
    assert message.headers is not None
    return int(message.headers["Nats-TTL"]), message.seq


async def test_a_keyed_jobs_claim_lives_as_long_as_its_record_once_it_ends(start: Start, config: Config) -> None:
    # The gateway claims a key for a week (a job may wait that long queued); the scheduler that ends
    # the job cuts the claim to the record's retention plus the slack, and a replay restores the week.
    h = await start(tune(config))
    claims = ClaimStore(await ensure_idempotency_bucket(h.js, config.nats), h.js, bucket=config.nats.idempotency_bucket)
    week_s = int(QUEUE_HORIZON_WITHOUT_DEADLINE_S + 3600 + KEY_TTL_SLACK_S)
    ended_s = int(3600 + KEY_TTL_SLACK_S)  # enqueue's retention, 3600 s

    async def keyed_job(key: str, *, kept: bool = True, claimed_for: str = "") -> tuple[str, str]:
        """A job queued as a gateway queues a keyed one (its record keeping the claim, or `kept=False`:
        as an older gateway's, keeping nothing), its claim naming it (or `claimed_for`)."""
        job_id = new_job_id()
        claim = Claim(job_id, "f" * 64, time.time()).encode()
        revision = await claims.write(claim_key(TENANT, key), claim, last_revision=0, ttl_s=week_s)
        await enqueue(
            h.nc, h.kv, max_attempts=1, idempotency_key=key, claim_revision=revision if kept else 0, job_id=job_id
        )
        if claimed_for:  # taken over: removed, then claimed afresh
            marker = await claims.remove(claim_key(TENANT, key), revision)
            taken = Claim(claimed_for, "f" * 64, time.time()).encode()
            await claims.write(claim_key(TENANT, key), taken, last_revision=marker, ttl_s=week_s)
        return job_id, claim_key(TENANT, key)

    async def ttl_is(key: str, expected_s: int) -> bool:
        return (await claim_ttl_s(h.js, config, key))[0] == expected_s

    # Queued by an older gateway (its record keeps no claim): its end reads the claim first; its
    # replay renews it, and the replayed record keeps the claim's revision and fingerprint (a
    # revision alone made its end write the claim back with a blank fingerprint: every repeat of the
    # key was refused ALREADY_EXISTS, a mixed-version pass).
    failing, failing_key = await keyed_job("order-7", kept=False)
    older, older_key = await keyed_job("order-8")
    # A claim a later submit took over (it names another job, at another revision) is left as it is.
    taken, taken_key = await keyed_job("order-9", claimed_for=new_job_id())
    batcher = await h.batcher(credits=3)
    orders = {order.job_id: order for order in [await batcher.next_order() for _ in range(3)]}
    await batcher.fail(orders[failing], MODEL_ERROR)
    for job_id in (older, taken):
        await batcher.answer(orders[job_id])
    await wait_state(h.js, failing, JobState.FAILED)
    for key in (failing_key, older_key):
        await until(lambda key=key: ttl_is(key, ended_s))
    decoded, _ = await claims.read(failing_key)
    assert decoded is not None
    assert (decoded.job_id, decoded.fingerprint) == (failing, "f" * 64)  # the same claim, with its new TTL

    (letter,) = (await h.ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest(model_name=MODEL))).dead_letters
    await h.ops.ReplayDeadLetters(ops_service_pb2.ReplayDeadLettersRequest(sequences=[letter.sequence]))
    replayed = await wait_state(h.js, failing, JobState.QUEUED)
    # A week again, with an hour for each attempt of the new budget (the job has no timeout of its
    # own); the replayed record keeps the claim's new revision, so its end cuts it once more.
    assert await ttl_is(failing_key, int(QUEUE_HORIZON_WITHOUT_DEADLINE_S + 3600 + 3600 + KEY_TTL_SLACK_S))
    _, revision = await claim_ttl_s(h.js, config, failing_key)
    assert (replayed.claim_revision, replayed.claim_fingerprint) == (revision, "f" * 64)
    await batcher.grant(1)
    await batcher.answer(await batcher.next_order())
    await wait_state(h.js, failing, JobState.SUCCEEDED)
    await until(lambda: ttl_is(failing_key, ended_s))
    after, _ = await claims.read(failing_key)
    assert after is not None
    assert (after.job_id, after.fingerprint) == (failing, "f" * 64)
    assert (await claim_ttl_s(h.js, config, taken_key))[0] == week_s


@pytest.mark.nats_fallback
async def test_poison_job_is_dead_lettered_while_500_others_succeed_and_replay_fixes_it(
    start: Start, config: Config
) -> None:
    h = await start(tune(config, max_attempts=3))
    poison_value = 13.0
    fixed = asyncio.Event()

    async def run(order: worker_service_pb2.WorkOrder) -> None:
        if x_of(order) == poison_value and not fixed.is_set():
            await batcher.fail(order, MODEL_ERROR)
        else:
            await batcher.answer(order)

    batcher = await h.batcher()
    batcher.serve(run)
    await batcher.grant(16)
    started = time.monotonic()
    others = [await enqueue(h.nc, h.kv, value=float(i % 7)) for i in range(250)]
    poison = await enqueue(h.nc, h.kv, value=poison_value)
    others += [await enqueue(h.nc, h.kv, value=float(i % 7)) for i in range(250)]

    dead = await wait_state(h.js, poison, JobState.FAILED, timeout_s=20)
    assert dead.attempt == 3
    assert dead.error is not None
    assert dead.error.reason == "MODEL_ERROR"

    async def all_done() -> bool:
        states = [(await read_record(h.js, job)).state for job in others]
        return all(s == JobState.SUCCEEDED for s in states)

    await until(all_done, timeout_s=30)
    elapsed = time.monotonic() - started
    (letter,) = (await h.ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest())).dead_letters
    assert (letter.job_id, letter.attempts, letter.last_error.reason) == (poison, 3, "MODEL_ERROR")

    fixed.set()
    assert (await h.ops.ReplayDeadLetters(ops_service_pb2.ReplayDeadLettersRequest(all=True))).replayed == 1
    replayed = await wait_state(h.js, poison, JobState.SUCCEEDED)
    assert replayed.attempt == 4
    await h.work_empty()
    print(f"poison: 500 jobs + 1 poison done in {elapsed:.2f} s")


async def test_a_model_that_fails_every_job_logs_a_line_of_each_kind_not_one_a_job(
    start: Start, config: Config
) -> None:
    """Ten jobs of 2 attempts, each failing MODEL_ERROR on both: a `job_requeued`, a
    `job_dead_lettered` and a `job_finished` line per job at info and warning (300 lines a second at
    100 jobs/s). Now the first of each kind names its job, and the rest within the interval are at
    debug only, each still there."""
    with capture_logs() as logs:  # from the start: a job's logger is bound at its dispatch
        h = await start(tune(config))
        batcher = await h.batcher()

        async def fail(order: worker_service_pb2.WorkOrder) -> None:
            await batcher.fail(order, MODEL_ERROR)

        batcher.serve(fail)
        await batcher.grant(4)
        jobs = {await enqueue(h.nc, h.kv, max_attempts=2) for _ in range(10)}
        for job_id in jobs:
            assert (await wait_state(h.js, job_id, JobState.FAILED, timeout_s=20)).attempt == 2
    for event, level in (("job_requeued", "info"), ("job_dead_lettered", "warning"), ("job_finished", "info")):
        said = [e for e in logs if e["event"] == event and e["log_level"] != "debug"]
        assert len(said) == 1, (event, said)
        assert (said[0]["log_level"], said[0]["job_id"] in jobs, said[0]["model"]) == (level, True, MODEL)
        held = {e["job_id"] for e in logs if e["event"] == event and e["log_level"] == "debug"}
        assert held == jobs - {said[0]["job_id"]}, event
    finished = [e for e in logs if e["event"] == "job_finished" and e["log_level"] == "info"]
    assert (finished[0]["state"], finished[0]["reason"]) == ("FAILED", "MODEL_ERROR")


@pytest.mark.nats_fallback
async def test_invalid_input_is_never_retried_nor_dead_lettered(start: Start, config: Config) -> None:
    h = await start(tune(config))
    batcher = await h.batcher(credits=1)
    job_id = await enqueue(h.nc, h.kv)
    order = await batcher.next_order()
    invalid = error_pb2.ErrorStatus(code=3, reason="INVALID_INPUT", message="NaN", retriable=False)
    await batcher.fail(order, invalid)
    failed = await wait_state(h.js, job_id, JobState.FAILED)
    assert (failed.attempt, failed.error.reason if failed.error else None) == (1, "INVALID_INPUT")
    await h.work_empty()
    assert (await h.ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest())).dead_letters == []


async def test_a_retrys_backoff_counts_the_failed_attempts_not_those_given_back(start: Start, config: Config) -> None:
    """A job given back four times (three shed by its batcher, one put back by its scheduler's stop)
    that then fails waits the base backoff, not 2**4 times it: the backoff counted `attempt`, which
    counts the refunded attempts too. The delay is the requeue's (its log line), not a timing. The
    second and third hand-backs in a row wait the backoff of the hand-backs before them (1 and 2
    steps, lifecycle.after_hand_back); the stop's put-back goes at once."""
    tuned = tune(config, retry_backoff_base_s=1.0, retry_backoff_max_s=100_000.0)
    with capture_logs() as logs:  # from the start: a job's logger is bound at its dispatch
        first = await start(tuned)
        batcher = await first.batcher(credits=1)
        job_id = await enqueue(first.nc, first.kv, max_attempts=2)
        for attempt in (1, 2, 3):
            order = await batcher.next_order()
            assert (order.job_id, order.attempt) == (job_id, attempt)
            shed = worker_service_pb2.WorkResult(job_id=order.job_id, attempt=order.attempt, dropped=True)
            await batcher._call.write(worker_service_pb2.ConnectRequest(result=shed))
            await batcher.grant(1)
        order = await batcher.next_order()
        assert (order.job_id, order.attempt) == (job_id, 4)
        await first.app.stop(grace_s=0.1)  # the job in flight goes back, its attempt given back
        second = await start(tuned)
        batcher = await second.batcher(credits=1)
        order = await batcher.next_order()
        assert (order.job_id, order.attempt) == (job_id, 5)
        await batcher.fail(order, MODEL_ERROR)

        def retries() -> list[dict[str, Any]]:
            return [e for e in logs if e["event"] == "job_requeued" and e["reason"] == "MODEL_ERROR"]

        async def retried() -> bool:
            return bool(retries())

        await until(retried)
    given_back = [e["delay_s"] for e in logs if e["event"] == "job_requeued" and e["reason"] != "MODEL_ERROR"]
    assert len(given_back) == 4
    assert given_back[0] == 0.0
    assert given_back[3] == 0.0
    assert 0.5 <= given_back[1] <= 1.0
    assert 1.0 <= given_back[2] <= 2.0
    (retry,) = retries()
    assert 0.5 <= retry["delay_s"] <= 1.0  # the first failure: base 1 s with equal jitter (was 8-16)
    record = await read_record(second.js, job_id)
    assert (record.state, record.attempt, record.max_attempts, record.failed_attempts) == (JobState.QUEUED, 5, 6, 1)


@pytest.mark.nats_fallback
async def test_a_dead_letter_counts_the_attempts_spent_not_those_given_back(start: Start, config: Config) -> None:
    """max_attempts 2, shed by its batcher four times (each attempt given back), then failing twice:
    the job gave up after 2 attempts, at attempt 6. The record's error, the letter, ListDeadLetters
    and the CLI's and console's text said 6 (`attempt`, which counts those given back too). The
    CLI's and console's text says it as the job's attempt reads, "2 of 2 (4 given back)" (it said
    "2 (4 more given back)", and `dlq list` had the 4 in a column of its own)."""
    h = await start(tune(config))
    batcher = await h.batcher(credits=1)
    job_id = await enqueue(h.nc, h.kv, max_attempts=2)
    for attempt in range(1, 7):
        order = await batcher.next_order()
        assert (order.job_id, order.attempt) == (job_id, attempt)
        if attempt <= 4:
            shed = worker_service_pb2.WorkResult(job_id=order.job_id, attempt=order.attempt, dropped=True)
            await batcher._call.write(worker_service_pb2.ConnectRequest(result=shed))
        else:
            await batcher.fail(order, MODEL_ERROR)
        await batcher.grant(1)
    failed = await wait_state(h.js, job_id, JobState.FAILED)
    assert failed.error is not None
    assert failed.error.message == "model raised: boom (gave up after 2 attempts, not counting 4 given back)"
    assert (failed.attempt, failed.given_back_attempts, failed.spent_attempts) == (6, 4, 2)
    await h.work_empty()

    (listed,) = (await h.ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest(model_name=MODEL))).dead_letters
    assert (listed.job_id, listed.attempts, listed.given_back_attempts, listed.allowed_attempts) == (job_id, 2, 4, 2)
    stored = await DeadLetterStore(h.nc, h.js, config.nats).get(listed.sequence)
    assert stored is not None
    assert (stored.attempts, stored.given_back_attempts, stored.last_attempt, stored.allowed_attempts) == (2, 4, 6, 2)
    shown = dead_letter_json(listed)  # what `asyncinfer dlq` and the console's pages print
    assert attempts_text(shown) == "2 of 2 (4 given back)"
    assert "attempts    2 of 2 (4 given back)" in dead_letter_text(shown).splitlines()  # dlq show
    row = dict(zip(DEAD_LETTER_COLUMNS, dead_letter_row(shown), strict=True))  # dlq list
    assert row["ATTEMPTS"] == "2 of 2 (4 given back)"


@pytest.mark.nats_fallback
async def test_a_job_every_batcher_hands_back_backs_off_then_is_dead_lettered(start: Start, config: Config) -> None:
    """A batcher that hands every order back unrun (as one would whose model or version the
    scheduler wrongly thinks it serves): the job went back at once with its attempt given back,
    every time, a hot loop that never ended (30 orders here, in a fraction of a second, until the
    script gave in). Now the first hand-back goes at once, each after it waits the model's retry
    backoff of the hand-backs in a row, and each past 5 (lifecycle.FREE_HAND_BACKS) counts as an attempt: with
    max_attempts 2, 5 given back, then 2 counted, and the job ends FAILED and dead-lettered
    (replayable), its last error DROPPED saying so. Delays are the requeues' log lines."""
    gives_in_after = 30
    with capture_logs() as logs:
        h = await start(tune(config))  # retry backoff 0.05 s, at most 0.2 s
        batcher = await h.batcher(credits=1)
        orders: list[tuple[str, int]] = []

        async def hand_back(order: worker_service_pb2.WorkOrder) -> None:
            orders.append((order.job_id, order.attempt))
            if len(orders) > gives_in_after:
                await batcher.answer(order)  # the old code's loop ends here, SUCCEEDED
                return
            dropped = worker_service_pb2.WorkResult(job_id=order.job_id, attempt=order.attempt, dropped=True)
            await batcher._call.write(worker_service_pb2.ConnectRequest(result=dropped))

        batcher.serve(hand_back)
        job_id = await enqueue(h.nc, h.kv, max_attempts=2)

        async def ended() -> bool:
            return (await read_record(h.js, job_id)).state.is_terminal

        await until(ended, timeout_s=20.0)
        record = await read_record(h.js, job_id)
        assert record.state is JobState.FAILED, f"{record.state} after {len(orders)} orders"
        await h.work_empty()
    assert orders == [(job_id, attempt) for attempt in range(1, 8)]
    assert (record.attempt, record.given_back_attempts, record.spent_attempts) == (7, 5, 2)
    assert record.error is not None
    assert (record.error.reason, record.error.message) == (
        "DROPPED",
        "batchers handed it back unrun 7 times in a row (each past 5 counts as an attempt) "
        "(gave up after 2 attempts, not counting 5 given back)",
    )
    requeued = [e["delay_s"] for e in logs if e["event"] == "job_requeued"]
    assert len(requeued) == 6
    assert requeued[0] == 0.0
    steps = [0.05, 0.1, 0.2, 0.2, 0.2]  # the backoff after 1, 2, 3, ... hand-backs in a row (at most 0.2 s)
    assert all(step / 2 <= delay <= step for delay, step in zip(requeued[1:], steps, strict=True)), requeued
    counted = [e["counted"] for e in logs if e["event"] == "job_handed_back_again"]
    assert counted == [False] * 4 + [True]
    (letter,) = (await h.ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest(model_name=MODEL))).dead_letters
    assert (letter.job_id, letter.attempts, letter.given_back_attempts, letter.last_error.reason) == (
        job_id,
        2,
        5,
        "DROPPED",
    )


async def test_a_job_handed_back_by_batchers_that_then_announce_its_version_loading_spends_no_attempt(
    start: Start, config: Config
) -> None:
    """Batchers sharing one Triton each learn of its outage on their own first call: each announces
    the version LOADING (dropping its credits here) and hands back the job it was running, which goes
    on to the next batcher that has not met the outage yet. Each past 5 in a row counted as an
    attempt, so with 7 such batchers a job of max_attempts 1 was dead-lettered within one outage
    ("batchers handed it back unrun 6 times in a row"). A hand-back whose batcher has since said it
    no longer serves the version is routing the scheduler has been told of, not a view that stays
    wrong: it counts no more (the backoff still grows). The job is given back 7 times, waits QUEUED
    with no attempt spent, and runs once a batcher serves the version again."""
    h = await start(tune(config))
    ready = worker_service_pb2.ServedModel(model_name=MODEL, model_version="1", max_batch_size=8)
    loading = worker_service_pb2.ServedModel()
    loading.CopyFrom(ready)
    loading.state = job_service_pb2.MODEL_VERSION_STATE_LOADING
    batchers = [await h.batcher(f"b{i}", credits=1) for i in range(7)]
    orders: list[tuple[str, str, int]] = []

    async def meets_the_outage(batcher: ScriptedBatcher) -> None:
        order = await batcher.orders.get()
        orders.append((batcher.batcher_id, order.job_id, order.attempt))
        # As a batcher whose Triton is out of reach: its version LOADING first, then the hand-back.
        await batcher._call.write(
            worker_service_pb2.ConnectRequest(models=worker_service_pb2.ServedModels(models=[loading]))
        )
        dropped = worker_service_pb2.WorkResult(job_id=order.job_id, attempt=order.attempt, dropped=True)
        await batcher._call.write(worker_service_pb2.ConnectRequest(result=dropped))

    meeting = [asyncio.create_task(meets_the_outage(b)) for b in batchers]
    try:
        job_id = await enqueue(h.nc, h.kv, max_attempts=1)

        async def settled() -> bool:
            record = await read_record(h.js, job_id)
            return record.state.is_terminal or (record.state is JobState.QUEUED and record.given_back_attempts == 7)

        await until(settled, timeout_s=20.0)
        record = await read_record(h.js, job_id)
        assert (record.state, record.given_back_attempts, record.spent_attempts) == (JobState.QUEUED, 7, 0), (
            f"{record.state} after {len(orders)} orders, {record.given_back_attempts} given back"
        )
        assert sorted(b for b, _, _ in orders) == [f"b{i}" for i in range(7)], "each batcher once"
        assert [(j, a) for _, j, a in orders] == [(job_id, attempt) for attempt in range(1, 8)]

        # b0's Triton answers again: READY, a credit, and the job runs there.
        await batchers[0]._call.write(
            worker_service_pb2.ConnectRequest(models=worker_service_pb2.ServedModels(models=[ready]))
        )
        await batchers[0].grant(1)
        order = await batchers[0].next_order(timeout_s=10.0)
        assert (order.job_id, order.attempt) == (job_id, 8)
        await batchers[0].answer(order)
        done = await wait_state(h.js, job_id, JobState.SUCCEEDED)
        assert (done.given_back_attempts, done.spent_attempts) == (7, 1)
    finally:
        for task in meeting:
            task.cancel()
        await asyncio.gather(*meeting, return_exceptions=True)


@pytest.mark.nats_fallback
async def test_a_job_a_flapping_triton_keeps_handing_back_is_dead_lettered_not_sent_round_for_good(
    start: Start, config: Config
) -> None:
    """One batcher whose Triton goes down with the job on it at every dispatch (a Triton flapping, or
    one the job brings down): each time it announces the version LOADING and hands the job back,
    then READY once its Triton answers. Every such hand-back was free (its batcher no longer served
    the version), so the job went round for good: 20 orders here until the script gave in and
    answered it. A batcher hands a job back out of reach once per outage, so its second one is a
    second outage with the job on it: past 5 in a row (lifecycle.FREE_HAND_BACKS) it counts as an
    attempt, and with max_attempts 2 the job ends FAILED and dead-lettered after 7 orders."""
    gives_in_after = 20
    h = await start(tune(config))  # retry backoff 0.05 s, at most 0.2 s
    ready = worker_service_pb2.ServedModel(model_name=MODEL, model_version="1", max_batch_size=8)
    loading = worker_service_pb2.ServedModel()
    loading.CopyFrom(ready)
    loading.state = job_service_pb2.MODEL_VERSION_STATE_LOADING
    batcher = await h.batcher("flapping", credits=1)
    orders: list[int] = []

    async def flap() -> None:
        while True:
            order = await batcher.orders.get()
            orders.append(order.attempt)
            if len(orders) > gives_in_after:
                await batcher.answer(order)  # the old code's loop ends here, SUCCEEDED
                return
            await batcher._call.write(
                worker_service_pb2.ConnectRequest(models=worker_service_pb2.ServedModels(models=[loading]))
            )
            dropped = worker_service_pb2.WorkResult(job_id=order.job_id, attempt=order.attempt, dropped=True)
            await batcher._call.write(worker_service_pb2.ConnectRequest(result=dropped))

            async def settled(job_id: str = order.job_id, attempt: int = order.attempt) -> bool:
                record = await read_record(h.js, job_id)  # put back, or dead-lettered
                return record.attempt == attempt and record.state is not JobState.RUNNING

            await until(settled)
            # Its Triton answers again: READY, and a credit.
            await batcher._call.write(
                worker_service_pb2.ConnectRequest(models=worker_service_pb2.ServedModels(models=[ready]))
            )
            await batcher.grant(1)

    flapping = asyncio.create_task(flap())
    try:
        job_id = await enqueue(h.nc, h.kv, max_attempts=2)

        async def ended() -> bool:
            return (await read_record(h.js, job_id)).state.is_terminal

        await until(ended, timeout_s=30.0)
        record = await read_record(h.js, job_id)
        assert record.state is JobState.FAILED, f"{record.state} after {len(orders)} orders"
        assert orders == list(range(1, 8))
        assert (record.given_back_attempts, record.spent_attempts, record.handed_back_by) == (5, 2, ("flapping",))
        assert record.error is not None
        assert record.error.reason == "DROPPED"
        (letter,) = (await h.ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest(model_name=MODEL))).dead_letters
        assert (letter.job_id, letter.attempts, letter.given_back_attempts) == (job_id, 2, 5)
    finally:
        flapping.cancel()
        await asyncio.gather(flapping, return_exceptions=True)


async def test_getjob_the_sdk_the_cli_and_the_console_count_attempts_without_those_given_back(
    start_stack: StartStack, config: Config
) -> None:
    """The job of the test above, submitted and read through a real gateway: GetJob, the SDK's Job,
    `asyncinfer get`'s and `watch`'s lines and the console's job page and list said "6/6" and
    "6 of 6" (`attempt` against `max_attempts`, each raised by every attempt given back); they say
    "2 of 2 (4 given back)". GetJob keeps the fencing number and adds given_back_attempts."""
    stack = await start_stack(tune(config), batcher=False)
    batcher = FakeBatcher(stack.scheduler.port, "b1")
    try:
        await batcher.connect()
        await batcher.grant(1)
        x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
        x.contents.fp32_contents.extend([1.0, 2.0, 3.0, 4.0])
        request = job_service_pb2.SubmitJobRequest(model_name=MODEL, inputs=[x], max_attempts=2)
        job_id = (await stack.jobs.SubmitJob(request)).job.job_id
        for attempt in range(1, 7):
            order = await batcher.next_order()
            assert (order.job_id, order.attempt) == (job_id, attempt)
            if attempt <= 4:
                shed = worker_service_pb2.WorkResult(job_id=order.job_id, attempt=order.attempt, dropped=True)
                await batcher._call.write(worker_service_pb2.ConnectRequest(result=shed))
            else:
                await batcher.fail(order, MODEL_ERROR)
            await batcher.grant(1)
        await wait_state(stack.nc.jetstream(), job_id, JobState.FAILED)
    finally:
        await batcher.close()

    got = (await stack.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job
    assert (got.attempt, got.max_attempts, got.given_back_attempts) == (6, 6, 4)
    async with AsyncClient(stack.address) as client:
        job = await client.get(job_id)
    assert (job.attempt, job.given_back_attempts, job.spent_attempts, job.allowed_attempts) == (6, 4, 2, 2)
    assert attempt_text(job) == "2 of 2 (4 given back)"
    assert "attempt     2 of 2 (4 given back)" in job_text(job).splitlines()  # asyncinfer get
    assert "  attempt 2 of 2 (4 given back)  " in job_summary(job)  # asyncinfer watch, list
    assert "<tr><td>attempt</td><td>2 of 2 (4 given back)</td></tr>" in pages_jobs.job_details(job, time.time())
    assert "2 of 2 (4 given back)" in pages_jobs._job_row(job, time.time())


# --- deadlines and timeouts -------------------------------------------------------------------


async def test_job_past_its_deadline_expires_at_dispatch_and_never_runs(start: Start, config: Config) -> None:
    h = await start(tune(config))
    batcher = await h.batcher()
    deadline = time.time() + 0.3
    expired = await enqueue(h.nc, h.kv, deadline=deadline)

    async def passed() -> bool:
        return time.time() > deadline

    await until(passed)
    await batcher.grant(1)
    record = await wait_state(h.js, expired, JobState.EXPIRED)
    assert record.error is not None
    assert record.error.reason == "DEADLINE_EXCEEDED"
    assert record.attempt == 0
    await h.work_empty()
    fresh = await enqueue(h.nc, h.kv)  # the credit was not used by the expired job
    order = await batcher.next_order()
    assert order.job_id == fresh


async def test_a_job_whose_deadline_passes_in_its_retry_backoff_is_expired_by_the_scheduler(
    start: Start, config: Config
) -> None:
    # A retry waits out its backoff (here 150-300 s) or its deadline, whichever comes first: the
    # scheduler then finds it overdue and ends it EXPIRED. It stayed QUEUED in its record until the
    # backoff's end (its EXPIRED webhook minutes late, its message counted in its tenant's queued
    # jobs), unless a gateway read expired it.
    h = await start(tune(config, retry_backoff_base_s=300.0, retry_backoff_max_s=300.0))
    batcher = await h.batcher(credits=1)
    job_id = await enqueue(h.nc, h.kv, deadline=time.time() + 1.0, max_attempts=3)
    order = await batcher.next_order()
    await batcher.fail(order, MODEL_ERROR)
    await batcher.grant(1)
    # The record as the bucket holds it (no gateway's expiry on read); the guard is far below the backoff.
    expired = await wait_state(h.js, job_id, JobState.EXPIRED, timeout_s=20.0)
    assert expired.attempt == 1
    assert expired.last_error is not None
    assert expired.last_error.reason == "MODEL_ERROR"
    assert expired.error is not None
    assert expired.error.reason == "DEADLINE_EXCEEDED"
    await h.work_empty()
    assert batcher.orders.empty()  # it never ran again


async def test_execution_timeout_fails_the_job_and_cancels_it_at_the_batcher(start: Start, config: Config) -> None:
    h = await start(tune(config, timeout_action="fail"))
    batcher = await h.batcher(credits=1)
    job_id = await enqueue(h.nc, h.kv, execution_timeout_s=0.3)
    order = await batcher.next_order()
    assert order.execution_timeout.ToMilliseconds() == 300
    cancel = await batcher.next_cancel()
    assert (cancel.job_id, cancel.attempt) == (job_id, 1)
    record = await wait_state(h.js, job_id, JobState.TIMED_OUT)
    assert record.error is not None
    assert record.error.reason == "EXECUTION_TIMEOUT"
    await h.work_empty()
    with capture_logs() as logs:
        await batcher.answer(order)  # too late: fenced out
        await batcher.grant(1)

        async def credit_counted() -> bool:
            return h.app.batchers.free_credits(MODEL) == 1

        await until(credit_counted)
    assert (await read_record(h.js, job_id)).state == JobState.TIMED_OUT
    # An answer the timeout's cancel expected is dropped quietly, not warned of as stale.
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == []


async def test_execution_timeout_with_retry_policy_runs_it_again(start: Start, config: Config) -> None:
    h = await start(tune(config, timeout_action="retry"))
    batcher = await h.batcher(credits=2)
    job_id = await enqueue(h.nc, h.kv, execution_timeout_s=0.3, max_attempts=2)
    first = await batcher.next_order()
    assert (await batcher.next_cancel()).attempt == 1
    second = await batcher.next_order()
    assert (second.job_id, second.attempt) == (job_id, 2)
    await batcher.answer(first)  # the late first attempt is discarded ...
    await batcher.answer(second)  # ... the second one counts
    done = await wait_state(h.js, job_id, JobState.SUCCEEDED)
    assert done.attempt == 2
    assert done.last_error is not None
    assert done.last_error.reason == "EXECUTION_TIMEOUT"

    # Spent attempts under the retry policy: TIMED_OUT, and a dead letter.
    await batcher.grant(1)
    doomed = await enqueue(h.nc, h.kv, execution_timeout_s=0.2, max_attempts=1)
    await batcher.next_order()
    record = await wait_state(h.js, doomed, JobState.TIMED_OUT)
    assert record.error is not None
    assert record.error.reason == "EXECUTION_TIMEOUT"
    (letter,) = (await h.ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest())).dead_letters
    assert letter.job_id == doomed


async def test_a_model_that_times_out_every_job_says_so_once_not_a_line_a_job(start: Start, config: Config) -> None:
    """Eight jobs whose batcher never answers, each past its execution timeout: a `job_timed_out`
    warning per job (a model that hangs at 100 jobs a second wrote 100 a second). Now the first
    names its job and the rest within the interval are at debug, each still there."""
    with capture_logs() as logs:  # from the start: a job's logger is bound at its dispatch
        h = await start(tune(config, timeout_action="fail"))
        batcher = await h.batcher(credits=8)
        jobs = {await enqueue(h.nc, h.kv, execution_timeout_s=0.2) for _ in range(8)}
        assert {(await batcher.next_order()).job_id for _ in jobs} == jobs  # all run, none answered
        for job_id in jobs:
            assert (await wait_state(h.js, job_id, JobState.TIMED_OUT)).error is not None
    said = [e for e in logs if e["event"] == "job_timed_out" and e["log_level"] != "debug"]
    assert len(said) == 1, said
    assert (said[0]["log_level"], said[0]["job_id"] in jobs, said[0]["model"], said[0]["action"]) == (
        "warning",
        True,
        MODEL,
        "fail",
    )
    assert "more_since_last" not in said[0]
    held = {e["job_id"] for e in logs if e["event"] == "job_timed_out" and e["log_level"] == "debug"}
    assert held == jobs - {said[0]["job_id"]}


# --- results stored for attempts no record names ------------------------------------------------


async def store_attempts_result(store: BlobStore, order: worker_service_pb2.WorkOrder) -> job_pb2.BlobRef:
    """What a batcher with claim_check_io does before it answers: the outputs stored under the
    order's output_name (out/<job_id>.<attempt>), kept for the job's result retention."""
    y = Tensor.from_numpy("y", np.full((1, 4), 2.0, np.float32))
    stored = await store_outputs(store, TENANT, order.output_name, [y], expires_at=time.time() + 3600)
    return job_pb2.BlobRef(ref=stored.ref, size_bytes=stored.size_bytes, sha256=stored.sha256)


def object_gone(store: BlobStore, ref: str) -> Callable[[], Awaitable[bool]]:
    async def gone() -> bool:
        try:
            await store.info(TENANT, ref)
        except NotFound:
            return True
        return False

    return gone


@pytest.mark.unit
def test_only_an_attempts_own_result_or_an_older_attempts_of_the_same_job_is_stale() -> None:
    job_id, other_id = new_job_id(), new_job_id()

    def ref(name: str) -> BlobRef:
        return BlobRef(ref=name, size_bytes=1, sha256="ab" * 32)

    assert own_attempts_result(job_id, 2, ref(f"out/{job_id}.2")) == f"out/{job_id}.2"
    for name in (f"out/{job_id}.1", f"out/{job_id}", f"out/{other_id}.2", f"in/{job_id}"):
        assert own_attempts_result(job_id, 2, ref(name)) is None
    assert own_attempts_result(job_id, 2, None) is None
    assert older_attempts_result(job_id, 3, ref(f"out/{job_id}.2")) == f"out/{job_id}.2"
    for name in (
        f"out/{job_id}.3",  # the attempt held: its own
        f"out/{job_id}.4",
        f"out/{job_id}",  # the scheduler's own result
        f"out/{job_id}.0",
        f"out/{job_id}.02",
        f"out/{job_id}.2x",
        f"out/{other_id}.1",
        f"in/{job_id}",
    ):
        assert older_attempts_result(job_id, 3, ref(name)) is None, name


async def test_a_result_stored_by_an_attempt_that_timed_out_is_deleted_when_it_answers(
    start: Start, config: Config
) -> None:
    """A batcher with claim_check_io stores an attempt's outputs before it answers. An attempt
    that ran past its execution timeout here is dropped when it answers at last: the object it
    stored (out/<job_id>.1) is deleted then, not kept counted against its tenant for the job's
    result retention (an hour here)."""
    h = await start(tune(config, timeout_action="fail"))
    store = await ensure_objects_bucket(h.nc, h.app.config.nats)
    batcher = await h.batcher(credits=1, reads_claim_checks=True)
    job_id = await enqueue(h.nc, h.kv, execution_timeout_s=0.3)
    order = await batcher.next_order()
    assert order.output_name == f"out/{job_id}.1"
    ref = await store_attempts_result(store, order)
    assert (await batcher.next_cancel()).attempt == 1
    await wait_state(h.js, job_id, JobState.TIMED_OUT)
    await batcher.answer_stored(order, ref)
    await until(object_gone(store, ref.ref))
    timed_out = await read_record(h.js, job_id)
    assert (timed_out.state, timed_out.result_ref) == (JobState.TIMED_OUT, None)


async def test_results_of_superseded_attempts_are_deleted_when_answered_or_named(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempt 1 times out and attempt 2 runs here. (1) Attempt 1 answers once its abandonment
    is forgotten (30 s; forgotten at once here): a stale result, fenced off by the newer attempt
    held, and the object it stored is deleted. (2) Attempt 2 answers naming attempt 1's object:
    refused (INVALID_RESULT), and that object, an older attempt's, is deleted too."""
    monkeypatch.setattr(leases, "PENDING_CANCEL_TTL_S", 0.0)  # the next abandonment forgets the older
    # A retry's backoff of 1-2 s (equal jitter): time to give attempt 2 a longer execution timeout.
    h = await start(tune(config, timeout_action="retry", retry_backoff_base_s=2.0, retry_backoff_max_s=2.0))
    store = await ensure_objects_bucket(h.nc, h.app.config.nats)
    batcher = await h.batcher(credits=3, reads_claim_checks=True)
    late_id = await enqueue(h.nc, h.kv, execution_timeout_s=0.3, max_attempts=2)
    first = await batcher.next_order()
    first_ref = await store_attempts_result(store, first)
    assert (await batcher.next_cancel()).attempt == 1
    backing_off = await wait_state(h.js, late_id, JobState.QUEUED)
    await h.kv.update(
        job_key(TENANT, late_id), encode_record(backing_off.evolve(execution_timeout_s=60.0)), last=backing_off.revision
    )
    second = await batcher.next_order(timeout_s=10.0)
    assert (second.job_id, second.attempt, second.execution_timeout.ToSeconds()) == (late_id, 2, 60)
    # Another job times out: its abandonment forgets late_id's attempt 1 (as 30 s would).
    forgetting_id = await enqueue(h.nc, h.kv, execution_timeout_s=0.3, max_attempts=1)
    assert (await batcher.next_order()).job_id == forgetting_id
    assert (await batcher.next_cancel()).job_id == forgetting_id
    with capture_logs() as logs:
        await batcher.answer_stored(first, first_ref)
        await until(object_gone(store, first_ref.ref))
    assert [e["attempt_in_flight"] for e in logs if e["event"] == "stale_result_discarded"] == [2]
    assert (await read_record(h.js, late_id)).state is JobState.RUNNING  # attempt 2 runs on

    # Attempt 2 names attempt 1's object (stored again here, as a confused batcher might).
    first_again = await store_attempts_result(store, first)
    await batcher.answer_stored(second, first_again)
    failed = await wait_state(h.js, late_id, JobState.FAILED)
    assert failed.error is not None
    assert failed.error.reason == "INVALID_RESULT"
    await until(object_gone(store, first_again.ref))


async def test_a_result_of_an_early_order_whose_running_write_lost_is_kept(start: Start, config: Config) -> None:
    """An order sent before its RUNNING write whose write then loses (here: another scheduler
    wrote the job's attempt 1 first) is cancelled and its answer dropped, but the object it names
    is left alone: out/<job_id>.1 may be the other scheduler's attempt's result, the one its
    record will name."""
    h = await start(tune(config))
    store = await ensure_objects_bucket(h.nc, h.app.config.nats)
    batcher = await h.batcher(reads_claim_checks=True)
    job_id = await enqueue(h.nc, h.kv)
    queued = decode_envelope(
        (
            await h.js.get_last_msg(
                h.app.config.nats.work_stream, job_work_subject(MODEL, Priority.NORMAL, TENANT, job_id)
            )
        ).data
    ).queued_record()
    elsewhere = queued.evolve(state=JobState.RUNNING, attempt=1, update_time=time.time())
    await h.kv.create(job_key(TENANT, job_id), encode_record(elsewhere))  # the other scheduler's write
    with capture_logs() as logs:
        await batcher.grant(1)
        order = await batcher.next_order()
        assert (order.job_id, order.attempt) == (job_id, 1)  # sent early, on the submit's own record
        ref = await store_attempts_result(store, order)
        assert (await batcher.next_cancel()).attempt == 1  # its write lost
        await batcher.answer_stored(order, ref)

        async def dropped() -> bool:
            return any(e["event"] == "abandoned_attempt_answered" and e["job_id"] == job_id for e in logs)

        await until(dropped)
        await asyncio.wait_for(h.app.flow._tasks.close(), 10.0)  # any deletion it started has ended
    info = await store.info(TENANT, ref.ref)
    assert info.ref.sha256 == ref.sha256
    assert not [e for e in logs if e["event"].startswith("stale_result_")]


# --- cancellation ---------------------------------------------------------------------------


async def cancel_as_gateway(h: Harness, job_id: str) -> JobRecord:
    """What the gateway's CancelJob does: QUEUED -> CANCELED, RUNNING -> CANCELLING, and a notice;
    for a queued job, returns once the scheduler heard it."""
    store = JobStore(
        KvBucket(name=h.app.config.nats.jobs_bucket, kv=h.kv, js=h.js), work_stream=h.app.config.nats.work_stream
    )
    record = await store.get(job_key(TENANT, job_id))
    assert record is not None
    now = time.time()

    def cancel(current: JobRecord) -> JobRecord | None:
        if current.state == JobState.QUEUED:
            return current.evolve(state=JobState.CANCELED, end_time=now, update_time=now)
        if current.state == JobState.RUNNING:
            return current.evolve(state=JobState.CANCELLING, update_time=now)
        return None

    latest, written = await store.transition(record, cancel)
    assert latest is not None
    assert written
    notice = CancelNotice(job_id=job_id, tenant=TENANT, model_name=MODEL)
    await h.nc.publish(cancel_subject(MODEL), notice.encode())  # a queued job's cancel is announced too
    if latest.state == JobState.CANCELED:

        async def heard() -> bool:  # a dispatch that came first would send its order early
            return h.app.flow.cancel_heard(job_id)

        await until(heard)
    return latest


async def test_cancel_of_a_queued_job_means_it_never_runs(start: Start, config: Config) -> None:
    h = await start(tune(config))
    batcher = await h.batcher()
    canceled = await enqueue(h.nc, h.kv)
    assert (await cancel_as_gateway(h, canceled)).state == JobState.CANCELED
    await batcher.grant(1)
    await h.work_empty()
    kept = await enqueue(h.nc, h.kv)
    order = await batcher.next_order()
    assert order.job_id == kept
    assert (await read_record(h.js, canceled)).state == JobState.CANCELED


async def test_cancel_of_a_running_job_drops_it_at_the_batcher(start: Start, config: Config) -> None:
    h = await start(tune(config))
    batcher = await h.batcher(credits=2)
    job_id = await enqueue(h.nc, h.kv)
    order = await batcher.next_order()
    assert (await cancel_as_gateway(h, job_id)).state == JobState.CANCELLING
    cancel = await batcher.next_cancel()
    assert (cancel.job_id, cancel.attempt) == (job_id, 1)
    dropped = worker_service_pb2.WorkResult(job_id=job_id, attempt=1, dropped=True)
    await batcher._call.write(worker_service_pb2.ConnectRequest(result=dropped))
    record = await wait_state(h.js, job_id, JobState.CANCELED)
    assert record.outputs == ()
    await h.work_empty()

    # Cancel after compute finished: the result arrives for a CANCELLING record; the cancel won.
    late = await enqueue(h.nc, h.kv)
    order = await batcher.next_order()
    await cancel_as_gateway(h, late)
    await batcher.next_cancel()
    await batcher.answer(order)
    record = await wait_state(h.js, late, JobState.CANCELED)
    assert record.outputs == ()
    await h.work_empty()


async def test_a_result_stored_for_a_job_cancelled_while_it_ran_is_deleted(start: Start, config: Config) -> None:
    """A job cancelled while its result is being stored ends CANCELED, its record naming no result
    (the cancel wins over the attempt's end). The object stored for it, by a batcher with
    claim_check_io (out/<job_id>.1) or by the scheduler for outputs too big for the record
    (out/<job_id>), was kept counted against its tenant for the job's result retention (an hour
    here), though no record would ever name it: deleted now."""
    h = await start(tune(config).replace(scheduler={"inline_result_max_bytes": 8}))
    store = await ensure_objects_bucket(h.nc, h.app.config.nats)
    batcher = await h.batcher(credits=2, reads_claim_checks=True)

    by_batcher = await enqueue(h.nc, h.kv)
    order = await batcher.next_order()
    ref = await store_attempts_result(store, order)
    assert (await cancel_as_gateway(h, by_batcher)).state == JobState.CANCELLING
    await batcher.next_cancel()
    await batcher.answer_stored(order, ref)  # the model did not stop at the cancel
    assert (await wait_state(h.js, by_batcher, JobState.CANCELED)).result_ref is None
    await until(object_gone(store, ref.ref))

    by_scheduler = await enqueue(h.nc, h.kv)
    order = await batcher.next_order()
    assert (await cancel_as_gateway(h, by_scheduler)).state == JobState.CANCELLING
    await batcher.next_cancel()
    await batcher.answer(order)  # 16 bytes of outputs: stored by the scheduler as out/<job_id>
    assert (await wait_state(h.js, by_scheduler, JobState.CANCELED)).result_ref is None
    await until(object_gone(store, result_ref(by_scheduler)))

    # A result that won (no cancel) keeps its object.
    await batcher.grant(1)
    kept = await enqueue(h.nc, h.kv)
    order = await batcher.next_order()
    await batcher.answer(order)
    succeeded = await wait_state(h.js, kept, JobState.SUCCEEDED)
    assert succeeded.result_ref is not None
    await store.info(TENANT, succeeded.result_ref.ref)


@pytest.mark.nats_fallback
async def test_a_job_cancelled_on_its_last_attempt_that_then_fails_ends_canceled_without_a_dead_letter(
    start: Start, config: Config
) -> None:
    # A cancel wins over what its attempt does next, a retriable failure of the last attempt
    # included: the job ends CANCELED, and no dead letter says it failed (one did: ListDeadLetters
    # listed it, the dead-letter alert counted it, and its replay was refused NOT_REPLAYABLE).
    h = await start(tune(config, timeout_action="retry"))
    batcher = await h.batcher(credits=2)
    failing = await enqueue(h.nc, h.kv, max_attempts=1)
    order = await batcher.next_order()
    assert (await cancel_as_gateway(h, failing)).state == JobState.CANCELLING
    assert (await batcher.next_cancel()).job_id == failing
    await batcher.fail(order, MODEL_ERROR)  # a model that does not stop at the cancel, then raises
    assert (await wait_state(h.js, failing, JobState.CANCELED)).attempt == 1

    # A hung run cancelled, then past its execution timeout under timeout_action "retry".
    hanging = await enqueue(h.nc, h.kv, max_attempts=1, execution_timeout_s=0.3)
    await batcher.next_order()
    assert (await cancel_as_gateway(h, hanging)).state == JobState.CANCELLING
    await wait_state(h.js, hanging, JobState.CANCELED)
    await h.work_empty()

    listed = await h.ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest(model_name=MODEL))
    assert [letter.job_id for letter in listed.dead_letters] == []
    assert listed.total == 0
    dead_total = h.app.metrics.registry.get_sample_value(
        "asyncinfer_dead_letters_total", {"model": MODEL, "reason": "MAX_ATTEMPTS"}
    )
    assert dead_total in (None, 0.0)


# --- pause, drain, snapshots, tenant counters ------------------------------------------------


async def test_pause_stops_dispatch_until_resume_and_snapshots_show_it(start: Start, config: Config) -> None:
    h = await start(tune(config))
    batcher = await h.batcher()
    assert (await h.ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name=MODEL))).paused
    assert (await h.queues.get("paused.demo")).value
    job_id = await enqueue(h.nc, h.kv, priority=Priority.HIGH)
    await batcher.grant(1)

    async def snapshot_paused() -> bool:
        snapshot = await h.snapshot()
        return (
            snapshot is not None
            and snapshot.paused
            and snapshot.depth(Priority.HIGH) == 1
            and snapshot.free_credits == 1
            and snapshot.in_flight == 0
        )

    # The scheduler's own report: it holds the job and the credit, unspent, while paused.
    await until(snapshot_paused)
    assert batcher.orders.empty()
    stats = (await h.ops.GetQueueStats(ops_service_pb2.GetQueueStatsRequest(model_name=MODEL))).models[0]
    assert stats.paused
    assert not (await h.ops.ResumeQueue(ops_service_pb2.ResumeQueueRequest(model_name=MODEL))).paused
    order = await batcher.next_order()
    assert order.job_id == job_id
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.nats_fallback
async def test_a_job_a_round_pulls_after_the_pause_was_answered_waits_for_the_resume(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round checked the pause before it pulled, not after: a round begun before PauseQueue
    answered, its pull still out (a loaded machine: CI saw it), brought a job submitted after the
    pause and dispatched it, and the job ran while its queue was paused. Now what such a round
    brings is put back, and waits for the resume."""
    h = await start(tune(config).replace(scheduler={"poll_interval_ms": 20.0, "hold_pulls_open": False}))
    queues = h.dispatcher().queues
    real_pull_next = queues.pull_next
    pulling, let_pull = asyncio.Event(), asyncio.Event()

    async def slow_pull_next(count: int = 1) -> Any:
        pulling.set()
        await let_pull.wait()
        return await real_pull_next(count)

    monkeypatch.setattr(queues, "pull_next", slow_pull_next)
    batcher = await h.batcher(credits=1)  # a round pulls only with a credit to give
    await asyncio.wait_for(pulling.wait(), 30)  # a round is out with its pull, the queue not paused
    assert (await h.ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name=MODEL))).paused
    job_id = await enqueue(h.nc, h.kv)
    let_pull.set()  # the round's pull brings the job submitted after the pause

    async def put_back() -> bool:
        return queues.put_back_count(Priority.NORMAL) == 1

    await until(put_back, timeout_s=10.0)
    assert batcher.orders.empty()
    assert not (await h.ops.ResumeQueue(ops_service_pb2.ResumeQueueRequest(model_name=MODEL))).paused
    order = await batcher.next_order(timeout_s=10)
    assert order.job_id == job_id


async def test_a_job_a_pause_put_back_keeps_its_tenants_turn_at_the_resume(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round's pull that comes back after a pause began puts its jobs back, but the pull had
    charged them to the tenant round robin: the turn moved past tenant a, whose job it put back,
    so at the resume tenant b's job, queued after a's, went first. Here b was served last before the
    pause, the paused round brings a's job (queued first) and puts it back: at the resume a's job
    runs first, as if the pause had pulled nothing (old code: b's). Nor is its priority charged for it."""
    h = await start(tune(config).replace(scheduler={"poll_interval_ms": 20.0, "hold_pulls_open": False}))
    queues = h.dispatcher().queues
    batcher = await h.batcher()
    served = await enqueue(h.nc, h.kv, tenant="b")
    await batcher.grant(1)
    order = await batcher.next_order()
    assert order.job_id == served  # b's turn was the last
    await batcher.answer(order)

    real_pull_next = queues.pull_next
    pulling, let_pull = asyncio.Event(), asyncio.Event()
    served_normal: list[float] = []  # the priority's count of jobs served, before the pull

    async def slow_pull_next(count: int = 1) -> Any:
        served_normal.append(queues.selector._served[Priority.NORMAL])
        pulling.set()
        await let_pull.wait()
        return await real_pull_next(count)

    monkeypatch.setattr(queues, "pull_next", slow_pull_next)
    await batcher.grant(1)
    await asyncio.wait_for(pulling.wait(), 30)  # a round is out with its pull, the queue not paused
    assert (await h.ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name=MODEL))).paused
    first = await enqueue(h.nc, h.kv, tenant="a")
    second = await enqueue(h.nc, h.kv, tenant="b")
    let_pull.set()  # the round brings a's job (and b's, with a window of two) and puts it back

    async def put_back() -> bool:
        return first in queues.put_back_jobs(Priority.NORMAL)

    await until(put_back, timeout_s=10.0)
    assert batcher.orders.empty()
    assert queues.selector._served[Priority.NORMAL] == served_normal[0]
    assert not (await h.ops.ResumeQueue(ops_service_pb2.ResumeQueueRequest(model_name=MODEL))).paused
    order = await batcher.next_order(timeout_s=10)
    assert order.job_id == first, f"b's job {second} went first" if order.job_id == second else order.job_id


async def test_a_job_put_back_to_wait_for_its_version_keeps_its_tenants_turn(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job a round chooses and then puts back because no batcher serves its version was charged
    to its tenant round robin and its priority: the turn moved past tenant a, so when a batcher
    for the version came, tenant b's job, queued after a's, went first (and NORMAL's count of jobs
    served grew by each time the job was put back). Here b was served last, a's job (version 1)
    is dispatched to a batcher serving only version 2 until that one leaves, then b's job is
    queued and a batcher for version 1 comes with one slot: a's job runs first (old code: b's)."""
    monkeypatch.setattr(version_routing, "WAIT_UNSERVED_S", 0.0)  # back at once, not a second later
    h = await start(tune(config).replace(scheduler={"poll_interval_ms": 20.0, "hold_pulls_open": False}))
    dispatcher = h.dispatcher()
    queues = dispatcher.queues
    first_v1 = await h.batcher("v1-first")
    served = await enqueue(h.nc, h.kv, tenant="b")
    await first_v1.grant(1)
    order = await first_v1.next_order()
    assert order.job_id == served  # b's turn was the last
    await first_v1.answer(order)
    await first_v1.close()
    served_normal = queues.selector._served[Priority.NORMAL]

    only_v2 = await h.batcher("only-v2", credits=1, version="2")
    waits = await enqueue(h.nc, h.kv, tenant="a")
    put_backs: list[str] = []
    real_put_back = queues.put_back

    def counted_put_back(priority: Priority, msg: Any, **kwargs: Any) -> None:
        put_backs.append(msg.subject.rsplit(".", 1)[-1])
        real_put_back(priority, msg, **kwargs)

    monkeypatch.setattr(queues, "put_back", counted_put_back)

    async def waited_twice() -> bool:
        return put_backs.count(waits) >= 2

    await until(waited_twice, timeout_s=10.0)  # pulled, put back to wait for version 1, and again
    await only_v2.close()

    async def no_credit() -> bool:
        return not h.app.batchers.credit_event(MODEL).is_set()

    await until(no_credit, timeout_s=10.0)
    await dispatcher.settled()  # no round holds a's job: it waits in the queue
    assert waits in queues.put_back_jobs(Priority.NORMAL)
    assert queues.selector._served[Priority.NORMAL] == served_normal
    second = await enqueue(h.nc, h.kv, tenant="b")
    v1 = await h.batcher("v1-again", credits=1)
    order = await v1.next_order(timeout_s=10)
    assert order.job_id == waits, f"b's job {second} went first" if order.job_id == second else order.job_id


@pytest.mark.parametrize("failing", ["running_write", "input_read"])
async def test_a_job_put_back_after_a_nats_failure_at_its_dispatch_keeps_its_tenants_turn(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """A job a round chose whose dispatch met a NATS failure (its RUNNING write, or the read of its
    claim-checked input) goes back to the queue unrun, but stayed charged to its tenant round robin
    and its priority: the turn moved past tenant a, so at the next round tenant b's job went ahead
    of a's next one, queued before it, and NORMAL's count of jobs served counted the failed job
    besides the one that ran. Here b was served last, a's first job's dispatch fails once (a's and
    b's next jobs queued meanwhile; the failed one waits out its retry delay), and the next round
    sends a's next job (old code: b's; NORMAL's count 2 past where it was, not 1)."""
    # The failed job stays away through the next round: its choice is between the other two.
    monkeypatch.setattr(job_dispatch, "DISPATCH_RETRY_DELAY_S", 30.0)
    h = await start(tune(config).replace(scheduler={"poll_interval_ms": 20.0, "hold_pulls_open": False}))
    queues = h.dispatcher().queues
    batcher = await h.batcher()
    served = await enqueue(h.nc, h.kv, tenant="b")
    await batcher.grant(1)
    order = await batcher.next_order()
    assert order.job_id == served  # b's turn was the last
    await batcher.answer(order)
    served_normal = queues.selector._served[Priority.NORMAL]

    # One NATS failure where the dispatch meets NATS, raised as the store would (the raw error, or
    # its Unavailable); a's and b's next jobs are queued just before it.
    failing_job, a_next, b_next = new_job_id(), new_job_id(), new_job_id()
    failed = asyncio.Event()
    dispatch: Any = h.app.flow._dispatch
    input_ref = None
    if failing == "running_write":
        target, name = dispatch._store, "_publish"  # the RUNNING write's compare-and-set
        error: Exception = NatsTimeoutError()

        def fails_for(*args: Any) -> bool:
            return bool(args[0].job_id == failing_job)
    else:
        target, name = dispatch._claim_check._store, "_info_or_none"  # the input read's first request
        error = Unavailable("cannot read the object's metadata: nats: timeout")
        x = Tensor.from_numpy("x", np.full((1, 4), 1.0, np.float32))
        data = tensor_pb2.InferInputs(inputs=[to_input_proto(x)]).SerializeToString()
        stored = await target.put_bytes("a", new_input_ref(), data, expires_at=time.time() + 600)
        input_ref = stored

        def fails_for(*args: Any) -> bool:
            return bool(args[0] == f"a/{stored.ref}")

    real = getattr(target, name)

    async def fails_once(*args: Any, **kwargs: Any) -> Any:
        if not failed.is_set() and fails_for(*args):
            failed.set()
            await enqueue(h.nc, h.kv, tenant="a", job_id=a_next)
            await enqueue(h.nc, h.kv, tenant="b", job_id=b_next)
            raise error
        return await real(*args, **kwargs)

    monkeypatch.setattr(target, name, fails_once)
    await enqueue(h.nc, h.kv, tenant="a", job_id=failing_job, input_ref=input_ref)
    await batcher.grant(1)
    await asyncio.wait_for(failed.wait(), 10)
    if failing == "running_write":  # its order went out ahead of the write, and was cancelled
        sent = await batcher.next_order()
        assert sent.job_id == failing_job
        assert (await batcher.next_cancel()).job_id == failing_job
        # Its credit stays spent: the batcher answers the cancelled order and grants it again.
        dropped = worker_service_pb2.WorkResult(job_id=sent.job_id, attempt=sent.attempt, dropped=True)
        await batcher._call.write(worker_service_pb2.ConnectRequest(result=dropped))
        await batcher.grant(1)
    order = await batcher.next_order(timeout_s=10)  # on the credit the failed dispatch gave back, or the new one
    assert order.job_id == a_next, f"b's job {b_next} went first" if order.job_id == b_next else order.job_id
    assert queues.selector._served[Priority.NORMAL] == served_normal + 1


async def b_served_last(h: Harness, batcher: ScriptedBatcher) -> float:
    """Runs one job of tenant b on the batcher, so that tenant a's turn is next; NORMAL's count of
    jobs served then."""
    served = await enqueue(h.nc, h.kv, tenant="b")
    await batcher.grant(1)
    order = await batcher.next_order()
    assert order.job_id == served
    await batcher.answer(order)
    return float(h.dispatcher().queues.selector._served[Priority.NORMAL])


async def test_a_job_put_back_as_its_record_is_not_written_yet_keeps_its_tenants_turn(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job whose record an older gateway had not written yet (job_record_not_written_yet: its
    message, not a record itself, came first) goes back to wait for it, unrun, but stayed charged
    to its tenant and priority. b served last, a's job put back so (a's and b's next jobs queued
    as its record is read, the put-back job kept away by a 30-s retry delay): the next round sends
    a's next job (old code: b's; NORMAL's count 2 past where it was, not 1)."""
    monkeypatch.setattr(job_dispatch, "DISPATCH_RETRY_DELAY_S", 30.0)
    h = await start(tune(config).replace(scheduler={"poll_interval_ms": 20.0, "hold_pulls_open": False}))
    batcher = await h.batcher()
    served_normal = await b_served_last(h, batcher)
    waiting, a_next, b_next = new_job_id(), new_job_id(), new_job_id()
    store: Any = h.app.flow._dispatch._store
    real_recorded = store.recorded
    read = asyncio.Event()

    async def recorded(key: str) -> Any:
        if waiting in key and not read.is_set():
            read.set()
            await enqueue(h.nc, h.kv, tenant="a", job_id=a_next)
            await enqueue(h.nc, h.kv, tenant="b", job_id=b_next)
        return await real_recorded(key)

    monkeypatch.setattr(store, "recorded", recorded)
    with capture_logs() as logs:
        await enqueue(h.nc, h.kv, tenant="a", job_id=waiting, legacy=True, with_record=False)
        await batcher.grant(1)
        order = await batcher.next_order()  # on the credit the put-back job gave back
    assert [e["job_id"] for e in logs if e["event"] == "job_record_not_written_yet"] == [waiting]
    assert order.job_id == a_next, f"b's job {b_next} went first" if order.job_id == b_next else order.job_id
    assert h.dispatcher().queues.selector._served[Priority.NORMAL] == served_normal + 1


async def test_a_job_put_back_as_its_batcher_left_during_its_write_keeps_its_tenants_turn(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job whose batcher left while its RUNNING write was in flight, its order not sent yet, goes
    straight back to the queue unrun (its attempt given back), but stayed charged to its tenant and
    priority. b served last on b1; a's job (an older gateway's message: no order before the write)
    is dispatched to b1, which leaves during the write (a's and b's next jobs queued meanwhile); b2
    then grants a credit, and the next round sends a's job again (old code: b's next; NORMAL's
    count 2 past where it was, not 1)."""
    h = await start(tune(config).replace(scheduler={"poll_interval_ms": 20.0, "hold_pulls_open": False}))
    b1 = await h.batcher("b1")
    b2 = await h.batcher("b2")
    served_normal = await b_served_last(h, b1)
    left, a_next, b_next = new_job_id(), new_job_id(), new_job_id()
    store: Any = h.app.flow._dispatch._store
    real_publish = store._publish
    registry = h.app.batchers

    async def b1_gone() -> bool:
        return all(session.batcher_id != "b1" for session in registry.sessions)

    async def leaves_during(*args: Any, **kwargs: Any) -> Any:
        if args[0].job_id == left and args[0].state is JobState.RUNNING and await b1_gone() is False:
            # b's first: the put-back job comes straight back, ahead of both, and a round's
            # window (two jobs for one slot) holds it and b's, so the turn decides between them.
            await enqueue(h.nc, h.kv, tenant="b", job_id=b_next)
            await enqueue(h.nc, h.kv, tenant="a", job_id=a_next)
            h.batchers.remove(b1)
            await b1.break_stream()
            await until(b1_gone)
        return await real_publish(*args, **kwargs)

    monkeypatch.setattr(store, "_publish", leaves_during)
    await enqueue(h.nc, h.kv, tenant="a", job_id=left, legacy=True)
    await b1.grant(1)

    async def requeued() -> bool:  # by the scheduler, its batcher gone
        record = decode_record((await h.kv.get(job_key("a", left))).value or b"")
        return record.state is JobState.QUEUED and record.last_error is not None

    await until(requeued)
    record = decode_record((await h.kv.get(job_key("a", left))).value or b"")
    assert record.last_error is not None
    assert record.last_error.reason == "WORKER_LOST", record.last_error
    await b2.grant(1)
    order = await b2.next_order()
    assert order.job_id == left, f"b's job {b_next} went first" if order.job_id == b_next else order.job_id
    assert h.dispatcher().queues.selector._served[Priority.NORMAL] == served_normal + 1


async def test_a_job_put_back_after_its_attempt_mismatched_its_early_order_keeps_its_tenants_turn(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job whose order went out ahead of its RUNNING write, which another writer's record then
    made a different attempt (dispatch_attempt_mismatch: here another scheduler had written attempt
    1), goes straight back unrun, its order cancelled and its attempt given back, but stayed
    charged to its tenant and priority. b served last; a's job mismatches (a's and b's next jobs
    queued as its write goes); the batcher answers the cancelled order and grants again; the next
    round sends a's job again (old code: b's next; NORMAL's count 2 past where it was, not 1)."""
    h = await start(tune(config).replace(scheduler={"poll_interval_ms": 20.0, "hold_pulls_open": False}))
    batcher = await h.batcher()
    served_normal = await b_served_last(h, batcher)
    mismatched, a_next, b_next = new_job_id(), new_job_id(), new_job_id()
    store: Any = h.app.flow._dispatch._store
    real_publish = store._publish
    written = asyncio.Event()

    async def another_writer_first(*args: Any, **kwargs: Any) -> Any:
        if args[0].job_id == mismatched and not written.is_set():
            written.set()
            # b's first: the put-back job comes straight back, ahead of both, and a round's
            # window (two jobs for one slot) holds it and b's, so the turn decides between them.
            await enqueue(h.nc, h.kv, tenant="b", job_id=b_next)
            await enqueue(h.nc, h.kv, tenant="a", job_id=a_next)
            elsewhere = args[0].evolve(dispatched_by="another scheduler")  # its attempt 1, RUNNING
            await h.kv.create(job_key("a", mismatched), encode_record(elsewhere))
        return await real_publish(*args, **kwargs)

    monkeypatch.setattr(store, "_publish", another_writer_first)
    with capture_logs() as logs:
        await enqueue(h.nc, h.kv, tenant="a", job_id=mismatched)
        await batcher.grant(1)
        sent = await batcher.next_order()
        assert (sent.job_id, sent.attempt) == (mismatched, 1)
        assert (await batcher.next_cancel()).attempt == 1
    assert [e["job_id"] for e in logs if e["event"] == "dispatch_attempt_mismatch"] == [mismatched]
    dropped = worker_service_pb2.WorkResult(job_id=sent.job_id, attempt=sent.attempt, dropped=True)
    await batcher._call.write(worker_service_pb2.ConnectRequest(result=dropped))
    await batcher.grant(1)
    order = await batcher.next_order()
    assert order.job_id == mismatched, f"b's job {b_next} went first" if order.job_id == b_next else order.job_id
    assert h.dispatcher().queues.selector._served[Priority.NORMAL] == served_normal + 1


async def test_a_redelivery_its_live_attempt_adopts_keeps_its_tenants_turn(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A running attempt's message that comes back (AckWait lapsed in a stall, or a sweep's nak that
    hit the newer delivery) is adopted by the dispatcher holding the attempt: nothing new runs, and
    its credit goes back, but choosing it stayed charged to its tenant and priority. a's job runs,
    then b is served last; a's job is redelivered (a nak, as a sweep's) and adopted (a's and b's next
    jobs queued as its record is read); the next round sends a's next job (old code: b's; NORMAL's
    count 2 past where it was, not 1), and a's running job ends as its one attempt."""
    h = await start(tune(config).replace(scheduler={"poll_interval_ms": 20.0, "hold_pulls_open": False}))
    batcher = await h.batcher()
    running_id, a_next, b_next = new_job_id(), new_job_id(), new_job_id()
    await enqueue(h.nc, h.kv, tenant="a", job_id=running_id)
    await batcher.grant(1)
    running_order = await batcher.next_order()
    assert running_order.job_id == running_id
    served_normal = await b_served_last(h, batcher)
    running = decode_record((await h.kv.get(job_key("a", running_id))).value or b"")
    assert running.state is JobState.RUNNING
    store: Any = h.app.flow._dispatch._store
    real_get = store.get
    read = asyncio.Event()

    async def get(key: str) -> Any:  # the redelivery's read of its record (not its first delivery)
        if running_id in key and not read.is_set():
            read.set()
            await enqueue(h.nc, h.kv, tenant="b", job_id=b_next)
            await enqueue(h.nc, h.kv, tenant="a", job_id=a_next)
        return await real_get(key)

    monkeypatch.setattr(store, "get", get)
    with capture_logs() as logs:
        await h.nc.publish(running.lease_subject, b"-NAK")  # as a sweep's would
        await h.nc.flush()
        await batcher.grant(1)
        order = await batcher.next_order()  # on the credit the adopted redelivery gave back
    assert [e["job_id"] for e in logs if e["event"] == "live_attempt_redelivered"] == [running_id]
    assert order.job_id == a_next, f"b's job {b_next} went first" if order.job_id == b_next else order.job_id
    assert h.dispatcher().queues.selector._served[Priority.NORMAL] == served_normal + 1
    await batcher.answer(running_order)

    async def succeeded() -> bool:
        done = decode_record((await h.kv.get(job_key("a", running_id))).value or b"")
        return done.state is JobState.SUCCEEDED

    await until(succeeded)
    assert decode_record((await h.kv.get(job_key("a", running_id))).value or b"").attempt == 1


async def test_an_order_sent_ahead_of_a_running_write_that_fails_keeps_its_credit_spent(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An order sent before its RUNNING write (a queued job, inputs inline) took the batcher's
    slot: when the write then met a NATS failure the order was cancelled, yet the dispatch gave
    its credit back, and the batcher granted it again once it answered the cancelled order (as
    a batcher does when an item leaves: services.batcher.work_session's top-up). The scheduler
    then held one credit more than the batcher had free slots, for good. Here a batcher of one
    slot grants 1, the first job's write fails once (two jobs queued meanwhile), the batcher
    answers the cancelled order dropped and grants 1: two credits granted, one order answered, so
    one order may be outstanding (old code: both queued jobs sent, three orders on two credits)."""
    monkeypatch.setattr(job_dispatch, "DISPATCH_RETRY_DELAY_S", 30.0)  # the failed job stays away
    h = await start(tune(config).replace(scheduler={"poll_interval_ms": 20.0, "hold_pulls_open": False}))
    dispatcher = h.dispatcher()
    registry = h.app.batchers
    credit = registry.credit_event(MODEL)
    granted = 0
    real_grant = registry.grant

    def counted_grant(session: Any, model_name: str, credits: int) -> None:
        nonlocal granted
        granted += credits  # as the scheduler reads them, in the stream's order
        real_grant(session, model_name, credits)

    monkeypatch.setattr(registry, "grant", counted_grant)
    store: Any = h.app.flow._dispatch._store
    real_publish = store._publish
    failing_job, first, second = new_job_id(), new_job_id(), new_job_id()
    failed = asyncio.Event()

    async def fails_once(*args: Any, **kwargs: Any) -> Any:
        if not failed.is_set() and args[0].job_id == failing_job:
            failed.set()
            await enqueue(h.nc, h.kv, job_id=first)
            await enqueue(h.nc, h.kv, job_id=second)
            raise NatsTimeoutError()  # the RUNNING write's compare-and-set
        return await real_publish(*args, **kwargs)

    monkeypatch.setattr(store, "_publish", fails_once)
    batcher = await h.batcher()
    await enqueue(h.nc, h.kv, job_id=failing_job)
    await batcher.grant(1)
    order = await batcher.next_order()
    assert order.job_id == failing_job  # sent ahead of its write
    assert (await batcher.next_cancel()).job_id == failing_job
    dropped = worker_service_pb2.WorkResult(job_id=order.job_id, attempt=order.attempt, dropped=True)
    await batcher._call.write(worker_service_pb2.ConnectRequest(result=dropped))
    await batcher.grant(1)  # its slot is free again

    async def quiet() -> bool:
        """Both grants read, no credit left and no round under way: nothing more will be sent."""
        return granted == 2 and not credit.is_set() and dispatcher._between_rounds.is_set()

    await until(quiet)
    outstanding = sorted(h.app.flow.in_flight)
    sent = [order.job_id] + [(await batcher.next_order()).job_id for _ in outstanding]
    assert len(sent) <= granted, f"{len(sent)} orders on {granted} credits: {sent}"
    assert outstanding == [first], outstanding


async def test_resume_counts_the_jobs_it_lets_go_though_a_dispatcher_takes_them_at_once(
    start: Start, config: Config
) -> None:
    """ResumeQueue's `queued` is what the resume lets go. It was counted after the resume, and the
    dispatcher the resume woke could take the job first: "0 queued" for a job that waited through
    the whole pause (a CLI test saw it twice in a session). Here a count asked once the queue is
    no longer paused waits until the dispatcher took the job, as a slow stats read would."""
    h = await start(tune(config))
    batcher = await h.batcher()
    await h.ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name=MODEL))
    job_id = await enqueue(h.nc, h.kv)
    await batcher.grant(1)

    async def held() -> bool:
        snapshot = await h.snapshot()
        return snapshot is not None and snapshot.paused and snapshot.total_depth == 1 and snapshot.free_credits == 1

    await until(held)  # the job and a credit, both left unspent while paused
    taken: list[worker_service_pb2.WorkOrder] = []
    stats: Any = h.app._stats
    read = stats.snapshot

    async def read_once_taken_if_resumed(model_name: str = "") -> Any:
        if model_name == MODEL and not h.app._pauses.is_paused(MODEL):
            taken.append(await batcher.next_order())  # the dispatcher sent the job on
        return await read(model_name)

    stats.snapshot = read_once_taken_if_resumed
    resumed = await h.ops.ResumeQueue(ops_service_pb2.ResumeQueueRequest(model_name=MODEL))
    assert resumed.state == ops_service_pb2.QUEUE_STATE_DISPATCHING
    assert resumed.queued == 1
    order = taken[0] if taken else await batcher.next_order()
    assert order.job_id == job_id
    await batcher.answer(order)
    await wait_state(h.js, job_id, JobState.SUCCEEDED)


@pytest.mark.nats_fallback
async def test_pause_and_resume_count_a_job_another_schedulers_held_pull_put_back(start: Start, config: Config) -> None:
    """A job submitted while the queue is paused can be handed to a pull another scheduler held
    open from before the pause (held pulls last up to HOLD_S, and a pause does not end them): that
    scheduler puts it back (a nak), its own put-back, which the consumer counts delivered, not
    pending. PauseQueue and ResumeQueue counted the asked scheduler's own view (the pending and its
    own put-backs): `asyncinfer queue resume` said "0 queued" for the job that waited through the
    pause. They now count the cluster's queue, as GetQueueStats does."""
    a = await start(tune(config))  # asked; no batcher
    b = await start(tune(config))
    on_b = await b.batcher("on-b", credits=1)  # idle: B holds a pull open on every priority
    held = b.dispatcher()._held
    await until(pulls_held_on_every_priority(held))
    paused = await a.ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name=MODEL))
    assert paused.queued == 0

    async def b_knows_the_pause() -> bool:
        return b.app._pauses is not None and b.app._pauses.is_paused(MODEL) and held.holding(Priority.NORMAL)

    await until(b_knows_the_pause)
    job_id = await enqueue(a.nc, a.kv)
    queues = b.dispatcher().queues

    async def put_back_on_b() -> bool:
        return queues.put_back_count(Priority.NORMAL) == 1

    await until(put_back_on_b)  # handed to B's held pull, put back there: the pause holds it
    cluster: Any = a.app._cluster_queues

    async def a_sees_bs_put_back() -> bool:
        latest = cluster._schedulers.latest(MODEL).get(b.app.instance_name)
        return latest is not None and latest.snapshot.priorities[Priority.NORMAL.value].put_back == 1

    await until(a_sees_bs_put_back)
    again = await a.ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name=MODEL))
    assert again.queued == 1, f"PauseQueue on A: {again.queued} queued"
    resumed = await a.ops.ResumeQueue(ops_service_pb2.ResumeQueueRequest(model_name=MODEL))
    assert resumed.queued == 1, f"ResumeQueue on A: {resumed.queued} queued"
    order = await on_b.next_order()
    assert order.job_id == job_id
    await on_b.answer(order)
    await wait_state(a.js, job_id, JobState.SUCCEEDED)


async def test_a_rounds_snapshots_leave_together_before_any_is_answered(nc: NatsClient, config: Config) -> None:
    """An idle scheduler with 100 models wrote 50 queue snapshots a second, each awaited before the
    next (27-31 ms of a 53-59 ms stats round). A round's snapshots are written as one pipelined
    group: here a stand-in for the bucket answers none until every write of the group arrived, which
    writes made one at a time never reach; then the real bucket holds each model's snapshot."""
    names = [f"model-{i}" for i in range(5)]
    snapshots = [QueueSnapshot(model_name=name, updated_at=1000.0 + i, in_flight=i) for i, name in enumerate(names)]
    held: list[Any] = []

    async def answer_once_all_arrived(msg: Any) -> None:
        held.append(msg)
        if len(held) == len(names):
            for seq, write in enumerate(held, start=1):
                await write.respond(json.dumps({"stream": "KV_stand-in", "seq": seq}).encode())

    stand_in = await nc.subscribe("$KV.stand-in.>", cb=answer_once_all_arrived)
    await nc.flush()
    js = nc.jetstream()
    await write_snapshots(js, "stand-in", snapshots)
    await stand_in.unsubscribe()
    assert sorted(write.subject for write in held) == sorted(f"$KV.stand-in.{snapshot_key(name)}" for name in names)
    queues = await ensure_queues_bucket(js, config.nats)
    await write_snapshots(js, config.nats.queues_bucket, snapshots)
    for snapshot in snapshots:
        assert decode_snapshot((await queues.get(snapshot_key(snapshot.model_name))).value or b"") == snapshot


async def test_paused_key_written_by_another_scheduler_is_honoured(start: Start, config: Config) -> None:
    h = await start(tune(config))
    batcher = await h.batcher()
    await h.queues.put("paused.demo", b"{}")  # as another scheduler's PauseQueue would
    await until(lambda: _true_if(h.app.metrics, "asyncinfer_queue_paused"))
    await enqueue(h.nc, h.kv)
    await batcher.grant(1)

    async def held() -> bool:
        snapshot = await h.snapshot()
        return snapshot is not None and snapshot.total_depth == 1 and snapshot.free_credits == 1

    await until(held)  # the job and the credit, both seen and left unspent
    assert batcher.orders.empty()
    await h.queues.delete("paused.demo")
    await batcher.next_order()


class HeldWatches:
    """A queues bucket whose watches deliver nothing until `released` is set (a NATS slow to send a
    watch's initial values); everything else is the real bucket's."""

    def __init__(self, kv: KeyValue, released: asyncio.Event) -> None:
        self._kv = kv
        self._released = released

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    async def watch(self, keys: str, **options: Any) -> Any:
        return HeldWatcher(await self._kv.watch(keys, **options), self._released)


class HeldWatcher:
    def __init__(self, watcher: Any, released: asyncio.Event) -> None:
        self._watcher = watcher
        self._released = released

    def __aiter__(self) -> HeldWatcher:
        return self

    async def __anext__(self) -> Any:
        await self._released.wait()
        return await self._watcher.__anext__()

    async def stop(self) -> None:
        await self._watcher.stop()


@pytest.mark.nats_fallback
async def test_a_restarted_scheduler_dispatches_no_job_of_a_paused_queue_before_it_reads_the_pause(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler started while a queue is paused holds every queue until its watch of the
    `paused.<model>` keys has sent the stored ones. The dispatchers started with the queue open
    and the watch's values were applied whenever they came: a restart whose values came late
    (NATS busy) pulled a paused queue's job and ran it. Here they come only when the test says."""
    first = await start(tune(config))
    assert (await first.ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name=MODEL))).paused
    job_id = await enqueue(first.nc, first.kv)
    await first.app.stop(grace_s=0.5)
    released = asyncio.Event()
    monkeypatch.setattr(
        scheduler_app, "PauseState", lambda kv, supervisor: pauses.PauseState(HeldWatches(kv, released), supervisor)
    )
    monkeypatch.setattr(pauses, "STORED_KEYS_WAIT_S", 0.2)
    with capture_logs() as logs:
        h = await start(tune(config))  # its start waits 0.2 s for the stored keys, then goes on
        batcher = await h.batcher(credits=1)
        state = h.app._pauses
        assert state is not None

        async def ordered_or_held() -> bool:
            held = h.app.batchers.credit_event(MODEL).is_set() and not state.resumed(MODEL).is_set()
            return not batcher.orders.empty() or held

        await until(ordered_or_held)  # the credit has come: the queue is held, or its job went out
        assert batcher.orders.empty()

        async def said() -> bool:
            return any(entry["event"] == "pauses_not_read" for entry in logs)

        await until(said)  # each watch that has not sent them in time is a warning, and is made again
    released.set()

    async def pause_read() -> bool:
        return state.known and state.is_paused(MODEL)

    await until(pause_read)
    assert batcher.orders.empty()
    assert (await read_record(h.js, job_id)).state == JobState.QUEUED
    assert not (await h.ops.ResumeQueue(ops_service_pb2.ResumeQueueRequest(model_name=MODEL))).paused
    order = await batcher.next_order()
    assert (order.job_id, order.attempt) == (job_id, 1)
    await batcher.answer(order)
    await wait_state(h.js, job_id, JobState.SUCCEEDED)


async def _true_if(metrics: Any, name: str) -> bool:
    return f'{name}{{model="demo"}} 1.0' in generate_latest(metrics.registry).decode()


async def test_drain_stops_dispatch_waits_for_jobs_in_flight_and_undrain_resumes(start: Start, config: Config) -> None:
    h = await start(tune(config))
    batcher = await h.batcher(credits=2)
    running = await enqueue(h.nc, h.kv)
    order = await batcher.next_order()
    timeout = duration_pb2.Duration(seconds=10)

    async def drain_call() -> ops_service_pb2.DrainResponse:
        return await h.ops.Drain(ops_service_pb2.DrainRequest(timeout=timeout))

    drain = asyncio.create_task(drain_call())

    async def draining() -> bool:
        return h.app.draining

    await until(draining)
    queued = await enqueue(h.nc, h.kv)
    assert not drain.done()
    await batcher.answer(order)
    answer = await asyncio.wait_for(drain, 5)
    assert answer.in_flight == 0
    assert answer.drained
    assert answer.state == ops_service_pb2.QUEUE_STATE_DRAINING
    drained_at = time.time()
    await wait_state(h.js, running, JobState.SUCCEEDED)

    async def held() -> bool:
        snapshot = await h.snapshot()
        return (
            snapshot is not None
            and snapshot.draining
            and snapshot.total_depth == 1
            and snapshot.in_flight == 0
            and snapshot.free_credits == 1
            and snapshot.desired_batchers == 0  # a held queue asks for no batcher
            and snapshot.updated_at > drained_at
        )

    await until(held)  # after the drain: the queued job and a credit, both left unspent
    assert batcher.orders.empty()
    assert (await read_record(h.js, queued)).state == JobState.QUEUED
    stats = (await h.ops.GetQueueStats(ops_service_pb2.GetQueueStatsRequest(model_name=MODEL))).models[0]
    assert stats.draining
    assert not stats.paused
    assert stats.state == ops_service_pb2.QUEUE_STATE_DRAINING
    assert stats.desired_batchers == 0
    assert _true_if_unlabelled(h.app.metrics, "asyncinfer_scheduler_draining")
    # Resuming a queue while the scheduler drains says so: the queue is still held.
    resumed = await h.ops.ResumeQueue(ops_service_pb2.ResumeQueueRequest(model_name=MODEL))
    assert resumed.state == ops_service_pb2.QUEUE_STATE_DRAINING
    assert resumed.HasField("queued")
    assert resumed.queued == 1
    short = await h.ops.Drain(ops_service_pb2.DrainRequest(timeout=duration_pb2.Duration(nanos=1000)))
    assert short.in_flight == 0
    assert short.drained

    # Reversible: undrain, and the job held through the drain runs.
    undrained = await h.ops.Undrain(ops_service_pb2.UndrainRequest())
    assert undrained.was_draining
    assert undrained.state == ops_service_pb2.QUEUE_STATE_DISPATCHING
    order = await batcher.next_order()
    assert order.job_id == queued
    await batcher.answer(order)
    await wait_state(h.js, queued, JobState.SUCCEEDED)
    stats = (await h.ops.GetQueueStats(ops_service_pb2.GetQueueStatsRequest(model_name=MODEL))).models[0]
    assert not stats.draining
    assert stats.state == ops_service_pb2.QUEUE_STATE_DISPATCHING
    assert not (await h.ops.Undrain(ops_service_pb2.UndrainRequest())).was_draining

    async def snapshot_undrained() -> bool:
        snapshot = await h.snapshot()
        return snapshot is not None and not snapshot.draining

    await until(snapshot_undrained)


def _true_if_unlabelled(metrics: Any, name: str) -> bool:
    return f"{name} 1.0" in generate_latest(metrics.registry).decode()


async def test_a_paused_queue_asks_for_no_more_batchers_than_it_has(start: Start, config: Config) -> None:
    """Issue 18: a paused queue of 30 jobs asked for 15 batchers. Held, its waiting jobs count for
    nothing; only the jobs in flight do, and never beyond the batchers connected."""
    h = await start(tune(config))
    await h.ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name=MODEL))
    for _ in range(30):
        await enqueue(h.nc, h.kv)

    async def stats() -> ops_service_pb2.ModelQueueStats:
        return (await h.ops.GetQueueStats(ops_service_pb2.GetQueueStatsRequest(model_name=MODEL))).models[0]

    async def all_queued() -> bool:
        return sum(p.depth for p in (await stats()).priorities) == 30

    await until(all_queued)
    paused = await stats()
    assert paused.paused
    assert paused.state == ops_service_pb2.QUEUE_STATE_PAUSED
    assert paused.desired_batchers == 0
    resumed = await h.ops.ResumeQueue(ops_service_pb2.ResumeQueueRequest(model_name=MODEL))
    assert resumed.state == ops_service_pb2.QUEUE_STATE_DISPATCHING
    assert resumed.queued == 30
    assert (await stats()).desired_batchers >= 1  # no batcher yet: scaling from zero asks for one


@pytest.mark.nats_fallback
def test_desired_batchers_of_held_and_open_queues() -> None:
    open_queue = {"connected": 2, "completed_per_s": 2.0, "target_drain_s": 1.0}
    assert desired_batchers(waiting=30, in_flight=0, **open_queue) == 30
    assert desired_batchers(waiting=30, in_flight=0, held=True, **open_queue) == 0
    assert desired_batchers(waiting=30, in_flight=4, held=True, **open_queue) == 2  # never more than connected
    assert desired_batchers(waiting=30, in_flight=1, held=True, **open_queue) == 1
    assert desired_batchers(waiting=0, in_flight=3, connected=0, completed_per_s=0.0, target_drain_s=1.0) == 1
    assert desired_batchers(waiting=5, in_flight=0, connected=0, completed_per_s=0.0, target_drain_s=1.0) == 1
    assert (
        desired_batchers(waiting=5, in_flight=0, connected=0, completed_per_s=0.0, target_drain_s=1.0, held=True) == 0
    )


async def test_snapshot_rates_and_desired_batchers(start: Start, config: Config) -> None:
    h = await start(tune(config))
    batcher = await h.batcher()
    batcher.serve(batcher.answer)
    jobs = [await enqueue(h.nc, h.kv) for _ in range(5)]
    await enqueue(h.nc, h.kv, tenant="other")
    await batcher.grant(2)
    for job in jobs:
        await wait_state(h.js, job, JobState.SUCCEEDED)
    stats = (await h.ops.GetQueueStats(ops_service_pb2.GetQueueStatsRequest())).models[0]
    assert stats.completed_per_second > 0
    # Six jobs queued with a notice each (issue 18: IN/S was always 0).
    assert stats.submitted_per_second > 0
    assert stats.submitted_per_second == pytest.approx(6 / max(time.monotonic() - h.started, 1.0), rel=0.5)
    assert stats.desired_batchers == 0  # nothing waits or runs: scale to zero

    async def snapshot_rate() -> bool:
        snapshot = await h.snapshot()
        return snapshot is not None and snapshot.completed_per_s > 0 and snapshot.connected_batchers == 1

    await until(snapshot_rate)
    exposition = generate_latest(h.app.metrics.registry).decode()
    assert 'asyncinfer_desired_batchers{model="demo"}' in exposition
    assert 'asyncinfer_results_total{model="demo"} 6.0' in exposition


# --- priority -------------------------------------------------------------------------------


def test_selector_weights_and_aging() -> None:
    selector = PrioritySelector({Priority.HIGH: 8, Priority.NORMAL: 3, Priority.LOW: 1}, aging_s=30.0)
    assert selector.plan(1, list(Priority)) == {Priority.HIGH: 1, Priority.NORMAL: 0, Priority.LOW: 0}
    plan = selector.plan(12, list(Priority))
    assert plan == {Priority.HIGH: 8, Priority.NORMAL: 3, Priority.LOW: 1}
    selector.observe_ages({Priority.LOW: 65.0})  # two levels up: LOW weighs like HIGH
    assert selector.effective_weight(Priority.LOW) == 8
    plan = selector.plan(16, [Priority.HIGH, Priority.LOW])
    assert plan == {Priority.HIGH: 8, Priority.LOW: 8}


class SteppedForward(datetime):
    """The scheduler's wall clock, stepped forward by two aging periods (an NTP sync after a resume,
    a VM's clock being set) since nats-server stamped the jobs now waiting."""

    STEP_S = 2 * 30.0

    @classmethod
    def now(cls, tz: tzinfo | None = None) -> Any:
        return datetime.now(tz) + timedelta(seconds=cls.STEP_S)


async def test_a_forward_step_of_the_schedulers_wall_clock_keeps_the_priorities_weights(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue's age was the scheduler's wall clock against the server's stamp on its oldest
    waiting message, so a forward step of 2 x aging_s aged every waiting queue two levels: 8:3:1
    weighed 8:8:8 until the jobs from before the step were dispatched (documented by cd1ab60).
    The age is on the server's clock alone now (a consumer info's `ts` against the stamp)."""
    monkeypatch.setattr(queue_stats, "datetime", SteppedForward)
    h = await start(tune(config).replace(scheduler={"aging_s": 30.0}))
    for priority in (Priority.HIGH, Priority.NORMAL, Priority.LOW):
        await enqueue(h.nc, h.kv, priority=priority)  # no batcher: they wait

    async def queue_stats_read() -> ops_service_pb2.ModelQueueStats:
        return (await h.ops.GetQueueStats(ops_service_pb2.GetQueueStatsRequest(model_name=MODEL))).models[0]

    async def all_aged() -> bool:
        return all(p.depth == 1 and p.HasField("oldest_age") for p in (await queue_stats_read()).priorities)

    await until(all_aged)
    await StatsRounds(h.app).wait(1)  # a round read the ages and handed them to the selector
    selector = h.dispatcher().queues.selector
    weights = {p: selector.effective_weight(p) for p in (Priority.HIGH, Priority.NORMAL, Priority.LOW)}
    assert weights == {Priority.HIGH: 8, Priority.NORMAL: 3, Priority.LOW: 1}  # 8:8:8 before
    assert selector.plan(12, list(Priority)) == {Priority.HIGH: 8, Priority.NORMAL: 3, Priority.LOW: 1}
    ages_s = [p.oldest_age.ToTimedelta().total_seconds() for p in (await queue_stats_read()).priorities]
    assert all(age_s < 30.0 for age_s in ages_s), ages_s  # 60.4 s each before


def test_a_queues_age_is_on_the_servers_clock_else_the_schedulers() -> None:
    stored_at = 1_800_000_000.0
    stepped_wall = stored_at + 3_600.0
    assert waited_s(stored_at, server_now=stored_at + 2.5, wall_now=stepped_wall) == 2.5
    assert waited_s(stored_at, server_now=None, wall_now=stored_at + 4.0) == 4.0  # a server older than 2.10
    assert waited_s(stored_at, server_now=stored_at - 1.0, wall_now=stepped_wall) == 0.0  # stored after the answer


def test_tenant_round_robin_takes_one_job_per_tenant_in_turn() -> None:
    rr = TenantRoundRobin()
    items = [("a", 1), ("a", 2), ("a", 3), ("b", 4), ("a", 5), ("c", 6)]
    chosen, rest = rr.choose(items, 3)
    assert chosen == [1, 4, 6]
    assert rest == [2, 3, 5]
    chosen, rest = rr.choose([("a", 2), ("a", 3), ("b", 7), ("c", 8)], 2)
    assert chosen == [2, 7]  # after c comes a, then b
    assert rr.several_tenants
    assert rr.window(4) == 8


async def test_jobs_given_back_by_the_tenant_round_robin_stay_in_their_queues_depth(
    start: Start, config: Config
) -> None:
    """Among several tenants a round pulls twice its free slots and gives back (nak) the jobs it
    does not take; the consumer then counts them as delivered, not pending. They were left out of
    the queue's depth (GetQueueStats, the snapshot the gateway reads for positions, admission and
    the desired batchers) for as long as no credit came: here 1 of 4 waiting jobs."""
    h = await start(tune(config))
    batcher = await h.batcher()
    for tenant in ("a", "a", "b", "b", "a"):
        await enqueue(h.nc, h.kv, tenant=tenant)
    await batcher.grant(1)
    # A round of 1 slot pulls 2 jobs (its first window is a probe for a second tenant), takes
    # one and gives the other back.
    await batcher.next_order()

    seen: list[tuple[int, int | None]] = []

    async def depth_is(count: int) -> bool:
        stats = await h.ops.GetQueueStats(ops_service_pb2.GetQueueStatsRequest(model_name=MODEL))
        (normal,) = [q for q in stats.models[0].priorities if q.priority == job_pb2.PRIORITY_NORMAL]
        snapshot = await h.snapshot()  # what the gateways read
        seen.append((normal.depth, snapshot.depth(Priority.NORMAL) if snapshot is not None else None))
        return seen[-1] == (count, count) and stats.models[0].in_flight == 1

    with contextlib.suppress(AssertionError):
        await until(lambda: depth_is(4))
    assert seen[-1] == (4, 4), f"GetQueueStats and the snapshot read {seen[-1]} of 4 waiting jobs"


# A stored time read from a message's ack subject (nanoseconds) and from a STREAM.MSG.GET (a
# datetime: microseconds) may differ by this much.
TIME_ROUNDING_S = 2e-6


async def test_a_queues_oldest_job_may_be_one_given_back(start: Start, config: Config) -> None:
    """A queue's oldest waiting time (priority aging, the deadline sweep's backlog, the snapshot the
    gateway places a queued job by) was read from the first message past the consumer's delivered
    sequence, so a job given back (the tenant round robin's rest here, or a held pull's), the
    oldest of the queue, was left out: here it is the second job's time, not the third's."""
    h = await start(tune(config))
    batcher = await h.batcher()
    jobs = [await enqueue(h.nc, h.kv, tenant=tenant) for tenant in ("a", "a", "b")]
    await batcher.grant(1)
    # A round of 1 slot pulls 2 jobs (a window probing for a second tenant), runs the first and
    # gives the second back: the third is the first past the delivered sequence.
    order = await batcher.next_order()
    assert order.job_id == jobs[0]
    assert h.dispatcher().queues.put_back_jobs(Priority.NORMAL) == {jobs[1]}
    stream = h.app.config.nats.work_stream
    stored_at = []
    for job_id, tenant in zip(jobs, ("a", "a", "b"), strict=True):
        msg = await h.js.get_msg(stream, subject=job_work_subject(MODEL, Priority.NORMAL, tenant, job_id))
        assert msg.time is not None
        stored_at.append(msg.time.timestamp())
    assert stored_at[2] - stored_at[1] > 10 * TIME_ROUNDING_S
    seen: list[tuple[float | None, float | None]] = []

    def the_given_back_jobs(times: tuple[float | None, float | None]) -> bool:
        return all(t is not None and abs(t - stored_at[1]) <= TIME_ROUNDING_S for t in times)

    async def oldest_is_the_given_back_job() -> bool:
        (own,) = await h.app._stats.snapshot(MODEL)  # what aging and the deadline sweep read
        (normal,) = [q for q in own.priorities if q.priority == Priority.NORMAL]
        snapshot = await h.snapshot()  # what the gateways read
        shared = snapshot.priorities.get(Priority.NORMAL.value) if snapshot is not None else None
        seen.append((normal.oldest_create_time, shared.oldest_create_time if shared is not None else None))
        return normal.depth == 2 and the_given_back_jobs(seen[-1])

    with contextlib.suppress(AssertionError):
        await until(oldest_is_the_given_back_job)
    assert the_given_back_jobs(seen[-1]), (
        f"read {seen[-1]}; the second job's time is {stored_at[1]}, the third's {stored_at[2]}"
    )


@pytest.mark.parametrize("answer", ["dropped", "failed"])
async def test_a_late_answer_of_a_superseded_attempt_leaves_the_attempt_that_took_over_alone(
    start: Start, config: Config, answer: str
) -> None:
    """Scheduler A's lease lapsed (a freeze, renewals lost) and B took the job over as attempt 2.
    A still holds attempt 1; its batcher then answers it: `dropped` (shed unrun), or `failed` with
    a retriable error. Both put the job back: the record's write was refused (it names attempt 2)
    but the nak went out, and a nak names its message by stream sequence, so it sent B's delivery
    back: the job was pulled again and ran as attempt 3 beside attempt 2, whose result was then
    discarded. Now a put-back of an attempt that no longer owns the record sends nothing."""
    a = await start(tune(config))
    b = await start(tune(config))
    on_a = await a.batcher("on-a", credits=1)
    job_id = await enqueue(a.nc, a.kv)
    first = await on_a.next_order()
    assert (first.job_id, first.attempt) == (job_id, 1)
    record = await wait_state(a.js, job_id, JobState.RUNNING)
    on_b = await b.batcher("on-b", credits=1)
    await a.nc.publish(record.lease_subject, b"-NAK")  # as AckWait's redelivery would, A's lease lapsed
    second = await on_b.next_order()
    assert (second.job_id, second.attempt) == (job_id, 2)
    await wait_state(a.js, job_id, JobState.RUNNING)
    with capture_logs() as logs:
        if answer == "dropped":
            late = worker_service_pb2.WorkResult(job_id=job_id, attempt=1, dropped=True)
            await on_a._call.write(worker_service_pb2.ConnectRequest(result=late))
        else:
            await on_a.fail(first, MODEL_ERROR)
        await on_a.grant(1)  # a credit on A: what is sent back is pulled there

        async def put_back_or_left_alone() -> bool:
            left_alone = any(entry["event"] == "put_back_refused" for entry in logs)
            return left_alone or not on_a.orders.empty()

        await until(put_back_or_left_alone)
    assert on_a.orders.empty(), f"A ran attempt {on_a.orders.get_nowait().attempt} beside B's attempt 2"
    running = await read_record(a.js, job_id)
    assert (running.state, running.attempt) == (JobState.RUNNING, 2)
    await on_b.answer(second)
    done = await wait_state(a.js, job_id, JobState.SUCCEEDED)
    assert done.attempt == 2


async def test_a_superseded_attempt_shed_past_the_deadline_leaves_the_attempt_that_took_over_alone(
    start: Start, config: Config
) -> None:
    """Scheduler A's lease lapsed and B took the job over as attempt 2; the job's deadline then
    passed, and A's batcher answers attempt 1 dropped (shed unrun). A's drop decided EXPIRED on
    attempt 1's record, lost the write to attempt 2's, and put back the record it found: a requeue
    of attempt 2, which passed the fence, wrote it QUEUED and sent B's delivery back (then
    EXPIRED at its dispatch), so B's answer was discarded. The put-back is fenced on attempt 1."""
    a = await start(tune(config))
    b = await start(tune(config))
    on_a = await a.batcher("on-a", credits=1)
    deadline = time.time() + 2.0  # B's dispatch comes before it, A's late answer after
    job_id = await enqueue(a.nc, a.kv, deadline=deadline)
    first = await on_a.next_order()
    assert (first.job_id, first.attempt) == (job_id, 1)
    record = await wait_state(a.js, job_id, JobState.RUNNING)
    on_b = await b.batcher("on-b", credits=1)
    await a.nc.publish(record.lease_subject, b"-NAK")  # as AckWait's redelivery would, A's lease lapsed
    second = await on_b.next_order()
    assert (second.job_id, second.attempt) == (job_id, 2)
    await wait_state(a.js, job_id, JobState.RUNNING)
    await asyncio.sleep(max(0.0, deadline - time.time()) + 0.05)  # the deadline itself is the event
    with capture_logs() as logs:
        late = worker_service_pb2.WorkResult(job_id=job_id, attempt=1, dropped=True)
        await on_a._call.write(worker_service_pb2.ConnectRequest(result=late))

        async def refused_or_moved() -> bool:
            if any(entry["event"] == "put_back_refused" for entry in logs):
                return True
            current = await read_record(a.js, job_id)
            return (current.state, current.attempt) != (JobState.RUNNING, 2)

        await until(refused_or_moved)
    running = await read_record(a.js, job_id)
    assert (running.state, running.attempt, running.given_back_attempts) == (JobState.RUNNING, 2, 0)
    await on_b.answer(second)
    done = await wait_state(a.js, job_id, JobState.SUCCEEDED)
    assert done.attempt == 2


async def test_a_superseded_attempt_stops_renewing_so_a_dead_takers_job_comes_back_after_ack_wait(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scheduler A's lease lapsed and B took the job over as attempt 2; then B dies (its renewals
    stop). A still held attempt 1 and renewed it with in-progress acks, which nats-server applies by
    stream sequence to the delivery pending now, B's: the message never came back while A's attempt
    lasted (its execution timeout, none here). A renewal round now reads the records of the attempts
    it renews and lets go of one that names a later attempt: the job comes back after AckWait and
    runs again (attempt 3), and attempt 1's batcher is told to drop it."""
    ack_wait_s = 2.0
    tuned = tune(config).replace(scheduler={"ack_wait_s": ack_wait_s, "lease_renew_interval_s": 0.3})
    a = await start(tuned)
    b = await start(tuned)
    on_a = await a.batcher("on-a", credits=1)
    job_id = await enqueue(a.nc, a.kv)
    first = await on_a.next_order()
    assert (first.job_id, first.attempt) == (job_id, 1)
    record = await wait_state(a.js, job_id, JobState.RUNNING)
    on_b = await b.batcher("on-b", credits=1)
    await a.nc.publish(record.lease_subject, b"-NAK")  # as AckWait's redelivery would, A's lease lapsed
    second = await on_b.next_order()
    assert (second.job_id, second.attempt) == (job_id, 2)
    await wait_state(a.js, job_id, JobState.RUNNING)

    async def no_renewals() -> None:
        pass

    b_flow: Any = b.app._flow
    monkeypatch.setattr(b_flow._leases, "renew", no_renewals)  # B dies: its lease is no longer renewed
    died = time.monotonic()
    await on_a.grant(1)  # a credit on A: the job, once back, runs there
    try:
        third = await on_a.next_order(timeout_s=ack_wait_s + 10.0)  # 10 s: room for a loaded machine
    except TimeoutError:
        raise AssertionError(f"not back {time.monotonic() - died:.1f} s after B died: A renews it") from None
    assert (third.job_id, third.attempt) == (job_id, 3)
    cancel = await on_a.next_cancel()  # attempt 1's batcher drops it
    assert (cancel.job_id, cancel.attempt) == (job_id, 1)
    await on_a.answer(third)
    done = await wait_state(a.js, job_id, JobState.SUCCEEDED)
    assert done.attempt == 3


@pytest.mark.parametrize("given_back", ["shed", "batcher_lost", "retried_after_a_backoff"])
async def test_a_job_its_attempt_gave_back_counts_in_its_queues_depth_and_oldest_time(
    start: Start, config: Config, given_back: str
) -> None:
    """A job put back by its attempt's end (its batcher shed it unrun, the batcher was lost, it
    failed and is retried after a backoff) is waiting again, but the consumer counts its message
    delivered until it is pulled again: with no credit to pull it, the queue's depth said 0 and its
    oldest time none, as the dispatchers' own put-backs did before they were counted. One put back
    with a delay counts in the depth at once, and in the oldest time once its delay has passed
    (before, it cannot be pulled: its age said the queue stalled while the backoff ran)."""
    # A retry's backoff of 30-60 s, which the test passes by moving the queues' clock on.
    h = await start(tune(config, retry_backoff_base_s=60.0, retry_backoff_max_s=60.0))
    batcher = await h.batcher("b1", credits=1)
    job_id = await enqueue(h.nc, h.kv)
    subject = job_work_subject(MODEL, Priority.NORMAL, TENANT, job_id)
    stored = await h.js.get_last_msg(h.app.config.nats.work_stream, subject)  # the work message
    assert stored.time is not None
    order = await batcher.next_order()
    assert order.job_id == job_id
    await wait_state(h.js, job_id, JobState.RUNNING)
    if given_back == "shed":
        shed = worker_service_pb2.WorkResult(job_id=job_id, attempt=1, dropped=True)
        await batcher._call.write(worker_service_pb2.ConnectRequest(result=shed))  # no credit back
    elif given_back == "batcher_lost":
        await batcher.close()
    else:
        await batcher.fail(order, MODEL_ERROR)  # retriable, no credit back
    await wait_state(h.js, job_id, JobState.QUEUED)
    (dispatcher,) = h.app._dispatchers.by_model[MODEL]
    skew_s = [0.0]
    dispatcher.queues._clock = lambda: time.monotonic() + skew_s[0]

    async def own_normal_queue() -> Any:
        (snapshot,) = await h.app._stats.snapshot(MODEL)  # this scheduler's own count
        return next(q for q in snapshot.priorities if q.priority is Priority.NORMAL)

    async def counted() -> bool:
        return bool((await own_normal_queue()).depth == 1)

    try:
        await until(counted)
    except AssertionError:
        raise AssertionError(f"the job given back is not counted: {await own_normal_queue()}") from None
    normal = await own_normal_queue()
    if given_back == "retried_after_a_backoff":
        assert normal.oldest_create_time is None  # not offered again yet
        assert normal.oldest_age_s is None
        skew_s[0] = 61.0  # its backoff has passed
        normal = await own_normal_queue()
        assert normal.depth == 1
    assert normal.oldest_create_time == pytest.approx(stored.time.timestamp(), abs=0.01)
    assert normal.oldest_age_s is not None


async def test_a_job_waiting_for_a_version_counts_in_its_queues_depth_and_oldest_time(
    start: Start, config: Config
) -> None:
    """A job whose version no batcher serves is pulled and put back (version_routing: for
    WAIT_UNSERVED_S) by every dispatch, so the consumer counts its message delivered nearly all
    the time: the queue's depth said 0 and its oldest time none while it waited (a free slot's
    held pull even made the snapshot skip the consumer), and the desired batchers said 0."""
    h = await start(tune(config))
    await h.batcher("only-v2", credits=1, version="2")  # a free slot, for another version
    job_id = await enqueue(h.nc, h.kv)  # version 1
    subject = job_work_subject(MODEL, Priority.NORMAL, TENANT, job_id)
    stored = await h.js.get_last_msg(h.app.config.nats.work_stream, subject)
    assert stored.time is not None

    # The snapshot that counted it: a read after it may land while a dispatch has pulled the job
    # again (every WAIT_UNSERVED_S) and not yet put it back, its depth 0 and oldest time none.
    counted_in: list[Any] = []

    async def snapshot() -> Any:
        (model,) = await h.app._stats.snapshot(MODEL)
        return model

    async def counted() -> bool:
        model = await snapshot()
        normal = next(q for q in model.priorities if q.priority is Priority.NORMAL)
        if normal.depth == 1 and normal.oldest_create_time is not None:
            counted_in.append(model)
            return True
        return False

    try:
        await until(counted)
    except AssertionError:
        raise AssertionError(f"the job waiting for its version is not counted: {await snapshot()}") from None
    (model,) = counted_in
    normal = next(q for q in model.priorities if q.priority is Priority.NORMAL)
    assert normal.oldest_create_time == pytest.approx(stored.time.timestamp(), abs=0.01)
    assert model.desired_batchers >= 1
    record = await read_record(h.js, job_id)
    assert (record.state, record.attempt) == (JobState.QUEUED, 0)


async def test_a_job_given_back_here_and_run_by_another_scheduler_leaves_this_ones_depth(
    start: Start, config: Config
) -> None:
    """A job one scheduler gave back (the tenant window's rest, or a held pull's) may be pulled
    again by another scheduler and run there. The first counted it as waiting until it pulled the
    job itself, which it never would: its queue's depth stayed one up for good (and with it its
    desired batchers: never 0). A stats round forgets a put-back job whose message the work stream no longer holds."""
    first = await start(tune(config))
    second = await start(tune(config))
    mine = await first.batcher("b1")
    other = await second.batcher("b2")
    for _ in range(2):
        await enqueue(first.nc, first.kv)
    await mine.grant(1)
    await mine.next_order()  # a window of 2 pulled (a probe), 1 taken, 1 given back
    queues = first.dispatcher().queues

    async def put_back_here() -> bool:
        return queues.put_back_count(Priority.NORMAL) == 1

    await until(put_back_here)
    await other.grant(1)
    order = await other.next_order()  # the job given back, run by the other scheduler
    await other.answer(order)
    await wait_state(second.js, order.job_id, JobState.SUCCEEDED)

    async def own_depth_is(count: int) -> bool:
        (snapshot,) = await first.app._stats.snapshot(MODEL)  # this scheduler's own count
        return snapshot.depth == count

    await until(lambda: own_depth_is(0))
    assert queues.put_back_count(Priority.NORMAL) == 0


async def test_two_schedulers_count_a_job_one_put_back_in_the_merged_depth_and_the_desired_batchers(
    start: Start, config: Config
) -> None:
    """Each scheduler counts its own put-backs in its queue's depth (the consumer counts a nak'ed
    message delivered, not pending), and every reader took a model's depths from its newest
    snapshot: with A's job put back (shed unrun, no credit to pull it again), the gateway's merge
    said 1 after A's write and 0 after B's, B's GetQueueStats said 0, and B's
    asyncinfer_desired_batchers 0. Now a snapshot says which part of its depth is its own
    put-backs, and a merge adds every scheduler's to the newest one's pending; each scheduler's
    desired batchers are the cluster's."""
    a = await start(tune(config))
    b = await start(tune(config))
    on_a = await a.batcher("on-a", credits=1)
    job_id = await enqueue(a.nc, a.kv)
    order = await on_a.next_order()
    assert order.job_id == job_id
    await wait_state(a.js, job_id, JobState.RUNNING)
    merges: list[QueueSnapshot] = []  # the gateway's merge as each snapshot arrives

    def merged(model_name: str, held: Any) -> None:
        if model_name == MODEL and held is not None:
            merges.append(held.snapshot)

    watch = SnapshotWatch(a.js, a.nc, bucket=a.app.config.nats.queues_bucket, monotonic=time.monotonic, on_merge=merged)
    await watch.start()
    try:
        shed = worker_service_pb2.WorkResult(job_id=job_id, attempt=1, dropped=True)
        await on_a._call.write(worker_service_pb2.ConnectRequest(result=shed))  # no credit back
        await wait_state(a.js, job_id, JobState.QUEUED)
        name_a, name_b = a.app.instance_name, b.app.instance_name

        async def written_by_a() -> bool:
            return any(m.scheduler == name_a and m.depth(Priority.NORMAL) == 1 for m in merges)

        await until(written_by_a)
        seen = len(merges)

        async def written_by_b_since() -> bool:
            return any(m.scheduler == name_b for m in merges[seen:])

        await until(written_by_b_since, timeout_s=15.0)  # its next change, or its heartbeat (5 s)
        after_b = next(m for m in merges[seen:] if m.scheduler == name_b)
        assert after_b.depth(Priority.NORMAL) == 1, f"the merge after B's write: {after_b}"
        request = ops_service_pb2.GetQueueStatsRequest(model_name=MODEL)
        (from_b,) = (await b.ops.GetQueueStats(request)).models
        normal = next(q for q in from_b.priorities if q.priority == job_pb2.PRIORITY_NORMAL)
        assert (normal.depth, from_b.in_flight, from_b.desired_batchers) == (1, 0, 1)

        async def b_asks_for_one() -> bool:
            return b.app.metrics.desired_batchers.labels(model=MODEL)._value.get() == 1

        try:
            await until(b_asks_for_one)
        except AssertionError:
            got = b.app.metrics.desired_batchers.labels(model=MODEL)._value.get()
            raise AssertionError(f"B's asyncinfer_desired_batchers: {got}") from None
    finally:
        await watch.stop()


@pytest.mark.parametrize("on_b", ["running", "given_back"])
async def test_a_job_put_back_here_and_taken_by_another_scheduler_leaves_this_ones_depth_at_once(
    start: Start, config: Config, on_b: str
) -> None:
    """A job A put back (shed unrun, no credit to pull it again) is pulled by B, which runs it, or
    runs it and gives it back (a retriable failure, no credit back: B's own put-back now). A
    counted it as its own put-back until its message left the stream (its result stored), however
    long it ran or waited on B, so the merge counted it twice: in B's jobs in flight or put-backs,
    and in A's put-backs. Now A reads the records of its put-backs each stats round and forgets one
    whose record names a later delivery of its message (B's, RUNNING or QUEUED again)."""
    a = await start(tune(config))
    b = await start(tune(config))
    on_a = await a.batcher("on-a", credits=1)
    job_id = await enqueue(a.nc, a.kv)
    first = await on_a.next_order()
    await wait_state(a.js, job_id, JobState.RUNNING)
    shed = worker_service_pb2.WorkResult(job_id=job_id, attempt=1, dropped=True)
    await on_a._call.write(worker_service_pb2.ConnectRequest(result=shed))  # no credit back
    await wait_state(a.js, job_id, JobState.QUEUED)
    queues = a.dispatcher().queues

    async def put_back_on_a() -> bool:
        return queues.put_back_count(Priority.NORMAL) == 1

    rounds = StatsRounds(a.app)
    await until(put_back_on_a)
    await rounds.wait(1)  # A has read its record since it put it back (each round, before its statistics)
    batcher_b = await b.batcher("on-b", credits=1)
    second = await batcher_b.next_order()  # pulled again by B
    assert (second.job_id, second.attempt, first.attempt) == (job_id, 2, 1)
    await wait_state(a.js, job_id, JobState.RUNNING)
    if on_b == "given_back":
        await batcher_b.fail(second, MODEL_ERROR)  # retriable, no credit back: put back on B
        await wait_state(a.js, job_id, JobState.QUEUED)

    async def own_depth() -> int:
        (snapshot,) = await a.app._stats.snapshot(MODEL)  # A's own count
        return snapshot.depth

    async def forgotten_on_a() -> bool:
        return await own_depth() == 0

    try:
        await until(forgotten_on_a)
    except AssertionError:
        raise AssertionError(f"A still counts the job B took: its depth {await own_depth()}") from None
    request = ops_service_pb2.GetQueueStatsRequest(model_name=MODEL)

    once = (0, 1) if on_b == "running" else (1, 0)  # (waiting, in flight)

    async def once_in_the_cluster() -> bool:
        (model,) = (await b.ops.GetQueueStats(request)).models
        return (sum(q.depth for q in model.priorities), model.in_flight) == once

    await until(once_in_the_cluster)


async def test_a_job_both_schedulers_put_back_unrun_counts_once_in_the_merged_depth(
    start: Start, config: Config
) -> None:
    """A job pinned to a version no batcher serves is pulled and put back by each scheduler's free
    slot in turn, its record never written: A counts it until a pull of its own brings it back, and
    so does B, so the merge, which adds every scheduler's put-backs to the pending, said 2 for one
    job. Each snapshot now carries the consumer's unacknowledged deliveries as read with its
    put-backs, and the merge counts no more put-backs than those."""
    a = await start(tune(config))
    b = await start(tune(config))
    on_a = await a.batcher("v2-on-a", credits=1, version="2")  # a free slot, for another version
    await enqueue(a.nc, a.kv)  # version 1
    on_a_queues, on_b_queues = a.dispatcher().queues, b.dispatcher().queues

    async def put_back_on_a() -> bool:
        return on_a_queues.put_back_count(Priority.NORMAL) == 1

    await until(put_back_on_a)
    await on_a.close()  # A pulls it no more: it stays among A's put-backs
    await b.batcher("v2-on-b", credits=1, version="2")

    async def both_count_it() -> bool:
        return on_a_queues.put_back_count(Priority.NORMAL) == 1 and on_b_queues.put_back_count(Priority.NORMAL) == 1

    await until(both_count_it, timeout_s=15.0)  # B pulls it once A's put-back delay (1 s) has passed
    cluster: Any = b.app._cluster_queues

    async def a_reports_it() -> bool:  # A's snapshot with its put-back, as B's watch holds it
        held = cluster._schedulers.latest(MODEL).get(a.app.instance_name)
        return held is not None and held.snapshot.priorities[Priority.NORMAL.value].put_back == 1

    await until(a_reports_it)
    request = ops_service_pb2.GetQueueStatsRequest(model_name=MODEL)
    (model,) = (await b.ops.GetQueueStats(request)).models
    normal = next(q for q in model.priorities if q.priority == job_pb2.PRIORITY_NORMAL)
    assert normal.depth == 1, f"one job waits; B's GetQueueStats says {normal.depth}"


@pytest.mark.parametrize("gone", ["restarted", "stopped_beside_another"])
async def test_a_job_put_back_by_a_scheduler_since_gone_counts_in_the_depth_and_the_desired_batchers(
    start: Start, config: Config, gone: str
) -> None:
    """A job its batcher shed (no credit back) is nak'ed at once: the consumer holds it delivered
    and unacknowledged, in its redelivery queue, until a pull comes for it, and a scheduler pulls
    only for a batcher with a free credit. Its putter counted it (its put-backs); once that
    scheduler was gone (restarted in place, or stopped or killed while another runs) nobody did:
    the queue said depth 0 and asyncinfer_desired_batchers 0 while the job waited, for as long as
    no batcher came, so an autoscaler on that signal never started the one that would pull it.
    Now the consumer's unacknowledged deliveries beyond the jobs in flight and put back that the
    reporting schedulers account for count as waiting; once the job ran, nothing is left over."""
    settings = {"queue_stats_interval_s": 0.2, "scheduler_id": "sched-a"}
    a = await start(tune(config).replace(scheduler=settings))
    beside = None
    if gone == "stopped_beside_another":
        beside = await start(tune(config).replace(scheduler={**settings, "scheduler_id": "sched-b"}))
    on_a = await a.batcher("on-a", credits=1)
    job_id = await enqueue(a.nc, a.kv)
    order = await on_a.next_order()
    await wait_state(a.js, job_id, JobState.RUNNING)
    shed = worker_service_pb2.WorkResult(job_id=job_id, attempt=order.attempt, dropped=True)
    await on_a._call.write(worker_service_pb2.ConnectRequest(result=shed))  # no credit back
    await wait_state(a.js, job_id, JobState.QUEUED)
    queues = a.dispatcher().queues

    async def put_back_on_a() -> bool:
        return queues.put_back_count(Priority.NORMAL) == 1

    await until(put_back_on_a)
    await a.close()
    await a.app.stop(grace_s=0.5)
    left = beside if beside is not None else await start(tune(config).replace(scheduler=settings))
    await StatsRounds(left.app).wait(2)
    stream = left.app.config.nats.work_stream
    info = await left.js.consumer_info(stream, work_consumer_name(MODEL, Priority.NORMAL))
    # Still held, not redelivered: nothing pulls it.
    assert (info.num_pending, info.num_ack_pending) == (0, 1)
    assert (await read_record(left.js, job_id)).state is JobState.QUEUED
    request = ops_service_pb2.GetQueueStatsRequest(model_name=MODEL)
    (model,) = (await left.ops.GetQueueStats(request)).models
    normal = next(q for q in model.priorities if q.priority == job_pb2.PRIORITY_NORMAL)
    assert (normal.depth, model.in_flight, model.desired_batchers) == (1, 0, 1), f"GetQueueStats: {model}"

    def gauge() -> float:
        return float(left.app.metrics.desired_batchers.labels(model=MODEL)._value.get())

    async def asks_for(count: int) -> bool:
        return gauge() == count

    try:
        await until(lambda: asks_for(1))
    except AssertionError:
        raise AssertionError(f"asyncinfer_desired_batchers: {gauge()}") from None
    batcher = await left.batcher("late", credits=1)  # the batcher it asked for pulls the job
    again = await batcher.next_order()
    assert again.job_id == job_id
    await batcher.answer(again)
    await wait_state(left.js, job_id, JobState.SUCCEEDED)
    try:
        await until(lambda: asks_for(0))
    except AssertionError:
        raise AssertionError(f"asyncinfer_desired_batchers once the job ran: {gauge()}") from None
    (model,) = (await left.ops.GetQueueStats(request)).models
    assert sum(q.depth for q in model.priorities) == 0, f"GetQueueStats once the job ran: {model}"


@pytest.mark.nats_fallback
async def test_jobs_put_back_by_a_scheduler_killed_with_sigkill_count_with_their_oldest_time(
    start: Start, config: Config, nc: NatsClient, tmp_path: Path
) -> None:
    """A scheduler process holding put-back jobs (shed by its batcher, no credit back: nak'ed, held
    unacknowledged in the consumer's redelivery queue) is killed with SIGKILL, and another starts
    under its name. Since f41f418 the new one counted them in the depth and the desired batchers
    (the consumer's unacknowledged deliveries beyond what the reporting schedulers account for),
    but with no oldest time: GetQueueStats said no oldest age, asyncinfer_queue_oldest_age_seconds
    0, and priority aging did not see the queue waiting. Now their oldest time is the oldest
    unacknowledged delivery's stored time, and once a batcher comes they run, once each."""
    settings = {"queue_stats_interval_s": 0.2, "scheduler_id": "sched-a"}
    port = free_port()
    process_config = tune(config).replace(
        scheduler={**settings, "port": port}, logging={"level": "info", "format": "json"}
    )
    config_file = tmp_path / "asyncinfer.toml"
    config_file.write_text(render_default_config(process_config))
    killed = Service("scheduler", config_file, tmp_path, port)
    await killed.start()
    try:
        js = nc.jetstream()
        kv = await js.key_value(config.nats.jobs_bucket)
        queues = await js.key_value(config.nats.queues_bucket)
        on_a = FakeBatcher(port, "on-a")
        try:
            await on_a.connect()
            await on_a.grant(2)
            jobs = {await enqueue(nc, kv) for _ in range(2)}
            orders = [await on_a.next_order(), await on_a.next_order()]
            assert {order.job_id for order in orders} == jobs
            for order in orders:  # shed, no credit back: each put back, and nothing pulls it
                shed = worker_service_pb2.WorkResult(job_id=order.job_id, attempt=order.attempt, dropped=True)
                await on_a._call.write(worker_service_pb2.ConnectRequest(result=shed))

            async def both_put_back() -> bool:
                try:
                    entry = await queues.get(snapshot_key(MODEL))
                except NotFoundError:
                    return False
                snapshot = decode_snapshot(entry.value or b"")
                return snapshot.priorities[Priority.NORMAL.value].put_back == 2

            await until(both_put_back, 10.0)
        finally:
            await on_a.close()
        killed.kill()
        stream = config.nats.work_stream
        info = await js.consumer_info(stream, work_consumer_name(MODEL, Priority.NORMAL))
        assert (info.num_pending, info.num_ack_pending) == (0, 2), "both held unacknowledged by the consumer"
        left = await start(tune(config).replace(scheduler=settings))  # the killed one's name: its snapshot replaced
        await StatsRounds(left.app).wait(2)
        request = ops_service_pb2.GetQueueStatsRequest(model_name=MODEL)
        (model,) = (await left.ops.GetQueueStats(request)).models
        normal = next(q for q in model.priorities if q.priority == job_pb2.PRIORITY_NORMAL)
        assert (normal.depth, model.in_flight, model.desired_batchers) == (2, 0, 1), f"GetQueueStats: {model}"
        assert normal.HasField("oldest_age"), f"GetQueueStats says no oldest age of the jobs waiting: {normal}"
        labels = {"model": MODEL, "priority": Priority.NORMAL.value}
        metrics = left.app.metrics

        def gauges() -> tuple[float, float, float]:
            return (
                metrics.queue_depth.labels(**labels)._value.get(),
                metrics.queue_oldest_age.labels(**labels)._value.get(),
                metrics.desired_batchers.labels(model=MODEL)._value.get(),
            )

        async def gauges_count_them() -> bool:
            depth, oldest_age, desired = gauges()
            return depth == 2 and oldest_age > 0 and desired == 1

        try:
            await until(gauges_count_them)
        except AssertionError:
            raise AssertionError(f"gauges (depth, oldest age, desired batchers): {gauges()}") from None
        assert Priority.NORMAL in left.dispatcher().queues.selector._oldest_age_s, "aging sees the queue waiting"
        batcher = await left.batcher("late", credits=2)  # the batcher asked for pulls them
        ran: set[str] = set()
        for _ in range(2):
            order = await batcher.next_order()
            ran.add(order.job_id)
            await batcher.answer(order)
        assert ran == jobs
        for job_id in jobs:
            record = await wait_state(left.js, job_id, JobState.SUCCEEDED)
            assert record.attempt == 2, "run once more after the shed, once"

        async def nothing_waits() -> bool:
            return metrics.queue_depth.labels(**labels)._value.get() == 0 and (
                metrics.desired_batchers.labels(model=MODEL)._value.get() == 0
            )

        await until(nothing_waits)
    finally:
        killed.stop()


async def test_a_job_another_scheduler_put_back_ages_this_ones_queue(start: Start, config: Config) -> None:
    """Priority aging read each scheduler's own view of a queue: the pending's first message and its
    own put-backs. A LOW job A's batcher shed (and A has no credit left to pull it again) is A's
    put-back alone, so B, whose batchers could run it, weighed its LOW queue at LOW's weight while
    the job waited on (with none pending behind it, the queue was not aged at all on B). Now every
    scheduler ages its queues on the cluster's oldest times, those of the others' put-backs too."""
    aging = {"queue_stats_interval_s": 0.2, "aging_s": 0.25}
    a = await start(tune(config).replace(scheduler=aging))
    b = await start(tune(config).replace(scheduler=aging))
    on_a = await a.batcher("on-a", credits=1)
    await b.batcher("on-b")  # no credit yet: B pulls nothing, its choice is only weighed
    job_id = await enqueue(a.nc, a.kv, priority=Priority.LOW)
    order = await on_a.next_order()
    assert order.job_id == job_id
    await wait_state(a.js, job_id, JobState.RUNNING)
    shed = worker_service_pb2.WorkResult(job_id=job_id, attempt=1, dropped=True)
    await on_a._call.write(worker_service_pb2.ConnectRequest(result=shed))  # no credit back
    await wait_state(a.js, job_id, JobState.QUEUED)
    on_a_queues, selector = a.dispatcher().queues, b.dispatcher().queues.selector

    async def put_back_on_a() -> bool:
        return on_a_queues.put_back_count(Priority.LOW) == 1

    await until(put_back_on_a)
    high = b.app.config.scheduler.weight_high

    async def aged_on_b() -> bool:  # waited past 2 * aging_s: LOW weighs as HIGH
        return selector.effective_weight(Priority.LOW) == high

    try:
        await until(aged_on_b)
    except AssertionError:
        weight = selector.effective_weight(Priority.LOW)
        raise AssertionError(f"B weighs the LOW queue {weight}, not {high}: {selector._oldest_age_s}") from None


async def test_priority_under_saturation_high_waits_far_less_and_low_completes(start: Start, config: Config) -> None:
    """A LOW backlog saturates the only batcher; HIGH jobs keep arriving while it drains."""
    h = await start(tune(config))
    batcher = await h.batcher()

    async def slow_answer(order: worker_service_pb2.WorkOrder) -> None:
        await asyncio.sleep(0.005)  # a little compute, so the backlog lasts
        await batcher.answer(order)

    low = [await enqueue(h.nc, h.kv, priority=Priority.LOW) for _ in range(200)]
    batcher.serve(slow_answer)
    await batcher.grant(2)
    high: list[str] = []
    for _ in range(40):
        high.append(await enqueue(h.nc, h.kv, priority=Priority.HIGH))
        await asyncio.sleep(0.01)  # arrivals spread over the run, not a sync wait
    for job in low:
        await wait_state(h.js, job, JobState.SUCCEEDED, timeout_s=30)
    waits: dict[Priority, list[float]] = {}
    for priority, jobs in ((Priority.HIGH, high), (Priority.LOW, low)):
        records = [await read_record(h.js, job) for job in jobs]
        assert all(r.state == JobState.SUCCEEDED for r in records)
        waits[priority] = [r.queue_duration_s or 0.0 for r in records]
    high_mean, low_mean = statistics.mean(waits[Priority.HIGH]), statistics.mean(waits[Priority.LOW])
    high_max = max(waits[Priority.HIGH])
    print(
        f"priority: HIGH mean queue wait {high_mean * 1000:.1f} ms (max {high_max * 1000:.1f} ms), "
        f"LOW mean {low_mean * 1000:.0f} ms (max {max(waits[Priority.LOW]) * 1000:.0f} ms), all 200 LOW done"
    )
    assert high_mean * 10 < low_mean


@pytest.mark.nats_fallback
async def test_an_idle_scheduler_holds_pulls_open_and_puts_back_what_it_may_not_run(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a credit and empty queues, a pull is held open on each priority's queue: a job arrives
    the moment it is stored, with no queued notice and long before the poll interval. One that
    arrives at a held pull as the model is paused is put back, still counted in the queue's
    depth, and runs after the resume."""
    tuned = tune(config)
    h = await start(tuned.replace(scheduler={"poll_interval_ms": 5_000.0, "hold_pulls_open": True}))
    batcher = await h.batcher(credits=1)
    dispatcher = h.dispatcher()
    held: Any = dispatcher._held

    holding = pulls_held_on_every_priority(held)
    brought = brought_by_held_pulls(held, monkeypatch)

    await until(holding)
    job_id = await enqueue(h.nc, h.kv, announce=False)  # no notice: only the held pull can see it
    order = await batcher.next_order(timeout_s=30)
    assert order.job_id == job_id
    assert brought == [job_id], "brought by the held pull, not found by a round after the 5 s poll"
    await batcher.answer(order)
    await wait_state(h.js, job_id, JobState.SUCCEEDED)
    await batcher.grant(1)
    await until(holding)
    # Paused while its pulls are held open: what they bring is put back, not run.
    await h.queues.put("paused.demo", b"{}")
    await until(lambda: _true_if(h.app.metrics, "asyncinfer_queue_paused"))
    parked = await enqueue(h.nc, h.kv, priority=Priority.LOW, announce=False)

    async def put_back() -> bool:
        snapshot = await h.snapshot()
        return (
            dispatcher.queues.put_back_count(Priority.LOW) == 1
            and snapshot is not None
            and snapshot.depth(Priority.LOW) == 1
            and snapshot.in_flight == 0
        )

    await until(put_back)
    assert batcher.orders.empty()
    await h.queues.delete("paused.demo")
    order = await batcher.next_order(timeout_s=30)
    assert order.job_id == parked
    assert dispatcher.queues.put_back_count(Priority.LOW) == 0


async def test_a_put_back_job_cancelled_while_queued_leaves_its_queues_depth(start: Start, config: Config) -> None:
    """A job a held pull brought while the model was paused is put back (counted in its queue's
    depth by this scheduler, as the consumer counts it delivered). Cancelled while queued, its
    message is deleted and never pulled again: the dispatcher of its model forgets it, and the
    depth goes back to 0 (the put-back bookkeeping is looked up by model, not by going through
    every dispatcher)."""
    h = await start(tune(config).replace(scheduler={"poll_interval_ms": 5_000.0, "hold_pulls_open": True}))
    await h.batcher(credits=1)
    dispatcher = h.dispatcher()
    await until(pulls_held_on_every_priority(dispatcher._held))
    await h.queues.put("paused.demo", b"{}")
    await until(lambda: _true_if(h.app.metrics, "asyncinfer_queue_paused"))
    parked = await enqueue(h.nc, h.kv, priority=Priority.LOW, announce=False)

    async def depth_is(count: int) -> bool:
        snapshot = await h.snapshot()
        return (
            dispatcher.queues.put_back_count(Priority.LOW) == count
            and snapshot is not None
            and snapshot.depth(Priority.LOW) == count
        )

    await until(lambda: depth_is(1))
    await cancel_as_gateway(h, parked)
    await h.work_empty()
    await until(lambda: depth_is(0))


@pytest.mark.parametrize("put_back", ["after_a_backoff", "at_once"])
async def test_a_job_cancelled_while_put_back_leaves_its_queues_depth_and_its_consumer(
    start: Start, config: Config, put_back: str
) -> None:
    """A job its attempt put back (retried after a backoff, or shed unrun: back at once) is
    counted in its queue's depth while it waits. Cancelled meanwhile (QUEUED -> CANCELED), its
    message is deleted and never pulled again: the count goes with it, and nats-server lets go of
    its delivery. The message was purged by a subject wider than its consumer's filter (any model
    and priority), which nats-server applies to the stream alone: the consumer kept the delivery
    (its ack pending, which KEDA's nats-jetstream lag and the gateway's max_queue_depth count)
    until the backoff ran out, or, put back at once, until a pull came for it (none: no credit)."""
    h = await start(tune(config, retry_backoff_base_s=60.0, retry_backoff_max_s=60.0))
    # An older message that stays in the stream (a model no scheduler here serves), as in any
    # stack with other queues: the stream's first message is not the one dropped.
    await h.js.publish(job_work_subject("elsewhere", Priority.NORMAL, TENANT, new_job_id()), b"")
    batcher = await h.batcher(credits=1)
    job_id = await enqueue(h.nc, h.kv)
    order = await batcher.next_order()
    await wait_state(h.js, job_id, JobState.RUNNING)
    if put_back == "after_a_backoff":
        await batcher.fail(order, MODEL_ERROR)  # retried after 30-60 s; no credit back
    else:
        shed = worker_service_pb2.WorkResult(job_id=job_id, attempt=1, dropped=True)
        await batcher._call.write(worker_service_pb2.ConnectRequest(result=shed))  # no credit back
    await wait_state(h.js, job_id, JobState.QUEUED)
    queues = h.dispatcher().queues

    async def depth_is(count: int) -> bool:
        (snapshot,) = await h.app._stats.snapshot(MODEL)
        return snapshot.depth == count and queues.put_back_count(Priority.NORMAL) == count

    await until(lambda: depth_is(1))
    await cancel_as_gateway(h, job_id)

    async def dropped() -> bool:
        return await work_messages(h.js, h.app.config) == 1  # the other model's alone

    await until(dropped)
    await until(lambda: depth_is(0))

    async def delivery_let_go() -> bool:  # applied by nats-server after the purge's answer
        stream, consumer = h.app.config.nats.work_stream, work_consumer_name(MODEL, Priority.NORMAL)
        info = await h.js.consumer_info(stream, consumer)
        return (info.num_pending, info.num_ack_pending) == (0, 0)

    try:
        await until(delivery_let_go)
    except AssertionError:
        info = await h.js.consumer_info(h.app.config.nats.work_stream, work_consumer_name(MODEL, Priority.NORMAL))
        raise AssertionError(f"the delivery is still held: ack pending {info.num_ack_pending}") from None
    assert (await read_record(h.js, job_id)).state is JobState.CANCELED


@pytest.mark.nats_fallback
async def test_an_idle_scheduler_asks_nats_nothing_while_its_pulls_are_held_open(
    start: Start, config: Config, nats_server: NatsServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A measurement pass: an idle scheduler made ~22 pull requests a second per model, a held
    pull on each priority expiring every poll interval and a poll beside them. While a pull is held
    open on every priority's queue, whatever a queue gets reaches one: no poll, and the pulls are
    held for HOLD_S (10 s; 5 s here, which outlasts the 2 s of idle watched, and the held pulls'
    end is waited for once). The poll interval here is the test config's 50 ms. A held pull on a
    connection that was lost is gone (the server forgot it): the dispatcher does not stay deaf to
    the queue it held (a job is found by a poll while the lost pulls are still out), and holds
    pulls again on the new connection once the lost ones ended (their timeout: HOLD_S and 2 s)."""
    monkeypatch.setattr(held_pulls, "HOLD_S", 5.0)
    h = await start(tune(config))
    batcher = await h.batcher(credits=1)
    dispatcher = h.dispatcher()
    held: Any = dispatcher._held

    holding = pulls_held_on_every_priority(held)

    await until(holding)
    pulls = await RequestsSeen.on(
        h.nc, consumer_next_subject(config.nats.work_stream, "*"), lambda subject, _data: f".work-{MODEL}-" in subject
    )
    # Nor does it wake to look at its connection: the client's callbacks tell it of a change (it
    # looked every second, a wake-up per model a second).
    wakes = 0
    real_wait = dispatcher._wait

    async def counted(*events: asyncio.Event, timeout_s: float | None = None) -> bool:
        nonlocal wakes
        wakes += 1
        return await real_wait(*events, timeout_s=timeout_s)

    monkeypatch.setattr(dispatcher, "_wait", counted)
    try:
        await asyncio.sleep(2.0)
        assert pulls.count == 0, f"{pulls.count} pull requests in 2 s of idle"
        assert wakes == 0, f"{wakes} wake-ups in 2 s of idle"
    finally:
        await pulls.close()
    job_id = await enqueue(h.nc, h.kv, announce=False)
    order = await batcher.next_order(timeout_s=5)
    assert order.job_id == job_id
    await batcher.answer(order)
    await wait_state(h.js, job_id, JobState.SUCCEEDED)
    await batcher.grant(1)
    await until(holding)

    # NATS restarts: the pulls held open on the old connection are gone with it. Killed, not
    # stopped: a nats-server that stops answers every pull it holds (409 Server Shutdown), which
    # ends them at once; one that crashes (or a node lost) tells nobody.
    async def connected() -> bool:
        return bool(h.nc.is_connected and h.app.nats_connected)

    lost = pulls_out(held)
    nats_server.kill()
    await until(lambda: _false(connected))
    nats_server.start()
    await until(connected, timeout_s=15)
    job_id = await enqueue(h.nc, h.kv, announce=False)  # no notice: a poll or a held pull must find it
    order = await batcher.next_order(timeout_s=30)
    assert order.job_id == job_id
    # Found by a poll while the pulls lost with the old connection were still out (how soon is not
    # asserted): a dispatcher deaf to the queues until they ended (HOLD_S and 2 s) found it after.
    assert len(lost) == 3
    assert not any(pull.done() for pull in lost), [pull.done() for pull in lost]
    await batcher.answer(order)
    await batcher.grant(1)
    await until(holding, timeout_s=60)  # held again, on the new connection, once the lost pulls ended


@pytest.mark.nats_fallback
async def test_held_pulls_that_expire_empty_are_held_again_without_a_round(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scale pass (100 idle models): each expiry of the held pulls was followed by a round of
    no-wait pulls, one per priority, that could find nothing (a queue gets nothing past a pull
    held open on it): 6 requests per model every HOLD_S rather than 3. Holds of 0.3 s here, so
    that several expire within the test."""
    monkeypatch.setattr(held_pulls, "HOLD_S", 0.3)
    h = await start(tune(config))
    batcher = await h.batcher(credits=1)
    dispatcher = h.dispatcher()
    pulls: Any = dispatcher._held

    holding = pulls_held_on_every_priority(pulls)

    await until(holding)  # past the first round, which found the queues empty
    subject = consumer_next_subject(config.nats.work_stream, "*")
    mine = f".work-{MODEL}-"
    held = await RequestsSeen.on(h.nc, subject, lambda s, data: mine in s and b'"expires"' in data)
    rounds = await RequestsSeen.on(h.nc, subject, lambda s, data: mine in s and b'"expires"' not in data)
    try:
        await held.wait_for(9)  # each priority's pull held three times
        assert rounds.count == 0, f"{rounds.count} no-wait pulls beside {held.count} held ones"
        job_id = await enqueue(h.nc, h.kv, announce=False)  # no notice: a held pull brings it
        order = await batcher.next_order(timeout_s=5)
        assert order.job_id == job_id
        await batcher.answer(order)
        await wait_state(h.js, job_id, JobState.SUCCEEDED)
    finally:
        await held.close()
        await rounds.close()


@pytest.mark.nats_fallback
async def test_an_idle_scheduler_knows_a_queue_it_holds_a_pull_on_is_empty_without_asking(
    start: Start, config: Config
) -> None:
    """A measurement pass on an idle `asyncinfer up` (session 27): every queue snapshot (the
    scheduler's own each queue_stats_interval_s, the console's GetQueueStats each 2 s) asked for
    each work consumer's info: 15 requests a second for up's 5 models, most of what the idle stack
    asked NATS. A queue a pull of ours is held open on has nothing waiting (the server hands a job
    to a waiting pull as it is stored), so its snapshot asks nothing. A queue without one is asked:
    a job waiting while the only credit is taken is counted."""
    h = await start(tune(config))  # a snapshot every 0.2 s
    batcher = await h.batcher(credits=1)
    dispatcher = h.dispatcher()
    held: Any = dispatcher._held

    holding = pulls_held_on_every_priority(held)

    await until(holding)
    infos = await RequestsSeen.on(
        h.nc, f"$JS.API.CONSUMER.INFO.{config.nats.work_stream}.*", lambda subject, _data: f".work-{MODEL}-" in subject
    )
    rounds = StatsRounds(h.app)
    try:
        await rounds.wait(3)
        assert await holding()
        assert infos.count == 0, f"{infos.count} consumer infos in 3 snapshots of an idle queue"
        stats = await h.ops.GetQueueStats(ops_service_pb2.GetQueueStatsRequest(model_name=MODEL))
        assert [q.depth for q in stats.models[0].priorities] == [0, 0, 0]
        assert infos.count == 0
        first = await enqueue(h.nc, h.kv)
        order = await batcher.next_order(timeout_s=5)  # the held pull brought it; no credit is left
        assert order.job_id == first
        waiting = await enqueue(h.nc, h.kv)

        async def counted() -> bool:
            snapshot = await h.snapshot()
            return snapshot is not None and snapshot.depth(Priority.NORMAL) == 1

        await until(counted)
        assert infos.count > 0
        await batcher.answer(order)
        await batcher.grant(1)
        assert (await batcher.next_order(timeout_s=5)).job_id == waiting
    finally:
        await infos.close()


async def test_a_queue_the_work_stream_holds_nothing_of_is_not_asked_and_the_snapshots_stay_right(
    nc: NatsClient, start: Start, config: Config
) -> None:
    """A scale pass (100 idle models, no batcher, so no pull held open): each stats round asked
    every work consumer's info, 300 a round. A queue the work stream holds no message of (one
    stream info tells) is empty and not asked; one that holds messages is asked as before. The
    snapshots stay right through it: a waiting job counted at its priority, a job pulled before a
    pause counted in flight, the paused queue's waiting jobs counted, the empty queue never asked."""
    asked: dict[str, int] = {}

    def seen(subject: str, _data: bytes) -> bool:
        if f".work-{MODEL}-" not in subject:
            return False
        priority = subject.rpartition("-")[2]
        asked[priority] = asked.get(priority, 0) + 1
        return True

    # Seen from before the start: its lease sweep (services.scheduler.lease_reclaim) asks each
    # consumer's info once, in the background.
    infos = await RequestsSeen.on(nc, f"$JS.API.CONSUMER.INFO.{config.nats.work_stream}.*", seen)
    try:
        h = await start(tune(config))  # a snapshot every 0.2 s
        rounds = StatsRounds(h.app)
        await infos.wait_for(3)  # the sweep's
        await rounds.wait(3)
        assert infos.count == 3, f"{infos.count - 3} consumer infos in 3 snapshots of an empty queue, no batcher"
        stats = await h.ops.GetQueueStats(ops_service_pb2.GetQueueStatsRequest(model_name=MODEL))
        assert [q.depth for q in stats.models[0].priorities] == [0, 0, 0]

        first = await enqueue(h.nc, h.kv, priority=Priority.HIGH)

        async def high_waiting() -> bool:
            snapshot = await h.snapshot()
            return snapshot is not None and [snapshot.depth(p) for p in Priority] == [1, 0, 0]

        await until(high_waiting)
        snapshot = await h.snapshot()
        assert snapshot is not None
        oldest = snapshot.priorities[Priority.HIGH.value].oldest_create_time
        assert oldest is not None  # the consumer was asked: its waiting message's time
        assert asked.get("high", 0) > 0

        batcher = await h.batcher(credits=1)
        order = await batcher.next_order(timeout_s=5)
        assert order.job_id == first
        assert (await h.ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name=MODEL))).paused
        waiting = [await enqueue(h.nc, h.kv) for _ in range(2)]

        async def paused_with_one_in_flight() -> bool:
            snapshot = await h.snapshot()
            return (
                snapshot is not None
                and snapshot.paused
                and snapshot.in_flight == 1
                and [snapshot.depth(p) for p in Priority] == [0, 2, 0]
            )

        await until(paused_with_one_in_flight)
        await batcher.answer(order)
        await wait_state(h.js, first, JobState.SUCCEEDED)

        async def paused_none_in_flight() -> bool:
            snapshot = await h.snapshot()
            return (
                snapshot is not None
                and snapshot.paused
                and snapshot.in_flight == 0
                and [snapshot.depth(p) for p in Priority] == [0, 2, 0]
            )

        await until(paused_none_in_flight)
        assert asked.get("low", 0) == 1, f"the empty LOW queue was asked {asked['low'] - 1} times past the sweep"
        await batcher.grant(1)
        assert not (await h.ops.ResumeQueue(ops_service_pb2.ResumeQueueRequest(model_name=MODEL))).paused
        for job_id in waiting:
            order = await batcher.next_order(timeout_s=5)
            assert order.job_id == job_id
            await batcher.answer(order)
            await batcher.grant(1)
    finally:
        await infos.close()


async def test_an_unchanged_snapshot_waits_for_the_heartbeat_and_a_batcher_gone_is_written_at_the_next_round(
    nc: NatsClient, start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scale pass: a scheduler of 100 idle models wrote 50 unchanged snapshots a second. A model's
    snapshot is written when what the gateway reads of it changed, else at the heartbeat: here none
    in rounds where nothing changed (the heartbeat an hour), while a batcher that connects, and one
    that goes away, is in the snapshot of the next round; with the heartbeat short, unchanged
    snapshots are written again and again."""
    monkeypatch.setattr(scheduler_app, "SNAPSHOT_HEARTBEAT_S", 3600.0)
    written = await RequestsSeen.on(nc, f"$KV.{config.nats.queues_bucket}.{MODEL}", lambda _s, _d: True)
    try:
        h = await start(tune(config))  # a round every 0.2 s
        rounds = StatsRounds(h.app)
        await written.wait_for(1)
        await rounds.wait(1)  # past the round that wrote it
        before = written.count
        await rounds.wait(5)
        assert written.count == before, f"{written.count - before} writes in 5 rounds of an idle, unchanged queue"

        batcher = await h.batcher(credits=2)

        async def batchers_are(count: int, credits: int) -> bool:
            snapshot = await h.snapshot()
            return snapshot is not None and (snapshot.connected_batchers, snapshot.free_credits) == (count, credits)

        await until(lambda: batchers_are(1, 2))
        await batcher.close()
        h.batchers.remove(batcher)
        await until(lambda: batchers_are(0, 0))
        snapshot = await h.snapshot()
        assert snapshot is not None
        h.app._snapshot_writes._heartbeat_s = 0.5
        await written.wait_for(written.count + 2)  # nothing changed: the heartbeat's
        latest = await h.snapshot()
        assert latest is not None
        assert latest.updated_at > snapshot.updated_at
        assert dataclasses.replace(latest, updated_at=0.0) == dataclasses.replace(snapshot, updated_at=0.0)
    finally:
        await written.close()


async def _false(predicate: Callable[[], Awaitable[bool]]) -> bool:
    return not await predicate()


@pytest.fixture
async def nats_proxy(nats_server: NatsServerProcess) -> AsyncIterator[SilentProxy]:
    """A proxy in front of the test's nats-server. Ask for it before `start`: it is then stopped
    after the scheduler (a scheduler stopping without NATS waits out its timeouts)."""
    proxy = SilentProxy(nats_server.port)
    await proxy.start()
    yield proxy
    await proxy.stop()


@pytest.mark.nats_fallback
async def test_held_pulls_on_a_connection_gone_silent_are_taken_as_lost(
    nats_proxy: SilentProxy, start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler's connection to nats-server goes silent (a hung proxy, a dead NAT entry:
    nothing crosses, nothing is closed), with a pull held open on every priority's queue. A blip
    shorter than the pings take to tell loses nothing: what the server sent meanwhile arrives
    late, on the same connection. A longer silence: the server still has the pulls, and hands a
    job submitted now to one of them; it never arrives, and comes back after AckWait (2 s here).
    The scheduler sees the silence by its pings (ping_interval_s x max_outstanding_pings, here
    0.25 s x 3) and connects again; the pulls it held on the silent connection no longer count
    (what they bring may go to it), so it polls: a job submitted then, with no queued notice,
    and the one lost in the silence, back after AckWait, run while the old pulls are still out,
    not once their time is up (HOLD_S, 5 s here, and 2 s). Once they ended it holds pulls again on
    the new connection. The silent connection is closed at last: nothing changes for the new one.
    Which of these ended each wait is asserted, not how soon (a loaded machine's to decide)."""
    monkeypatch.setattr(held_pulls, "HOLD_S", 5.0)
    proxied = tune(config).replace(
        nats={"url": f"nats://127.0.0.1:{nats_proxy.port}", "ping_interval_s": 0.25, "max_outstanding_pings": 3},
        scheduler={"ack_wait_s": 2.0, "lease_renew_interval_s": 0.5},
    )
    h = await start(proxied)  # the test's own client (h.nc) goes to nats-server directly
    batcher = await h.batcher(credits=2)
    dispatcher = h.dispatcher()
    held: Any = dispatcher._held

    holding = pulls_held_on_every_priority(held)

    await until(holding)
    normal_consumer = dispatcher.queues.consumers[Priority.NORMAL]

    handed_over = h.one_handed_over(normal_consumer)

    # A blip, shorter than the pings take to tell: the job handed over meanwhile arrives late.
    nats_proxy.silence()
    blip = await enqueue(h.nc, h.kv, announce=False)
    await until(handed_over)
    nats_proxy.resume()
    order = await batcher.next_order()
    assert order.job_id == blip
    await batcher.answer(order)
    await wait_state(h.js, blip, JobState.SUCCEEDED)
    await batcher.grant(1)
    await until(holding)
    assert nats_proxy.connections == 1  # the same connection all along

    # What sees the silence: the pings as configured (0.25 s x 3), nothing else crossing the
    # proxy; with nats-py's defaults (120 s x 2) the reconnect below would outlast its 30-s guard.
    lost_pulls = pulls_out(held)  # the pulls held open on the connection about to go silent
    nats_proxy.silence()
    lost = await enqueue(h.nc, h.kv)  # its notice is lost in the silence too
    await until(handed_over)  # to the held pull on the silent connection
    connection = dispatcher.queues.connection()

    async def reconnected() -> bool:
        return nats_proxy.connections == 2 and dispatcher.queues.connection() not in (connection, -1)

    await until(reconnected, timeout_s=30)  # a new connection, through the proxy (a hang guard)
    assert not held.holding(Priority.NORMAL)  # its pull was on the silent connection

    after = await enqueue(h.nc, h.kv, announce=False)  # no notice: a poll must find it
    # It, and the job handed to the silent connection, back after the consumer's AckWait (2 s),
    # whichever comes first (the reconnect may take longer than AckWait on a loaded machine).
    info = await h.js.consumer_info(config.nats.work_stream, normal_consumer)
    assert info.config.ack_wait == 2.0
    attempts: dict[str, int] = {}
    for _ in range(2):
        order = await batcher.next_order(timeout_s=30)
        attempts[order.job_id] = order.attempt
        # Found by a poll while the pulls held on the silent connection were still out: a
        # dispatcher deaf to the queues until they ended (HOLD_S and 2 s) found them after.
        assert not any(pull.done() for pull in lost_pulls), (order.job_id, [pull.done() for pull in lost_pulls])
        await batcher.answer(order)
        await batcher.grant(1)
    assert attempts == {after: 1, lost: 1}  # the lost one's first run: it never reached the scheduler
    await wait_state(h.js, lost, JobState.SUCCEEDED)

    await nats_proxy.cut()  # the silent connection is closed at last (nats-server forgets it)
    await until(holding, timeout_s=60)  # again, on the new connection, once the old pulls ended
    assert all(pull.done() for pull in lost_pulls)
    brought = brought_by_held_pulls(held, monkeypatch)
    job_id = await enqueue(h.nc, h.kv, priority=Priority.LOW, announce=False)
    order = await batcher.next_order(timeout_s=30)
    assert order.job_id == job_id
    assert brought == [job_id], "a held pull brings it, no poll"
    await batcher.answer(order)
    await wait_state(h.js, job_id, JobState.SUCCEEDED)
    assert nats_proxy.connections == 2


@pytest.mark.nats_fallback
async def test_a_held_pull_does_not_let_its_job_overtake_a_higher_priority_one(
    nats_proxy: SilentProxy, start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job a held pull brings while a higher priority's pull is not held open is put back for the
    round to choose: that queue may hold a job it must not overtake. The case here: the
    scheduler's connection was lost and it connected again, while nats-server still has the pulls
    it held; they bring what comes (their inbox is subscribed again on the new connection) but no
    longer count, and the dispatcher polls while they last. HIGH's pull had been handed a job as
    the connection went (lost with it; back after AckWait, 30 s), so HIGH's queue has no pull on
    the server, and NORMAL's has. A HIGH job, then a NORMAL one, with no queued notices (lost, or
    late: another gateway's): the NORMAL one reaches its pull, is put back, and the HIGH one runs
    first, with the only credit. The put-back costs no attempt. The round asks HIGH although the
    last poll found it empty (a poll marks the queues it found empty for the poll interval): it
    skipped HIGH, and took the NORMAL job back at once, ahead of the HIGH one after all. Holds of
    5 s (the pulls on the server outlast the test's steps); a poll interval of 1 s."""
    monkeypatch.setattr(held_pulls, "HOLD_S", 5.0)
    proxied = tune(config).replace(
        nats={"url": f"nats://127.0.0.1:{nats_proxy.port}"}, scheduler={"poll_interval_ms": 1_000.0}
    )
    h = await start(proxied)  # the test's own client (h.nc) goes to nats-server directly
    batcher = await h.batcher(credits=1)
    dispatcher = h.dispatcher()
    held: Any = dispatcher._held

    holding = pulls_held_on_every_priority(held)

    await until(holding)
    high_consumer = dispatcher.queues.consumers[Priority.HIGH]

    handed_over = h.one_handed_over(high_consumer)

    nats_proxy.silence()
    await enqueue(h.nc, h.kv, priority=Priority.HIGH, announce=False)
    await until(handed_over)  # to HIGH's pull, on the silent connection
    connection = dispatcher.queues.connection()
    subject = consumer_next_subject(config.nats.work_stream, high_consumer)
    polls = await RequestsSeen.on(h.nc, subject, lambda _subject, data: b'"no_wait"' in data)
    await nats_proxy.cut()

    async def reconnected() -> bool:
        return dispatcher.queues.connection() not in (connection, -1)

    try:
        await until(reconnected)
        await polls.wait_for(1)  # a round asked HIGH's queue, on the new connection...
    finally:
        await polls.close()

    async def marked_empty() -> bool:  # the round over, its credit back
        return dispatcher.queues.known_empty(Priority.HIGH) and h.app.batchers.free_credits(MODEL) == 1

    await until(marked_empty)  # ...found it empty, and will not ask it for the poll interval
    # What the test needs, checked rather than assumed: no pull counts as held.
    assert not any(held.holding(p) for p in (Priority.HIGH, Priority.NORMAL, Priority.LOW))
    urgent = await enqueue(h.nc, h.kv, priority=Priority.HIGH, announce=False)
    later = await enqueue(h.nc, h.kv, priority=Priority.NORMAL, announce=False)
    order = await batcher.next_order()
    assert order.job_id == urgent, "the NORMAL job a held pull brought ran ahead of a waiting HIGH one"
    assert dispatcher.queues.put_back_count(Priority.NORMAL) == 1  # it came, and was put back
    await batcher.answer(order)
    await batcher.grant(1)
    order = await batcher.next_order()
    assert (order.job_id, order.attempt) == (later, 1)  # the put-back was no attempt
    await batcher.answer(order)
    done = await wait_state(h.js, later, JobState.SUCCEEDED)
    assert (done.attempt, done.max_attempts, done.last_error) == (1, 3, None)
    assert dispatcher.queues.put_back_count(Priority.NORMAL) == 0


@pytest.mark.nats_fallback
async def test_a_stop_does_not_wait_out_a_held_pull(start: Start, config: Config) -> None:
    """Pulls are held open for 10 s (HOLD_S): a stop ends them rather than wait (the old stop waited for
    them, each at most a poll interval)."""
    h = await start(tune(config))
    await h.batcher(credits=1)
    dispatcher = h.dispatcher()
    held: Any = dispatcher._held

    holding = pulls_held_on_every_priority(held)

    await until(holding)
    await h.app.stop(grace_s=0.5)
    # Each ended by the stop's message to its inbox, not expired empty after HOLD_S (how long the
    # stop took is not asserted: a loaded machine's to decide).
    assert held.ended_at_close == {"interrupted": len(PRIORITIES_BY_RANK)}


@pytest.mark.nats_fallback
async def test_a_dead_letter_lives_as_long_as_its_jobs_record(
    nc: NatsClient, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A soak pass (session 25): dead letters, each holding its job's inputs, were kept for ever,
    long after their jobs' records were gone and a replay was refused. Each now carries the
    record's retention (plus an hour) as its TTL; a stream made by a release before allows TTLs
    once a scheduler of this one starts."""
    js = nc.jetstream()
    old = api.StreamConfig(name=config.nats.dead_letter_stream, subjects=[DEAD_SUBJECTS])
    await ensure_stream(js, old, retry_for_s=5.0)
    await ensure_dead_letter_stream(js, config.nats)
    assert (await js.stream_info(config.nats.dead_letter_stream)).config.allow_msg_ttl
    monkeypatch.setattr(dead_letters, "DEAD_LETTER_SLACK_S", 0.0)
    store = DeadLetterStore(nc, js, config.nats)
    letter = DeadLetter(
        job_id=new_job_id(), tenant="t", model_name="demo", reason="MAX_ATTEMPTS", attempts=1,
        dead_time=time.time(), original=b"inputs",
    )  # fmt: skip
    short = await store.add(letter, retention_s=1.0)
    kept = await store.add(dataclasses.replace(letter, job_id=new_job_id()))  # no retention known: kept
    assert await store.get(short.sequence) is not None

    async def expired() -> bool:
        return await store.get(short.sequence) is None

    await until(expired, timeout_s=10.0)
    assert await store.get(kept.sequence) is not None


@pytest.mark.nats_fallback
async def test_a_round_whose_pull_fails_is_said_once_per_interval_and_a_bug_keeps_its_traceback(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round whose pull failed logged an error with its traceback, and so did the next round, a
    poll interval later (here 20 ms): a line per round, each drawn on the event loop. NATS out of
    reach (a raw "no responders") is a warning with its error, a bug keeps its traceback, each at
    most once per 5 s; the rounds go on, and a job queued after runs."""
    h = await start(tune(config).replace(scheduler={"poll_interval_ms": 20.0, "hold_pulls_open": False}))
    queues = h.dispatcher().queues
    real_pull_next = queues.pull_next
    failures: list[Exception] = [NoRespondersError() for _ in range(10)] + [RuntimeError("a bug") for _ in range(10)]
    all_raised = asyncio.Event()

    async def failing_pull_next(count: int = 1) -> Any:
        if failures:
            error = failures.pop(0)
            if not failures:
                all_raised.set()
            raise error
        return await real_pull_next(count)

    monkeypatch.setattr(queues, "pull_next", failing_pull_next)
    with capture_logs() as logs:
        batcher = await h.batcher(credits=1)  # a round pulls only with a credit to give
        await asyncio.wait_for(all_raised.wait(), 30)
        job_id = await enqueue(h.nc, h.kv)
        order = await batcher.next_order(timeout_s=30)
        assert order.job_id == job_id
    lines = [e for e in logs if e["event"] == "pull_failed"]
    assert [(e["log_level"], "exc_info" in e) for e in lines] == [("warning", False), ("error", True)], lines
    assert lines[0]["error"].startswith("NoRespondersError: nats: no responders"), lines[0]
    assert isinstance(lines[1]["exc_info"], RuntimeError), lines[1]


@pytest.mark.nats_fallback
async def test_a_held_pull_that_fails_is_said_once_per_interval(
    start: Start, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A held pull that failed logged an error with its traceback, for each priority's pull, again
    after every round. NATS out of reach is a warning with its error, once per 5 s."""
    h = await start(tune(config).replace(scheduler={"poll_interval_ms": 20.0, "hold_pulls_open": True}))
    queues = h.dispatcher().queues
    real_hold = queues.hold
    failing = 12
    all_raised = asyncio.Event()

    async def failing_hold(priority: Priority, wait_s: float) -> Any:
        nonlocal failing
        if failing:
            failing -= 1
            if not failing:
                all_raised.set()
            raise NatsTimeoutError()
        return await real_hold(priority, wait_s)

    monkeypatch.setattr(queues, "hold", failing_hold)
    with capture_logs() as logs:
        batcher = await h.batcher(credits=1)
        await asyncio.wait_for(all_raised.wait(), 30)
        job_id = await enqueue(h.nc, h.kv)
        order = await batcher.next_order(timeout_s=30)
        assert order.job_id == job_id
    lines = [e for e in logs if e["event"] == "held_pull_failed"]
    assert [(e["log_level"], "exc_info" in e) for e in lines] == [("warning", False)], lines
    assert lines[0]["error"].startswith("TimeoutError: nats: timeout"), lines[0]
