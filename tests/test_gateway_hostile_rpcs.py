"""Hostile input for the gateway's other RPCs: GetJob, WatchJob, CancelJob, ListJobs, SubmitJobs,
UploadInput and ReadResult, sent as raw bytes (sometimes undecodable) with random API keys, at a
gateway that has API keys and a small upload limit. Every answer must be OK or a clean canonical
refusal (never UNKNOWN or INTERNAL, never a hang), and a refused call stores nothing: the WORK
stream, the jobs bucket and the objects bucket keep their message counts.

Reuses the SubmitJob property's strategies; see tests/test_gateway_hostile.py for the set-up idea
(the gateway on a loop of its own, synchronous gRPC calls from hypothesis).
"""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asyncinfer.api_keys import hash_key
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.ids import new_job_id
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc, tensor_pb2
from services.gateway.list_jobs import encode_token
from tests.test_gateway_hostile import (
    CALL_TIMEOUT_S,
    GRPC_LIMIT_BYTES,
    HUGE_TEXT,
    KITCHEN,
    LABELS,
    MAX_REQUEST_BYTES,
    Payload,
    demo_input,
    duration,
    gateway_on_its_own_loop,
    submit_request,
    unknown_field,
    valid_request,
)

SERVICE = "/asyncinfer.v1.JobService/"
MAX_UPLOAD_BYTES = 4096
KEY, OTHER_KEY = "hostile-key", "other-key"
EXAMPLES = 100
Code = grpc.StatusCode
Counts = tuple[int, int, int]  # (WORK stream, jobs bucket, objects bucket) messages

HOSTILE = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)


@dataclass
class Gateway:
    """A gateway on a loop of its own, a channel to it, and two jobs of the caller's tenant."""

    channel: grpc.Channel
    run: Callable[[Coroutine[Any, Any, Any]], Any]
    count: Callable[[], Counts]
    jobs: tuple[job_pb2.Job, ...]  # tenant "acme", newest last
    other_job: job_pb2.Job  # tenant "other"

    def raw(self, kind: str, method: str) -> Any:
        """A multi-callable sending raw bytes and answering raw bytes."""
        return getattr(self.channel, kind)(SERVICE + method, request_serializer=None, response_deserializer=None)


@pytest.fixture
def gateway(config: Config) -> Iterator[Gateway]:

    cfg = config.replace(
        gateway={
            "max_request_bytes": MAX_REQUEST_BYTES,
            "max_upload_bytes": MAX_UPLOAD_BYTES,
            "api_keys": [
                {"tenant": "acme", "sha256": hash_key(KEY)},
                {"tenant": "other", "sha256": hash_key(OTHER_KEY)},
            ],
        },
        models=(DEMO_MODEL, KITCHEN),
    )
    with gateway_on_its_own_loop(cfg) as (app, run, js):

        async def count() -> Counts:
            streams = (cfg.nats.work_stream, f"KV_{cfg.nats.jobs_bucket}", f"OBJ_{cfg.nats.objects_bucket}")
            infos = [await js.stream_info(stream) for stream in streams]
            return infos[0].state.messages, infos[1].state.messages, infos[2].state.messages

        channel = grpc.insecure_channel(f"127.0.0.1:{app.port}")
        try:
            stub = job_service_pb2_grpc.JobServiceStub(channel)
            request = job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[demo_input()])
            jobs = tuple(stub.SubmitJob(request, metadata=auth(KEY), timeout=5).job for _ in range(2))
            other = stub.SubmitJob(request, metadata=auth(OTHER_KEY), timeout=5).job
            yield Gateway(channel=channel, run=run, count=lambda: run(count()), jobs=jobs, other_job=other)
        finally:
            channel.close()


def auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


# --- what a hostile client sends ---------------------------------------------------------------

