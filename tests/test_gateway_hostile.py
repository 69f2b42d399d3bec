"""Hostile input: random SubmitJob requests thrown at a running gateway (real nats-server, real
gRPC server). Every answer must be a clean INVALID_ARGUMENT / NOT_FOUND / RESOURCE_EXHAUSTED, or OK
for a request that happens to be valid (then queued exactly once); never INTERNAL or UNKNOWN, never
a hang, and nothing is queued for a refused request.

The gateway runs on its own event loop in a background thread so that hypothesis can drive plain
synchronous gRPC calls at it, one example after another, against one gateway.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import struct
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf.message import DecodeError
from google.rpc import code_pb2
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asyncinfer.config import DEMO_MODEL, Config, ModelConfig, TensorSpecConfig
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.nats import JetStreamContext
from asyncinfer.nats.connection import connect
from asyncinfer.tensors import NUMPY_DTYPES, join_bytes_elements
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc, tensor_pb2
from services.gateway.app import MESSAGE_HEADROOM_BYTES, GatewayApp

T = TypeVar("T")

SUBMIT_PATH = "/asyncinfer.v1.JobService/SubmitJob"
MAX_REQUEST_BYTES = 64 * 1024  # small, so oversize requests (ours and gRPC's) stay cheap to build
GRPC_LIMIT_BYTES = MAX_REQUEST_BYTES + MESSAGE_HEADROOM_BYTES
CALL_TIMEOUT_S = 10.0
EXPLORE_EXAMPLES = int(os.environ.get("HOSTILE_EXAMPLES", "0"))
QUEUE_DEPTH = 5  # the "kitchen" model's queue limit, so that some valid submits meet RESOURCE_EXHAUSTED

# A model with one input of each interesting kind; no batcher runs, so its loader is never loaded.
KITCHEN = ModelConfig(
    name="kitchen",
    version="7",
    loader="services.batcher.models.demo:build_demo_model",
    max_batch_size=4,
    max_queue_depth=QUEUE_DEPTH,
    inputs=(
        TensorSpecConfig(name="text", datatype="BYTES", shape=(-1,)),
        TensorSpecConfig(name="small", datatype="INT8", shape=(-1, 3)),
        TensorSpecConfig(name="half", datatype="FP16", shape=(-1, -1)),
        TensorSpecConfig(name="flag", datatype="BOOL", shape=(-1, 1)),
    ),
    outputs=(TensorSpecConfig(name="y", datatype="FP32", shape=(-1, 1)),),
)
MODELS = {m.name: m for m in (DEMO_MODEL, KITCHEN)}
WEBHOOK_SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()

CLEAN_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
# Options other features own (idempotency, claim check): their own codes are theirs to test.
FEATURE_REFUSALS = {grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.ALREADY_EXISTS}
TOP_LEVEL_FIELDS = set(job_service_pb2.SubmitJobRequest.DESCRIPTOR.fields_by_name)


@dataclass
class LiveGateway:
    """A gateway serving on a loop of its own, and how to count what it queued."""

    port: int
    run: Callable[[Coroutine[Any, Any, Any]], Any]
    count_queued: Callable[[], tuple[int, int]]  # (WORK stream messages, job records)


@pytest.fixture
def live_gateway(config: Config) -> Iterator[LiveGateway]:
    cfg = config.replace(
        gateway={"max_request_bytes": MAX_REQUEST_BYTES},
        models=(DEMO_MODEL, KITCHEN),
        # Callbacks to loopback are then valid requests like any other.
        webhooks={"secrets": [{"tenant": "default", "secret": WEBHOOK_SECRET}], "allowed_networks": ["127.0.0.0/8"]},
    )
    with gateway_on_its_own_loop(cfg) as (app, run, js):

        async def count() -> tuple[int, int]:
            work = await js.stream_info(cfg.nats.work_stream)
            records = await js.stream_info(f"KV_{cfg.nats.jobs_bucket}")
            return work.state.messages, records.state.messages

        yield LiveGateway(port=app.port, run=run, count_queued=lambda: run(count()))


Run = Callable[[Coroutine[Any, Any, T]], T]


@contextlib.contextmanager
def gateway_on_its_own_loop(cfg: Config) -> Iterator[tuple[GatewayApp, Run[Any], JetStreamContext]]:
    """A gateway serving on an event loop in a background thread (hypothesis drives plain
    functions), how to run a coroutine there, and a JetStream context on that loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="gateway-loop", daemon=True)
    thread.start()

    def run(coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=30)

    try:
        app = GatewayApp(cfg)
        run(app.start())
        nc = run(connect(cfg.nats, name="hostile-test"))
        try:
            yield app, run, nc.jetstream()
        finally:
            run(app.stop(grace_s=1))
            run(nc.close())
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


