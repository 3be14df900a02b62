"""Structured logs for every kxpu command: JSON for machines, key=value for people."""

from __future__ import annotations

import logging
import re
import sys
from typing import Literal

import structlog
from structlog.typing import EventDict, WrappedLogger

LogFormat = Literal["json", "text"]
LOG_LEVELS = ("debug", "info", "warning", "error")


# What could end or garble a line in a text log, besides the newline the logfmt renderer escapes itself: a
# device ID from a request, a file's content. Escaped so that every event stays exactly one line.
_LINE_BREAKERS = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _escape(value: str) -> str:
    return _LINE_BREAKERS.sub(_escaped, value)


def one_line(text: str) -> str:
    """``text`` with every line break and control character escaped (``\\n``, ``\\x0d``, ``\\u2028``):
    for messages that carry what a user wrote (a config key, a file's content) into one line."""
    return _escape(text.replace("\n", "\\n"))


def _one_line(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    for key, value in event_dict.items():
        if isinstance(value, str) and _LINE_BREAKERS.search(value):
            event_dict[key] = _escape(value)
    return event_dict


MAX_FIELD_CHARS = 2048  # a field longer than this is cut (a name or value sent by a client can be megabytes)


def _capped(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    """Cut every string field but a traceback to MAX_FIELD_CHARS, saying how much was left out: one bad
    request must not write megabytes into the log."""
    for key, value in event_dict.items():
        if isinstance(value, str) and len(value) > MAX_FIELD_CHARS and key != "exception":
            event_dict[key] = f"{value[:MAX_FIELD_CHARS]}…({len(value) - MAX_FIELD_CHARS} more characters)"
    return event_dict


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
            _capped,
            *([] if fmt == "json" else [_one_line]),  # JSON escapes control characters itself
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
