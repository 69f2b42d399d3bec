"""The shared building blocks: IDs, tensors, the record codec, config, and the NATS bootstrap
against a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import pty
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import structlog

from asyncinfer.codecs.record import decode_record, encode_record
from asyncinfer.config import Config, NatsConfig, load_config, render_default_config
from asyncinfer.declarations import ensure_jobs_bucket, ensure_work_consumer, ensure_work_stream
from asyncinfer.embedded_nats import EPHEMERAL_RANGE_FILE, NatsServerProcess, free_port
from asyncinfer.errors import ConfigError, InvalidArgument, Unavailable
from asyncinfer.failure_lines import FailureLines
from asyncinfer.ids import is_job_id, job_id_time_ms, new_job_id
from asyncinfer.jobs import JobRecord, JobState, Priority, work_subject
from asyncinfer.log_throttle import RepeatedLines, Throttle
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import streams
from asyncinfer.nats.connection import FIRST_CONNECT_ATTEMPTS, connect
from asyncinfer.ports import IN_USE, BusyPort, PortUse, busy_ports
from asyncinfer.supervision import outcome_seen
from asyncinfer.tensor_codec import decode_tensors, to_input_proto, to_output_proto
from asyncinfer.tensors import NUMPY_DTYPES, ModelSignature, Tensor, TensorSpec, validate_inputs
from asyncinfer.v1 import tensor_pb2

# Also run with the NATS adapter's fast path off (make pytest-nats-fallback).
pytestmark = pytest.mark.nats_fallback


@pytest.mark.unit
def test_job_ids_are_uuid7_and_sort_by_time() -> None:
    ids = [new_job_id() for _ in range(5000)]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    assert all(is_job_id(i) for i in ids)
    assert job_id_time_ms(ids[0]) <= job_id_time_ms(ids[-1])
    assert not is_job_id("not-a-uuid")


@pytest.mark.unit
def test_free_ports_picked_one_after_another_are_distinct() -> None:
    """The OS may hand out the port it just freed again: a test that picked nats's and the
    batcher's ports in a row once got the same one twice, and `up` refused the configuration."""
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


@pytest.mark.unit
@pytest.mark.skipif(not EPHEMERAL_RANGE_FILE.exists(), reason="Linux's ip_local_port_range")
def test_free_ports_are_outside_the_range_outgoing_connections_are_bound_in() -> None:
    """A test that killed a service and started it again on its picked port saw it exit at once
    now and then on a busy machine: a port from the ephemeral range (what bind to port 0 gives) may
    be taken meanwhile by any process's outgoing connection, and stays taken in TIME_WAIT after it
    closes, where nothing can listen on it (the service's own check says IN_USE)."""
    first, last = (int(n) for n in EPHEMERAL_RANGE_FILE.read_text().split())
    ports = [free_port() for _ in range(200)]
    assert [p for p in ports if first <= p <= last] == []
    # Why: a connection's local port, closed from its side (TIME_WAIT), cannot be listened on.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname()[:2])
        accepted, _ = listener.accept()
        port = client.getsockname()[1]
        client.close()
        accepted.close()
    assert first <= port <= last
    use = PortUse("batcher.port", "127.0.0.1", port)
    assert busy_ports([use]) == [BusyPort(use, IN_USE)]


