"""What the operating commands `status` and `gc` share: a run's state as its files show
it, the collection bounds that follow from it, and how both print sizes and tables.

Everything here reads disk only, so it works the same whether a daemon runs or not:
- whether a daemon holds the run's lock (`<state_dir>/daemon.lock`, docs/design.md §5);
- the last shipped step: the complete batch directories are the truth, not progress;
- the latest published weights version (`STABLE` markers, in `trainer.weights_layout`);
- `progress.json`, the daemon's last saved snapshot (applied version, last bound, ...);
- the collection bounds that follow from the applied version (docs/design.md §3).

The bound arithmetic and the formatting are pure; the readers block (these commands run
no event loop).
"""

from __future__ import annotations

import fcntl
import functools
import os
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path

import attrs
from payload_gc import CollectionPlan, plan_root

from orchestrator.config import Config
from orchestrator.core.staleness import Staleness
from orchestrator.errors import UserError
from orchestrator.handoff import (
    LOCK_FILE,
    PROGRESS_FILE,
    Progress,
    load_progress,
    published_versions,
)

__all__ = [
    "DaemonLock",
    "RunMissing",
    "RunOnDisk",
    "describe_holder",
    "format_as_of",
    "format_table",
    "format_version",
    "human_bytes",
    "list_payload_root",
    "probe_daemon_lock",
    "read_run_on_disk",
]

# The holder line `hold_run_lock` writes is short; read a little more to be safe.
_HOLDER_LINE_MAX = 256
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


class RunMissing(UserError):
    """The config names a run directory that does not exist."""


def format_version(version: int) -> str:
    """A version or bound for people: `v8`; a negative bound is shown as the number."""
    return f"v{version}" if version >= 0 else str(version)


def format_as_of(unix_time: float, now: float) -> str:
    """When a snapshot was taken, for people: `2026-11-29 09:50:00 UTC, 12 s ago`.

    A time of 0 (never recorded) is `an unknown time`.
    """
    if unix_time <= 0:
        return "an unknown time"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix_time))
    return f"{stamp}, {_age(now - unix_time)}"


def describe_holder(holder: str, now: float) -> str:
    """A lock holder's line (`host=vm pid=7625 since=1796693403`) for people:
    `pid 7625 on vm, started 2026-12-08 01:30:03 UTC, 8.1 min ago`. A line in another
    form is returned as it is."""
    fields = dict(part.partition("=")[::2] for part in holder.split())
    try:
        since = float(fields["since"])
        return f"pid {fields['pid']} on {fields['host']}, started {format_as_of(since, now)}"
    except (KeyError, ValueError):
        return holder


def _age(seconds: float) -> str:
    if seconds <= -1:
        # Clocks of two hosts disagree (the daemon may run on another one).
        return f"{-seconds:.0f} s in the future"
    # A lock's `since` is rounded to the second: up to half a second ahead of the clock.
    seconds = max(seconds, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit} ago"
    return f"{seconds:.0f} s ago"


def human_bytes(size: int) -> str:
    """`size` in binary units for a table: `512 B`, `4.0 KiB`, `1.5 GiB`."""
    value = float(size)
    for unit in _UNITS[:-1]:
        if value < 1024:
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} {_UNITS[-1]}"


