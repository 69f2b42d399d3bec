"""structlog set-up: one JSON object per line (or console output for people), with context bound
per job (job_id, tenant, model, attempt) through `structlog.contextvars` or `log.bind`."""

from __future__ import annotations

import logging
import sys

import structlog

from asyncinfer.config import LoggingConfig

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(config: LoggingConfig, *, service: str) -> None:
    level = _LEVELS[config.level]
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if config.format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)
    # Libraries that log through the standard library (nats, grpc) go to stderr at WARNING and up.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