@pytest.mark.unit
def test_tensor_round_trips_numpy_and_protobuf() -> None:
    x = Tensor.from_numpy("x", np.arange(8, dtype=np.float32).reshape(2, 4))
    typed = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[2, 4])
    typed.contents.fp32_contents.extend(range(8))
    assert decode_tensors([typed]) == [x]
    assert decode_tensors([to_input_proto(x)]) == [x]
    texts = Tensor.from_numpy("t", np.array([b"a", "b\u00e9"], dtype=object))
    assert texts.to_numpy().tolist() == [b"a", "b\u00e9".encode()]
    out = to_output_proto(texts)
    assert list(out.contents.bytes_contents) == [b"a", "b\u00e9".encode()]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("datatype", "field", "values"),
    [
        ("FP32", "fp32_contents", [0.0, -1.5, 3.4e38, float("inf"), 1e-45]),
        ("FP64", "fp64_contents", [0.0, -1.5, 1.7e308, 5e-324]),
        ("INT32", "int_contents", [0, -(2**31), 2**31 - 1]),
        ("INT64", "int64_contents", [0, -(2**63), 2**63 - 1]),
        ("UINT32", "uint_contents", [0, 2**32 - 1]),
        ("UINT64", "uint64_contents", [0, 2**64 - 1]),
        ("INT8", "int_contents", [-128, 127]),
        ("UINT16", "uint_contents", [0, 65535]),
        ("BOOL", "bool_contents", [True, False]),
    ],
)
def test_typed_contents_decode_to_the_little_endian_bytes_numpy_writes(
    datatype: str, field: str, values: list[float]
) -> None:
    """Typed contents are packed by array.array where it can (tensor_codec): the bytes are numpy's."""
    message = tensor_pb2.InferInputTensor(name="x", datatype=datatype, shape=[len(values)])
    getattr(message.contents, field).extend(values)
    (tensor,) = decode_tensors([message])
    stored = list(getattr(message.contents, field))  # as the field holds them (FP32: rounded)
    assert tensor.data == np.asarray(stored, dtype=NUMPY_DTYPES[datatype]).tobytes()
    assert tensor.to_numpy().tolist() == np.asarray(stored, dtype=NUMPY_DTYPES[datatype]).tolist()


@pytest.mark.unit
def test_invalid_tensors_name_the_field() -> None:
    wrong_field = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    wrong_field.contents.int64_contents.extend([1, 2, 3, 4])
    bad_type = tensor_pb2.InferInputTensor(name="z", datatype="FLOAT", shape=[1])
    with pytest.raises(InvalidArgument) as info:
        decode_tensors([wrong_field, bad_type])
    fields = [v.field for v in info.value.violations]
    assert fields == ["inputs[0].contents.int64_contents", "inputs[1].datatype"]


def good_m() -> Tensor:
    return Tensor.from_numpy("m", np.zeros(2, np.int64))


@pytest.mark.unit
def test_validate_inputs_reports_each_problem() -> None:
    signature = ModelSignature(
        inputs=(TensorSpec("x", "FP32", (-1, 4)), TensorSpec("m", "INT64", (-1,))),
        outputs=(TensorSpec("y", "FP32", (-1, 4)),),
    )
    good = Tensor.from_numpy("x", np.zeros((2, 4), np.float32))
    assert validate_inputs([good, Tensor.from_numpy("m", np.zeros(2, np.int64))], signature, max_batch_size=8) == []
    short = Tensor("x", "FP32", (2, 4), b"\0" * 12)
    problems = validate_inputs([short, Tensor.from_numpy("q", np.zeros(1))], signature, max_batch_size=8)
    descriptions = " | ".join(f"{v.field}: {v.description}" for v in problems)
    assert "inputs[0].contents" in descriptions
    assert "unknown input 'q'" in descriptions
    assert "missing input 'm'" in descriptions
    too_big = Tensor.from_numpy("x", np.zeros((9, 4), np.float32))
    wrong_shape = Tensor.from_numpy("m", np.zeros((9, 2), np.int64))
    problems = validate_inputs([too_big, wrong_shape], signature, max_batch_size=8)
    assert any("max_batch_size 8" in v.description for v in problems)
    assert any(v.field == "inputs[1].shape" for v in problems)
    # One item without its batch dimension (the SDK's and grpcurl's commonest mistake) is named.
    (lacking,) = validate_inputs(
        [Tensor.from_numpy("x", np.zeros(4, np.float32)), good_m()], signature, max_batch_size=8
    )
    assert lacking.description == (
        "input 'x' must have shape [-1, 4] (-1: any), got [4]: the first dimension counts the items; "
        "one item is shape [1, 4]"
    )
    (other,) = validate_inputs([Tensor.from_numpy("x", np.zeros(5, np.float32)), good_m()], signature, max_batch_size=8)
    assert other.description == "input 'x' must have shape [-1, 4] (-1: any), got [5]"


