"""The payload errors: a bad segment, a missing file, corrupt bytes.

Each message is one line naming the file, so the daemon can log it and the CLI can print
it without a traceback.
"""

from __future__ import annotations

from pathlib import Path


class PayloadError(Exception):
    """Base class of every payload error."""


class BadSegment(PayloadError):
    """A segment (or an inline array) that must not be trusted.

    `reason` is a short kind: ``not_plain_name``, ``traversal``, ``wrong_version_dir``,
    ``field``, ``dtype``, ``shape``, ``out_of_range``, ``digest``,
    ``symlink``, ``not_regular_file``, ``malformed``, ``coverage``. `file` is the segment's
    file name as given (``""`` when it has none).
    """

    def __init__(self, reason: str, file: str, detail: str) -> None:
        # The kind first: a log line cut short still says what was wrong.
        super().__init__(f"bad payload segment: {reason}: {detail} (file {file!r})")
        self.reason = reason
        self.file = file
        self.detail = detail


class PayloadMissing(PayloadError):
    """A payload file that is missing, or shorter than a segment says it is."""

    def __init__(self, path: Path, detail: str = "no such file") -> None:
        super().__init__(f"payload file {str(path)!r} missing: {detail}")
        self.path = path
        self.detail = detail


class PayloadCorrupt(PayloadError):
    """Bytes whose blake2b digest differs from the one their segment carries."""

    def __init__(self, path: Path, segment_desc: str) -> None:
        super().__init__(f"payload file {str(path)!r} corrupt: digest mismatch for {segment_desc}")
        self.path = path
        self.segment_desc = segment_desc
