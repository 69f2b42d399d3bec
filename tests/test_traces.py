"""Traces (asyncinfer.tracing) against a real stack: real NATS, the gateway, the scheduler and a
batcher in this process, each with its own TracerProvider, and OpenTelemetry's in-memory exporter
on all three. A job submitted with a W3C traceparent is one trace, the caller's, with spans from
the three services; a batch span links every job it held; the trace ID is on the Job and in the
job's log lines; with tracing off nothing of it exists."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
import structlog
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from asyncinfer.client import AsyncClient, JobRequest
from asyncinfer.codecs.envelope import decode_envelope, encode_envelope
from asyncinfer.codecs.record import decode_record, encode_record
from asyncinfer.config import DEMO_MODEL, FLAKY_MODEL, Config
from asyncinfer.contract import TRACEPARENT_HEADER, job_work_subject
from asyncinfer.errors import ResourceExhausted
from asyncinfer.jobs import BATCH_LABEL, CHUNK_LABEL, JobRecord, JobState, Priority, queued_envelope
from asyncinfer.tracing import SHUTDOWN_EXPORT_S, Tracing, trace_id_of
from asyncinfer.v1 import batch_service_pb2, job_pb2, job_service_pb2
from services.gateway.submit import JobSubmitter
from tests import codec_v0_readers as old_readers
from tests.batch_helpers import batches_stub, create_request, demo_records, jsonl, upload, wait_ended
from tests.kv_helpers import job_record
from tests.stack import Stack, StartStack
from tests.test_client_sdk import free_port
from tests.test_end_to_end import demo_request
from tests.test_record_codec import MINIMAL

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
SERVICES = {"asyncinfer-gateway", "asyncinfer-scheduler", "asyncinfer-batcher"}


@pytest.fixture
def traced(config: Config) -> Config:
    return config.replace(tracing={"enabled": True})


def export_spans(stack: Stack) -> InMemorySpanExporter:
    """One in-memory exporter on the three services' providers (after they started: nothing is
    traced before the first submit)."""
    exporter = InMemorySpanExporter()
    assert stack.batcher is not None
    for app in (stack.gateway, stack.scheduler, stack.batcher):
        app.tracing.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


async def wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """The result_commit span ends after the terminal write that a watcher already saw."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for spans"
        await asyncio.sleep(0.01)


async def finished(stack: Stack, job_id: str) -> job_pb2.Job:
    """The job once terminal (its watch ends then), as GetJob shows it."""
    async for _update in stack.jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=job_id)):
        pass
    return (await stack.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job


def service_of(span: ReadableSpan) -> str:
    return str(span.resource.attributes["service.name"])


def hex_id(value: int, digits: int) -> str:
    return f"{value:0{digits}x}"


def parent_of(span: ReadableSpan) -> str:
    """The span ID of its parent, in hex ("" for a root)."""
    return "" if span.parent is None else hex_id(span.parent.span_id, 16)


async def stored(stack: Stack, job_id: str) -> JobRecord:
    """The job's record as the jobs bucket holds it."""
    nats = stack.config.nats
    record = await job_record(
        stack.nc.jetstream(), f"default.{job_id}", bucket=nats.jobs_bucket, work_stream=nats.work_stream
    )
    assert record is not None
    return record


async def test_a_job_is_one_trace_across_the_three_services(traced: Config, start_stack: StartStack) -> None:
    stack = await start_stack(traced)
    exporter = export_spans(stack)
    with structlog.testing.capture_logs() as logs:
        submitted = await stack.jobs.SubmitJob(demo_request([[1, 2, 3, 4]]), metadata=(("traceparent", CALLER),))
        job = await finished(stack, submitted.job.job_id)
        await wait_for(lambda: any(s.name == "result_commit" for s in exporter.get_finished_spans()))
    assert job.state == job_pb2.JOB_STATE_SUCCEEDED
    assert submitted.job.trace_id == job.trace_id == TRACE_ID  # the caller's trace, on the Job

    spans = [s for s in exporter.get_finished_spans() if s.name != "batch"]
    assert {s.context.trace_id for s in spans} == {int(TRACE_ID, 16)}, "one trace: the caller's"
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"submit", "queued", "dispatch", "compute", "result_commit"}
    assert {service_of(s) for s in spans} == SERVICES
    assert service_of(by_name["submit"]) == "asyncinfer-gateway"
    assert {service_of(by_name[n]) for n in ("queued", "dispatch", "result_commit")} == {"asyncinfer-scheduler"}
    assert service_of(by_name["compute"]) == "asyncinfer-batcher"
    # The chain of parents: caller -> submit -> (queued, dispatch -> compute, result_commit).
    submit = by_name["submit"]
    assert parent_of(submit) == "00f067aa0ba902b7"
    assert (submit.attributes or {})["asyncinfer.job_id"] == job.job_id
    for name in ("queued", "dispatch", "result_commit"):
        assert parent_of(by_name[name]) == hex_id(submit.context.span_id, 16), name
    assert parent_of(by_name["compute"]) == hex_id(by_name["dispatch"].context.span_id, 16)

    # The trace ID in every line about the job, from each service that logs one (its lifecycle
    # lines are at debug, which capture_logs keeps: tests configure no level).
    about = [line for line in logs if line.get("job_id") == job.job_id]
    events = {line["event"] for line in about}
    assert {"job_submitted", "job_dispatched", "job_finished"} <= events
    assert all(line.get("trace_id") == TRACE_ID for line in about), about

    # And on the record as stored (the scheduler wrote RUNNING and SUCCEEDED from the message's).
    record = await stored(stack, job.job_id)
    assert trace_id_of(record.traceparent) == TRACE_ID