@pytest.mark.unit
def test_record_codec_round_trips() -> None:
    record = JobRecord(
        job_id=new_job_id(),
        tenant="t1",
        model_name="demo",
        model_version="1",
        state=JobState.SUCCEEDED,
        priority=Priority.HIGH,
        create_time=1.5,
        update_time=2.5,
        max_attempts=3,
        result_retention_s=60.0,
        attempt=1,
        labels={"a": "b"},
        outputs=(Tensor.from_numpy("y", np.ones((1, 4), np.float32)),),
    )
    assert decode_record(encode_record(record), revision=7) == record.evolve(revision=7)


@pytest.mark.unit
def test_default_config_renders_and_loads_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "asyncinfer.toml"
    path.write_text(render_default_config())
    assert load_config(path, environ={}) == Config()
    overridden = load_config(path, environ={"ASYNCINFER_GATEWAY__PORT": "6001", "ASYNCINFER_NATS__URL": "nats://x:1"})
    assert overridden.gateway.port == 6001
    assert overridden.nats.url == "nats://x:1"
    with pytest.raises(ConfigError, match=r"gateway\.port"):
        load_config(path, environ={"ASYNCINFER_GATEWAY__PORT": "-3"})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml", environ={})


async def test_bootstrap_is_idempotent(nc: NatsClient, config: Config) -> None:
    js = nc.jetstream()
    for _ in range(2):
        await ensure_work_stream(js, config.nats)
        jobs = await ensure_jobs_bucket(js, config.nats)
        name = await ensure_work_consumer(js, config.nats, model_name="demo", priority=Priority.HIGH, ack_wait_s=30)
    assert name == "work-demo-high"
    ack = await js.publish(work_subject("demo", Priority.HIGH), b"{}", headers={"Nats-Msg-Id": "j1"})
    dup = await js.publish(work_subject("demo", Priority.HIGH), b"{}", headers={"Nats-Msg-Id": "j1"})
    assert dup.duplicate
    assert dup.seq == ack.seq
    revision = await jobs.kv.create("t.j1", b"x")
    assert (await jobs.kv.get("t.j1")).revision == revision


async def test_connect_fails_fast_without_a_server() -> None:
    # first_connect_wait_s 0: 3 tries (the default waits 60 s for a NATS that is not up yet).
    settings = NatsConfig(url=f"nats://127.0.0.1:{free_port()}", connect_timeout_s=0.5, first_connect_wait_s=0)
    with pytest.raises(Unavailable, match="cannot connect to NATS"):
        await connect(settings, name="test")


def _server_with_a_login(tmp_path: Path, port: int = 0) -> NatsServerProcess:
    return NatsServerProcess(store_dir=tmp_path / "nats", port=port, extra_args=("--user", "u", "--pass", "secret"))


async def test_a_first_connect_with_a_wait_waits_for_the_server_and_says_so_in_one_line(tmp_path: Path) -> None:
    """nats.first_connect_wait_s: a service started before NATS answers (a pod before the NATS
    StatefulSet) keeps trying rather than exiting 69 after three tries, in one line, not one a try."""
    port = free_port()
    server = _server_with_a_login(tmp_path, port)
    settings = NatsConfig(url=f"nats://u:secret@127.0.0.1:{port}", connect_timeout_s=0.5, first_connect_wait_s=30)
    with structlog.testing.capture_logs() as logs:
        connecting = asyncio.ensure_future(connect(settings, name="test"))
        try:
            # Past the tries a first connect gets without the wait (which then gave up).
            await until(lambda: connecting.done() or failed_attempts(logs) > FIRST_CONNECT_ATTEMPTS)
            assert not connecting.done(), connecting.exception()
            await asyncio.to_thread(server.start)
            nc = await asyncio.wait_for(connecting, 10)
        finally:
            connecting.cancel()
    try:
        await nc.flush(timeout=5)
    finally:
        await nc.close()
        server.stop()
    said = [entry for entry in logs if entry["log_level"] != "debug"]
    assert [entry["event"] for entry in said] == ["nats_waiting_for_server"], said
    assert said[0]["url"] == f"nats://***@127.0.0.1:{port}", said
    assert said[0]["gives_up_after_s"] == 30


async def test_a_first_connect_gives_up_once_its_wait_has_passed() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    settings = NatsConfig(url=url, connect_timeout_s=0.5, first_connect_wait_s=1.5)
    started = time.monotonic()
    with pytest.raises(Unavailable, match=re.escape(f"cannot connect to NATS at {url}: ")):
        await connect(settings, name="test")
    assert 1.5 <= time.monotonic() - started < 5


