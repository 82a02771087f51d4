"""A sample left out of a step because its payload files could not be read, and why.

Both sides of the hand-off drop such a sample rather than the step: the trainer reading a
native batch (`read_batch(..., on_corrupt="drop")`), and the daemon writing a format that
carries payload bytes (prime-rl's, which reads the routing rows when it ships).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen
class DroppedSample:
    """A sample `read_batch(..., on_corrupt="drop")` left out of a batch, and why.

    `index` is its place in the batch file's `samples`; `server` is the inference server
    that generated it (None when the batch does not say). `reason` is
    ``payload_corrupt`` (a digest mismatch; only with `verify`), ``payload_missing`` (a
    payload file or its `payload_dir` missing, or a file shorter than a segment needs) or
    ``bad_payload_file`` (a symbolic link or not a regular file where a payload file
    should be). `file` is the path concerned and `error` the reader's one-line message.
    """

    index: int
    group_id: str
    rollout_id: str
    server: str | None
    reason: str
    file: str
    error: str

    def __str__(self) -> str:
        server = self.server if self.server is not None else "unknown"
        return (
            f"samples[{self.index}] (rollout {self.rollout_id} of group {self.group_id}, "
            f"server {server}) dropped: {self.reason}: {self.error}"
        )


class NothingToShip(Exception):
    """Every sample of the step was dropped (its payload could not be read): nothing was
    written. `dropped` says which and why."""

    def __init__(self, step: int, dropped: Sequence[DroppedSample]) -> None:
        super().__init__(f"step {step}: every sample's payload is unreadable; nothing shipped")
        self.step = step
        self.dropped = tuple(dropped)
