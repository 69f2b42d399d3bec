"""The connection under `AsyncClient` (asyncinfer.client._async): its channel, metadata and deadlines,
and `_call`, the one place an RPC is made and retried per the client's `RetryPolicy`."""

from __future__ import annotations

import asyncio
import enum
import os
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar

import grpc
from grpc import aio

from asyncinfer.client._addresses import most_telling
from asyncinfer.client._convert import named
from asyncinfer.client._retry import Deadline, RetryPolicy, checked_timeout
from asyncinfer.client._targets import check_target
from asyncinfer.client.batches import BatchCalls
from asyncinfer.client.errors import AsyncInferClientError, from_rpc_error, with_connection_hint, with_earlier_hint
from asyncinfer.client.types import Job
from asyncinfer.grpc_keepalive import Keepalive
from asyncinfer.tensors import TensorSpec
from asyncinfer.v1 import job_service_pb2_grpc

if TYPE_CHECKING:
    from asyncinfer.v1.job_service_pb2_grpc import JobServiceAsyncStub

T = TypeVar("T")
E = TypeVar("E", bound=enum.StrEnum)
JobLike = Job | str

# Reconnect soon after the gateway comes back (grpc's default first backoff is a whole second).
# Not grpc.min_reconnect_backoff_ms: gRPC takes it as the least time a connection attempt is given
# (20 s by default), and at 100 ms a gateway 150 ms away could not be reached at all.
_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.primary_user_agent", "asyncinfer-python"),
)

# The process in which the SDK made its first channel. gRPC's state (the C core's threads,
# grpc.aio's poller) is not carried over by fork(): a child forked after that, making a client of
# its own, crashed on its first call (SIGSEGV) or hung (the parent's client still open), whether
# gRPC's fork support was on or off (grpcio 1.85); now it is told at once.
_channel_pid: int | None = None
FORKED_AFTER_USE = (
    "this process was forked from one that had already made an asyncinfer client, and gRPC cannot be "
    "used in such a child: make clients only after the fork, never before it in the parent (gunicorn "
    "--preload: in post_fork or on first use; Celery prefork: in worker_process_init), or start workers "
    "with multiprocessing's 'spawn' or 'forkserver' method (multiprocessing.get_context('spawn'))"
)


def check_not_forked() -> None:
    """Raises RuntimeError in a child forked after this SDK made a channel (FORKED_AFTER_USE)."""
    if _channel_pid is not None and _channel_pid != os.getpid():
        raise RuntimeError(FORKED_AFTER_USE)