async def test_a_batch_span_links_every_job_it_held(traced: Config, start_stack: StartStack) -> None:
    stack = await start_stack(traced, batcher=False)
    submitted = [
        (await stack.jobs.SubmitJob(demo_request([[float(i)] * 4]))).job.job_id for i in range(6)
    ]  # no traceparent: each job a new trace of its own
    # The work message carries the trace context in a header too (for NATS tooling).
    subject = job_work_subject("demo", Priority.NORMAL, "default", submitted[0])
    message = await stack.nc.jetstream().get_last_msg(traced.nats.work_stream, subject)
    assert trace_id_of((message.headers or {})[TRACEPARENT_HEADER]) != ""
    await stack.start_batcher()  # the six are dispatched together and batch together
    exporter = export_spans(stack)
    jobs = [await finished(stack, job_id) for job_id in submitted]
    await wait_for(lambda: sum(s.name == "result_commit" for s in exporter.get_finished_spans()) == len(jobs))
    assert len({job.trace_id for job in jobs}) == len(jobs), "one trace per job"
    assert trace_id_of(message.headers[TRACEPARENT_HEADER]) == jobs[0].trace_id

    spans = exporter.get_finished_spans()
    batches = {s.context.span_id: s for s in spans if s.name == "batch"}
    dispatches = {s.context.trace_id: s for s in spans if s.name == "dispatch"}
    computes = [s for s in spans if s.name == "compute"]
    assert len(computes) == len(jobs)
    held: dict[int, set[int]] = {span_id: set() for span_id in batches}
    for compute in computes:
        (link,) = compute.links  # back to its batch
        held[link.context.span_id].add(compute.context.trace_id)
    for span_id, batch in batches.items():
        assert service_of(batch) == "asyncinfer-batcher"
        assert batch.context.trace_id not in dispatches, "a batch is a trace of its own"
        linked = {(link.context.trace_id, link.context.span_id) for link in batch.links}
        # Every job it held, by the dispatch span its compute continues.
        assert linked == {(trace_id, dispatches[trace_id].context.span_id) for trace_id in held[span_id]}
        assert (batch.attributes or {})["asyncinfer.batch_items"] == len(batch.links)
    assert max(len(b.links) for b in batches.values()) > 1, "jobs queued together should share a batch"
    for job in jobs:
        (compute,) = [s for s in computes if hex_id(s.context.trace_id, 32) == job.trace_id]
        assert len(batches[compute.links[0].context.span_id].links) == job.batch.batch_size