# Mostly the right key, so that most calls reach the RPC's own checks.
AUTH = st.one_of(
    st.just(("acme", auth(KEY))),
    st.just(("acme", auth(KEY))),
    st.just(("acme", auth(KEY))),
    st.just(("other", auth(OTHER_KEY))),
    st.sampled_from(
        [
            (None, ()),
            (None, (("authorization", "Bearer wrong"),)),
            (None, (("authorization", "Basic " + KEY),)),
            (None, (("authorization", "Bearer "),)),
            (None, (("authorization", "Bearer " + "k" * 4000),)),
            (None, (("x-api-key", KEY),)),
        ]
    ),
)
# Real job IDs are filled in by `job_id_for`: "<acme>" and "<other>" name the seeded jobs.
JOB_IDS = st.one_of(
    st.sampled_from(["<acme>", "<acme>", "<other>", "<unknown>", "<upper>", "<braces>", "<urn>", "<uuid4>"]),
    st.sampled_from(["", " ", "*", ">", "a.b", "acme.x", "..", "\x00", "default.>", "$KV.jobs.>"]),
    st.text(max_size=40),
    HUGE_TEXT,
)


def job_id_for(gateway: Gateway, name: str) -> str:
    real = gateway.jobs[0].job_id
    return {
        "<acme>": real,
        "<other>": gateway.other_job.job_id,
        "<unknown>": new_job_id(),
        "<upper>": real.upper(),
        "<braces>": "{" + real + "}",
        "<urn>": "urn:uuid:" + real,
        "<uuid4>": str(uuid.uuid4()),
    }.get(name, name)


def mangle(payload: bytes, how: str, string_field: int = 1) -> Payload:
    """The serialized request, or bytes that are not one (`string_field`: a string field's number)."""
    if how == "unknown-field":
        payload += unknown_field(4242, b"\xff\x00")
    elif how == "bad-utf8":
        payload += unknown_field(string_field, b"\xc3\x28")
    elif how == "truncated-varint":
        payload += b"\x08\x80\x80\x80"
    elif how == "garbage":
        payload = b"\xff" * 9 + payload
    return Payload(payload)


MANGLE = st.sampled_from(["none"] * 6 + ["unknown-field", "bad-utf8", "truncated-varint", "garbage"])


def call_code(call: Callable[[], Any], *, size: int = 0) -> tuple[Code, Any]:
    refused: grpc.RpcError | None = None
    try:
        return Code.OK, call()
    except grpc.RpcError as error:
        refused = error
    assert refused.code() != Code.DEADLINE_EXCEEDED, "the gateway hung"
    if size > GRPC_LIMIT_BYTES:  # gRPC's own refusal, before the gateway sees it
        assert refused.code() == Code.RESOURCE_EXHAUSTED, refused.details()
    else:
        check_clean(refused)
    return refused.code(), refused


def check_clean(error: grpc.RpcError) -> None:
    code, details = error.code(), (error.details() or "")
    assert code not in (Code.UNKNOWN, Code.INTERNAL, Code.UNIMPLEMENTED), f"{code}: {details[:300]}"
    status = status_details(error)  # type: ignore[arg-type]
    # Every refusal of ours carries an ErrorInfo; gRPC's own (oversize trailers: "Stream removed") does not.
    assert status is not None, f"{code} without a rich status: {details[:300]}"
    assert "ErrorInfo" in unpack_details(status), f"{code}: {details[:300]}"


def owns(gateway: Gateway, tenant: str | None, job_id: str) -> bool:
    """Whether `job_id` names one of `tenant`'s seeded jobs (the one each test may reach)."""
    mine = {"acme": gateway.jobs[0].job_id, "other": gateway.other_job.job_id}
    return tenant is not None and mine.get(tenant) == job_id


UNDECODABLE = ("bad-utf8", "truncated-varint", "garbage")


# --- GetJob, ReadResult, CancelJob: one job ID ---------------------------------------------------


@given(who=AUTH, name=JOB_IDS, how=MANGLE)
@HOSTILE
def test_hostile_get_job(gateway: Gateway, who: tuple[str | None, Any], name: str, how: str) -> None:
    tenant, metadata = who
    job_id = job_id_for(gateway, name)
    payload = mangle(job_service_pb2.GetJobRequest(job_id=job_id).SerializeToString(), how)
    before = gateway.count()
    code, answer = call_code(lambda: gateway.raw("unary_unary", "GetJob")(bytes(payload), metadata=metadata, timeout=5))
    assert gateway.count() == before
    if how in UNDECODABLE:
        assert code == Code.INVALID_ARGUMENT  # the request is read before the caller is known
    elif tenant is None:
        assert code == Code.UNAUTHENTICATED
    elif owns(gateway, tenant, job_id):
        assert code == Code.OK
        assert job_service_pb2.GetJobResponse.FromString(answer).job.job_id == job_id
    else:
        assert code == Code.NOT_FOUND  # another tenant's job is not there either


