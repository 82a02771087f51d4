"""structlog set-up: a console renderer on a TTY, JSON lines otherwise."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def _stderr_logger(*_args: Any) -> structlog.PrintLogger:
    return structlog.PrintLogger(sys.stderr)


def configure_logging(*, json_lines: bool | None = None, level: int = logging.INFO) -> None:
    """Configure structlog (and stdlib logging, which httpx uses) to render the same way.

    `json_lines=None` picks JSON lines unless stderr is a terminal.
    """
    if json_lines is None:
        json_lines = not sys.stderr.isatty()
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_lines
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # Look sys.stderr up at each logger's creation, not once here: a process (or a
        # test run) may replace it after logging is configured.
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # httpx logs every request at INFO; that is noise for a daemon making thousands.
    root.setLevel(logging.WARNING)