# --- what a hostile client sends -------------------------------------------------------------

INT64 = st.integers(-(2**63), 2**63 - 1)
INT32 = st.integers(-(2**31), 2**31 - 1)
# Under the request size limit, so that they reach the validation (and its error messages).
HUGE_TEXT = st.sampled_from(["m" * 30_000, "é" * 15_000, "\U0001f4a5" * 7_000])
NAMES = st.one_of(
    st.sampled_from(["demo", "kitchen", "", "DEMO", "demo ", "kitchen\x00", "../demo", "*", ">"]),
    st.text(max_size=40),
    HUGE_TEXT,
)
DATATYPES = st.one_of(
    st.sampled_from([*NUMPY_DTYPES, "BYTES"]),
    st.sampled_from(["", "fp32", "FP8", "BF16", "STRING", "FP32 ", "INT128", "OBJECT"]),
    st.text(max_size=20),
    HUGE_TEXT,
)
DIMENSION = st.one_of(
    st.integers(0, 5),
    st.sampled_from([-1, -2, 2**31, 2**32 + 1, 2**62, 2**63 - 1, -(2**63)]),
    INT64,
)
SHAPES = st.one_of(
    st.lists(DIMENSION, max_size=6),
    st.builds(lambda n, d: [d] * n, st.sampled_from([64, 1000, 20_000]), st.integers(0, 3)),
    # Products that overflow int64 several times over.
    st.builds(lambda n: [2**40] * n, st.integers(2, 8)),
)
ELEMENT_BYTES = st.one_of(st.binary(max_size=12), st.sampled_from([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\x00"]))


@st.composite
def lying_bytes_elements(draw: st.DrawFn) -> bytes:
    """Triton's length-prefixed BYTES serialization, with prefixes that may lie."""
    elements = draw(st.lists(ELEMENT_BYTES, max_size=4))
    data = join_bytes_elements(elements)
    lie = draw(st.sampled_from(["none", "longer", "huge", "truncated", "trailing"]))
    if lie == "longer" and elements:
        data = struct.pack("<I", len(elements[0]) + 5) + data[4:]
    elif lie == "huge":
        data = struct.pack("<I", 2**32 - 1) + data
    elif lie == "truncated" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif lie == "trailing":
        data += b"\x01\x02"
    return data


def _typed_values(field: str) -> st.SearchStrategy[list[Any]]:
    values: dict[str, st.SearchStrategy[Any]] = {
        "bool_contents": st.booleans(),
        "int_contents": st.one_of(st.integers(-130, 300), INT32),
        "int64_contents": INT64,
        "uint_contents": st.integers(0, 2**32 - 1),
        "uint64_contents": st.integers(0, 2**64 - 1),
        "fp32_contents": st.floats(width=32),
        "fp64_contents": st.floats(),
        "bytes_contents": ELEMENT_BYTES,
    }
    return st.lists(values[field], max_size=12)


CONTENT_FIELDS = [f.name for f in tensor_pb2.InferTensorContents.DESCRIPTOR.fields]


@st.composite
def fitting_tensor(draw: st.DrawFn, spec: TensorSpecConfig, rows: int) -> tensor_pb2.InferInputTensor:
    """A tensor that fits its spec (the batch dimension is `rows`), raw or typed."""
    shape = [rows] + [draw(st.integers(1, 3)) if d == -1 else d for d in spec.shape[1:]]
    count = 1
    for d in shape:
        count *= d
    tensor = tensor_pb2.InferInputTensor(name=spec.name, datatype=spec.datatype, shape=shape)
    if spec.datatype == "BYTES":
        elements = draw(st.lists(ELEMENT_BYTES, min_size=count, max_size=count))
        if draw(st.booleans()):
            tensor.raw_contents = join_bytes_elements(elements)
        else:
            tensor.contents.bytes_contents.extend(elements)
    elif spec.datatype == "FP16" or draw(st.booleans()):
        size = count * NUMPY_DTYPES[spec.datatype].itemsize
        tensor.raw_contents = draw(st.binary(min_size=size, max_size=size))
    elif spec.datatype == "FP32":
        tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), min_size=count, max_size=count)))
    elif spec.datatype == "INT8":
        tensor.contents.int_contents.extend(draw(st.lists(st.integers(-128, 127), min_size=count, max_size=count)))
    elif spec.datatype == "BOOL":
        tensor.contents.bool_contents.extend(draw(st.lists(st.booleans(), min_size=count, max_size=count)))
    return tensor