@given(who=AUTH, name=JOB_IDS, how=MANGLE)
@HOSTILE
def test_hostile_read_result(gateway: Gateway, who: tuple[str | None, Any], name: str, how: str) -> None:
    tenant, metadata = who
    job_id = job_id_for(gateway, name)
    payload = mangle(job_service_pb2.ReadResultRequest(job_id=job_id).SerializeToString(), how)
    before = gateway.count()
    code, _ = call_code(
        lambda: list(gateway.raw("unary_stream", "ReadResult")(bytes(payload), metadata=metadata, timeout=5))
    )
    assert gateway.count() == before
    if how in UNDECODABLE:
        assert code == Code.INVALID_ARGUMENT  # the request is read before the caller is known
    elif tenant is None:
        assert code == Code.UNAUTHENTICATED
    elif owns(gateway, tenant, job_id):
        assert code == Code.FAILED_PRECONDITION  # QUEUED: no result yet
    else:
        assert code == Code.NOT_FOUND


@given(who=AUTH, name=JOB_IDS, how=MANGLE, reason=st.one_of(st.text(max_size=30), HUGE_TEXT))
@HOSTILE
def test_hostile_cancel_job(gateway: Gateway, who: tuple[str | None, Any], name: str, how: str, reason: str) -> None:
    tenant, metadata = who
    job_id = job_id_for(gateway, name)
    payload = mangle(job_service_pb2.CancelJobRequest(job_id=job_id, reason=reason).SerializeToString(), how)
    before = gateway.count()
    code, _ = call_code(lambda: gateway.raw("unary_unary", "CancelJob")(bytes(payload), metadata=metadata, timeout=5))
    if code != Code.OK:
        assert gateway.count() == before
    if how in UNDECODABLE:
        assert code == Code.INVALID_ARGUMENT  # the request is read before the caller is known
    elif tenant is None:
        assert code == Code.UNAUTHENTICATED
    elif owns(gateway, tenant, job_id):
        assert code in (Code.OK, Code.FAILED_PRECONDITION)  # the first cancel wins; the rest find it ended
    else:
        assert code == Code.NOT_FOUND
    if tenant == "other":
        return
    # Nothing cancels a job of another tenant.
    stub = job_service_pb2_grpc.JobServiceStub(gateway.channel)
    other = stub.GetJob(job_service_pb2.GetJobRequest(job_id=gateway.other_job.job_id), metadata=auth(OTHER_KEY))
    assert other.job.state == job_pb2.JOB_STATE_QUEUED


# --- WatchJob ---------------------------------------------------------------------------------

REVISIONS = st.one_of(st.integers(0, 8), st.integers(0, 2**64 - 1), st.sampled_from([2**63, 2**64 - 1]))