async def test_tracing_off_makes_no_spans_and_no_trace_fields(config: Config, start_stack: StartStack) -> None:
    stack = await start_stack(config)
    assert stack.batcher is not None
    assert not any(app.tracing.enabled for app in (stack.gateway, stack.scheduler, stack.batcher))
    with structlog.testing.capture_logs() as logs:
        submitted = await stack.jobs.SubmitJob(demo_request([[1, 2, 3, 4]]), metadata=(("traceparent", CALLER),))
        job = await finished(stack, submitted.job.job_id)
    assert job.state == job_pb2.JOB_STATE_SUCCEEDED
    assert job.trace_id == submitted.job.trace_id == ""
    assert not any("trace_id" in line for line in logs)
    assert (await stored(stack, job.job_id)).traceparent == ""
    stub = batches_stub(stack.channel)
    ref = await upload(stack.jobs, jsonl(demo_records(2)))
    created = await stub.CreateBatch(create_request(ref), metadata=(("traceparent", CALLER),))
    assert created.batch.trace_id == ""


async def test_a_malformed_traceparent_starts_a_new_trace(traced: Config, start_stack: StartStack) -> None:
    """W3C: a traceparent that cannot be parsed is ignored, never a failed request."""
    stack = await start_stack(traced)
    exporter = export_spans(stack)
    submitted = await stack.jobs.SubmitJob(demo_request([[1, 2, 3, 4]]), metadata=(("traceparent", "garbage"),))
    job = await finished(stack, submitted.job.job_id)
    assert job.state == job_pb2.JOB_STATE_SUCCEEDED
    assert len(job.trace_id) == 32
    assert job.trace_id != TRACE_ID
    await wait_for(lambda: any(s.name == "result_commit" for s in exporter.get_finished_spans()))
    (submit,) = [s for s in exporter.get_finished_spans() if s.name == "submit"]
    assert submit.parent is None
    assert hex_id(submit.context.trace_id, 32) == job.trace_id


async def test_an_invalid_submit_is_a_failed_span(traced: Config, start_stack: StartStack) -> None:
    stack = await start_stack(traced)
    exporter = export_spans(stack)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stack.jobs.SubmitJob(demo_request([[1, 2, 3]]), metadata=(("traceparent", CALLER),))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (submit,) = exporter.get_finished_spans()
    assert submit.name == "submit"
    assert not submit.status.is_ok
    assert hex_id(submit.context.trace_id, 32) == TRACE_ID


def test_tracing_off_is_the_default_and_needs_no_provider() -> None:
    tracing = Tracing.start(Config().tracing, service="gateway")
    assert not tracing.enabled
    tracing.shutdown()  # nothing to flush


def test_trace_ids_of_traceparents() -> None:
    assert trace_id_of(CALLER) == TRACE_ID
    assert trace_id_of("") == trace_id_of("garbage") == trace_id_of("00-abc-def-01") == ""


def test_the_traceparent_rides_on_the_record_and_its_work_message_and_old_readers_skip_it() -> None:
    traced_record = dataclasses.replace(MINIMAL, traceparent=CALLER)
    data = encode_record(traced_record)
    assert decode_record(data) == traced_record
    assert old_readers.decode_record(data) == MINIMAL  # the previous release reads the rest
    assert b"traceparent" not in encode_record(MINIMAL)  # untraced: not a byte more
    queued = dataclasses.replace(traced_record, state=JobState.QUEUED, attempt=0)
    envelope = queued_envelope(queued, ())
    message = decode_envelope(encode_envelope(envelope))
    assert message.traceparent == CALLER
    assert message.queued_record().traceparent == CALLER
    assert b"traceparent" not in encode_envelope(queued_envelope(MINIMAL, ()))