@st.composite
def random_tensor(draw: st.DrawFn, model: ModelConfig | None) -> tensor_pb2.InferInputTensor:
    spec_names = [s.name for s in model.inputs] if model else []
    tensor = tensor_pb2.InferInputTensor(
        name=draw(st.one_of(st.sampled_from([*spec_names, "x", ""]), st.text(max_size=20), HUGE_TEXT)),
        datatype=draw(DATATYPES),
        shape=draw(SHAPES),
    )
    kind = draw(st.sampled_from(["raw", "typed", "typed", "both", "none", "bytes"]))
    if kind in ("raw", "both"):
        tensor.raw_contents = draw(st.binary(max_size=64))
    if kind in ("typed", "both"):
        field = draw(st.sampled_from(CONTENT_FIELDS))
        getattr(tensor.contents, field).extend(draw(_typed_values(field)))
    if kind == "bytes":
        tensor.raw_contents = draw(lying_bytes_elements())
    return tensor


@st.composite
def mutated_tensor(draw: st.DrawFn, tensor: tensor_pb2.InferInputTensor) -> tensor_pb2.InferInputTensor:
    """A fitting tensor with one thing wrong (or, sometimes, nothing)."""
    mutation = draw(st.sampled_from(["none", "datatype", "shape", "dim", "raw", "typed", "drop", "name"]))
    tensor = tensor_pb2.InferInputTensor.FromString(tensor.SerializeToString())
    if mutation == "datatype":
        tensor.datatype = draw(DATATYPES)
    elif mutation == "shape":
        tensor.ClearField("shape")
        tensor.shape.extend(draw(SHAPES))
    elif mutation == "dim" and tensor.shape:
        tensor.shape[draw(st.integers(0, len(tensor.shape) - 1))] = draw(DIMENSION)
    elif mutation == "raw":
        tensor.ClearField("contents")
        tensor.raw_contents = draw(st.one_of(st.binary(max_size=40), lying_bytes_elements()))
    elif mutation == "typed":
        field = draw(st.sampled_from(CONTENT_FIELDS))
        getattr(tensor.contents, field).extend(draw(_typed_values(field)))
    elif mutation == "drop":
        tensor.ClearField("contents")
        tensor.ClearField("raw_contents")
    elif mutation == "name":
        tensor.name = draw(NAMES)
    return tensor


@st.composite
def model_inputs(draw: st.DrawFn, model: ModelConfig | None) -> list[tensor_pb2.InferInputTensor]:
    if model is None or draw(st.integers(0, 4)) == 0:
        return draw(st.lists(random_tensor(model), max_size=4))
    rows = draw(st.sampled_from([1, 1, 2, model.max_batch_size, model.max_batch_size + 1, 0]))
    tensors = [draw(fitting_tensor(spec, rows)) for spec in model.inputs]
    if draw(st.booleans()):
        index = draw(st.integers(0, len(tensors) - 1))
        tensors[index] = draw(mutated_tensor(tensors[index]))
    if draw(st.integers(0, 9)) == 0:
        tensors.append(draw(st.one_of(random_tensor(model), st.sampled_from(tensors))))
    tensors = draw(st.permutations(tensors))
    if draw(st.integers(0, 9)) == 0:
        tensors = tensors * draw(st.sampled_from([2, 3000]))  # duplicates, many of them
    return tensors


