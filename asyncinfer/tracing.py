"""OpenTelemetry traces of jobs: one trace per job, from the caller's W3C `traceparent` through the
gateway, the scheduler and the batcher.

The trace context travels as a W3C traceparent string (`00-<trace id>-<span id>-<flags>`): in the
caller's gRPC metadata, on the job's record (which the work message is, so NATS carries it with the
record), and on the work order to the batcher (`WorkOrder.traceparent`). Each hop starts its spans
as children of the one it was handed:

    gateway    submit                         (parent: the caller's traceparent, if any)
    scheduler    queued, dispatch, result_commit   (parent: submit, from the record)
    batcher        compute                    (parent: dispatch, from the order; linked to the batch)
    batcher    batch                          (a trace of its own, linking every job it held)

A file batch (BatchService) is a trace of its CreateBatch, its chunk jobs traces of their own linked
to it (a batch has as many chunks as its file makes):

    gateway    create_batch                   (parent: the caller's traceparent, if any)
    gateway      prepare_batch                (parent: create_batch, from the batch's record)
    gateway    submit                         (a chunk job's: a new trace, linked to create_batch)

Each service has a TracerProvider of its own (not the global one), so that `asyncinfer up` and the
tests, which run all three in one process, still name each span's service (`service.name`).

Off (the default) costs nothing per job: `Tracing.off()` makes no provider, callers check
`enabled` before building anything, and opentelemetry is not even imported (it is the `tracing`
extra; a base or server install runs without it).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import structlog

from asyncinfer.config import TracingConfig
from asyncinfer.contract import TRACEPARENT_HEADER
from asyncinfer.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

log = structlog.get_logger("asyncinfer.tracing")

# The W3C header: the gRPC metadata key (lower case, as gRPC hands metadata over) and the work
# message's NATS header.
TRACEPARENT = TRACEPARENT_HEADER
OTLP_ENDPOINT_VARIABLE = "OTEL_EXPORTER_OTLP_ENDPOINT"

AttributeValue = str | int | float | bool

# How long a stopping service gives its exporter to send the spans it holds: past it, the exporter
# stops retrying (a collector that is away) and the spans are dropped.
SHUTDOWN_EXPORT_S = 2.0


def trace_id_of(traceparent: str) -> str:
    """The trace ID (32 hex digits) of a W3C traceparent; "" when there is none."""
    parts = traceparent.split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else ""


def trace_sampled_of(traceparent: str) -> bool | None:
    """Whether the trace of a W3C traceparent was sampled (its flags' sampled bit: its spans are
    recorded and exported, a trace viewer shows it); None when there is no trace ID."""
    parts = traceparent.split("-")
    if not trace_id_of(traceparent) or len(parts[3]) != 2:
        return None
    try:
        return bool(int(parts[3], 16) & 0x01)
    except ValueError:
        return None


def trace_fields(traceparent: str) -> dict[str, str]:
    """What a log line about a traced job adds (`trace_id`); nothing for an untraced one."""
    return {"trace_id": trace_id_of(traceparent)} if traceparent else {}


def traceparent_in(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The caller's traceparent in gRPC invocation metadata ("" when it sent none)."""
    for key, value in metadata or ():
        if key == TRACEPARENT and isinstance(value, str):
            return value
    return ""