@given(who=AUTH, name=JOB_IDS, how=MANGLE, after=REVISIONS)
@HOSTILE
def test_hostile_watch_job(gateway: Gateway, who: tuple[str | None, Any], name: str, how: str, after: int) -> None:
    tenant, metadata = who
    job_id = job_id_for(gateway, name)
    payload = mangle(job_service_pb2.WatchJobRequest(job_id=job_id, after_revision=after).SerializeToString(), how)
    real = owns(gateway, tenant, job_id) and how not in UNDECODABLE
    revision = gateway.jobs[0].revision if tenant == "acme" else gateway.other_job.revision
    # A watch of a live job resumed at its current revision waits for the next change: that is no
    # hang. after_revision 0 always sends the current record (a queued job's revision is 0).
    waits = real and after == revision and after != 0
    timeout = 0.5 if waits else 5
    before = gateway.count()
    call = gateway.raw("unary_stream", "WatchJob")(bytes(payload), metadata=metadata, timeout=timeout)
    try:
        first = next(call)
        code = Code.OK
    except grpc.RpcError as error:
        code = error.code()
        if not waits:
            assert code != Code.DEADLINE_EXCEEDED, "the gateway hung"
            check_clean(error)
    finally:
        call.cancel()
    event(code.name)
    assert gateway.count() == before
    if how in UNDECODABLE:
        assert code == Code.INVALID_ARGUMENT
    elif tenant is None:
        assert code == Code.UNAUTHENTICATED
    elif real:
        if after < revision or after == 0:
            assert code == Code.OK
            assert job_service_pb2.WatchJobResponse.FromString(first).job.job_id == job_id
        else:
            assert code == (Code.DEADLINE_EXCEEDED if after == revision else Code.INVALID_ARGUMENT)
    else:
        assert code == Code.NOT_FOUND


# --- ListJobs ---------------------------------------------------------------------------------


class Short(str):
    """Text whose repr stays short, for hypothesis's report of a failing example."""

    def __repr__(self) -> str:
        head = str.__repr__(self[:80])
        return f"Short({head}{'...' if len(self) > 80 else ''}, {len(self)} chars)"


class ShortDict(dict[str, str]):
    def __repr__(self) -> str:
        return f"ShortDict({len(self)} entries, {sum(len(k) + len(v) for k, v in self.items())} chars)"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


PAGE_TOKENS = st.one_of(
    st.sampled_from(["", "<real>", "<real>", "<tampered>", "<other-filter>"]),
    st.sampled_from([_b64(b"[" * 20_000), _b64(b'{"after":' * 5_000)]),
    st.text(max_size=30),
    st.binary(max_size=60).map(_b64),
    st.sampled_from(
        [
            _b64(b"[" * 20_000),  # nesting past Python's recursion limit
            _b64(b'{"after":' * 5_000 + b"1" + b"}" * 5_000),
            _b64(b'{"after":' + b"9" * 5_000 + b',"filter":"x"}'),  # past int's digit limit
            _b64(json.dumps({"after": 5, "filter": "x"}).encode()),
            _b64(json.dumps({"after": ["x"], "filter": {}}).encode()),
            _b64(json.dumps({"after": new_job_id(), "filter": ["x"]}).encode()),
            _b64(json.dumps([1, 2]).encode()),
            _b64(b'"just a string"'),
            _b64(b"\xff\xfe{}"),
            "A" * 40_000,
            "=" * 100,
            "\U0001f4a5" * 1000,
            "%%%",
        ]
    ),
    HUGE_TEXT,
)


class ShortList(list[int]):
    def __repr__(self) -> str:
        return f"ShortList({self[:3]!r}..., {len(self)} items)"


STATES = st.one_of(
    st.lists(st.sampled_from(list(job_pb2.JobState.values())), max_size=4),
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=4),
    st.builds(lambda n: ShortList([99] * n), st.sampled_from([50, 3_000])),
)
PAGE_SIZES = st.one_of(st.integers(-3, 5), st.sampled_from([-(2**31), 2**31 - 1, 1000, 1001]))