LABEL_TEXT = st.one_of(st.text(max_size=10), st.text(min_size=60, max_size=300), st.just("ключ-\U0001f511"))
LABELS = st.one_of(
    st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=3),
    st.dictionaries(LABEL_TEXT, LABEL_TEXT, max_size=20),
    st.builds(
        lambda n, width: {f"k{i}" + "x" * width: "v" * width for i in range(n)},
        st.sampled_from([17, 2000]),
        st.sampled_from([1, 70, 300]),
    ),
)


@st.composite
def timestamp(draw: st.DrawFn) -> Any:
    from google.protobuf import timestamp_pb2

    seconds = draw(
        st.one_of(st.integers(1_700_000_000, 2_100_000_000), INT64, st.sampled_from([0, 253402300799, 253402300800]))
    )
    nanos = draw(st.one_of(st.integers(0, 999_999_999), INT32, st.just(999_999_999)))
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)


@st.composite
def duration(draw: st.DrawFn) -> Any:
    from google.protobuf import duration_pb2

    seconds = draw(st.one_of(st.integers(-5, 100_000), INT64, st.sampled_from([315_576_000_000, 315_576_000_001])))
    nanos = draw(st.one_of(st.integers(0, 999_999_999), INT32, st.just(999_999_999)))
    return duration_pb2.Duration(seconds=seconds, nanos=nanos)


CALLBACK_URLS = st.sampled_from(
    [
        "http://127.0.0.1:9/hook",
        "not a url",
        "http://[::1",
        "ftp://example.invalid/x",
        "https://",
        "http://127.0.0.1:99999/",
    ]
)


@st.composite
def valid_request(draw: st.DrawFn) -> job_service_pb2.SubmitJobRequest:
    """A request the gateway must accept (unless the model's queue is full)."""
    model = MODELS[draw(st.sampled_from(sorted(MODELS)))]
    rows = draw(st.integers(1, model.max_batch_size))
    request = job_service_pb2.SubmitJobRequest(
        model_name=model.name,
        inputs=[draw(fitting_tensor(spec, rows)) for spec in model.inputs],
        priority=draw(st.sampled_from(list(job_pb2.Priority.values()))),
        labels=draw(st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=3)),
        max_attempts=draw(st.integers(0, model.max_attempts_limit)),
    )
    if draw(st.booleans()):
        request.queue_ttl.FromSeconds(draw(st.integers(1, 10**6)))
    return request


@st.composite
def submit_request(draw: st.DrawFn) -> job_service_pb2.SubmitJobRequest:
    if draw(st.integers(0, 4)) == 0:
        return draw(valid_request())
    name = draw(st.one_of(st.sampled_from(["demo", "kitchen"]), NAMES))
    request = job_service_pb2.SubmitJobRequest(model_name=name)
    request.inputs.extend(draw(model_inputs(MODELS.get(name))))
    if draw(st.integers(0, 3)) == 0:
        request.model_version = draw(st.one_of(st.sampled_from(["1", "7", "2"]), NAMES))
    if draw(st.booleans()):
        request.priority = draw(st.one_of(st.integers(0, 4), INT32))  # type: ignore[assignment]
    if draw(st.booleans()):
        request.labels.update(draw(LABELS))
    if draw(st.integers(0, 3)) == 0:
        request.deadline.CopyFrom(draw(timestamp()))
    if draw(st.integers(0, 3)) == 0:
        request.queue_ttl.CopyFrom(draw(duration()))
    if draw(st.integers(0, 3)) == 0:
        request.execution_timeout.CopyFrom(draw(duration()))
    if draw(st.integers(0, 3)) == 0:
        request.result_retention.CopyFrom(draw(duration()))
    if draw(st.integers(0, 3)) == 0:
        request.max_attempts = draw(st.one_of(st.integers(-1, 12), INT32))
    if draw(st.integers(0, 5)) == 0:
        request.callback.url = draw(CALLBACK_URLS)
        request.callback.events.extend(draw(st.lists(st.one_of(st.integers(0, 4), INT32), max_size=3)))  # type: ignore[arg-type]
    return request


