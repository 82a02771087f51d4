"""Names of the entries payload_gc itself keeps inside a payload root."""

from __future__ import annotations

#: Marker file saying "this directory is a payload root; wiping it is expected".
MARKER_NAME = ".payload-root"
#: The collector's own directory: its lock file and its audit log.
CONTROL_DIR_NAME = ".payload-gc"
LOCK_NAME = "lock"
AUDIT_LOG_NAME = "audit.jsonl"

#: Entries of the root that belong to payload_gc: never collected, never foreign.
CONTROL_NAMES = frozenset({MARKER_NAME, CONTROL_DIR_NAME})
