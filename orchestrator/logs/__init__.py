"""structlog set-up: one short line per event for people on a TTY (`console`), JSON
lines otherwise (files, pipes, journald: what tests and tools parse)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from orchestrator.logs.console import human_line


def _stderr_logger(*_args: Any) -> structlog.PrintLogger:
    return structlog.PrintLogger(sys.stderr)


def console_processors(*, colors: bool) -> list[Any]:
    """The console's chain after the shared processors: each event as one sentence
    (`human_line`), rendered after the time and level by structlog's ConsoleRenderer."""
    return [
        human_line,
        structlog.dev.ConsoleRenderer(colors=colors, pad_event_to=0, pad_level=False),
    ]


def configure_logging(*, json_lines: bool | None = None, level: int = logging.INFO) -> None:
    """Configure structlog (and stdlib logging, which httpx uses) to render the same way.

    `json_lines=None` picks JSON lines unless stderr is a terminal.
    """
    if json_lines is None:
        json_lines = not sys.stderr.isatty()
    # A person reads the wall-clock time of day; a machine, the full UTC instant.
    stamper = (
        structlog.processors.TimeStamper(fmt="iso", utc=True)
        if json_lines
        else structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False)
    )
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        stamper,
    ]
    rendering: list[Any] = (
        [structlog.processors.JSONRenderer()]
        if json_lines
        else console_processors(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, *rendering],
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
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *rendering],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # httpx logs every request at INFO; that is noise for a daemon making thousands.
    root.setLevel(logging.WARNING)
