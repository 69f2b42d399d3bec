"""Tools shared by the backlog, recovery and batching sections, on top of bench.system.common:
service configs with every port chosen up front (so a killed service can be restarted on the
same port), waiting for batchers to connect, watching job-record updates, store sizes, and a
results accumulator that prints each figure as it is made and writes through common.write_results.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from asyncinfer.codecs.record import decode_record
from asyncinfer.config import Config, ModelConfig, TensorSpecConfig
from asyncinfer.jobs import JobRecord
from asyncinfer.v1 import ops_service_pb2, ops_service_pb2_grpc
from bench.system.common import bench_config, fmt, free_port, ratio, row, write_results


def demo_model(**changes: Any) -> ModelConfig:
    """The demo model (y = 2x + 1 on FP32 [-1, 4]) with bench settings: batches up to 64 and 512
    credits, so neither limits a drain."""
    base = ModelConfig(
        name="demo",
        loader="services.batcher.models.demo:build_demo_model",
        max_batch_size=64,
        max_queue_delay_ms=2.0,
        max_queue_size=512,
        inputs=(TensorSpecConfig(name="x", datatype="FP32", shape=(-1, 4)),),
        outputs=(TensorSpecConfig(name="y", datatype="FP32", shape=(-1, 4)),),
    )
    return base.model_copy(update=changes)


def services_config(nats_url: str, models: Sequence[ModelConfig], **sections: Any) -> Config:
    """common.bench_config with these models, every gRPC port chosen now (a restarted service
    gets the same one), the batcher not connected to any scheduler (set per batcher), and the
    scheduler's idle poll at 50 ms."""
    base: dict[str, Any] = {
        "gateway": {"port": free_port()},
        "scheduler": {"port": free_port(), "poll_interval_ms": 50.0},
        "batcher": {"port": free_port(), "scheduler_address": None},
        "models": [m.model_dump() for m in models],
    }
    for key, value in sections.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
    return bench_config(nats_url, **base)


def batcher_config(config: Config, scheduler_address: str, batcher_id: str = "", metrics: bool = False) -> Config:
    """A batcher of `config` on a port of its own, connected to that scheduler."""
    return config.replace(
        batcher={
            "port": free_port(),
            "metrics_port": free_port() if metrics else 0,
            "batcher_id": batcher_id,
            "scheduler_address": scheduler_address,
        }
    )


async def connected_batchers(scheduler_address: str, model_name: str) -> int:
    """Batchers serving the model through this scheduler (its OpsService)."""
    async with grpc.aio.insecure_channel(scheduler_address) as channel:
        stub = ops_service_pb2_grpc.OpsServiceStub(channel)
        answer = await stub.GetQueueStats(ops_service_pb2.GetQueueStatsRequest(model_name=model_name), timeout=5)
    return sum(m.connected_batchers for m in answer.models if m.model_name == model_name)


async def wait_batchers(scheduler_address: str, model_name: str, count: int, timeout_s: float = 120.0) -> float:
    """Waits until `count` batchers serve the model through this scheduler; seconds waited."""
    started = time.monotonic()
    while True:
        with contextlib.suppress(grpc.aio.AioRpcError):
            if await connected_batchers(scheduler_address, model_name) >= count:
                return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"{count} batcher(s) for {model_name} not connected after {timeout_s}s")
        await asyncio.sleep(0.02)


def du_bytes(path: Path) -> int:
    """Bytes allocated on disk under path (like du -s)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


@dataclass(frozen=True)
class RecordUpdate:
    at: float  # time.monotonic() when the bench saw it
    key: str
    record: JobRecord


class RecordWatch:
    """Every job-record write from now on, with the time the bench saw it (an ordered push
    consumer on the KV bucket's subjects: a local NATS hop, well under a millisecond)."""

    def __init__(self, js: Any, bucket: str = "jobs") -> None:
        self._js = js
        self._bucket = bucket
        self.updates: list[RecordUpdate] = []
        self._subscription: Any = None
        self._listeners: list[Callable[[RecordUpdate], None]] = []

    async def start(self) -> None:
        prefix = f"$KV.{self._bucket}."

        async def on_msg(msg: Any) -> None:
            if not msg.data:  # delete / purge markers
                return
            update = RecordUpdate(time.monotonic(), msg.subject[len(prefix) :], decode_record(msg.data))
            self.updates.append(update)
            for listener in self._listeners:
                listener(update)

        self._subscription = await self._js.subscribe(
            f"{prefix}>", cb=on_msg, ordered_consumer=True, deliver_policy="new"
        )

    def listen(self, listener: Callable[[RecordUpdate], None]) -> None:
        self._listeners.append(listener)

    async def stop(self) -> None:
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.unsubscribe()


@dataclass
class Results:
    """Rows, ratios and notes of one section, printed as they are made."""

    section: str
    title: str
    quick: bool = False
    rows: list[dict[str, Any]] = field(default_factory=list)
    ratios: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)

    def row(self, name: str, runs: Sequence[float], unit: str, note: str = "") -> dict[str, Any]:
        made = row(name, runs, unit, note)
        self.rows.append(made)
        print(
            f"  {name}: {fmt(made['value'], unit)} {unit} ({fmt(made['min'], unit)}-{fmt(made['max'], unit)}, "
            f"n={made['runs']}) {note}",
            flush=True,
        )
        return made

    def ratio(self, name: str, value: float, target: str, met: bool | None) -> None:
        self.ratios.append(ratio(name, value, target, met))
        print(f"  ratio {name}: {fmt(value, 'x')} (target {target}: {met})", flush=True)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def write(self, intro: str = "") -> Path:
        _json, md = write_results(
            self.section,
            self.title,
            self.rows,
            self.ratios,
            self.notes,
            intro=intro,
            plots=self.plots,
            quick=self.quick,
        )
        return md