async def test_a_bulk_streams_traceparent_is_the_parent_of_each_jobs_submit(
    traced: Config, start_stack: StartStack
) -> None:
    stack = await start_stack(traced)
    exporter = export_spans(stack)
    items = [job_service_pb2.SubmitJobsItem(job=demo_request([[float(i)] * 4])) for i in range(3)]

    async def requests() -> AsyncIterator[job_service_pb2.SubmitJobsRequest]:
        yield job_service_pb2.SubmitJobsRequest(items=items)

    (response,) = [r async for r in stack.jobs.SubmitJobs(requests(), metadata=(("traceparent", CALLER),))]
    jobs = [answer.job for answer in response.answers]
    assert [job.trace_id for job in jobs] == [TRACE_ID] * 3
    for job in jobs:
        await finished(stack, job.job_id)
    await wait_for(lambda: sum(s.name == "result_commit" for s in exporter.get_finished_spans()) == 3)
    submits = [s for s in exporter.get_finished_spans() if s.name == "submit"]
    assert {(s.attributes or {})["asyncinfer.job_id"] for s in submits} == {job.job_id for job in jobs}
    assert {parent_of(s) for s in submits} == {"00f067aa0ba902b7"}


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC receiver: what a Collector or Jaeger is to the exporter."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str]] = []  # (service.name, span name, trace ID hex)

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: object
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append((attributes["service.name"], span.name, span.trace_id.hex()))
        return trace_service_pb2.ExportTraceServiceResponse()


async def test_spans_are_exported_over_otlp_when_an_endpoint_is_configured(
    traced: Config, start_stack: StartStack
) -> None:
    collector = Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        stack = await start_stack(traced.replace(tracing={"otlp_endpoint": f"http://127.0.0.1:{port}"}))
        submitted = await stack.jobs.SubmitJob(demo_request([[1, 2, 3, 4]]), metadata=(("traceparent", CALLER),))
        await finished(stack, submitted.job.job_id)
        await stack.stop()  # flushes each service's exporter
    finally:
        await server.stop(None)
    in_trace = {(service, name) for service, name, trace_id in collector.spans if trace_id == TRACE_ID}
    assert {service for service, _ in in_trace} == SERVICES
    assert {name for _, name in in_trace} == {"submit", "queued", "dispatch", "compute", "result_commit"}


def test_the_standard_otlp_endpoint_variable_is_honoured() -> None:
    """No endpoint configured: $OTEL_EXPORTER_OTLP_ENDPOINT names one (spans are made either way)."""
    config = Config().tracing.model_copy(update={"enabled": True})
    for environ, exports in (({}, False), ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, True)):
        tracing = Tracing.start(config, service="scheduler", environ=environ)
        assert tracing.enabled
        assert tracing.otlp_endpoint == ("http://127.0.0.1:4317" if exports else "")
        tracing.shutdown()


def test_a_collector_that_is_away_holds_a_stop_for_seconds_not_for_the_exporters_retries() -> None:
    """The OTLP exporter retries a refused export for up to 10 s; a stopping service gives the
    spans it holds SHUTDOWN_EXPORT_S, then drops them (`up` stopped in 12 s, service by service).
    What ended the stop's wait is asserted (the time limit stopped the exporter, and says so), not
    how long the stop took: a loaded machine's to decide."""
    from tests.test_client_sdk import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens
    config = Config().tracing.model_copy(update={"enabled": True, "otlp_endpoint": endpoint})
    tracing = Tracing.start(config, service="gateway")
    with tracing.span("submit"):
        pass
    with structlog.testing.capture_logs() as logs:
        tracing.shutdown()
    given_up = [line for line in logs if line["event"] == "trace_export_given_up"]
    assert given_up == [
        {
            "event": "trace_export_given_up",
            "log_level": "warning",
            "otlp_endpoint": endpoint,
            "after_s": SHUTDOWN_EXPORT_S,
        }
    ]


async def test_a_canceled_jobs_lines_carry_its_trace_id(traced: Config, start_stack: StartStack) -> None:
    stack = await start_stack(traced, batcher=False)  # no batcher: it stays queued
    submitted = await stack.jobs.SubmitJob(demo_request([[1, 2, 3, 4]]), metadata=(("traceparent", CALLER),))
    with structlog.testing.capture_logs() as logs:
        canceled = await stack.jobs.CancelJob(job_service_pb2.CancelJobRequest(job_id=submitted.job.job_id))
    assert canceled.job.state == job_pb2.JOB_STATE_CANCELED
    assert canceled.job.trace_id == TRACE_ID
    (line,) = [line for line in logs if line["event"] == "job_cancel_requested"]
    assert line["trace_id"] == TRACE_ID


