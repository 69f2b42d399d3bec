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

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def renders_for_people(config: LoggingConfig) -> bool:
    """Console lines when asked, or by default (`auto`) when stderr is a terminal; else JSON."""
    if config.format == "auto":
        return sys.stderr.isatty()
    return config.format == "console"


def configure_logging(config: LoggingConfig, *, service: str) -> None:
    level = _LEVELS[config.level]
    renderer: structlog.typing.Processor
    tail: list[structlog.typing.Processor]
    if renders_for_people(config):
        # The console renderer formats exceptions itself (format_exc_info would turn them into a string first).
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        tail = [renderer]
    else:
        renderer = structlog.processors.JSONRenderer()
        tail = [structlog.processors.format_exc_info, renderer]
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(), *tail],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
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


def service_context(service: str) -> contextvars.Context:
    """A copy of the current context in which log lines name `service`; run a service's start and
    stop in it (`asyncio.create_task(app.start(), context=...)`) and the tasks they start inherit it."""
    context = contextvars.copy_context()
    context.run(structlog.contextvars.bind_contextvars, service=service)
    return context
