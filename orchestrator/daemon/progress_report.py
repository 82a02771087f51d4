"""The progress line: every `[progress] report_interval_s` an info line `progress`.

At scale a batch takes minutes to fill; between `shipped batch` lines the daemon would
otherwise say nothing, and a run that discards every rollout would look the same as one
that fills slowly until the stall warning (orchestrator/daemon/stall.py). The line says:

- `step`: the batch being filled; `queued_samples` ready for it of the `needed_samples`
  a batch takes; `inflight_rollouts` running;
- over the `interval_s` seconds since the previous line (or since the daemon started):
  `rollouts_per_s` (rollouts completed, `RunState.rollouts["completed"]`), `discards` by
  reason and `failures` by kind, the reasons and kinds that grew only.

It reads the same `Figures` as the stall warning, so both name the same step, samples,
discard reasons (the sink's) and failure kinds (`RunState.failures`) under the same keys;
only their windows differ (the warning counts since the last shipped batch). No line is
logged once nothing is left to ship (`max_steps` shipped, or stopping).

`progress_line` is the arithmetic, pure; `ProgressReporter` decides when a line is due on
the caller's clock; `serve_progress_report` runs it on trio's clock.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping

import attrs
import structlog
import trio

from orchestrator.daemon.stall import Figures
from orchestrator.handoff.progress import ProgressLine

log = structlog.get_logger("orchestrator")


@attrs.frozen
class Tally:
    """What the progress line reads of the run at one moment: what the stall watch reads,
    plus the rollouts in flight and the rollouts completed so far (a total of this run)."""

    figures: Figures
    inflight: int
    completed: int
    inflight_limit: int = 0


def grown(now: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """Each key's growth from `before` to `now`, keys that grew only."""
    return {key: n - before.get(key, 0) for key, n in now.items() if n > before.get(key, 0)}


def progress_line(before: Tally, now: Tally, elapsed_s: float) -> ProgressLine:
    """The line for the `elapsed_s` seconds from `before` to `now`: the state at `now`,
    the rollouts per second and the discards and failures in between. A rate over no
    time (`elapsed_s <= 0`) is 0."""
    completed = max(0, now.completed - before.completed)
    rate = completed / elapsed_s if elapsed_s > 0 else 0.0
    figures = now.figures
    return ProgressLine(
        step=figures.step,
        queued_samples=figures.queued,
        needed_samples=figures.needed,
        inflight_rollouts=now.inflight,
        inflight_limit=now.inflight_limit,
        interval_s=round(max(elapsed_s, 0.0), 1),
        rollouts_per_s=round(rate, 2),
        discards=grown(figures.discards, before.figures.discards),
        failures=grown(figures.failures, before.figures.failures),
    )


@attrs.define
class ProgressReporter:
    """When a progress line is due, and what it says.

    Times are the caller's clock (trio's in the daemon). `start` takes the first
    baseline; `check` returns the line due at `now` (None before `interval_s` has passed
    since the last line, with nothing left to ship, or when off) and takes `now` as the
    next baseline; `next_check` says when to ask again. `interval_s = 0`: never.
    `last` and `last_at` are the last line logged and when.
    """

    interval_s: float
    _base: Tally | None = None
    _base_at: float = 0.0
    last: ProgressLine | None = None
    last_at: float | None = None

    @property
    def on(self) -> bool:
        return self.interval_s > 0

    def start(self, now: float, tally: Tally) -> None:
        self._base, self._base_at = tally, now

    def check(self, now: float, tally: Tally) -> ProgressLine | None:
        if not self.on:
            return None
        if self._base is None:
            self.start(now, tally)
            return None
        if now - self._base_at < self.interval_s:
            return None
        line = progress_line(self._base, tally, now - self._base_at)
        self.start(now, tally)
        if tally.figures.idle:
            return None
        self.last, self.last_at = line, now
        return line

    def next_check(self, now: float) -> float:
        """When a line may next be due (always later than `now`)."""
        if not self.on:
            return math.inf
        due = self._base_at + self.interval_s
        return due if due > now else now + self.interval_s


async def serve_progress_report(
    reporter: ProgressReporter,
    tally: Callable[[], Tally],
    on_line: Callable[[], Awaitable[None]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Log `progress` every `reporter.interval_s`, reading `tally()` then; after each
    line, `on_line()` (the daemon saves its progress, so `orchestrator status` shows the
    same). Runs until cancelled; with the reporter off, sleeps."""
    reporter.start(trio.current_time(), tally())
    task_status.started()
    while True:
        await trio.sleep_until(reporter.next_check(trio.current_time()))
        line = reporter.check(trio.current_time(), tally())
        if line is not None:
            log.info("progress", **line.to_json())
            await on_line()