async def test_the_sdk_sends_a_traceparent_and_shows_the_trace_id(traced: Config, start_stack: StartStack) -> None:
    stack = await start_stack(traced)
    async with AsyncClient(stack.address) as client:
        job = await client.submit("demo", {"x": [[1.0, 2.0, 3.0, 4.0]]}, traceparent=CALLER)
        assert job.trace_id == TRACE_ID
        done = await client.wait(job)
        assert done.trace_id == TRACE_ID
        untraced = await client.submit("demo", {"x": [[1.0, 2.0, 3.0, 4.0]]})
        assert len(untraced.trace_id) == 32  # a trace of its own
        assert untraced.trace_id != TRACE_ID
        requests = [JobRequest(model="demo", inputs={"x": [[float(i)] * 4]}) for i in range(3)]
        bulked = [result async for result in client.bulk(requests, traceparent=CALLER)]
        assert [r.job.trace_id for r in bulked if r.job] == [TRACE_ID] * 3, "the stream's trace, as submit's"
        batch = await client.create_batch(jsonl(demo_records(2)), "demo", traceparent=CALLER)
        assert batch.trace_id == TRACE_ID, "CreateBatch in the caller's trace"
        assert (await client.get_batch(batch)).trace_id == TRACE_ID
        untraced_batch = await client.create_batch(jsonl(demo_records(2)), "demo")
        assert len(untraced_batch.trace_id) == 32
        assert untraced_batch.trace_id != TRACE_ID


async def test_a_retried_jobs_attempts_are_all_in_its_one_trace(traced: Config, start_stack: StartStack) -> None:
    models = [DEMO_MODEL.model_dump(), FLAKY_MODEL.model_dump()]  # flaky: a row below 0 fails, 2 attempts
    stack = await start_stack(traced.replace(models=models))
    exporter = export_spans(stack)
    request = demo_request([[-1, 0, 0, 0]])
    request.model_name = "flaky"
    submitted = await stack.jobs.SubmitJob(request, metadata=(("traceparent", CALLER),))
    job = await finished(stack, submitted.job.job_id)
    assert job.state == job_pb2.JOB_STATE_FAILED
    assert job.attempt == 2
    await wait_for(lambda: sum(s.name == "result_commit" for s in exporter.get_finished_spans()) == 2)
    spans = [s for s in exporter.get_finished_spans() if s.name != "batch"]
    assert {s.context.trace_id for s in spans} == {int(TRACE_ID, 16)}
    names = sorted(s.name for s in spans)
    assert names == sorted(["submit", *["queued", "dispatch", "compute", "result_commit"] * 2])
    attempts = sorted((s.attributes or {})["asyncinfer.attempt"] for s in spans if s.name == "queued")
    assert attempts == [1, 2]
    assert all((s.attributes or {})["asyncinfer.failed"] for s in spans if s.name == "compute")
    # Failed attempts are failed spans, as a trace viewer shows and searches them.
    failed = [s for s in spans if s.name in ("compute", "result_commit")]
    assert all(s.status.status_code is StatusCode.ERROR for s in failed), [(s.name, s.status) for s in failed]
    assert all((s.attributes or {})["asyncinfer.error_reason"] == "MODEL_ERROR" for s in failed if s.name != "compute")
    assert all(s.status.status_code is StatusCode.UNSET for s in spans if s.name in ("submit", "queued", "dispatch"))


