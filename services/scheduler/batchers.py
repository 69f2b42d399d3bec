"""Connected batchers and their credits.

A credit is one work order a batcher said it will accept for a model. The dispatcher reserves a
credit before it pulls a message, so the scheduler never holds more messages than batchers can
take (no prefetch: a LOW job pulled early could otherwise overtake a HIGH job published later).
"""

from __future__ import annotations

import asyncio
import itertools

from asyncinfer.errors import InvalidArgument
from services.scheduler.messages import CancelOrder, ModelControlOrder, ServedModel, WorkerHello, WorkOrder
from services.scheduler.outbound import OutboundQueue

_session_numbers = itertools.count(1)


class BatcherSession:
    """One Connect stream. Its outbound queue is drained by the stream's response iterator; None
    in the queue ends the stream. A work order overtakes the lower-priority ones queued before it
    (services.scheduler.outbound)."""

    def __init__(self, hello: WorkerHello) -> None:
        self.batcher_id = hello.batcher_id
        self.takes_batches = hello.takes_batches
        # It reads input refs and stores large outputs itself (batcher.claim_check_io).
        self.reads_claim_checks = hello.reads_claim_checks
        # It answers a run past its execution timeout itself, counted from its batch's start: this
        # scheduler's timer is then a backstop (scheduler.execution_timeout_backstop_s later).
        self.times_out_runs = hello.times_out_runs
        # A batcher that reconnects keeps its ID but gets a new session.
        self.session_number = next(_session_numbers)
        self.models: dict[str, ServedModel] = {}
        # Model name -> the versions it serves (ready); `announced` also holds those loading.
        self.versions: dict[str, frozenset[str]] = {}
        self.announced: tuple[ServedModel, ...] = ()
        # The versions it could not load (the models registry shows them, with why).
        self.load_failures = hello.load_failures
        self.credits: dict[str, int] = {}
        self.serve(hello.models)
        self.in_flight: set[str] = set()
        self.outbound = OutboundQueue()
        self.closed = False

    def __repr__(self) -> str:
        return f"BatcherSession({self.batcher_id!r}#{self.session_number})"

    def serve(self, served: tuple[ServedModel, ...]) -> set[str]:
        """What the batcher serves now (hello, or a later change); the model names whose
        versions changed. A model it no longer serves loses its credits."""
        ready = [m for m in served if m.ready]
        versions: dict[str, set[str]] = {}
        for model in ready:
            versions.setdefault(model.model_name, set()).add(model.model_version)
        new_versions = {name: frozenset(v) for name, v in versions.items()}
        changed = {n for n in set(new_versions) | set(self.versions) if new_versions.get(n) != self.versions.get(n)}
        self.announced = served
        self.versions = new_versions
        self.models = {}
        for model in ready:
            self.models.setdefault(model.model_name, model)
        self.credits = {name: self.credits.get(name, 0) for name in self.models}
        return changed

    def serves(self, model_name: str, version: str) -> bool:
        return version in self.versions.get(model_name, ())

    def still_serves(self, model_name: str, version: str) -> bool:
        """Whether it still says it serves the version (READY; any of the model's where `version`
        is empty) and its stream is open: what a hand-back of an order for it is weighed by
        (lifecycle.after_hand_back). A batcher whose Triton is out of reach announced it LOADING
        first, a stopping one nothing."""
        if self.closed:
            return False
        return self.serves(model_name, version) if version else bool(self.versions.get(model_name))

    def send(self, order: WorkOrder | CancelOrder | ModelControlOrder) -> None:
        if self.closed:
            raise RuntimeError(f"{self!r} is closed")
        self.outbound.put_nowait(order)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.credits = dict.fromkeys(self.models, 0)
            self.outbound.put_nowait(None)


class BatcherRegistry:
    """The open sessions, with an event per model that is set while any of them has a credit."""

    def __init__(self) -> None:
        self._sessions: list[BatcherSession] = []
        self._credit_events: dict[str, asyncio.Event] = {}

    @property
    def sessions(self) -> tuple[BatcherSession, ...]:
        return tuple(self._sessions)

    def register(self, session: BatcherSession) -> None:
        self._sessions.append(session)

    def unregister(self, session: BatcherSession) -> None:
        """Closes the session and forgets it (its credits with it)."""
        session.close()
        if session in self._sessions:
            self._sessions.remove(session)
        for model_name in session.models:
            self._refresh(model_name)

    def serve(self, session: BatcherSession, served: tuple[ServedModel, ...]) -> None:
        """The session's batcher serves these versions now (a version loaded, loading or gone)."""
        before = set(session.models)
        session.serve(served)
        for model_name in before | set(session.models):
            self._refresh(model_name)

    def served_versions(self, model_name: str) -> set[str]:
        """The versions of the model that some open session serves."""
        return {v for s in self._sessions if not s.closed for v in s.versions.get(model_name, ())}

    def reserve_serving(self, model_name: str, version: str) -> BatcherSession | None:
        """Takes one credit from the open session with the most free credits for the model among
        those that serve `version`."""
        best: BatcherSession | None = None
        for session in self._sessions:
            free = session.credits.get(model_name, 0)
            if free > 0 and session.serves(model_name, version) and (best is None or free > best.credits[model_name]):
                best = session
        if best is not None:
            best.credits[model_name] -= 1
            self._refresh(model_name)
        return best

    def grant(self, session: BatcherSession, model_name: str, credits: int) -> None:
        if model_name not in session.models:
            raise InvalidArgument(f"credit for model {model_name!r}, which the batcher did not announce in hello")
        if credits <= 0:
            raise InvalidArgument(f"credits must be positive, got {credits}")
        if session.closed:
            return
        session.credits[model_name] += credits
        self._refresh(model_name)

    def reserve(self, model_name: str) -> BatcherSession | None:
        """Takes one credit from the open session with the most free credits for the model."""
        best: BatcherSession | None = None
        for session in self._sessions:
            free = session.credits.get(model_name, 0)
            if free > 0 and (best is None or free > best.credits[model_name]):
                best = session
        if best is not None:
            best.credits[model_name] -= 1
            self._refresh(model_name)
        return best

    def release(self, session: BatcherSession, model_name: str) -> None:
        """Gives back a reserved credit that was not used (nothing to dispatch)."""
        if not session.closed and model_name in session.credits:  # not a model the batcher has since unloaded
            session.credits[model_name] += 1
            self._refresh(model_name)

    def credit_event(self, model_name: str) -> asyncio.Event:
        event = self._credit_events.get(model_name)
        if event is None:
            event = self._credit_events[model_name] = asyncio.Event()
            self._refresh(model_name)
        return event

    def free_credits(self, model_name: str) -> int:
        return sum(s.credits.get(model_name, 0) for s in self._sessions)

    def serving(self, model_name: str) -> list[BatcherSession]:
        return [s for s in self._sessions if model_name in s.models]

    def _refresh(self, model_name: str) -> None:
        event = self._credit_events.get(model_name)
        if event is None:
            return
        if self.free_credits(model_name) > 0:
            event.set()
        else:
            event.clear()
