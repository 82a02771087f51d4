"""The per-step directories of the trainer hand-off: `step_000007`, and when one is complete.

Batches (`<batches_dir>/step_000007/batch.bin`) and weights
(`<weights_dir>/step_000007/STABLE`) share one naming rule and one completeness rule (a
real directory holding its marker file, written last), so they live here once.

The naming rule has two layouts. "native", ours, pads the step to 6 digits
(`step_000007`); native batches use it. "prime-rl" spells it without padding (`step_7`), as
prime-rl names its `broadcasts/step_7/` weights and `rollouts/step_7/` input directories
(`prime_rl.utils.pathing.get_step_path`), so the daemon can follow that trainer's weights
(`[trainer] weights_layout`) and ship its input (`[trainer] format`). Either way each step
has exactly one spelling.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Literal, get_args

StepLayout = Literal["native", "prime-rl"]
STEP_LAYOUTS: tuple[StepLayout, ...] = get_args(StepLayout)

STEP_DIR_PREFIX = "step_"
STEP_DIR_DIGITS = 6

# The fewest digits each layout writes a step with: "prime-rl" writes 1 (no padding).
_LAYOUT_DIGITS: dict[StepLayout, int] = {"native": STEP_DIR_DIGITS, "prime-rl": 1}

# ASCII digits only: `str.isdigit` would also accept "٣" and other Unicode digits.
_STEP_DIR_NAME = re.compile(r"step_([0-9]+)")


def step_dir_name(step: int, layout: StepLayout = "native") -> str:
    """The directory name of step `step` in `layout`: `step_000007` ("native": zero-padded
    to 6 digits, wider when needed) or `step_7` ("prime-rl": no padding).

    Raises ValueError for a negative step or an unknown layout.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{STEP_DIR_PREFIX}{step:0{_layout_digits(layout)}d}"


def step_dir(parent: Path, step: int, layout: StepLayout = "native") -> Path:
    """The directory of step `step` in `parent`: `<parent>/step_000007` ("native") or
    `<parent>/step_7` ("prime-rl").

    Raises ValueError for a negative step or an unknown layout.
    """
    return parent / step_dir_name(step, layout)


def parse_step_dir(name: str, layout: StepLayout = "native") -> int | None:
    """The step a directory name stands for in `layout`, or None when it is not a step
    directory of that layout.

    Only the layout's canonical spelling counts, the one `step_dir_name` writes. "native":
    `step_000007`, `step_1234567`, but not `step_7` or `step_0000007`. "prime-rl": `step_7`,
    `step_0`, but not `step_07` or `step_000007`. In both, `step_7a`, `STEP_7` and
    non-ASCII digits are not step directories. One spelling per step means two
    directories can never claim the same step. Raises ValueError for an unknown layout.
    """
    _layout_digits(layout)  # an unknown layout is an error, whatever the name
    match = _STEP_DIR_NAME.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step_dir_name(step, layout) == name else None


def _layout_digits(layout: StepLayout) -> int:
    """The fewest digits `layout` writes a step with. Raises ValueError for an unknown
    layout (a caller's typo must not read as "no step directory")."""
    try:
        return _LAYOUT_DIGITS[layout]
    except KeyError:
        choices = ", ".join(repr(choice) for choice in STEP_LAYOUTS)
        raise ValueError(f"unknown step layout {layout!r} (one of {choices})") from None


def is_complete_step_dir(path: Path, marker: str) -> bool:
    """Whether `path` is a complete step directory: a real directory (not a symbolic link)
    holding the file `marker`. Blocking.

    A directory without the marker (being written, or cut short, right now) is not
    complete.
    """
    return path.is_dir() and not path.is_symlink() and (path / marker).is_file()


def complete_steps(
    directory: Path, marker: str, *, above: int = -1, layout: StepLayout = "native"
) -> list[int]:
    """The steps above `above` whose directory in `directory` is complete (holds the file
    `marker`), sorted. Blocking: one listing, and one `stat` per step directory above
    `above`.

    Only the canonical step directories of `layout` count (`parse_step_dir`), by the rule
    of `is_complete_step_dir` (checked here from the listing's file types, to spare a
    `stat` per directory). A missing `directory` means none. Raises OSError when it exists
    but cannot be listed, ValueError for an unknown layout.
    """
    _layout_digits(layout)  # an unknown layout is an error, even in an empty directory
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    return sorted(
        step
        for entry in entries
        if (step := parse_step_dir(entry.name, layout)) is not None
        and step > above
        and entry.is_dir(follow_symlinks=False)
        and os.path.isfile(os.path.join(entry.path, marker))
    )


#: How many candidate steps `newest_complete_step` opens by their exact path before it
#: lists the directory for the older ones. A running daemon's candidates are the versions
#: it may apply, at most `max_async_steps + 1` of them; only a resumed run has more.
EXACT_PROBES = 16

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# A marker that is a FIFO must not block the open: it is refused after `fstat`.
_MARKER_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC


def newest_complete_step(
    directory: Path,
    marker: str,
    *,
    above: int,
    up_to: int,
    layout: StepLayout = "native",
    exact_probes: int = EXACT_PROBES,
) -> int | None:
    """The newest step in `above + 1 .. up_to` whose directory in `directory` is complete
    (holds the file `marker`), or None. Blocking.

    Each candidate is checked by opening its exact path, newest first, and the first
    complete one is the answer: `directory` is opened, then `<step dir>` in it (never
    through a symbolic link), then `marker` in that (a regular file; a link to one counts,
    as in `complete_steps`). Opening is what makes a network filesystem's client
    revalidate a name (NFS close-to-open), where a listing or a `stat` may be served from
    its caches for many seconds: on sshfs with its default cache a new step directory
    stays out of listings for 20 s, and is opened at once. Only the newest `exact_probes`
    candidates are opened; when none of them is complete and older candidates remain, one
    listing (`complete_steps`) answers for those.

    A missing `directory` means None. Any other failure to open a candidate (missing,
    a link, not a directory, not readable) means it is not complete yet. Raises OSError
    when `directory` exists but cannot be opened, ValueError for an unknown layout.
    """
    _layout_digits(layout)  # an unknown layout is an error, even with no candidate
    lowest = max(above + 1, 0)
    if up_to < lowest:
        return None
    try:
        directory_fd = os.open(directory, _DIR_FLAGS)
    except FileNotFoundError:
        return None
    try:
        newest = range(up_to, max(lowest - 1, up_to - exact_probes), -1)
        for step in newest:
            if _opens_complete(directory_fd, step_dir_name(step, layout), marker):
                return step
    finally:
        os.close(directory_fd)
    rest_up_to = up_to - exact_probes
    if rest_up_to < lowest:
        return None
    older = [
        s for s in complete_steps(directory, marker, above=above, layout=layout) if s <= rest_up_to
    ]
    return older[-1] if older else None


def _opens_complete(directory_fd: int, name: str, marker: str) -> bool:
    """Whether `<directory_fd>/name` opens as a directory (not through a link) holding a
    `marker` that opens as a regular file."""
    try:
        step_fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=directory_fd)
    except OSError:
        return False
    try:
        marker_fd = os.open(marker, _MARKER_FLAGS, dir_fd=step_fd)
    except OSError:
        return False
    finally:
        os.close(step_fd)
    try:
        return stat.S_ISREG(os.fstat(marker_fd).st_mode)
    except OSError:
        return False
    finally:
        os.close(marker_fd)