async def test_a_pipeline_jobs_trace_shows_each_steps_compute(traced: Config, start_stack: StartStack) -> None:
    twice = {
        **DEMO_MODEL.model_dump(include={"inputs", "outputs"}),
        "name": "twice",
        "steps": [
            {"model": "demo", "inputs": {"x": "x"}, "outputs": {"y": "once"}},
            {"model": "demo", "inputs": {"x": "once"}, "outputs": {"y": "y"}},
        ],
    }
    stack = await start_stack(traced.replace(models=[DEMO_MODEL.model_dump(), twice]))
    exporter = export_spans(stack)
    request = demo_request([[1, 2, 3, 4]])
    request.model_name = "twice"
    submitted = await stack.jobs.SubmitJob(request, metadata=(("traceparent", CALLER),))
    job = await finished(stack, submitted.job.job_id)
    assert job.state == job_pb2.JOB_STATE_SUCCEEDED
    await wait_for(lambda: any(s.name == "result_commit" for s in exporter.get_finished_spans()))
    spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == int(TRACE_ID, 16)]
    (dispatch,) = [s for s in spans if s.name == "dispatch"]
    computes = [s for s in spans if s.name == "compute"]
    assert len(computes) == 2, "one per step"
    assert {parent_of(s) for s in computes} == {hex_id(dispatch.context.span_id, 16)}


async def test_each_chunk_job_of_a_batch_is_a_trace_of_its_own(traced: Config, start_stack: StartStack) -> None:
    """A batch's chunk jobs, which its driver submits (no SubmitJob, no caller's traceparent), are
    traced as any job is: each a trace from its submit on, the span naming its batch and chunk."""
    stack = await start_stack(traced.replace(batches={"chunk_records": 100, "drive_interval_s": 0.05}))
    exporter = export_spans(stack)
    stub = batches_stub(stack.channel)
    created = await stub.CreateBatch(create_request(await upload(stack.jobs, jsonl(demo_records(150)))))
    batch = await wait_ended(stub, created.batch.batch_id)
    assert batch.state == batch_service_pb2.BATCH_STATE_COMPLETED
    assert batch.chunks_total == 2
    listed = await stack.jobs.ListJobs(job_service_pb2.ListJobsRequest(labels={BATCH_LABEL: batch.batch_id}))
    jobs = list(listed.jobs)
    assert len(jobs) == 2
    assert all(len(job.trace_id) == 32 for job in jobs), [job.trace_id for job in jobs]
    assert len({job.trace_id for job in jobs}) == 2, "a trace per chunk job"
    await wait_for(lambda: sum(s.name == "result_commit" for s in exporter.get_finished_spans()) == 2)
    for job in jobs:
        spans = [s for s in exporter.get_finished_spans() if hex_id(s.context.trace_id, 32) == job.trace_id]
        by_name = {s.name: s for s in spans}
        # A chunk of more rows than max_batch_size runs as several items: a compute span each.
        start, _, end = job.labels[CHUNK_LABEL].partition("-")
        parts = math.ceil((int(end) - int(start)) / DEMO_MODEL.max_batch_size)
        assert sorted(s.name for s in spans) == sorted(
            ["compute"] * parts + ["dispatch", "queued", "result_commit", "submit"]
        )
        submit = by_name["submit"]
        assert service_of(submit) == "asyncinfer-gateway"
        assert submit.parent is None
        assert submit.status.is_ok
        attributes = submit.attributes or {}
        assert attributes["asyncinfer.job_id"] == job.job_id
        assert attributes["asyncinfer.batch_id"] == batch.batch_id
        assert attributes["asyncinfer.chunk"] == job.labels[CHUNK_LABEL]
        for name in ("queued", "dispatch", "result_commit"):
            assert parent_of(by_name[name]) == hex_id(submit.context.span_id, 16), name
        computes = [s for s in spans if s.name == "compute"]
        assert {parent_of(s) for s in computes} == {hex_id(by_name["dispatch"].context.span_id, 16)}


