"""The daemon's own state on disk: `<run_dir>/orchestrator/` (docs/design.md §5).

- `progress.json`: saved atomically after every shipped batch and every applied version,
  for `orchestrator status` and for people. It is informative: the source of truth for
  "shipped" is the set of complete batch directories, so a crash between shipping a batch
  and saving progress neither re-ships nor loses a batch.
- `daemon.lock`: one daemon per run, an advisory `flock` the kernel releases when the
  process dies, even by SIGKILL, so a crash never leaves a lock to clean up by hand.

Blocking functions: call them from a worker thread in async code.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from orchestrator.errors import UserError
from orchestrator.handoff.durable import replace_file_atomically

PROGRESS_FILE = "progress.json"
LOCK_FILE = "daemon.lock"


@attrs.frozen
class TopError:
    """The most common error text of one kind since the last shipped batch, and how often
    it was seen (what `orchestrator status` shows of a run where nothing ships)."""

    kind: str
    text: str
    count: int

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def describe(self) -> str:
        return f"{self.kind}: {self.text} ({self.count}x)"


@attrs.frozen
class ProgressLine:
    """The figures of one `progress` log line (orchestrator/daemon/reporting/progress_report.py).

    `step` is the batch being filled, `queued_samples` the samples ready for it of the
    `needed_samples` a batch takes, `inflight_rollouts` the rollouts running of the
    `inflight_limit` the dispatcher obeys (0: not recorded). Over the
    `interval_s` seconds since the previous line (or the daemon's start):
    `rollouts_per_s` (completed rollouts), `discards` by reason and `failures` by kind
    (the reasons and kinds that grew only, as in the stall warning), by environment the
    rollouts `scored` and their `mean_reward` (the envs that scored any only), the
    `discarded_bytes` of payload files deleted with discards, and `cpu_s_per_rollout`,
    the daemon process's CPU seconds per completed rollout (None: none completed, or a
    file written before it was recorded).
    """

    step: int
    queued_samples: int
    needed_samples: int
    inflight_rollouts: int
    interval_s: float
    rollouts_per_s: float
    discards: Mapping[str, int] = attrs.field(factory=dict)
    failures: Mapping[str, int] = attrs.field(factory=dict)
    inflight_limit: int = 0
    scored: Mapping[str, int] = attrs.field(factory=dict)
    mean_reward: Mapping[str, float] = attrs.field(factory=dict)
    # Bytes of the payload files deleted with discarded rollouts in the interval: what
    # they cost the disk, written and deleted for nothing.
    discarded_bytes: int = 0
    cpu_s_per_rollout: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The line's fields, as logged and as `progress.json` holds them."""
        fields = attrs.asdict(self)
        for name in ("discards", "failures", "scored", "mean_reward"):
            fields[name] = dict(getattr(self, name))
        return fields

    @classmethod
    def from_json(cls, raw: Any) -> ProgressLine:
        return cls(
            step=int(raw["step"]),
            queued_samples=int(raw["queued_samples"]),
            needed_samples=int(raw["needed_samples"]),
            inflight_rollouts=int(raw["inflight_rollouts"]),
            interval_s=float(raw["interval_s"]),
            rollouts_per_s=float(raw["rollouts_per_s"]),
            discards=_counts(raw.get("discards")),
            failures=_counts(raw.get("failures")),
            inflight_limit=int(raw.get("inflight_limit", 0)),
            scored=_counts(raw.get("scored")),
            mean_reward={str(k): float(v) for k, v in dict(raw.get("mean_reward") or {}).items()},
            discarded_bytes=int(raw.get("discarded_bytes", 0)),
            cpu_s_per_rollout=(
                None if raw.get("cpu_s_per_rollout") is None else float(raw["cpu_s_per_rollout"])
            ),
        )


