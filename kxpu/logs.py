"""Structured logs for every kxpu command: JSON for machines, key=value for people."""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

LogFormat = Literal["json", "text"]
LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str = "info", fmt: LogFormat = "text") -> None:
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.processors.LogfmtRenderer(
            key_order=["timestamp", "level", "component", "event"], bool_as_flag=False
        )
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    """A logger whose lines carry ``logger=<name>``; safe to create at import, before configuration.

    A lazy proxy: binding eagerly at import would freeze structlog's default configuration.
    """
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(component=name)
    return logger


def error_text(exc: BaseException) -> str:
    """``Type: message`` of the failure that matters: the leaves of an exception group (a TaskGroup's
    "unhandled errors in a TaskGroup (1 sub-exception)" says nothing), joined by ``; ``."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(error_text(inner) for inner in exc.exceptions)
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def log_failure(
    logger: structlog.typing.FilteringBoundLogger, event: str, exc: BaseException, **fields: object
) -> None:
    """One error line naming what failed (``error=Type: message``); the traceback only at debug level,
    for whoever is debugging: an operator's log is read line by line, and a traceback is a bug report."""
    logger.error(event, error=error_text(exc), **fields)
    logger.debug(f"{event}: traceback", exc_info=exc, **fields)
