"""Model controls across the pool (OpsService.LoadModel / UnloadModel): one ModelControl order on
the Connect stream of each batcher targeted, and its answer awaited. A batcher carries it out as
tritonclient's load_model / unload_model would on it (services/batcher/model_control.py): new
versions are warmed up before they take work, and what an old version holds finishes on it. Its
announcement of what it serves then reaches the dispatch (and the registry) on the same stream.

A batcher whose stream ends before it answers, or that does not answer in time, counts as failed
(UNAVAILABLE, DEADLINE_EXCEEDED); the others' outcomes are reported as they are.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from asyncinfer.errors import NotFound
from asyncinfer.jobs import JobError
from services.scheduler.batchers import BatcherRegistry, BatcherSession
from services.scheduler.messages import ModelControlOrder

UNAVAILABLE_CODE = 14
DEADLINE_EXCEEDED_CODE = 4


@dataclass(frozen=True, slots=True)
class ControlOutcome:
    batcher_id: str
    error: JobError | None = None  # None: it succeeded


class ModelControls:
    def __init__(self, batchers: BatcherRegistry) -> None:
        self._batchers = batchers
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[BatcherSession, asyncio.Future[JobError | None]]] = {}

    def targets(self, batcher_ids: Sequence[str]) -> list[BatcherSession]:
        sessions = [s for s in self._batchers.sessions if not s.closed]
        if batcher_ids:
            sessions = [s for s in sessions if s.batcher_id in batcher_ids]
            missing = sorted(set(batcher_ids) - {s.batcher_id for s in sessions})
            if missing:
                raise NotFound(f"no batcher {missing} is connected to this scheduler", reason="BATCHER_NOT_FOUND")
        if not sessions:
            raise NotFound("no batcher is connected to this scheduler", reason="BATCHER_NOT_FOUND")
        return sessions

    async def run(
        self,
        *,
        action: str,
        model_name: str,
        config_json: str = "",
        model_version: str = "",
        batcher_ids: Sequence[str] = (),
        timeout_s: float,
    ) -> list[ControlOutcome]:
        sessions = self.targets(batcher_ids)
        loop = asyncio.get_running_loop()
        waits: list[tuple[BatcherSession, int, asyncio.Future[JobError | None]]] = []
        for session in sessions:
            request_id = next(self._ids)
            future: asyncio.Future[JobError | None] = loop.create_future()
            self._pending[request_id] = (session, future)
            waits.append((session, request_id, future))
            session.send(
                ModelControlOrder(
                    request_id=request_id,
                    action=action,
                    model_name=model_name,
                    config_json=config_json,
                    model_version=model_version,
                )
            )
        try:
            await asyncio.wait([f for _s, _i, f in waits], timeout=timeout_s)
        finally:
            for _session, request_id, _future in waits:
                self._pending.pop(request_id, None)
        outcomes = []
        for session, _request_id, future in waits:
            if future.done():
                outcomes.append(ControlOutcome(session.batcher_id, future.result()))
            else:
                future.cancel()
                late = JobError(
                    code=DEADLINE_EXCEEDED_CODE, reason="CONTROL_TIMED_OUT", message=f"no answer in {timeout_s:g} s"
                )
                outcomes.append(ControlOutcome(session.batcher_id, late))
        return outcomes

    def answered(self, session: BatcherSession, request_id: int, error: JobError | None) -> None:
        pending = self._pending.get(request_id)
        if pending is not None and pending[0] is session and not pending[1].done():
            pending[1].set_result(error)

    def session_ended(self, session: BatcherSession) -> None:
        gone = JobError(code=UNAVAILABLE_CODE, reason="BATCHER_LOST", message="the batcher left before it answered")
        for owner, future in self._pending.values():
            if owner is session and not future.done():
                future.set_result(gone)
