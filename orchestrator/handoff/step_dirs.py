"""The per-step directories of the trainer hand-off: `step_000007`, and when one is complete.

Batches (`<batches_dir>/step_000007/batch.json`) and weights
(`<weights_dir>/step_000007/STABLE`) share one naming rule and one completeness rule (a
real directory holding its marker file, written last), so they live here once.
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


def step_dir(parent: Path, step: int) -> Path:
    """The directory of step `step` in `parent`: `<parent>/step_000007`.

    Raises ValueError for a negative step.
    """
    return parent / step_dir_name(step)


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


def is_complete_step_dir(path: Path, marker: str) -> bool:
    """Whether `path` is a complete step directory: a real directory (not a symbolic link)
    holding the file `marker`. Blocking.

    A directory without the marker (being written, or cut short, right now) is not
    complete.
    """
    return path.is_dir() and not path.is_symlink() and (path / marker).is_file()


def complete_steps(directory: Path, marker: str, *, above: int = -1) -> list[int]:
    """The steps above `above` whose directory in `directory` is complete (holds the file
    `marker`), sorted. Blocking: one listing, and one `stat` per step directory above
    `above`.

    Only canonical step directories count, by the rule of `is_complete_step_dir` (checked
    here from the listing's file types, to spare a `stat` per directory). A missing
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
