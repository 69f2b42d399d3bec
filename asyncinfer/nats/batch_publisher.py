"""Coalescing concurrent publishes to one stream into JetStream atomic batches (ADR-50).

Writes that are ready together — those asked for in the same turn of the event loop, and those
that arrive while a batch is in flight — go to the server as one atomic batch: every message
but the last is published without a reply, the last carries `Nats-Batch-Commit`, and the server
answers once for all of them (all stored, or none). A lone write is a batch of one: a plain
publish, at once. Nothing waits to fill a batch.

A batch the server refuses (a duplicate Nats-Msg-Id, a failed expected-last-subject-sequence, a
stream without `allow_atomic`) or that gets no answer fails every write in it with
`BatchNotStored`; the caller then writes each one alone, with its own retries. Atomic batches are
about saving round trips here, never about all-or-nothing between jobs. A stream without
`allow_atomic` (declared by an older release) turns batching off for the process, logged once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.requests import request

log = structlog.get_logger("asyncinfer.nats")

BATCH_ID_HEADER = "Nats-Batch-Id"
BATCH_SEQUENCE_HEADER = "Nats-Batch-Sequence"
BATCH_COMMIT_HEADER = "Nats-Batch-Commit"
# The server's limits: 1,000 messages per batch, 50 batches in flight per stream.
MAX_MESSAGES_PER_BATCH = 1000
MAX_BATCHES_IN_FLIGHT = 50
# The server's error code when a stream does not allow atomic batches.
ATOMIC_DISABLED_ERR_CODE = 10174


class BatchNotStored(Exception):
    """The batch this write was in was not stored (or its answer was lost): write it alone."""


@dataclass(slots=True)
class _Write:
    subject: str
    payload: bytes
    headers: dict[str, str]
    stored: asyncio.Future[int]


class BatchPublisher:
    def __init__(
        self, nc: NatsClient, *, what: str, max_batch: int = 100, in_flight: int = 8, timeout_s: float = 5.0
    ) -> None:
        self._nc = nc
        self._what = what
        self._max_batch = min(max_batch, MAX_MESSAGES_PER_BATCH)
        self._slots = asyncio.Semaphore(min(in_flight, MAX_BATCHES_IN_FLIGHT))
        self._timeout_s = timeout_s
        self._waiting: list[_Write] = []
        self._flush_due = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.enabled = True
        # What was sent: batches (one answer each) and the messages in them.
        self.batches_sent = 0
        self.messages_sent = 0

    async def publish(self, subject: str, payload: bytes, headers: Mapping[str, str]) -> int:
        """Stores the message (in a batch with the others ready now); its stream sequence.
        BatchNotStored when its batch was not stored."""
        loop = asyncio.get_running_loop()
        write = _Write(subject, payload, dict(headers), loop.create_future())
        self._waiting.append(write)
        if not self._flush_due:
            self._flush_due = True
            loop.call_soon(self._flush)  # after this turn: everything asked for in it joins
        return await write.stored

    def _flush(self) -> None:
        self._flush_due = False
        while self._waiting:
            batch, self._waiting = self._waiting[: self._max_batch], self._waiting[self._max_batch :]
            task = asyncio.create_task(self._send(batch), name=f"batch-publish-{self._what}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[_Write]) -> None:
        try:
            async with self._slots:
                sequences = await self._store(batch)
        except BaseException as exc:
            for write in batch:
                if not write.stored.done():
                    write.stored.set_exception(BatchNotStored(str(exc) or type(exc).__name__))
            if not isinstance(exc, Exception):
                raise
            return
        for write, sequence in zip(batch, sequences, strict=True):
            if not write.stored.done():
                write.stored.set_result(sequence)

    async def _store(self, batch: list[_Write]) -> list[int]:
        self.batches_sent += 1
        self.messages_sent += len(batch)
        if len(batch) == 1 or not self.enabled:
            if len(batch) > 1:
                raise BatchNotStored("atomic batches are off")
            (only,) = batch
            answer = await request(
                self._nc, only.subject, only.payload, timeout_s=self._timeout_s, headers=only.headers
            )
            return [_sequence(answer.data, 1)[0]]
        batch_id = self._nc.new_inbox().rpartition(".")[2]
        last = len(batch)
        for number, write in enumerate(batch[:-1], 1):
            headers = {**write.headers, BATCH_ID_HEADER: batch_id, BATCH_SEQUENCE_HEADER: str(number)}
            await self._nc.publish(write.subject, write.payload, headers=headers)
        final = batch[-1]
        headers = {
            **final.headers,
            BATCH_ID_HEADER: batch_id,
            BATCH_SEQUENCE_HEADER: str(last),
            BATCH_COMMIT_HEADER: "1",
        }
        answer = await request(self._nc, final.subject, final.payload, timeout_s=self._timeout_s, headers=headers)
        try:
            return _sequence(answer.data, last)
        except _AtomicDisabled:
            self.enabled = False
            log.warning("atomic_batches_off", what=self._what, reason="the stream does not allow atomic batches")
            raise

    async def close(self) -> None:
        """Awaits the batches in flight (each bounded by its timeout)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class _AtomicDisabled(BatchNotStored):
    pass


def _sequence(data: bytes, count: int) -> list[int]:
    """The stream sequences of a batch of `count` from the server's answer to its last message."""
    try:
        answer = json.loads(data)
    except ValueError as exc:
        raise BatchNotStored(f"unreadable answer: {data[:200]!r}") from exc
    error = answer.get("error")
    if error is not None:
        if error.get("err_code") == ATOMIC_DISABLED_ERR_CODE:
            raise _AtomicDisabled(error.get("description", ""))
        raise BatchNotStored(f"{error.get('err_code')}: {error.get('description')}")
    last = int(answer["seq"])
    return list(range(last - count + 1, last + 1))