async def test_a_first_connect_with_a_wait_still_ends_at_once_on_a_refused_login(tmp_path: Path) -> None:
    """Waiting will not change refused credentials: a configuration error (exit 2) at once."""
    server = _server_with_a_login(tmp_path)
    server.start()
    try:
        settings = NatsConfig(url=f"nats://u:wrong@127.0.0.1:{server.port}", first_connect_wait_s=30)
        started = time.monotonic()
        with pytest.raises(ConfigError, match="refused this connection's credentials"):
            await connect(settings, name="test")
        assert time.monotonic() - started < 5
    finally:
        server.stop()


async def until(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    give_up_at = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < give_up_at, "timed out"
        await asyncio.sleep(0.05)


def failed_attempts(logs: list[dict[str, object]]) -> int:
    return sum(entry["event"] == "nats_error" for entry in logs)


async def test_a_connected_client_reconnects_past_the_first_connects_attempts(
    nats_server: NatsServerProcess, config: Config
) -> None:
    """Only the first connect gives up: once connected, the client tries again for as long as the
    server is away (here twice the failed attempts a first connect gets), and is back with it."""
    nc = await connect(config.nats, name="test")
    try:
        with structlog.testing.capture_logs() as logs:
            nats_server.stop()
            # Twice the attempts a first connect gets (nats-py's own limit, had it been set, would
            # have closed the client after one more than that).
            await until(lambda: nc.is_closed or failed_attempts(logs) > 2 * FIRST_CONNECT_ATTEMPTS)
        assert not nc.is_closed
        # One warning per kind of failure, the repeats at debug (one a second for as long as it was away).
        warned = [str(e["error"]) for e in logs if e["event"] == "nats_error" and e["log_level"] == "warning"]
        assert len(warned) == len(set(warned)), warned
        nats_server.start()
        await until(lambda: nc.is_connected)
        await nc.flush(timeout=5)
    finally:
        await nc.close()


async def test_closing_a_connection_warns_of_nothing_but_losing_the_server_does(
    nats_server: NatsServerProcess, config: Config
) -> None:
    closed = await connect(config.nats, name="test")
    with structlog.testing.capture_logs() as logs:
        await closed.close()
    assert [entry for entry in logs if entry["log_level"] != "debug"] == []

    lost = await connect(config.nats, name="test")
    try:
        with structlog.testing.capture_logs() as logs:
            nats_server.stop()
            await until(lambda: any(entry["event"] == "nats_disconnected" for entry in logs))
        assert any(entry["log_level"] == "warning" and entry["event"] == "nats_disconnected" for entry in logs)
    finally:
        await lost.close()


def _listener(port: int = 0) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


@pytest.mark.unit
def test_busy_ports_finds_listeners_and_ports_configured_twice() -> None:
    with _listener() as taken, _listener() as free_later:
        taken_port, free_port_ = taken.getsockname()[1], free_later.getsockname()[1]
        free_later.close()
        uses = [
            PortUse("a.port", "127.0.0.1", taken_port),
            PortUse("b.port", "127.0.0.1", free_port_),
            PortUse("c.port", "127.0.0.1", free_port_),
            PortUse("d.port", "127.0.0.1", 0),  # any free port: never busy
        ]
        busy = busy_ports(uses)
    assert [(b.use.setting, b.why) for b in busy] == [("a.port", IN_USE), ("c.port", "configured twice (also b.port)")]
    assert busy_ports(uses[1:2]) == []  # the probe let go of what it bound


@pytest.mark.unit
def test_busy_ports_does_not_count_a_port_a_stopped_server_left_in_time_wait() -> None:
    # A stack stopped a moment ago leaves its servers' ends of closed connections in TIME_WAIT;
    # the servers rebind such a port (SO_REUSEADDR) and the check must not refuse it either.
    with _listener() as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()  # the server side closes first: its end goes to TIME_WAIT
            client.recv(1)
    assert busy_ports([PortUse("gateway.port", "127.0.0.1", port)]) == []


LOG_ONE_LINE = """
from asyncinfer.config import LoggingConfig
from asyncinfer.logs import configure_logging
import logging, structlog
configure_logging(LoggingConfig(format="auto"), service="gateway")
structlog.get_logger("t").warning("something_happened", n=1)
logging.getLogger("grpc").warning("from a library")
"""


def test_logs_are_console_lines_on_a_terminal_and_json_otherwise() -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    piped = subprocess.run(
        [sys.executable, "-c", LOG_ONE_LINE], capture_output=True, text=True, env=env, timeout=60, check=True
    )
    lines = [json.loads(line) for line in piped.stderr.splitlines()]
    assert [(line["event"], line["service"], line["level"]) for line in lines] == [
        ("something_happened", "gateway", "warning"),
        ("from a library", "gateway", "warning"),
    ]

    controller, terminal = pty.openpty()
    try:
        on_terminal = subprocess.run(
            [sys.executable, "-c", LOG_ONE_LINE], stderr=terminal, env=env, timeout=60, check=True
        )
        assert on_terminal.returncode == 0
        os.close(terminal)
        terminal = -1
        written = b""
        with contextlib.suppress(OSError):  # EIO once the terminal's other end is closed
            while chunk := os.read(controller, 4096):
                written += chunk
    finally:
        os.close(controller)
        if terminal != -1:
            os.close(terminal)
    text = re.sub(r"\x1b\[[0-9;]*m", "", written.decode())
    assert "{" not in text, text
    assert re.search(r"\[warning\s*\] something_happened\s+\[gateway\]\s+n=1", text), text
    assert "from a library" in text


LOG_AN_EXCEPTION = """
from asyncinfer.config import LoggingConfig
from asyncinfer.logs import configure_logging
import logging, structlog
configure_logging(LoggingConfig(format="console"), service="gateway")

def connect(url):
    nats_password = "hunter2-in-a-local"
    raise ConnectionError(f"cannot reach {url}")

for log in (structlog.get_logger("t"), logging.getLogger("nats")):
    try:
        connect("nats://127.0.0.1:4222")
    except ConnectionError:
        log.exception("connect_failed")
"""


def test_a_logged_exception_is_drawn_without_its_frames_locals() -> None:
    """A console line's traceback was Rich's with every frame's locals: 0.25-1.5 s of CPU each on
    the event loop (a burst froze a process for 100 s), and whatever a frame held (a password, an
    API key) printed to the terminal. It is the standard library's traceback now."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    ran = subprocess.run(
        [sys.executable, "-c", LOG_AN_EXCEPTION], capture_output=True, text=True, env=env, timeout=60, check=True
    )
    assert "hunter2" not in ran.stderr, ran.stderr
    assert ran.stderr.count("connect_failed") == 2, ran.stderr
    assert ran.stderr.count("ConnectionError: cannot reach nats://127.0.0.1:4222") == 2, ran.stderr
    assert ran.stderr.count("line 9, in connect") == 2, ran.stderr  # where it was raised


@pytest.mark.unit
def test_the_tests_own_log_lines_draw_tracebacks_without_locals(capsys: pytest.CaptureFixture[str]) -> None:
    """The services a test runs in its own process log through the tests' structlog configuration
    (tests/conftest.py), whose tracebacks are drawn as the services' (no locals)."""

    def connect() -> None:
        api_key = "ak_live_in_a_local"
        raise ConnectionError(f"refused with a key of {len(api_key)} characters")

    try:
        connect()
    except ConnectionError:
        structlog.get_logger("test").exception("connect_failed")
    out = capsys.readouterr().out
    assert "ConnectionError: refused with a key of 18 characters" in out, out
    assert "ak_live" not in out, out


@pytest.mark.unit
async def test_a_shielded_tasks_failure_its_caller_left_is_not_logged_as_never_retrieved() -> None:
    """The gateway's submits run shielded from their callers; one whose caller's deadline passed
    and which then failed (NATS electing a leader) logged "Task exception was never retrieved"
    with a traceback, ~170 a minute in the failover pass (session 25)."""
    loop = asyncio.get_running_loop()
    logged: list[str] = []
    loop.set_exception_handler(lambda _loop, context: logged.append(context["message"]))
    try:

        async def fails() -> None:
            raise RuntimeError("nats: timeout")

        for watched in (False, True):
            task = asyncio.ensure_future(fails())
            if watched:
                task.add_done_callback(outcome_seen)
            await asyncio.wait([task])
            del task
            gc.collect()
            assert logged == ([] if watched else ["Task exception was never retrieved"])
            logged.clear()
    finally:
        loop.set_exception_handler(None)


@pytest.mark.unit
async def test_a_declaration_waits_out_an_election_then_fails_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A service that started as a node was lost (a pod restarted during a failover) had 5 s
    (nats.connect_timeout_s) to declare its streams, then died with the NATS client's traceback."""
    monkeypatch.setattr(streams, "DECLARE_RETRY_S", 0.5)
    calls = 0

    async def elected_on_the_third_try(_timeout_s: float) -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise TimeoutError("nats: timeout")
        return "declared"

    assert await streams.declaration(elected_on_the_third_try, retry_for_s=0.01, what="declare X") == "declared"

    async def never_answers(_timeout_s: float) -> str:
        raise TimeoutError("nats: timeout")

    with pytest.raises(Unavailable, match=r"cannot declare X: JetStream did not answer for 0.5 s"):
        await streams.declaration(never_answers, retry_for_s=0.01, what="declare X")


@pytest.mark.unit
def test_failure_lines_say_nats_out_of_reach_in_a_line_and_a_bug_with_its_traceback() -> None:
    """A loop failing each round: NATS out of reach is a warning with its error, a bug its
    traceback; each at most once per interval, the next saying how many were held back. A bug
    raised elsewhere is another line."""
    now = [0.0]
    lines = FailureLines(5.0, clock=lambda: now[0])
    log = structlog.get_logger("test")

    def bug(where: int) -> RuntimeError:
        try:
            if where == 1:
                raise RuntimeError("one")
            raise RuntimeError("two")
        except RuntimeError as exc:
            return exc

    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            lines.failed(log, "x_failed", Unavailable("cannot read the job record: nats: timeout"), model="m")
            lines.failed(log, "x_failed", bug(1))
        lines.failed(log, "x_failed", bug(2))
        now[0] = 5.0
        lines.failed(log, "x_failed", Unavailable("cannot read the job record: nats: timeout"), model="m")
    assert [(e["log_level"], e.get("error"), e.get("more_since_last")) for e in logs] == [
        ("warning", "cannot read the job record: nats: timeout", None),
        ("error", None, None),
        ("error", None, None),
        ("warning", "cannot read the job record: nats: timeout", 2),
    ]
    assert [str(e["exc_info"]) for e in logs if "exc_info" in e] == ["one", "two"]
    assert logs[0]["model"] == "m"


@pytest.mark.unit
def test_repeated_lines_say_the_first_whole_then_one_an_interval_with_how_many_went_to_debug() -> None:
    now = [0.0]
    lines = RepeatedLines(5.0, clock=lambda: now[0])
    log = structlog.get_logger()
    with structlog.testing.capture_logs() as logs:
        for n in range(4):
            lines.say(log, "warning", "job_failed", kind=("m", "MODEL_ERROR"), job_id=f"j{n}")
        lines.say(log, "warning", "job_failed", kind=("other", "MODEL_ERROR"), job_id="o0")  # its own
        now[0] = 5.0
        lines.say(log, "warning", "job_failed", kind=("m", "MODEL_ERROR"), job_id="j4")
    said = [(e["log_level"], e["job_id"], e.get("more_since_last")) for e in logs]
    assert said == [
        ("warning", "j0", None),
        ("debug", "j1", None),
        ("debug", "j2", None),
        ("debug", "j3", None),
        ("warning", "o0", None),
        ("warning", "j4", 3),
    ]


@pytest.mark.unit
def test_a_throttle_lets_one_line_a_key_through_per_interval_and_counts_the_rest() -> None:
    """A pull refused while a leader was elected logged ~50 lines a second (a failover pass)."""
    now = [0.0]
    throttle = Throttle(5.0, clock=lambda: now[0])
    assert throttle.allow("a") == 0
    assert [throttle.allow("a") for _ in range(49)] == [None] * 49
    assert throttle.allow("b") == 0  # each key on its own
    now[0] = 5.0
    assert throttle.allow("a") == 49
    assert throttle.allow("a") is None
