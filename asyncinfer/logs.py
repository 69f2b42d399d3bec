"""structlog set-up: one JSON object per line for machines, console lines for people, with context
bound per job (job_id, tenant, model, attempt) through `structlog.contextvars` or `log.bind`.

Every line names the service that logged it (`service`): a process running one service binds it
once; `asyncinfer up`, which runs them all in one process, runs each service's start and stop in a
context of its own (`service_context`), which the tasks they start inherit. Event names are
snake_case (`model_loaded`), as a log query would spell them.
"""

from __future__ import annotations

import contextvars
import logging
import sys

import structlog

from asyncinfer.config import LoggingConfig

# How a console line draws its exception: the standard library's traceback (0.4 ms of CPU for a
# NATS write refused, bench/traceback_render_cost.py). structlog's default is Rich's with every
# frame's locals (240 ms; 90 without the locals), drawn on the event loop: a burst of 65 such lines
# held a whole process for 100 s on two loaded cores. The locals also print whatever a frame holds
# (an API key, a NATS password) to the terminal.
TRACEBACKS = structlog.dev.plain_traceback

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def renders_for_people(config: LoggingConfig) -> bool:
    """Console lines when asked, or by default (`auto`) when stderr is a terminal; else JSON."""
    if config.format == "auto":
        return sys.stderr.isatty()
    return config.format == "console"


class QuietStop:
    """A processor that drops info lines once `begin` is called: `asyncinfer up`'s stop on a
    person's terminal, where each service's stop and disconnect events were ~9 lines after Ctrl-C
    for what `asyncinfer stopped` says in one. With `until_serving`, also until `serving` is called:
    `up`'s start, whose ~16 lines (nats_server_started, gateway_started, model_loaded, ...) came
    above its banner, which says what serves where. Warnings and errors still show. `applied`:
    whether configure_logging put it to work (console lines on a terminal, at info or above)."""

    def __init__(self, *, until_serving: bool = False) -> None:
        self._quiet = until_serving
        self.applied = False

    def serving(self) -> None:
        self._quiet = False

    def begin(self) -> None:
        self._quiet = True

    def __call__(
        self, _logger: object, method: str, event_dict: structlog.typing.EventDict
    ) -> structlog.typing.EventDict:
        if self._quiet and method == "info":
            raise structlog.DropEvent
        return event_dict


def configure_logging(config: LoggingConfig, *, service: str, quiet_stop: QuietStop | None = None) -> None:
    """`quiet_stop` applies to console lines on a terminal at info and above only: JSON lines, or
    lines to a file or a pipe, are read by programs and keep every event; debug asked for them all."""
    level = _LEVELS[config.level]
    tail: list[structlog.typing.Processor]
    if renders_for_people(config):
        # Local wall-clock time and the service in brackets after the event, as a person reads a
        # terminal; the console renderer formats exceptions itself (no format_exc_info).
        stamp = structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False)
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), exception_formatter=TRACEBACKS)
        tail = [_service_as_logger_name, renderer]
    else:
        stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
        tail = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        stamp,
    ]
    quieting: list[structlog.typing.Processor] = []
    if quiet_stop is not None and renders_for_people(config) and sys.stderr.isatty() and level > logging.DEBUG:
        quieting = [quiet_stop]
        quiet_stop.applied = True
    structlog.configure(
        processors=[*quieting, *shared, structlog.processors.StackInfoRenderer(), *tail],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        # Configured once per process, before anything logs: each module's logger is built on its
        # first call and kept (uncached, every call rebuilt it: 5.4 us for a line filtered out,
        # 2.0 cached; the gateway makes one per submitted job).
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    # Libraries that log through the standard library (nats, grpc) go to stderr at WARNING and up,
    # rendered as our own lines are (one JSON object a line, or console lines).
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("asyncio").addFilter(_NATS_TLS_EOF)


class _DropMessage(logging.Filter):
    """Drops a library's log line of one exact message."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self._message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self._message


# nats-py upgrades its connection to TLS with loop.start_tls, which never calls the stream
# protocol's connection_made again, so the protocol does not know it runs over TLS and answers the
# server's close as over plain TCP (keep the write side open); asyncio ignores that and says so at
# warning. Every service on TLS NATS logged it at each stop and after each refused start: a warning
# an operator can do nothing about, beside the lines that matter.
_NATS_TLS_EOF = _DropMessage("returning true from eof_received() has no effect when using ssl")


def _service_as_logger_name(
    _logger: object, _method: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    """The console renderer shows `logger_name` in brackets after the event: the service's name
    (a library's line keeps its logger's name, and the service that was running, if known)."""
    service = event_dict.pop("service", None)
    if service is not None:
        if "logger_name" in event_dict:
            event_dict["service"] = service
        else:
            event_dict["logger_name"] = service
    return event_dict


def service_context(service: str) -> contextvars.Context:
    """A copy of the current context in which log lines name `service`; run a service's start and
    stop in it (`asyncio.create_task(app.start(), context=...)`) and the tasks they start inherit it."""
    context = contextvars.copy_context()
    context.run(structlog.contextvars.bind_contextvars, service=service)
    return context
