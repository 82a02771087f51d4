"""Names of the per-step directories of the trainer hand-off: `step_000007`.

Batches (`<batches_dir>/step_000007/`) and weights (`<weights_dir>/step_000007/STABLE`)
share one naming rule, so it lives here once.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

STEP_DIR_PREFIX = "step_"
STEP_DIR_DIGITS = 6

# ASCII digits only: `str.isdigit` would also accept "٣" and other Unicode digits.
_STEP_DIR_NAME = re.compile(r"step_([0-9]+)")


def step_dir_name(step: int) -> str:
    """The directory name of step `step`: zero-padded to 6 digits, wider when needed.

    Raises ValueError for a negative step.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{STEP_DIR_PREFIX}{step:0{STEP_DIR_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name stands for, or None when it is not a step directory.

    Only the canonical form counts (`step_000007`, `step_1234567`): `step_7`,
    `step_0000007`, `step_7a`, `STEP_000007` and non-ASCII digits are not step
    directories. One spelling per step means two directories can never claim the same
    step.
    """
    match = _STEP_DIR_NAME.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step_dir_name(step) == name else None


def complete_steps(directory: Path, marker: str, *, above: int = -1) -> list[int]:
    """The steps above `above` whose directory in `directory` holds the file `marker`,
    sorted. Blocking: one listing, and one `stat` per step directory above `above`.

    Only canonical step directories count, never through a symbolic link; a directory
    without the marker (written, or cut short, right now) is not complete. A missing
    `directory` means none. Raises OSError when it exists but cannot be listed.
    """
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    return sorted(
        step
        for entry in entries
        if (step := parse_step_dir(entry.name)) is not None
        and step > above
        and entry.is_dir(follow_symlinks=False)
        and os.path.isfile(os.path.join(entry.path, marker))
    )