@given(
    who=AUTH,
    token=PAGE_TOKENS.map(Short),
    states=STATES,
    size=PAGE_SIZES,
    model=st.sampled_from(["", "demo", "kitchen", "nope", "\x00", "m" * 5000]).map(Short),
    labels=LABELS.map(ShortDict),
    how=MANGLE,
)
@HOSTILE
def test_hostile_list_jobs(
    gateway: Gateway,
    who: tuple[str | None, Any],
    token: str,
    states: list[int],
    size: int,
    model: str,
    labels: dict[str, str],
    how: str,
) -> None:
    tenant, metadata = who
    real_token = encode_token(gateway.jobs[1].job_id, _fingerprint_of_no_filter())
    token = {
        "<real>": real_token,
        "<tampered>": real_token[:-3] + "xyz",
        "<other-filter>": encode_token(gateway.jobs[1].job_id, "0" * 32),
    }.get(token, token)
    request = job_service_pb2.ListJobsRequest(page_size=size, page_token=token, model_name=model, labels=labels)
    request.states.extend(states)  # type: ignore[arg-type]
    payload = mangle(request.SerializeToString(), how, string_field=2)  # page_token
    before = gateway.count()
    list_jobs = gateway.raw("unary_unary", "ListJobs")
    code, answer = call_code(lambda: list_jobs(bytes(payload), metadata=metadata, timeout=10), size=len(payload))
    assert gateway.count() == before
    if len(payload) > GRPC_LIMIT_BYTES:
        assert code == Code.RESOURCE_EXHAUSTED
        return
    if how in UNDECODABLE:
        assert code == Code.INVALID_ARGUMENT
        return
    if tenant is None:
        assert code == Code.UNAUTHENTICATED
        return
    if code != Code.OK:
        assert code == (Code.RESOURCE_EXHAUSTED if len(payload) > GRPC_LIMIT_BYTES else Code.INVALID_ARGUMENT)
        return
    assert how in ("none", "unknown-field")
    response = job_service_pb2.ListJobsResponse.FromString(answer)
    mine = {job.job_id for job in gateway.jobs} if tenant == "acme" else {gateway.other_job.job_id}
    assert {job.job_id for job in response.jobs} <= mine
    assert len(response.jobs) <= max(size, 0) or size <= 0


def _fingerprint_of_no_filter() -> str:
    from services.gateway.list_jobs import ListQuery

    return ListQuery().fingerprint("acme")


# --- SubmitJobs -------------------------------------------------------------------------------


@st.composite
def bulk_item(draw: st.DrawFn) -> tuple[str, Payload]:
    kind = draw(st.sampled_from(["valid", "valid", "hostile", "undecodable"]))
    correlation = draw(st.one_of(st.text(max_size=10), st.just("c" * 3000)))
    if kind == "undecodable":
        job = draw(st.sampled_from([b"\xff" * 5, unknown_field(1, b"demo\xff"), b"\x0a\x80\x80\x80\x80\x10"]))
        return kind, Payload(unknown_field(1, job))
    request = draw(valid_request() if kind == "valid" else submit_request())
    # Keep the stream cheap: items stay far below the request size limit.
    if request.ByteSize() > MAX_REQUEST_BYTES // 4:
        request = job_service_pb2.SubmitJobRequest(model_name=request.model_name[:100])
    item = job_service_pb2.SubmitJobsRequest(job=request, correlation_id=correlation)
    return kind, Payload(item.SerializeToString())


@given(who=AUTH, items=st.lists(bulk_item(), max_size=6))
@HOSTILE
def test_hostile_submit_jobs(gateway: Gateway, who: tuple[str | None, Any], items: list[tuple[str, Payload]]) -> None:
    tenant, metadata = who
    before = gateway.count()
    call = gateway.channel.stream_stream(
        SERVICE + "SubmitJobs",
        request_serializer=None,
        response_deserializer=job_service_pb2.SubmitJobsResponse.FromString,
    )
    answers: list[job_service_pb2.SubmitJobsResponse] = []

    def drain() -> None:
        answers.extend(call(iter([bytes(payload) for _, payload in items]), metadata=metadata, timeout=10))

    code, _ = call_code(drain)
    accepted = sum(1 for answer in answers if answer.HasField("job"))
    work, records, objects = before
    assert gateway.count() == (work + accepted, records, objects), "one job (one work message) per accepted item"
    first_undecodable = next((i for i, (kind, _) in enumerate(items) if kind == "undecodable"), None)
    if tenant is None:
        assert code == Code.UNAUTHENTICATED
        assert not answers
    elif first_undecodable is not None:
        assert code == Code.INVALID_ARGUMENT  # the stream itself is broken: it ends there
        assert len(answers) <= first_undecodable
    else:
        assert code == Code.OK
        assert [answer.index for answer in answers] == list(range(len(items)))
    for answer in answers:
        if answer.HasField("error"):
            assert answer.error.code in {
                c.value[0] for c in (Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.RESOURCE_EXHAUSTED)
            } | ({Code.UNIMPLEMENTED.value[0], Code.ALREADY_EXISTS.value[0]}), answer.error
        else:
            assert answer.job.state == job_pb2.JOB_STATE_QUEUED