def unknown_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field the schema does not have."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


class Payload(bytes):
    """Bytes whose repr stays short, for hypothesis's report of a failing example."""

    def __repr__(self) -> str:
        head = bytes(self[:160])
        return f"Payload({head!r}{'...' if len(self) > 160 else ''}, {len(self)} bytes)"


@st.composite
def wire_payload(draw: st.DrawFn) -> Payload:
    """A serialized request, sometimes oversize, with unknown fields or garbage appended."""
    payload = draw(submit_request()).SerializeToString()
    tail = draw(st.sampled_from(["none"] * 5 + ["unknown", "garbage", "oversize", "grpc-oversize", "bad-utf8"]))
    if tail == "unknown":
        payload += unknown_field(draw(st.integers(100, 2**29 - 1)), draw(st.binary(max_size=32)))
    elif tail == "garbage":
        payload += draw(st.binary(min_size=1, max_size=32))
    elif tail == "oversize":
        payload += unknown_field(999, bytes(draw(st.integers(MAX_REQUEST_BYTES, GRPC_LIMIT_BYTES - 1024))))
    elif tail == "grpc-oversize":
        payload += unknown_field(999, bytes(GRPC_LIMIT_BYTES + draw(st.integers(1, 4096))))
    elif tail == "bad-utf8":
        payload += unknown_field(1, b"demo\xff") if draw(st.booleans()) else unknown_field(12, b"\x0a\x02\xc3\x28")
    return Payload(payload)


# --- the properties ----------------------------------------------------------------------------


def parse(payload: bytes) -> job_service_pb2.SubmitJobRequest | None:
    """The request as the gateway sees it, or None when it is not a valid SubmitJobRequest."""
    try:
        return job_service_pb2.SubmitJobRequest.FromString(payload)
    except DecodeError:
        return None


def check_refusal(error: grpc.RpcError, request: job_service_pb2.SubmitJobRequest | None, size: int) -> None:
    code = error.code()
    details = error.details() or ""
    allowed = set(CLEAN_REFUSALS)
    if request is not None and (request.idempotency_key or request.input_ref):
        allowed |= FEATURE_REFUSALS
    assert code in allowed, f"{code}: {details[:300]}"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and size <= GRPC_LIMIT_BYTES:
        # Ours (a full queue) rather than gRPC's transport giving up on the answer (an error
        # message too large for the trailers reads the same).
        assert "metadata" not in details, details[:300]
        reason = unpack_details(status_details(error))["ErrorInfo"].reason  # type: ignore[arg-type]
        assert reason == "QUEUE_FULL", reason
    if code == grpc.StatusCode.INVALID_ARGUMENT and request is not None:
        status = status_details(error)  # type: ignore[arg-type]
        assert status is not None
        assert status.code == code_pb2.INVALID_ARGUMENT
        bad = unpack_details(status).get("BadRequest")
        assert bad is not None, details[:300]
        assert bad.field_violations, details[:300]
        for violation in bad.field_violations:
            top = violation.field.split(".")[0].split("[")[0]
            assert top in TOP_LEVEL_FIELDS, f"violation names no request field: {violation.field!r}"