class Tracing:
    """One service's tracer. `Tracing.off()` when tracing is not configured: `enabled` is False
    and nothing else may be called."""

    def __init__(self, provider: TracerProvider | None = None, *, otlp_endpoint: str = "") -> None:
        self._provider = provider
        self._tracer: Tracer | None = None if provider is None else provider.get_tracer("asyncinfer")
        self.enabled = provider is not None
        self.otlp_endpoint = otlp_endpoint  # where spans are exported ("": nowhere, or off)
        self._stop_exporting: Callable[[], None] | None = None

    @classmethod
    def off(cls) -> Tracing:
        return cls()

    @classmethod
    def start(cls, config: TracingConfig, *, service: str, environ: Mapping[str, str] | None = None) -> Tracing:
        """The service's tracer per `config` (off unless enabled), exporting over OTLP/gRPC to
        `otlp_endpoint` or $OTEL_EXPORTER_OTLP_ENDPOINT when either is set."""
        if not config.enabled:
            return cls.off()
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased
        except ImportError as exc:
            raise ConfigError(
                f"tracing.enabled needs OpenTelemetry: pip install 'asyncinfer[tracing]' ({exc})"
            ) from exc
        resource = Resource.create(
            {"service.name": f"{config.service_name}-{service}", "service.namespace": config.service_name}
        )
        provider = TracerProvider(resource=resource, sampler=ParentBased(_linked_or_ratio(config.sample_ratio)))
        environ = os.environ if environ is None else environ
        endpoint = config.otlp_endpoint or environ.get(OTLP_ENDPOINT_VARIABLE, "")
        exporter = None
        if endpoint:
            exporter = _service_exporter(endpoint, service=service)
            # Batched, in the SDK's own thread: exporting never runs on the event loop.
            provider.add_span_processor(BatchSpanProcessor(exporter))
        log.info("tracing_on", service=service, otlp_endpoint=endpoint or None, sample_ratio=config.sample_ratio)
        tracing = cls(provider, otlp_endpoint=endpoint)
        tracing._stop_exporting = exporter.shutdown if exporter is not None else None
        return tracing

    def add_span_processor(self, processor: SpanProcessor) -> None:
        """Another destination for this service's spans (the tests' in-memory exporter)."""
        assert self._provider is not None, "tracing is off"
        self._provider.add_span_processor(processor)

    def shutdown(self) -> None:
        """Flushes and stops the exporters (blocking: call it off the event loop), within about
        SHUTDOWN_EXPORT_S: a collector that is away would otherwise hold the service's stop for
        the exporter's retries (~10 s each). Idempotent."""
        if self._provider is None:
            return
        give_up = None
        if self._stop_exporting is not None:
            give_up = threading.Timer(SHUTDOWN_EXPORT_S, self._give_up_exporting, args=(self._stop_exporting,))
            give_up.daemon = True
            give_up.start()
        try:
            self._provider.shutdown()
        finally:
            if give_up is not None:
                give_up.cancel()

    def _give_up_exporting(self, stop_exporting: Callable[[], None]) -> None:
        """The shutdown's time limit passed with spans not yet taken by the collector (it is away,
        or slow): they are dropped, the exporter's retries (~10 s each) ended. Logged: spans were
        lost, and this, not the collector, ended the stop's wait."""
        log.warning("trace_export_given_up", otlp_endpoint=self.otlp_endpoint, after_s=SHUTDOWN_EXPORT_S)
        stop_exporting()

    @contextmanager
    def span(
        self,
        name: str,
        *,
        parent: str = "",
        server: bool = False,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> Iterator[TraceSpan]:
        """A span around the block, a child of `parent` (a traceparent; "": a new trace). An
        exception leaving the block is recorded on it and marks it failed."""
        from opentelemetry.trace import SpanKind, use_span

        assert self._tracer is not None, "tracing is off"
        span = self._tracer.start_span(
            name,
            context=_context_of(parent),
            kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
            attributes=attributes,
        )
        with use_span(span, end_on_exit=True, record_exception=True, set_status_on_exception=True):
            yield TraceSpan(span)

    def begin(
        self,
        name: str,
        *,
        parent: str = "",
        attributes: Mapping[str, AttributeValue] | None = None,
        links: Sequence[str] = (),
    ) -> TraceSpan:
        """A span started now, a child of `parent` ("": a new trace), linked to the spans `links`
        (traceparents), that lasts until its `end()`: one never ended is never exported, for a try
        whose outcome decides whether it happened at all (a batch's chunk that waits for room makes
        no job, so no trace: BatchDriver)."""
        assert self._tracer is not None, "tracing is off"
        return TraceSpan(
            self._tracer.start_span(name, context=_context_of(parent), attributes=attributes, links=_links_of(links))
        )

    def record(
        self,
        name: str,
        *,
        parent: str = "",
        start_s: float,
        end_s: float,
        attributes: Mapping[str, AttributeValue] | None = None,
        links: Sequence[str] = (),
        error: str = "",
    ) -> str:
        """A span that already happened (Unix seconds), a child of `parent` ("": a new trace),
        linked to the spans `links` (traceparents); `error`: it failed, and why. Returns its own
        traceparent."""
        assert self._tracer is not None, "tracing is off"
        span = self._tracer.start_span(
            name,
            context=_context_of(parent),
            attributes=attributes,
            links=_links_of(links),
            start_time=round(start_s * 1e9),
        )
        recorded = TraceSpan(span)
        if error:
            recorded.fail(error)
        span.end(end_time=round(end_s * 1e9))
        return recorded.traceparent


class TraceSpan:
    """A span in progress, as callers see it: its traceparent (what the next hop continues) and
    its attributes."""

    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    @property
    def traceparent(self) -> str:
        context = self._span.get_span_context()
        return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"

    def set(self, key: str, value: AttributeValue) -> None:
        self._span.set_attribute(key, value)

    def fail(self, description: str) -> None:
        """Marks the span failed (status ERROR), as a trace viewer shows and searches it."""
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, description))

    def end(self) -> None:
        """Ends a span of `Tracing.begin` (it is exported then)."""
        self._span.end()