async def test_a_chunk_refused_for_now_makes_no_trace_until_its_job_is_made(
    traced: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver submits a refused chunk again at a later tick: only the try that made its job
    is a trace (a failed span per tick would fill the trace store while a queue stays full)."""
    stack = await start_stack(traced.replace(batches={"chunk_records": 100, "drive_interval_s": 0.05}))
    exporter = export_spans(stack)
    enqueue = JobSubmitter.enqueue_prepared
    refusals = 3

    async def refuse_at_first(self: JobSubmitter, *args: Any, **kwargs: Any) -> JobRecord:
        nonlocal refusals
        if refusals:
            refusals -= 1
            raise ResourceExhausted("queue 'demo' is full", reason="QUEUE_FULL")
        return await enqueue(self, *args, **kwargs)

    monkeypatch.setattr(JobSubmitter, "enqueue_prepared", refuse_at_first)
    stub = batches_stub(stack.channel)
    created = await stub.CreateBatch(create_request(await upload(stack.jobs, jsonl(demo_records(150)))))
    batch = await wait_ended(stub, created.batch.batch_id)
    assert batch.state == batch_service_pb2.BATCH_STATE_COMPLETED
    assert refusals == 0
    await wait_for(lambda: sum(s.name == "result_commit" for s in exporter.get_finished_spans()) == 2)
    submits = [s for s in exporter.get_finished_spans() if s.name == "submit"]
    assert len(submits) == 2, "one per chunk job made"
    assert all(s.status.is_ok for s in submits)


async def test_a_batchs_chunk_jobs_link_to_its_create_batch_span_across_a_gateway_restart(
    traced: Config, start_stack: StartStack
) -> None:
    """CreateBatch is a span in its caller's trace, and each chunk job's trace (a new one: a batch
    has as many chunks as its file makes) links to it, also for the chunks that a gateway which
    took the batch over after a restart submits: the link is read from the batch's record."""
    config = traced.replace(
        gateway={"port": free_port()},  # the same address after the restart
        batches={"chunk_records": 100, "chunks_in_flight": 1, "drive_interval_s": 0.05},
    )
    stack = await start_stack(config, batcher=False)  # the first chunk's job waits: one in flight
    before = InMemorySpanExporter()
    stack.gateway.tracing.add_span_processor(SimpleSpanProcessor(before))
    exporter = InMemorySpanExporter()
    stack.scheduler.tracing.add_span_processor(SimpleSpanProcessor(exporter))
    stub = batches_stub(stack.channel)
    ref = await upload(stack.jobs, jsonl(demo_records(300)))
    created = await stub.CreateBatch(create_request(ref), metadata=(("traceparent", CALLER),))
    batch_id = created.batch.batch_id
    assert created.batch.trace_id == TRACE_ID
    await wait_for(lambda: any(s.name == "submit" for s in before.get_finished_spans()))
    await stack.restart_gateway()
    stack.gateway.tracing.add_span_processor(SimpleSpanProcessor(exporter))
    await stack.start_batcher()
    assert stack.batcher is not None
    stack.batcher.tracing.add_span_processor(SimpleSpanProcessor(exporter))
    batch = await wait_ended(stub, batch_id)
    assert batch.state == batch_service_pb2.BATCH_STATE_COMPLETED
    assert batch.chunks_total == 3

    (create,) = [s for s in before.get_finished_spans() if s.name == "create_batch"]
    assert service_of(create) == "asyncinfer-gateway"
    assert hex_id(create.context.trace_id, 32) == TRACE_ID
    assert parent_of(create) == "00f067aa0ba902b7"
    assert (create.attributes or {})["asyncinfer.batch_id"] == batch_id
    first = [s for s in before.get_finished_spans() if s.name == "submit"]
    after = [s for s in exporter.get_finished_spans() if s.name == "submit"]
    assert (len(first), len(after)) == (1, 2), "one chunk submitted before the restart, two after"
    for submit in first + after:
        assert (submit.attributes or {})["asyncinfer.batch_id"] == batch_id
        assert submit.parent is None, "a chunk job is a trace of its own"
        assert submit.context.trace_id != create.context.trace_id
        linked = [(link.context.trace_id, link.context.span_id) for link in submit.links]
        assert linked == [(create.context.trace_id, create.context.span_id)], submit.attributes


async def test_a_batchs_preparation_is_a_span_in_its_create_batch_trace(
    traced: Config, start_stack: StartStack
) -> None:
    """A batch's VALIDATING (its input file read, checked line by line and cut into chunks, which
    for a large file takes minutes) is a `prepare_batch` span, a child of its CreateBatch span
    (read from the batch's record: the driver prepares after CreateBatch answered), saying what it
    read and how it ended: records, invalid ones, chunks, bytes, format, the state it moved the
    batch to; a batch it fails (the file is not what input_format says) is a failed span, why as
    its description. No batcher: preparing needs none."""
    stack = await start_stack(traced.replace(batches={"chunk_records": 100, "drive_interval_s": 0.05}), batcher=False)
    exporter = InMemorySpanExporter()
    stack.gateway.tracing.add_span_processor(SimpleSpanProcessor(exporter))
    stub = batches_stub(stack.channel)
    data = jsonl(demo_records(150)) + b'{"custom_id": "bad", "inputs": {"x": "no"}}\n'
    good = await stub.CreateBatch(create_request(await upload(stack.jobs, data)), metadata=(("traceparent", CALLER),))
    wrong = await stub.CreateBatch(
        create_request(await upload(stack.jobs, data), input_format=batch_service_pb2.BATCH_INPUT_FORMAT_NPY)
    )

    def prepared(batch_id: str) -> list[ReadableSpan]:
        return [
            s
            for s in exporter.get_finished_spans()
            if s.name == "prepare_batch" and (s.attributes or {}).get("asyncinfer.batch_id") == batch_id
        ]

    await wait_for(lambda: bool(prepared(good.batch.batch_id)) and bool(prepared(wrong.batch.batch_id)))
    creates = {
        (s.attributes or {})["asyncinfer.batch_id"]: s
        for s in exporter.get_finished_spans()
        if s.name == "create_batch"
    }
    for batch in (good.batch, wrong.batch):
        (span,) = prepared(batch.batch_id)
        create = creates[batch.batch_id]
        assert service_of(span) == "asyncinfer-gateway"
        assert span.context.trace_id == create.context.trace_id
        assert parent_of(span) == hex_id(create.context.span_id, 16)
    assert hex_id(prepared(good.batch.batch_id)[0].context.trace_id, 32) == TRACE_ID  # the caller's

    (span,) = prepared(good.batch.batch_id)
    assert span.status.is_ok
    assert dict(span.attributes or {}) == {
        "asyncinfer.batch_id": good.batch.batch_id,
        "asyncinfer.tenant": "default",
        "asyncinfer.model": "demo",
        "asyncinfer.input_bytes": len(data),
        "asyncinfer.input_format": "JSONL",
        "asyncinfer.records": 151,
        "asyncinfer.invalid_records": 1,
        "asyncinfer.chunks": 2,
        "asyncinfer.batch_state": "IN_PROGRESS",
    }
    (span,) = prepared(wrong.batch.batch_id)
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "input_format says NPY, but the file is not NPY or NPZ " + (
        "(it does not start with either's magic bytes): JSONL, or no array file"
    )
    assert (span.attributes or {})["asyncinfer.batch_state"] == "FAILED"
    assert "asyncinfer.records" not in (span.attributes or {})  # nothing read past the first bytes


def test_a_new_trace_linked_to_a_sampled_span_is_sampled_whatever_the_ratio() -> None:
    """With sample_ratio 0 a new trace is not recorded, unless it links to a span that was (a
    chunk job to its batch's sampled CreateBatch): the link an operator follows leads somewhere."""
    ratio_0 = Config().replace(tracing={"enabled": True, "sample_ratio": 0.0}).tracing
    tracing = Tracing.start(ratio_0, service="gateway")
    exporter = InMemorySpanExporter()
    tracing.add_span_processor(SimpleSpanProcessor(exporter))
    unsampled = f"00-{TRACE_ID}-00f067aa0ba902b7-00"
    for name, links in (("alone", ()), ("linked", (CALLER,)), ("linked_unsampled", (unsampled,))):
        tracing.begin(name, links=links).end()
    tracing.record("recorded", start_s=1.0, end_s=2.0, links=(CALLER,))
    try:
        assert sorted(s.name for s in exporter.get_finished_spans()) == ["linked", "recorded"]
    finally:
        tracing.shutdown()
