"""The audit log `<root>/.payload-gc/audit.jsonl`: one JSON line per real collection or
wipe, so "where did my files go" always has an answer."""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Mapping

from ._layout import AUDIT_LOG_NAME

_APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def utc_timestamp(seconds: float) -> str:
    """`seconds` since the epoch as ISO 8601 in UTC, e.g. `2026-11-29T09:37:46.123+00:00`."""
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat(timespec="milliseconds")


def append_audit(control_fd: int, record: Mapping[str, object]) -> None:
    """Append `record` as one JSON line to the audit log in the open control directory.

    The line goes out in a single `write` on an `O_APPEND` descriptor, so lines from
    successive collectors never interleave. Raises `OSError` if it cannot be written.
    """
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(AUDIT_LOG_NAME, _APPEND_FLAGS, 0o644, dir_fd=control_fd)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