@given(payload=wire_payload())
@settings(
    # HOSTILE_EXAMPLES=5000 explores further, with a fresh random seed each run.
    max_examples=EXPLORE_EXAMPLES or 250,
    deadline=None,
    derandomize=not EXPLORE_EXAMPLES,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
def test_hostile_submits_are_refused_cleanly_and_queue_nothing(live_gateway: LiveGateway, payload: bytes) -> None:
    request = parse(bytes(payload))
    before = live_gateway.count_queued()
    with grpc.insecure_channel(f"127.0.0.1:{live_gateway.port}") as channel:
        submit = channel.unary_unary(
            SUBMIT_PATH, request_serializer=None, response_deserializer=job_service_pb2.SubmitJobResponse.FromString
        )
        refused: grpc.RpcError | None = None
        try:
            response = submit(bytes(payload), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as error:
            refused = error
    if refused is not None:
        event(f"refused: {refused.code().name}")
        assert refused.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "the gateway hung"
        check_refusal(refused, request, len(payload))
        assert live_gateway.count_queued() == before, "a refused request queued something"
        return
    event("accepted")
    assert request is not None, "an unparseable request was accepted"
    assert response.job.state == job_pb2.JOB_STATE_QUEUED
    assert response.job.model_name == request.model_name
    work, records = before
    assert live_gateway.count_queued() == (work + 1, records), "an accepted job is queued exactly once (one write)"


def test_the_gateway_still_serves_after_hostile_input(live_gateway: LiveGateway) -> None:
    garbage = [b"\xff" * 7, unknown_field(1, b"\xc3\x28"), b"\x0a\x80\x80\x80\x80\x10"]
    with grpc.insecure_channel(f"127.0.0.1:{live_gateway.port}") as channel:
        submit = channel.unary_unary(
            SUBMIT_PATH, request_serializer=None, response_deserializer=job_service_pb2.SubmitJobResponse.FromString
        )
        for payload in garbage:
            with pytest.raises(grpc.RpcError):
                submit(payload, timeout=CALL_TIMEOUT_S)
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4], raw_contents=bytes(16))
        accepted = stub.SubmitJob(job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[x]), timeout=5)
        assert accepted.job.state == job_pb2.JOB_STATE_QUEUED
    assert live_gateway.count_queued() == (1, 0)


# --- regressions: what the property above found, one plain test each --------------------------


def refusal(live_gateway: LiveGateway, request: job_service_pb2.SubmitJobRequest) -> grpc.RpcError:
    """The gateway's refusal of `request`, after checking that it queued nothing."""
    before = live_gateway.count_queued()
    with grpc.insecure_channel(f"127.0.0.1:{live_gateway.port}") as channel, pytest.raises(grpc.RpcError) as info:
        job_service_pb2_grpc.JobServiceStub(channel).SubmitJob(request, timeout=CALL_TIMEOUT_S)
    assert live_gateway.count_queued() == before
    return info.value


def violated_fields(error: grpc.RpcError) -> list[str]:
    bad = unpack_details(status_details(error))["BadRequest"]  # type: ignore[arg-type]
    return [v.field for v in bad.field_violations]


def demo_input() -> tensor_pb2.InferInputTensor:
    return tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4], raw_contents=bytes(16))