def tls_credentials(
    *,
    ca_file: str | os.PathLike[str] | None = None,
    cert_file: str | os.PathLike[str] | None = None,
    key_file: str | os.PathLike[str] | None = None,
) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM files: the CA that verifies the server (None: the system's
    CAs) and, for mutual TLS, a client certificate and its key (both or neither)."""
    if bool(cert_file) != bool(key_file):
        raise ValueError("tls_cert_file and tls_key_file go together: give both or neither")
    ca = Path(ca_file).read_bytes() if ca_file else None
    if cert_file and key_file:
        return grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=Path(key_file).read_bytes(),
            certificate_chain=Path(cert_file).read_bytes(),
        )
    return grpc.ssl_channel_credentials(root_certificates=ca)


def _enum(kind: type[E], value: E | str, what: str) -> E:
    """A Priority or JobState from itself or its name in any case ("high", "HIGH")."""
    return named(value, {member.value: member for member in kind}, what)


def _job_ids(jobs: Iterable[JobLike]) -> list[str]:
    """The distinct job IDs of many jobs, in order; one ID alone is a TypeError (a string is an
    iterable of characters, each of which would be looked up)."""
    if isinstance(jobs, str | Job):
        raise TypeError(f"pass many jobs as a list (e.g. [{jobs!r}]), not one job")
    return list(dict.fromkeys(_job_id(job) for job in jobs))


def _job_id(job: JobLike) -> str:
    return job.job_id if isinstance(job, Job) else job


def _unary_budget(deadline: Deadline, default_s: float) -> float:
    remaining = deadline.remaining()
    return default_s if remaining is None else min(remaining, default_s)


class ClientChannel:
    """What every part of `AsyncClient` calls through: one channel to one gateway, the call metadata
    (the API key), the default deadline and the retry policy (`AsyncClient` documents them)."""

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        tls_ca_file: str | os.PathLike[str] | None = None,
        tls_cert_file: str | os.PathLike[str] | None = None,
        tls_key_file: str | os.PathLike[str] | None = None,
        keepalive_s: float | None = 30.0,
    ) -> None:
        check_target(target)  # one gRPC can never reach was retried for ~7 s on each call
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            # grpc.aio would bind the channel to whatever loop is current now, and every call made
            # later under asyncio.run() failed with "attached to a different loop".
            raise RuntimeError(
                "make an AsyncClient inside a coroutine (the event loop that will use it is running then: "
                "e.g. in an async with block, or a web framework's startup hook), or use the blocking Client"
            ) from None
        # gRPC takes the first of two options with the same name: the caller's go first.
        options = [
            *channel_options,
            *_CHANNEL_OPTIONS,
            *(Keepalive(keepalive_s).client_options() if keepalive_s is not None else ()),
        ]
        if checked_timeout(timeout_s) is None:
            raise ValueError("timeout_s is the default seconds of a unary call, 0 or more, not None")
        check_not_forked()
        global _channel_pid
        _channel_pid = os.getpid()
        from_files = credentials is None and bool(tls_ca_file or tls_cert_file or tls_key_file)
        if from_files:
            credentials = tls_credentials(ca_file=tls_ca_file, cert_file=tls_cert_file, key_file=tls_key_file)
        self._tls = credentials is not None
        # Whether a client certificate goes with it (None: credentials made by the caller, unknown),
        # for the hint after a mutual-TLS server closed the connection (with_connection_hint).
        self._client_cert: bool | None = bool(tls_cert_file) if from_files or credentials is None else None
        # Kept for the tries of each address after a refusal (_addresses.most_telling).
        self._target, self._credentials, self._options = target, credentials, options
        if credentials is not None:
            self._channel = aio.secure_channel(target, credentials, options=options)
        else:
            self._channel = aio.insecure_channel(target, options=options)
        self._job_stub: JobServiceAsyncStub = job_service_pb2_grpc.JobServiceStub(self._channel)
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {api_key}"),) if api_key is not None else ()
        )
        # Made once, with the channel: grpcio 1.85 crashes the process (a segfault or an abort)
        # when a stub made on a closed channel is called.
        self._batches = BatchCalls(
            self._channel,
            self._metadata,
            lambda invoke, deadline=None: self._call(invoke, self._deadline(None) if deadline is None else deadline),
            backoff=self._backoff_or_raise,
        )
        self._closed = False
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        # Input specs by model, from ListModels: fetched on the first submit with inputs, asked
        # again for a model not listed before (once per model name) and for one whose submit the
        # gateway refused for its signature (`forget_signature`), never again from a gateway
        # without ListModels.
        self._input_specs: dict[str, dict[str, TensorSpec]] | None = None
        # ... and by (model, version) for each version ListModels gives inputs for: a pinned
        # submit is validated against its version's, which a [[models.versions]] entry may change.
        self._version_specs: dict[tuple[str, str], dict[str, TensorSpec]] = {}
        self._unlisted: set[str] = set()
        self._list_models_unimplemented = False
        self._specs_lock = asyncio.Lock()

    def forget_signature(self, model: str) -> None:
        """Drops what the client cached of `model`'s signature (its versions' too), so that its next
        submit asks ListModels again: the gateway refused one of its submits for an input's
        datatype or shape. A hot update may have changed its inputs since they were cached (a
        long-lived client typed by the old signature for good, each submit refused), or loaded it
        (one not listed when asked was sent untyped for good). A refused submit queued nothing, so
        nothing else changes; ListModels is asked once per such refusal, never per accepted submit
        (nor per submit of a model the gateway does not know: asked once more, then left alone)."""
        if self._input_specs is not None:
            self._input_specs.pop(model, None)
        self._unlisted.discard(model)
        for key in [key for key in self._version_specs if key[0] == model]:
            del self._version_specs[key]

    async def _require_served(self, model: str) -> None:
        """NotFoundError, before a large upload, for a model the gateway does not list
        (JobCalls', which keeps the ListModels cache; nothing is checked here)."""

    async def close(self) -> None:
        """Closes the channel; a call after it raises RuntimeError, and so does one in flight
        (another task's watch, say). Idempotent."""
        self._closed = True
        await self._channel.close(None)

    def _raise_if_closed_meanwhile(self) -> None:
        """A call cancelled by the channel's close, not by a cancel of its task: RuntimeError (it
        raised a bare CancelledError in a task nobody cancelled, which TaskGroup and asyncio.run
        take for a cancel)."""
        task = asyncio.current_task()
        if self._closed and (task is None or task.cancelling() == 0):
            raise RuntimeError("the client was closed while this call ran")

    @property
    def _stub(self) -> JobServiceAsyncStub:
        if self._closed:
            raise RuntimeError("the client is closed")
        return self._job_stub

    async def __aenter__(self) -> Self:
        if self._closed:  # said here, not at the block's first call
            raise RuntimeError("the client is closed")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _deadline(self, timeout_s: float | None) -> Deadline:
        return Deadline(self.timeout_s if timeout_s is None else timeout_s)

    async def _hinted(self, error: AsyncInferClientError, deadline: Deadline) -> AsyncInferClientError:
        """`error` as raised: where it is a refusal, the most telling error of the target's addresses
        (within what is left of `deadline`), and its hint."""
        remaining = deadline.remaining()
        if remaining is None or remaining > 0:
            error = await most_telling(error, self._target, self._credentials, self._options, remaining)
        return with_connection_hint(error, tls=self._tls, client_cert=self._client_cert)

    async def _backoff_or_raise(
        self,
        error: AsyncInferClientError,
        attempt: int,
        deadline: Deadline,
        cause: BaseException | None,
        broken_at: float | None = None,
        earlier: AsyncInferClientError | None = None,
    ) -> None:
        """Sleeps before attempt `attempt + 1`, or raises `error` when that is not allowed.
        `broken_at`: when a stream that had been answering broke (RetryPolicy.stream_resume_s).
        `earlier`: the error the attempt before this one was retried for, whose hint a
        DEADLINE_EXCEEDED keeps (`with_earlier_hint`). A deadline that the sleep overran (a busy
        machine) raises `error` as one that leaves no room for the sleep does: the call is cut
        short by its deadline, and what its attempts met (and its hint) is the news, not
        "did not complete within 10 s"."""
        if not self.retry.retriable(error) or not self.retry.allows_attempt(attempt, broken_at):
            raise with_earlier_hint(
                await self._hinted(error, deadline), earlier, tls=self._tls, client_cert=self._client_cert
            ) from cause
        delay = self.retry.backoff_s(attempt, error)
        if not deadline.allows_sleep(delay):
            raise await self._hinted(error, deadline) from cause
        if self.retry.on_retry is not None:
            self.retry.on_retry(error, delay)
        await asyncio.sleep(delay)
        if deadline.expired():
            raise await self._hinted(error, deadline) from cause

    async def _call(
        self, invoke: Callable[[float | None], Awaitable[T]], deadline: Deadline, *, retry: bool = True
    ) -> T:
        """One RPC (or a whole streamed read), retried per the policy; `invoke` gets the seconds left."""
        attempt = 0
        earlier: AsyncInferClientError | None = None
        while True:
            attempt += 1
            deadline.check("the call")
            try:
                return await invoke(deadline.remaining())
            except asyncio.CancelledError:
                self._raise_if_closed_meanwhile()
                raise
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error)
                if not retry:
                    raise await self._hinted(error, deadline) from rpc_error
                await self._backoff_or_raise(error, attempt, deadline, rpc_error, None, earlier)
                earlier = error
