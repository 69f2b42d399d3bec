"""The options every client command shares (--gateway, --scheduler, --api-key, --ops-key, --tls-ca,
--tls-cert, --tls-key, --timeout, --json, --config), as the handlers receive them."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from asyncinfer.client import AsyncClient, AsyncInferClientError, RetryPolicy, tls_credentials
from asyncinfer.client._addresses import REFUSED
from asyncinfer.client._targets import FORMS, target_problem
from asyncinfer.commands.inputs import header_problem
from asyncinfer.commands.output import UsageError

DEFAULT_GATEWAY = "127.0.0.1:50051"
DEFAULT_SCHEDULER = "127.0.0.1:50052"
DEFAULT_CALL_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Options:
    """The options every client command shares."""

    gateway: str
    scheduler: str
    api_key: str | None
    ops_key: str | None  # sent to the OpsService (dlq, queue, stats); api_key never is
    tls_ca_file: str | None
    tls_cert_file: str | None
    tls_key_file: str | None
    timeout_s: float | None  # None: unary calls take DEFAULT_CALL_TIMEOUT_S, waits are unbounded
    json: bool
    config: Path | None
    # Where each address came from, for an error about it: the flag, or the environment variable.
    gateway_from: str = "--gateway"
    scheduler_from: str = "--scheduler"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Options:
        gateway, gateway_from = _address(args, "gateway", "ASYNCINFER_GATEWAY_ADDRESS", DEFAULT_GATEWAY)
        scheduler, scheduler_from = _address(args, "scheduler", "ASYNCINFER_SCHEDULER_ADDRESS", DEFAULT_SCHEDULER)
        return cls(
            gateway=gateway,
            scheduler=scheduler,
            api_key=getattr(args, "api_key", None) or os.environ.get("ASYNCINFER_API_KEY") or None,
            ops_key=getattr(args, "ops_key", None) or os.environ.get("ASYNCINFER_OPS_KEY") or None,
            tls_ca_file=getattr(args, "tls_ca", None) or os.environ.get("ASYNCINFER_TLS_CA_FILE") or None,
            tls_cert_file=getattr(args, "tls_cert", None) or os.environ.get("ASYNCINFER_TLS_CERT_FILE") or None,
            tls_key_file=getattr(args, "tls_key", None) or os.environ.get("ASYNCINFER_TLS_KEY_FILE") or None,
            timeout_s=getattr(args, "timeout", None),
            json=bool(getattr(args, "json", False)),
            config=getattr(args, "config", None),
            gateway_from=gateway_from,
            scheduler_from=scheduler_from,
        )

    @property
    def gateway_target(self) -> str:
        """--gateway, or a UsageError naming where it came from if gRPC can never reach it."""
        return _reachable(self.gateway, self.gateway_from)

    @property
    def scheduler_target(self) -> str:
        """--scheduler, or a UsageError naming where it came from if gRPC can never reach it."""
        return _reachable(self.scheduler, self.scheduler_from)

    @property
    def call_timeout_s(self) -> float:
        return self.timeout_s if self.timeout_s is not None else DEFAULT_CALL_TIMEOUT_S

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca_file or self.tls_cert_file or self.tls_key_file)

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials when a --tls-* option is given (the same CA for gateway and scheduler)."""
        if not self.tls:
            return None
        return tls_credentials(ca_file=self.tls_ca_file, cert_file=self.tls_cert_file, key_file=self.tls_key_file)

    def client(self) -> AsyncClient:
        """A client of the gateway; make it inside the running event loop, and close it."""
        return AsyncClient(
            self.gateway_target,
            api_key=sendable_key(self.api_key, "ASYNCINFER_API_KEY"),
            timeout_s=self.call_timeout_s,
            credentials=self.credentials(),
            # At a command line a name DNS says does not exist is a typo: said at once, where the
            # SDK's default retries it (a program may start before its gateway's name exists).
            retry=RetryPolicy(retry_no_such_host=False, on_retry=say_retrying(self.gateway)),
        )


def _address(args: argparse.Namespace, flag: str, variable: str, default: str) -> tuple[str, str]:
    """An address and where it came from: the flag, else the environment variable, else the default."""
    if given := getattr(args, flag, None):
        return given, f"--{flag}"
    if from_environment := os.environ.get(variable):
        return from_environment, variable
    return default, f"--{flag}"


def sendable_key(key: str | None, variable: str) -> str | None:
    """The key, or a UsageError where it cannot be sent (the flag's type checks it as given: this
    is for the environment variable's)."""
    problem = header_problem(key) if key is not None else None
    if problem is not None:
        raise UsageError(f"{variable}: {problem}")
    return key


def _reachable(address: str, where: str) -> str:
    try:
        address.encode()
    except UnicodeEncodeError:  # the environment's bytes, not UTF-8 (the flag's type checks its own)
        raise UsageError(f"{where}={address!r} is not UTF-8 text") from None
    problem = target_problem(address)
    if problem is not None:
        separator = " " if where.startswith("--") else "="
        raise UsageError(f"{where}{separator}{address!r}: {problem}; give {FORMS}")
    return address


Handler = Callable[[argparse.Namespace, Options], Coroutine[Any, Any, int]]


def nothing_listens(error: AsyncInferClientError) -> bool:
    """Whether `error` is a connection refused: nothing listens there (the stack down, or starting),
    so nothing was sent."""
    return error.code is grpc.StatusCode.UNAVAILABLE and REFUSED in error.message


def say_retrying(address: str) -> Callable[[AsyncInferClientError, float], None]:
    """Says on stderr, once, that the gateway (or the scheduler) does not answer and the call is
    tried again (the SDK's retries were seconds of silence before the error and its hint)."""
    said = False

    def say(error: AsyncInferClientError, _delay_s: float) -> None:
        nonlocal said
        # Only where nothing listens (the stack down, or starting): a TLS mismatch or another
        # service answers at once, and its hint says what to check.
        if not said and nothing_listens(error):
            said = True
            print(f"asyncinfer: {address} does not answer yet; trying again for a few seconds", file=sys.stderr)

    return say