# --- UploadInput ------------------------------------------------------------------------------

SHA256S = st.one_of(
    st.sampled_from(["", "<right>", "<right-upper>", "0" * 64, "g" * 64, "0" * 63, "0" * 65, " " * 64]),
    st.text(max_size=70),
    HUGE_TEXT,
)
SIZES = st.one_of(
    st.sampled_from(["<right>", "<right>"]),
    st.integers(-5, MAX_UPLOAD_BYTES + 5),
    st.sampled_from([-(2**63), 2**63 - 1, MAX_UPLOAD_BYTES, MAX_UPLOAD_BYTES + 1, 2**40]),
)


@st.composite
def upload_messages(draw: st.DrawFn) -> tuple[bool, list[Payload]]:
    """The messages of one upload, and whether they are a correct upload."""
    content = draw(
        st.one_of(
            st.just(tensor_pb2.InferInputs(inputs=[demo_input()]).SerializeToString()),
            st.binary(max_size=200),
            st.binary(min_size=MAX_UPLOAD_BYTES + 1, max_size=MAX_UPLOAD_BYTES + 100),
        )
    )
    sha = draw(SHA256S)
    size = draw(SIZES)
    digest = hashlib.sha256(content).hexdigest()
    metadata = job_service_pb2.UploadInputMetadata(
        size_bytes=len(content) if size == "<right>" else size,
        sha256={"<right>": digest, "<right-upper>": digest.upper()}.get(sha, sha),
    )
    if draw(st.integers(0, 3)) == 0:
        metadata.retention.CopyFrom(draw(duration()))
    pieces = draw(st.integers(1, 4))
    step = max(1, len(content) // pieces)
    chunks = [content[i : i + step] for i in range(0, len(content), step)] or [b""]
    messages = [job_service_pb2.UploadInputRequest(metadata=metadata, chunk=chunks[0])]
    messages += [job_service_pb2.UploadInputRequest(chunk=c) for c in chunks[1:]]
    shape = draw(st.sampled_from(["ok"] * 4 + ["no-metadata", "chunk-first", "two-metadata", "undecodable", "empty"]))
    if shape == "no-metadata":
        messages = [job_service_pb2.UploadInputRequest(chunk=c) for c in chunks]
    elif shape == "chunk-first":
        messages.insert(0, job_service_pb2.UploadInputRequest(chunk=b"early"))
    elif shape == "two-metadata":
        messages.insert(draw(st.integers(1, len(messages))), job_service_pb2.UploadInputRequest(metadata=metadata))
    payloads = [Payload(m.SerializeToString()) for m in messages]
    if shape == "undecodable":
        payloads.insert(draw(st.integers(0, len(payloads))), Payload(b"\x0a\x80\x80\x80\x80\x10"))
    elif shape == "empty":
        payloads = []
    retention_s = metadata.retention.seconds + metadata.retention.nanos / 1e9
    correct = (
        shape == "ok"
        and size in ("<right>", len(content), 0)
        and sha in ("<right>", "<right-upper>", "")
        and len(content) <= MAX_UPLOAD_BYTES
        and (not metadata.HasField("retention") or 0 < retention_s <= 10**6)
    )
    return correct, payloads


@given(who=AUTH, upload=upload_messages())
@HOSTILE
def test_hostile_upload_input(
    gateway: Gateway, who: tuple[str | None, Any], upload: tuple[bool, list[Payload]]
) -> None:
    tenant, metadata = who
    correct, payloads = upload
    before = gateway.count()
    upload_call = gateway.raw("stream_unary", "UploadInput")
    code, answer = call_code(lambda: upload_call(iter([bytes(p) for p in payloads]), metadata=metadata, timeout=10))
    if tenant is None:
        assert code == Code.UNAUTHENTICATED
    elif code == Code.OK:
        response = job_service_pb2.UploadInputResponse.FromString(answer)
        assert response.ref.ref.startswith("in/")
        assert response.ref.size_bytes <= MAX_UPLOAD_BYTES
        work, records, objects = gateway.count()
        assert (work, records) == before[:2]
        assert objects > before[2], "an accepted upload is stored"
        return
    else:
        assert not correct, f"a correct upload was refused: {code}"
        assert code == Code.INVALID_ARGUMENT
    assert gateway.count() == before, "a refused upload left something behind"


# --- plain checks -----------------------------------------------------------------------------


def test_the_gateway_still_serves_a_submit_after_hostile_rpcs(gateway: Gateway) -> None:
    garbage = b"\x0a\x80\x80\x80\x80\x10"
    for kind, method in [
        ("unary_unary", "GetJob"),
        ("unary_unary", "CancelJob"),
        ("unary_unary", "ListJobs"),
        ("unary_unary", "ListModels"),
        ("unary_unary", "DeleteInput"),
        ("unary_stream", "WatchJob"),
        ("unary_stream", "ReadResult"),
    ]:
        unary = gateway.raw(kind, method)
        code, _ = call_code(lambda: list(unary(garbage, metadata=auth(KEY), timeout=5)))  # noqa: B023
        assert code == Code.INVALID_ARGUMENT, method
    for kind, method in [("stream_unary", "UploadInput"), ("stream_stream", "SubmitJobs")]:
        streaming = gateway.raw(kind, method)
        code, _ = call_code(lambda: list(streaming(iter([garbage]), metadata=auth(KEY), timeout=5)))  # noqa: B023
        assert code == Code.INVALID_ARGUMENT, method
    before = gateway.count()
    stub = job_service_pb2_grpc.JobServiceStub(gateway.channel)
    request = job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[demo_input()])
    job = stub.SubmitJob(request, metadata=auth(KEY), timeout=5).job
    assert job.state == job_pb2.JOB_STATE_QUEUED
    assert gateway.count() == (before[0] + 1, before[1], before[2])  # one write: the work message