def format_table(
    header: Sequence[str], rows: Iterable[Sequence[str]], *, numeric: Collection[int]
) -> list[str]:
    """Lines of a table indented by two spaces, columns two spaces apart, each as wide as
    its widest cell; the columns whose index is in `numeric` are right-aligned, the others
    left-aligned. Trailing blanks are stripped. Raises ValueError for a row whose length
    differs from the header's."""
    table = [list(header), *(list(row) for row in rows)]
    if any(len(row) != len(header) for row in table):
        raise ValueError(f"every row of the table needs {len(header)} cells")
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = []
    for row in table:
        cells = [
            cell.rjust(width) if i in numeric else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append(("  " + "  ".join(cells)).rstrip())
    return lines


@attrs.frozen
class DaemonLock:
    """Whether a daemon holds the run's lock, as far as can be told from outside.

    `running` is None when it cannot be told (the lock file exists but cannot be opened
    or locked, e.g. a filesystem without `flock`). `holder` is the line the lock file
    holds (`host=... pid=... since=...`): the live daemon's when `running`, otherwise the
    last one that ran; None when the file is missing or empty.
    """

    running: bool | None
    holder: str | None
    path: Path


def probe_daemon_lock(state_dir: Path) -> DaemonLock:
    """Tell whether a daemon holds `<state_dir>/daemon.lock`, without disturbing it.

    The file is opened read-only (never created) and a non-blocking *shared* flock is
    tried: it fails only while a daemon holds its exclusive lock, and when it succeeds it
    is released at once, so at worst a daemon starting in those microseconds sees the
    run as locked and says so. Never raises for file-system problems: they make
    `running` None.
    """
    path = state_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return DaemonLock(running=False, holder=None, path=path)
    except OSError:
        return DaemonLock(running=None, holder=None, path=path)
    try:
        holder = _holder_line(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return DaemonLock(running=True, holder=holder, path=path)
        except OSError:
            return DaemonLock(running=None, holder=holder, path=path)
        # Free at once: a daemon starting now must not find the run locked by us.
        fcntl.flock(fd, fcntl.LOCK_UN)
        return DaemonLock(running=False, holder=holder, path=path)
    finally:
        os.close(fd)


def _holder_line(fd: int) -> str | None:
    try:
        raw = os.pread(fd, _HOLDER_LINE_MAX, 0)
    except OSError:
        return None
    line = raw.decode(errors="replace").strip().splitlines()
    return line[0] if line else None


@attrs.frozen
class RunOnDisk:
    """What a run's files say, each read once.

    `shipped_step` is the last complete batch directory (0: none shipped);
    `published_version` the latest `STABLE` weights (0: only the initial v0).
    `progress` is None when `progress_problem` says why: `missing` or `unreadable`.
    """

    run_dir: Path
    state_dir: Path
    batches_dir: Path
    weights_dir: Path
    payload_root: Path
    staleness: Staleness
    daemon: DaemonLock
    shipped_step: int
    published_version: int
    progress: Progress | None
    progress_problem: str | None
    # `[progress] stall_warning_s`: quiet this long, status says no batch has shipped.
    stall_warning_s: float = 0.0

    @property
    def max_off_policy_steps(self) -> int:
        return self.staleness.max_off_policy_steps

    @property
    def progress_path(self) -> Path:
        return self.state_dir / PROGRESS_FILE


def read_run_on_disk(config: Config, *, source: str = "the config") -> RunOnDisk:
    """Read the state of the run `config` describes from its files.

    Raises RunMissing when the run directory does not exist (naming `source`, the config
    file it came from), UserError (one line naming the directory) when the batches or
    weights directory cannot be listed.
    """
    if not config.run_dir.is_dir():
        raise RunMissing(f"run directory {config.run_dir} does not exist (run_dir in {source})")
    progress = load_progress(config.state_dir)
    problem = None
    if progress is None:
        # load_progress says None for both; an operator needs to know which it is.
        problem = "unreadable" if (config.state_dir / PROGRESS_FILE).exists() else "missing"
    shipped = functools.partial(config.handoff.shipped_steps, config.handoff_settings)
    published = functools.partial(
        published_versions, config.weights_dir, layout=config.trainer.weights_layout
    )
    return RunOnDisk(
        run_dir=config.run_dir,
        state_dir=config.state_dir,
        batches_dir=config.batches_dir,
        weights_dir=config.weights_dir,
        payload_root=config.payload_root,
        staleness=config.staleness,
        daemon=probe_daemon_lock(config.state_dir),
        shipped_step=_last(_listed(shipped, config.batches_dir, "batches")),
        published_version=_last(_listed(published, config.weights_dir, "weights")),
        progress=progress,
        progress_problem=problem,
        stall_warning_s=config.progress.stall_warning_s,
    )


def _listed(list_steps: Callable[[], list[int]], directory: Path, what: str) -> list[int]:
    """`list_steps()`, which lists `directory`; an OSError as one line naming it."""
    try:
        return list_steps()
    except OSError as exc:
        raise UserError(f"cannot list the {what} directory {directory}: {exc.strerror}") from None


def _last(steps: list[int]) -> int:
    return steps[-1] if steps else 0


def list_payload_root(root: Path, bound: int) -> CollectionPlan:
    """Plan a collection of `root` at `bound` from its direct children alone, listed by
    payload_gc (no link followed, mount points flagged): no directory is entered or
    measured (every usage is None), so it is cheap however many files the root holds.
    For the marker and foreign-entry checks before a real collection.

    Raises RootMissing when `root` does not exist, RootRefused when it is a symbolic
    link or not a directory (as the collector would), PayloadGCError when it cannot be
    opened.
    """
    return plan_root(root, bound, measure=False)