@attrs.frozen
class Progress:
    """A snapshot of the run, as `progress.json` holds it.

    Times are Unix times. `started_at` is when the daemon started, `last_shipped_at` when
    it last shipped a batch (None: none since it started). `failures` are totals by kind
    since it started; `recent_discards`, `recent_failures` and `top_error` (the most
    common error text) count since the last shipped batch, or since the start.
    `needed_samples` is what a batch takes (0: not recorded); `last_report` the figures
    of the daemon's last `progress` log line and `last_report_at` when it was logged
    (None: no line yet, or `[progress] report_interval_s = 0`); `prompts_drawn` the
    prompts drawn from the environment so far. Files written before
    these keys existed read with their defaults.
    """

    step: int  # the last shipped batch (0: none)
    applied_version: int
    bound: int | None  # the last collection bound (None: no collection yet)
    inflight_rollouts: int = 0
    inflight_limit: int = 0
    queued_samples: int = 0
    discards: Mapping[str, int] = attrs.field(factory=dict)
    updated_at: float = 0.0
    pid: int = 0
    started_at: float = 0.0
    last_shipped_at: float | None = None
    failures: Mapping[str, int] = attrs.field(factory=dict)
    recent_discards: Mapping[str, int] = attrs.field(factory=dict)
    recent_failures: Mapping[str, int] = attrs.field(factory=dict)
    top_error: TopError | None = None
    needed_samples: int = 0
    last_report: ProgressLine | None = None
    last_report_at: float | None = None
    # Prompts the run has drawn from its environment: a resumed run goes on with the next.
    prompts_drawn: int = 0

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def save_progress(state_dir: Path, progress: Progress) -> None:
    """Write `progress.json` atomically (temp file, fsync, rename)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    data = json.dumps(progress.to_json(), indent=1, sort_keys=True).encode()
    replace_file_atomically(state_dir / PROGRESS_FILE, data)


def load_progress(state_dir: Path) -> Progress | None:
    """The saved progress, or None when there is none or it cannot be read as progress."""
    try:
        raw = json.loads((state_dir / PROGRESS_FILE).read_bytes())
        return Progress(
            step=int(raw["step"]),
            applied_version=int(raw["applied_version"]),
            bound=None if raw["bound"] is None else int(raw["bound"]),
            inflight_rollouts=int(raw.get("inflight_rollouts", 0)),
            inflight_limit=int(raw.get("inflight_limit", 0)),
            queued_samples=int(raw.get("queued_samples", 0)),
            discards={str(k): int(v) for k, v in dict(raw.get("discards", {})).items()},
            updated_at=float(raw.get("updated_at", 0.0)),
            pid=int(raw.get("pid", 0)),
            started_at=float(raw.get("started_at", 0.0)),
            last_shipped_at=_optional_float(raw.get("last_shipped_at")),
            failures=_counts(raw.get("failures")),
            recent_discards=_counts(raw.get("recent_discards")),
            recent_failures=_counts(raw.get("recent_failures")),
            top_error=_top_error(raw.get("top_error")),
            needed_samples=int(raw.get("needed_samples", 0)),
            last_report=_last_report(raw.get("last_report")),
            last_report_at=_optional_float(raw.get("last_report_at")),
            prompts_drawn=int(raw.get("prompts_drawn", 0)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _counts(value: Any) -> dict[str, int]:
    return {str(k): int(v) for k, v in dict(value or {}).items()}


def _top_error(value: Any) -> TopError | None:
    if value is None:
        return None
    return TopError(str(value["kind"]), str(value["text"]), int(value["count"]))


def _last_report(value: Any) -> ProgressLine | None:
    return None if value is None else ProgressLine.from_json(value)


class RunLocked(UserError):
    """Another daemon holds this run's lock."""


@contextlib.contextmanager
def hold_run_lock(state_dir: Path) -> Iterator[None]:
    """Hold `<state_dir>/daemon.lock` for the duration; one daemon per run.

    Raises RunLocked (one line, naming the holder) when another live process holds it.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            raise RunLocked(
                f"another orchestrator is running for this run ({holder}); lock file {path}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            f"host={socket.gethostname()} pid={os.getpid()} since={time.time():.0f}\n".encode(),
            0,
        )
        yield
    finally:
        os.close(fd)
