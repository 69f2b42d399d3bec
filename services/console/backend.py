"""The console's one way to the stack: the gateway's JobService and BatchService and the
scheduler's OpsService, over their public gRPC APIs, with the keys the console is configured with.
Protobuf stays here: pages get the SDK's `Job`, `Batch` and `ModelInfo`, and the small frozen
dataclasses below."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from asyncinfer.access import bearer_metadata
from asyncinfer.client import Job, JobState, ModelInfo
from asyncinfer.client._convert import job_from_proto, models_from_proto, state_to_proto
from asyncinfer.client.batches import FILES, Batch, batch_from_proto
from asyncinfer.client.errors import SOCKET_CLOSED, AsyncInferClientError, DeadlineExceededError, from_rpc_error
from asyncinfer.commands.ops import dead_letter_json, queue_state_name
from asyncinfer.config import ConsoleConfig
from asyncinfer.grpc_keepalive import Keepalive
from asyncinfer.grpc_server import LIVENESS_SERVICE
from asyncinfer.supervision import cancel_and_wait
from asyncinfer.tls import read_secret, renewing_channel_credentials
from asyncinfer.v1 import (
    batch_service_pb2,
    batch_service_pb2_grpc,
    job_pb2,
    job_service_pb2,
    job_service_pb2_grpc,
    ops_service_pb2,
    ops_service_pb2_grpc,
)
from services.console.served_certificates import ServedCertificate, served_certificates

T = TypeVar("T")
CALL_TIMEOUT_S = 10.0
PRIORITIES = {
    job_pb2.PRIORITY_HIGH: "HIGH",
    job_pb2.PRIORITY_NORMAL: "NORMAL",
    job_pb2.PRIORITY_LOW: "LOW",
    job_pb2.PRIORITY_UNSPECIFIED: "NORMAL",  # the API's default
}


@dataclass(frozen=True, slots=True)
class PriorityQueue:
    priority: str
    depth: int
    oldest_age_s: float


@dataclass(frozen=True, slots=True)
class ModelQueues:
    model_name: str
    state: str
    priorities: tuple[PriorityQueue, ...]
    in_flight: int
    connected_batchers: int
    free_credits: int
    desired_batchers: int
    submitted_per_second: float
    completed_per_second: float
    # (batch size, batches, jobs) over the last minute, smallest size first.
    batch_sizes: tuple[tuple[int, int, int], ...] = ()
    # Schedulers reporting the model (the counts above but depths are theirs together) and how
    # many drain; 0 from a scheduler of a release before that says neither.
    schedulers: int = 0
    draining_schedulers: int = 0

    @property
    def depth(self) -> int:
        return sum(p.depth for p in self.priorities)


@dataclass(frozen=True, slots=True)
class JobsPage:
    jobs: tuple[Job, ...]
    next_page_token: str


@dataclass(frozen=True, slots=True)
class BatchesPage:
    batches: tuple[Batch, ...]
    next_page_token: str


@dataclass(frozen=True, slots=True)
class DeadLettersPage:
    letters: tuple[dict[str, Any], ...]  # asyncinfer.commands.ops.dead_letter_json's form
    next_page_token: str
    total: int | None


# How long the calls on channels made with a certificate since renewed may go on before they are
# cut: a page's call ends within CALL_TIMEOUT_S, a batch file's download has no deadline.
RETIRED_CHANNELS_GRACE_S = 3600.0


@dataclass(frozen=True, slots=True)
class Channels:
    """The channel to the gateway and the one to the scheduler, made with one set of credentials,
    and their stubs."""

    gateway: aio.Channel
    scheduler: aio.Channel
    jobs: job_service_pb2_grpc.JobServiceAsyncStub
    batches: batch_service_pb2_grpc.BatchServiceAsyncStub
    ops: ops_service_pb2_grpc.OpsServiceAsyncStub

    @classmethod
    def open(
        cls, config: ConsoleConfig, credentials: grpc.ChannelCredentials | None, options: Sequence[tuple[str, Any]]
    ) -> Channels:
        gateway = _channel(config.gateway_address, credentials, options)
        scheduler = _channel(config.scheduler_address, credentials, options)
        return cls(
            gateway=gateway,
            scheduler=scheduler,
            jobs=job_service_pb2_grpc.JobServiceStub(gateway),
            batches=batch_service_pb2_grpc.BatchServiceStub(gateway),
            ops=ops_service_pb2_grpc.OpsServiceStub(scheduler),
        )

    async def close(self, grace_s: float | None) -> None:
        """Closed once their calls ended, or at `grace_s` (None: at once)."""
        await asyncio.gather(self.gateway.close(grace_s), self.scheduler.close(grace_s))


class Backend:
    """One channel to the gateway and one to the scheduler, for the console's lifetime, or until
    its TLS files are renewed (`renew_certificates`). Failures raise the SDK's typed errors
    (`AsyncInferClientError`), which the pages show."""

    def __init__(self, config: ConsoleConfig) -> None:
        # Its client certificate, key and CA, read again once they change (asyncinfer.tls: a bad
        # file now is a ConfigError naming its console.tls_* setting).
        self.certificates = (
            renewing_channel_credentials(
                ca_file=config.tls_ca_file,
                cert_file=config.tls_cert_file,
                key_file=config.tls_key_file,
                key="console.tls",
                service="console",
            )
            if config.tls_ca_file
            else None
        )
        credentials = self.certificates.current() if self.certificates is not None else None
        self._config = config
        # Idle connections are pinged too: a console is read now and then, and a connection that went
        # silent between two reads (its peer's host lost) would otherwise be found out by no one,
        # each page waiting out its deadline on it, for good.
        self._options = [*Keepalive(config.keepalive_s).client_options(without_calls=True), *RECONNECT_OPTIONS]
        self._credentials = credentials
        self._channels = Channels.open(config, credentials, self._options)
        # Channels made with certificates since renewed, closing once their calls end: owned, and
        # closed at once by close().
        self._retiring: dict[asyncio.Task[None], Channels] = {}
        self._closed = False
        unsigned = credentials is not None and not config.tls_cert_file  # TLS without a client certificate
        self._gateway = Peer("the gateway", config.gateway_address, "console.tenant_key", unsigned)
        self._scheduler = Peer("the scheduler", config.scheduler_address, "console.ops_key", unsigned)
        self._tenant = bearer_metadata(read_secret(config.tenant_key, config.tenant_key_file, "console.tenant_key"))
        ops_key = read_secret(config.ops_key, config.ops_key_file, "console.ops_key")
        self._ops_metadata = bearer_metadata(ops_key)
        self.has_ops_key = ops_key is not None

    async def renew_certificates(self) -> None:
        """New channels for the calls from now on once the console's TLS files changed (a renewed
        client certificate, key or CA; one that cannot be used is logged and the last good one
        kept: asyncinfer.tls.RenewingFiles). A gRPC channel keeps the credentials it was made with
        for every reconnect, so one made before a renewal would present the old certificate until
        the console restarts. The calls already made on the old channels finish on them. The
        console calls it before each page and each queue sample."""
        if self.certificates is None or self._closed:
            return
        credentials = await asyncio.to_thread(self.certificates.current)
        if credentials is self._credentials or self._closed:
            return
        self._credentials = credentials
        retired, self._channels = self._channels, Channels.open(self._config, credentials, self._options)
        closing = asyncio.create_task(retired.close(RETIRED_CHANNELS_GRACE_S), name="console-retired-channels")
        self._retiring[closing] = retired
        closing.add_done_callback(self._retiring.pop)

    async def served_certificates(self) -> list[ServedCertificate]:
        """The gateway's and the scheduler's serving certificates as this console is served them
        (a handshake each, with its own TLS files): none in plaintext."""
        return await served_certificates(self._config)

    async def close(self) -> None:
        """Closes the channels. The console closes its Backend once its pages and its sampler
        have stopped (ConsoleApp.stop), so no call is left on the channels that renewals retired:
        their closes, waiting on calls, are ended rather than waited for."""
        self._closed = True
        await self._channels.close(None)
        await cancel_and_wait(list(self._retiring))

    async def unreachable(self, timeout_s: float) -> list[str]:
        """What of the gateway and the scheduler this console cannot reach now (each's health
        Check of its liveness service, SERVING until it stops; empty: both), for /readyz."""

        async def check(peer: Peer, channel: aio.Channel) -> str | None:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                answer = await stub.Check(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE), timeout=timeout_s)
            except grpc.aio.AioRpcError as error:
                return f"{peer.name} at {peer.address}: {error.code().name} {(error.details() or '')[:200]}"
            if answer.status != health_pb2.HealthCheckResponse.SERVING:
                return f"{peer.name} at {peer.address}: {_serving_status(answer.status)}"
            return None

        channels = self._channels
        answers = await asyncio.gather(
            check(self._gateway, channels.gateway), check(self._scheduler, channels.scheduler)
        )
        return [answer for answer in answers if answer is not None]

    # -- JobService ------------------------------------------------------------------------

    async def models(self) -> list[ModelInfo]:
        request = job_service_pb2.ListModelsRequest()
        answer = await self._gateway.call(
            self._channels.jobs.ListModels(request, timeout=CALL_TIMEOUT_S, metadata=self._tenant)
        )
        return models_from_proto(answer)

    async def list_jobs(
        self,
        *,
        states: Sequence[JobState] = (),
        model: str = "",
        labels: Mapping[str, str] | None = None,
        page_size: int = 50,
        page_token: str = "",
    ) -> JobsPage:
        request = job_service_pb2.ListJobsRequest(
            page_size=page_size,
            page_token=page_token,
            states=[state_to_proto(state) for state in states],
            model_name=model,
            labels=dict(labels or {}),
        )
        answer = await self._gateway.call(
            self._channels.jobs.ListJobs(request, timeout=CALL_TIMEOUT_S, metadata=self._tenant)
        )
        return JobsPage(tuple(job_from_proto(job) for job in answer.jobs), answer.next_page_token)

    async def job(self, job_id: str) -> Job:
        request = job_service_pb2.GetJobRequest(job_id=job_id)
        answer = await self._gateway.call(
            self._channels.jobs.GetJob(request, timeout=CALL_TIMEOUT_S, metadata=self._tenant)
        )
        return job_from_proto(answer.job, answer.progress if answer.HasField("progress") else None)

    async def cancel_job(self, job_id: str, *, reason: str) -> Job:
        request = job_service_pb2.CancelJobRequest(job_id=job_id, reason=reason)
        answer = await self._gateway.call(
            self._channels.jobs.CancelJob(request, timeout=CALL_TIMEOUT_S, metadata=self._tenant)
        )
        return job_from_proto(answer.job)

    # -- BatchService (the tenant's key: batches are per tenant) ----------------------------

    async def list_batches(self, *, page_size: int = 20, page_token: str = "") -> BatchesPage:
        request = batch_service_pb2.ListBatchesRequest(page_size=page_size, page_token=page_token)
        answer = await self._gateway.call(
            self._channels.batches.ListBatches(request, timeout=CALL_TIMEOUT_S, metadata=self._tenant)
        )
        return BatchesPage(tuple(batch_from_proto(b) for b in answer.batches), answer.next_page_token)

    async def batch(self, batch_id: str) -> Batch:
        request = batch_service_pb2.GetBatchRequest(batch_id=batch_id)
        answer = await self._gateway.call(
            self._channels.batches.GetBatch(request, timeout=CALL_TIMEOUT_S, metadata=self._tenant)
        )
        return batch_from_proto(answer.batch)

    async def cancel_batch(self, batch_id: str) -> Batch:
        request = batch_service_pb2.CancelBatchRequest(batch_id=batch_id)
        answer = await self._gateway.call(
            self._channels.batches.CancelBatch(request, timeout=CALL_TIMEOUT_S, metadata=self._tenant)
        )
        return batch_from_proto(answer.batch)

    async def batch_file(self, batch_id: str, file: str) -> AsyncGenerator[bytes, None]:
        """The batch's `output`, `errors` or `npz` file, piece by piece as the gateway streams it.
        The first piece (or the refusal) comes within CALL_TIMEOUT_S, as a page's call does, else
        DeadlineExceededError naming the gateway: a gateway that took the call and sends nothing
        held the download open for good. The pieces after it have no deadline: a large file takes
        as long as it takes (a broken stream raises)."""
        request = batch_service_pb2.ReadBatchFileRequest(batch_id=batch_id, file=FILES[file])
        call = self._channels.batches.ReadBatchFile(request, metadata=self._tenant)
        try:
            pieces = aiter(call)
            try:
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    first = await anext(pieces, None)
            except TimeoutError:
                late = DeadlineExceededError("Deadline Exceeded", code=grpc.StatusCode.DEADLINE_EXCEEDED)
                raise self._gateway.explained(late) from None
            if first is None:
                return
            yield first.chunk
            async for piece in pieces:
                yield piece.chunk
        except grpc.RpcError as rpc_error:
            raise self._gateway.explained(from_rpc_error(rpc_error)) from rpc_error
        finally:
            call.cancel()  # the download ended early (the browser went, a deadline): the gateway stops

    # -- OpsService ------------------------------------------------------------------------

    async def queues(self) -> list[ModelQueues]:
        request = ops_service_pb2.GetQueueStatsRequest()
        answer = await self._scheduler.call(
            self._channels.ops.GetQueueStats(request, timeout=CALL_TIMEOUT_S, metadata=self._ops_metadata)
        )
        return [_model_queues(model) for model in answer.models]

    async def dead_letters(self, *, model: str = "", page_size: int = 50, page_token: str = "") -> DeadLettersPage:
        request = ops_service_pb2.ListDeadLettersRequest(model_name=model, page_size=page_size, page_token=page_token)
        answer = await self._scheduler.call(
            self._channels.ops.ListDeadLetters(request, timeout=CALL_TIMEOUT_S, metadata=self._ops_metadata)
        )
        total = answer.total if answer.HasField("total") else None
        return DeadLettersPage(tuple(dead_letter_json(d) for d in answer.dead_letters), answer.next_page_token, total)

    async def dead_letter(self, sequence: int) -> dict[str, Any]:
        request = ops_service_pb2.GetDeadLetterRequest(sequence=sequence)
        answer = await self._scheduler.call(
            self._channels.ops.GetDeadLetter(request, timeout=CALL_TIMEOUT_S, metadata=self._ops_metadata)
        )
        return dead_letter_json(answer.dead_letter)

    async def replay(self, sequences: Sequence[int] = (), *, every: bool = False, model: str = "") -> str:
        request = ops_service_pb2.ReplayDeadLettersRequest(sequences=sequences, all=every, model_name=model)
        answer = await self._scheduler.call(
            self._channels.ops.ReplayDeadLetters(request, timeout=CALL_TIMEOUT_S, metadata=self._ops_metadata)
        )
        said = f"replayed {answer.replayed}" + (f", skipped {answer.skipped}" if answer.skipped else "")
        return said + (f", {answer.remaining} left" if answer.HasField("remaining") else "")

    async def purge(self, sequences: Sequence[int] = (), *, every: bool = False, model: str = "") -> str:
        request = ops_service_pb2.PurgeDeadLettersRequest(sequences=sequences, all=every, model_name=model)
        answer = await self._scheduler.call(
            self._channels.ops.PurgeDeadLetters(request, timeout=CALL_TIMEOUT_S, metadata=self._ops_metadata)
        )
        return f"purged {answer.purged}" + (f", {answer.remaining} left" if answer.HasField("remaining") else "")

    async def pause(self, model: str, *, paused: bool) -> str:
        if paused:
            pause = ops_service_pb2.PauseQueueRequest(model_name=model)
            answer: Any = await self._scheduler.call(
                self._channels.ops.PauseQueue(pause, timeout=CALL_TIMEOUT_S, metadata=self._ops_metadata)
            )
        else:
            resume = ops_service_pb2.ResumeQueueRequest(model_name=model)
            answer = await self._scheduler.call(
                self._channels.ops.ResumeQueue(resume, timeout=CALL_TIMEOUT_S, metadata=self._ops_metadata)
            )
        queued = f", {answer.queued} queued" if answer.HasField("queued") else ""
        return f"{model}: {queue_state_name(answer.state)}{queued}"


# Pages come back soon after a gateway or scheduler restart: gRPC's default reconnect backoff
# starts at 1 s and grows to 120 s, so after a 30-s outage pages kept failing 13.9 s after the
# service was back, after 90 s 25.7 s (session 30); the SDK's channels use the same bounds.
# (Not grpc.min_reconnect_backoff_ms: that is the least time an attempt is given.)
RECONNECT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


def _channel(
    target: str, credentials: grpc.ChannelCredentials | None, options: Sequence[tuple[str, Any]]
) -> aio.Channel:
    if credentials is not None:
        return aio.secure_channel(target, credentials, options=options)
    return aio.insecure_channel(target, options=options)


@dataclass(frozen=True, slots=True)
class Peer:
    """A service the console calls, named in the errors its calls raise: gRPC's own text ("failed to
    connect to all addresses", "invalid API key") says neither which service nor which setting."""

    name: str  # "the gateway"
    address: str
    key_setting: str  # the console setting whose key this service is called with
    # Over TLS with no client certificate: a refusal of a server that requires one (mutual TLS)
    # reaches the console as gRPC's "Socket closed" (asyncinfer.client.errors.SOCKET_CLOSED),
    # which the console then explains, since only it knows it sent none.
    without_client_cert: bool = False

    def explained(self, error: AsyncInferClientError) -> AsyncInferClientError:
        if error.code is grpc.StatusCode.UNAVAILABLE:
            if self.without_client_cert and SOCKET_CLOSED in error.message:
                error.hint = (
                    f"{self.name} closed the connection after the TLS handshake: if it requires client certificates "
                    "(mutual TLS: its tls_client_ca_file), set console.tls_cert_file and console.tls_key_file (a "
                    "certificate its CA signed)"
                )
            error.message = f"{self.name} ({self.address}) does not answer: {error.message}"
        elif error.code is grpc.StatusCode.DEADLINE_EXCEEDED and error.reason == error.code.name:
            # The console's own deadline (a service's own DEADLINE_EXCEEDED names a reason):
            # gRPC's text, "Deadline Exceeded", said neither who was waited for nor how long.
            error.message = f"{self.name} ({self.address}) did not answer within {CALL_TIMEOUT_S:g} s: {error.message}"
        elif error.code is grpc.StatusCode.UNAUTHENTICATED:
            error.message = f"{self.name} refused this console's {self.key_setting}: {error.message}"
        elif error.code is grpc.StatusCode.PERMISSION_DENIED:
            error.message = f"{self.name} does not allow this console's {self.key_setting} that: {error.message}"
        else:
            return error
        error.args = (error.message,)
        return error

    async def call(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except grpc.RpcError as rpc_error:
            raise self.explained(from_rpc_error(rpc_error)) from rpc_error


def _serving_status(status: int) -> str:
    """A health answer's status by name; one newer than this console by its number (the health
    protocol adds values as ours do)."""
    try:
        name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    except ValueError:
        return f"status {status}"
    return name


def _model_queues(model: ops_service_pb2.ModelQueueStats) -> ModelQueues:
    return ModelQueues(
        model_name=model.model_name,
        state=queue_state_name(model.state),
        priorities=tuple(
            PriorityQueue(
                # A value newer than this console is shown as its number, not taken for NORMAL.
                priority=PRIORITIES.get(p.priority, f"priority {p.priority}"),
                depth=p.depth,
                oldest_age_s=p.oldest_age.seconds + p.oldest_age.nanos / 1e9,
            )
            for p in model.priorities
        ),
        in_flight=model.in_flight,
        connected_batchers=model.connected_batchers,
        free_credits=model.free_credits,
        desired_batchers=model.desired_batchers,
        submitted_per_second=model.submitted_per_second,
        completed_per_second=model.completed_per_second,
        batch_sizes=tuple((c.batch_size, c.batches, c.jobs) for c in model.batch_sizes),
        schedulers=model.schedulers,
        draining_schedulers=model.draining_schedulers,
    )