def _linked_or_ratio(ratio: float) -> Any:
    """The sampler of new traces: sampled when a span they link to was (a batch's chunk job linked
    to its sampled CreateBatch, a batcher's batch span to a sampled job's dispatch), so that a
    link followed from a recorded trace leads to a recorded one; else `ratio` of them."""
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult, TraceIdRatioBased

    class LinkedOrRatio(Sampler):
        def __init__(self) -> None:
            self._ratio = TraceIdRatioBased(ratio)

        def should_sample(
            self,
            parent_context: Any,
            trace_id: int,
            name: str,
            kind: Any = None,
            attributes: Any = None,
            links: Sequence[Any] | None = None,
            trace_state: Any = None,
        ) -> SamplingResult:
            if any(link.context.trace_flags.sampled for link in links or ()):
                return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
            return self._ratio.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

        def get_description(self) -> str:
            return f"LinkedOrRatio{{{ratio}}}"

    return LinkedOrRatio()


def _service_exporter(endpoint: str, *, service: str) -> SpanExporter:
    """An OTLP/gRPC exporter whose lines name the service (its export thread binds it: a thread
    does not inherit the context the service was started in) and whose shutdown may come twice
    (once from Tracing.shutdown's time limit, once from the SDK) without a warning."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    class ServiceExporter(OTLPSpanExporter):
        _bound = False
        _stopped = False

        def export(self, spans: Any) -> Any:
            if not self._bound:
                structlog.contextvars.bind_contextvars(service=service)
                self._bound = True
            return super().export(spans)

        def shutdown(self, *args: Any, **kwargs: Any) -> None:
            if not self._stopped:
                self._stopped = True
                super().shutdown(*args, **kwargs)

    return ServiceExporter(endpoint=endpoint)


def _context_of(traceparent: str) -> Any:
    """The OpenTelemetry context whose current span is the one `traceparent` names; an empty
    context (a new trace) for "" or a malformed one (W3C: ignore it, never fail the request)."""
    from opentelemetry.context import Context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if not traceparent:
        return Context()
    return TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent}, context=Context())


def _span_context_of(traceparent: str) -> Any:
    from opentelemetry.trace import get_current_span

    return get_current_span(_context_of(traceparent)).get_span_context()


def _links_of(traceparents: Sequence[str]) -> list[Any]:
    """Links to the spans `traceparents` name; a malformed one (an invalid context) is left out."""
    from opentelemetry.trace import Link

    contexts = [_span_context_of(traceparent) for traceparent in traceparents if traceparent]
    return [Link(context) for context in contexts if context.is_valid]
