"""The run's JSON-lines files, `<run_dir>/evals.jsonl` and `<run_dir>/steps.jsonl`: one
line per eval or shipped batch, appended with one `write` of the whole line (O_APPEND),
so a reader never sees half a line but for the last one after a crash, which
`orchestrator report` passes over. Written in a worker thread; a line that cannot be
written is logged, never the end of the run."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog
import trio

log = structlog.get_logger(__name__)


def append_line(path: Path, record: Mapping[str, Any]) -> None:
    """Append `record` as one JSON line to `path` (created if missing; not through a
    link). Blocking. Raises OSError."""
    data = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(path, flags, 0o644)
    try:
        view = memoryview(data)
        while view:  # a regular file takes it whole; a short write goes on where it ended
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


async def append_run_line(
    path: Path, record: Mapping[str, Any], *, limiter: trio.CapacityLimiter
) -> None:
    """`append_line` in a worker thread; a failure is logged once per call."""
    try:
        await trio.to_thread.run_sync(append_line, path, record, limiter=limiter)
    except (OSError, ValueError) as exc:
        log.error("cannot append to the run's record", path=str(path), error=str(exc))