def test_typed_values_out_of_their_datatypes_range_are_refused(live_gateway: LiveGateway) -> None:
    # int_contents carries 32 bits: 300 in an INT8 tensor used to wrap silently (to 44).
    request = job_service_pb2.SubmitJobRequest(model_name="kitchen")
    for spec in KITCHEN.inputs:
        tensor = request.inputs.add(name=spec.name, datatype=spec.datatype, shape=[1, *[1] * (len(spec.shape) - 1)])
        tensor.raw_contents = (
            join_bytes_elements([b"a"]) if spec.datatype == "BYTES" else bytes(NUMPY_DTYPES[spec.datatype].itemsize)
        )
    small = next(t for t in request.inputs if t.name == "small")
    small.shape[:] = [1, 3]
    small.ClearField("raw_contents")
    small.contents.int_contents.extend([1, 300, -129])
    error = refusal(live_gateway, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    index = list(request.inputs).index(small)
    assert violated_fields(error) == [f"inputs[{index}].contents.int_contents"]
    assert "[-128, 127]" in (error.details() or "")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("deadline", {"seconds": 2**62}),
        ("deadline", {"seconds": 2_000_000_000, "nanos": -1}),
        ("deadline", {"seconds": 253402300799, "nanos": 999_999_999}),  # rounds past 9999 as a float
        ("execution_timeout", {"seconds": 315_576_000_000, "nanos": 999_999_999}),
        ("queue_ttl", {"seconds": 300_000_000_000}),  # valid as a duration, but ends after 9999
        ("queue_ttl", {"seconds": 2**62}),
        ("execution_timeout", {"seconds": 2**62}),
        ("execution_timeout", {"seconds": 5, "nanos": -3}),
        ("result_retention", {"seconds": -(2**62)}),
    ],
)
def test_timestamps_and_durations_out_of_range_are_refused(
    live_gateway: LiveGateway, field: str, value: dict[str, int]
) -> None:
    # These used to be accepted (or to fail in the answer, after queuing): INTERNAL/UNKNOWN.
    request = job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[demo_input()])
    getattr(request, field).MergeFrom(type(getattr(request, field))(**value))
    error = refusal(live_gateway, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert violated_fields(error) == [field]


def test_a_far_but_valid_deadline_is_accepted_and_answered(live_gateway: LiveGateway) -> None:
    request = job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[demo_input()])
    request.deadline.seconds = 253402300799  # 9999-12-31T23:59:59Z
    with grpc.insecure_channel(f"127.0.0.1:{live_gateway.port}") as channel:
        job = job_service_pb2_grpc.JobServiceStub(channel).SubmitJob(request, timeout=CALL_TIMEOUT_S).job
    assert abs(job.deadline.ToNanoseconds() / 1e9 - 253402300799) < 1e-3  # float seconds inside
    assert live_gateway.count_queued() == (1, 0)


def test_an_unparseable_callback_url_is_refused(live_gateway: LiveGateway) -> None:
    request = job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[demo_input()])
    request.callback.url = "http://[::1"  # urlsplit raises ValueError
    error = refusal(live_gateway, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violated_fields(error) == ["callback.url"]


def test_refusals_quoting_huge_input_still_reach_the_client(live_gateway: LiveGateway) -> None:
    # Errors quote names, datatypes and shapes; unbounded, their trailers passed the client's
    # metadata limit and it saw RESOURCE_EXHAUSTED "Stream removed" instead.
    huge = "\U0001f4a5" * 7_000
    not_found = refusal(live_gateway, job_service_pb2.SubmitJobRequest(model_name=huge, inputs=[demo_input()]))
    assert not_found.code() == grpc.StatusCode.NOT_FOUND
    assert "demo" in (not_found.details() or "")
    bad_datatype = tensor_pb2.InferInputTensor(name="x", datatype=huge, shape=[1, 4])
    invalid = refusal(live_gateway, job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[bad_datatype]))
    assert invalid.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violated_fields(invalid) == ["inputs[0].datatype"]
    long_shape = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1] * 5_000)
    invalid = refusal(live_gateway, job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[long_shape]))
    assert violated_fields(invalid) == ["inputs[0].shape"]


def test_thousands_of_violations_are_reported_as_a_few_and_a_count(live_gateway: LiveGateway) -> None:
    request = job_service_pb2.SubmitJobRequest(model_name="demo")
    request.inputs.extend(tensor_pb2.InferInputTensor(name=f"in{i}", datatype="FP8") for i in range(3_000))
    error = refusal(live_gateway, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    fields = violated_fields(error)
    assert fields[:7] == [f"inputs[{i}].datatype" for i in range(7)]
    assert len(fields) == 8
    bad = unpack_details(status_details(error))["BadRequest"]  # type: ignore[arg-type]
    assert "2993 more" in bad.field_violations[-1].description


def test_undecodable_request_is_invalid_argument(live_gateway: LiveGateway) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{live_gateway.port}") as channel:
        submit = channel.unary_unary(
            SUBMIT_PATH, request_serializer=None, response_deserializer=job_service_pb2.SubmitJobResponse.FromString
        )
        with pytest.raises(grpc.RpcError) as info:
            submit(unknown_field(1, b"demo\xff"), timeout=CALL_TIMEOUT_S)  # invalid UTF-8 in model_name
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
