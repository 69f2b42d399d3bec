"""The options every client command shares (--gateway, --scheduler, --api-key, --timeout, --json,
--config), as the handlers receive them."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncinfer.client import AsyncClient

DEFAULT_GATEWAY = "127.0.0.1:50051"
DEFAULT_SCHEDULER = "127.0.0.1:50052"
DEFAULT_CALL_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Options:
    """The options every client command shares."""

    gateway: str
    scheduler: str
    api_key: str | None
    timeout_s: float | None  # None: unary calls take DEFAULT_CALL_TIMEOUT_S, waits are unbounded
    json: bool
    config: Path | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Options:
        return cls(
            gateway=getattr(args, "gateway", None) or os.environ.get("ASYNCINFER_GATEWAY_ADDRESS") or DEFAULT_GATEWAY,
            scheduler=getattr(args, "scheduler", None)
            or os.environ.get("ASYNCINFER_SCHEDULER_ADDRESS")
            or DEFAULT_SCHEDULER,
            api_key=getattr(args, "api_key", None) or os.environ.get("ASYNCINFER_API_KEY") or None,
            timeout_s=getattr(args, "timeout", None),
            json=bool(getattr(args, "json", False)),
            config=getattr(args, "config", None),
        )

    @property
    def call_timeout_s(self) -> float:
        return self.timeout_s if self.timeout_s is not None else DEFAULT_CALL_TIMEOUT_S

    def client(self) -> AsyncClient:
        """A client of the gateway; make it inside the running event loop, and close it."""
        return AsyncClient(self.gateway, api_key=self.api_key, timeout_s=self.call_timeout_s)


Handler = Callable[[argparse.Namespace, Options], Coroutine[Any, Any, int]]