# --- regressions: what the properties above found, one plain test each ------------------------


def list_refusal(gateway: Gateway, request: job_service_pb2.ListJobsRequest) -> grpc.RpcError:
    stub = job_service_pb2_grpc.JobServiceStub(gateway.channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.ListJobs(request, metadata=auth(KEY), timeout=CALL_TIMEOUT_S)
    return info.value


def test_thousands_of_unknown_states_are_refused_with_a_short_error(gateway: Gateway) -> None:
    # One violation each used to pass the client's trailer limit: RESOURCE_EXHAUSTED "Stream removed".
    error = list_refusal(gateway, job_service_pb2.ListJobsRequest(states=[99] * 3_000))  # type: ignore[list-item]
    assert error.code() == Code.INVALID_ARGUMENT
    bad = unpack_details(status_details(error))["BadRequest"]  # type: ignore[arg-type]
    assert len(bad.field_violations) == 8
    assert "2993 more" in bad.field_violations[-1].description


def test_a_deeply_nested_page_token_is_invalid_argument(gateway: Gateway) -> None:
    error = list_refusal(gateway, job_service_pb2.ListJobsRequest(page_token=_b64(b"[" * 20_000)))
    assert error.code() == Code.INVALID_ARGUMENT
    reason = unpack_details(status_details(error))["ErrorInfo"].reason  # type: ignore[arg-type]
    assert reason == "INVALID_PAGE_TOKEN"


def test_a_caller_without_a_key_is_unauthenticated_whatever_the_job_id(gateway: Gateway) -> None:
    # A malformed job ID used to answer NOT_FOUND before the key was checked.
    stub = job_service_pb2_grpc.JobServiceStub(gateway.channel)
    for call in (
        lambda: stub.GetJob(job_service_pb2.GetJobRequest(job_id="nope"), timeout=5),
        lambda: stub.CancelJob(job_service_pb2.CancelJobRequest(job_id="nope"), timeout=5),
        lambda: list(stub.WatchJob(job_service_pb2.WatchJobRequest(job_id="nope"), timeout=5)),
        lambda: list(stub.ReadResult(job_service_pb2.ReadResultRequest(job_id="nope"), timeout=5)),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == Code.UNAUTHENTICATED
