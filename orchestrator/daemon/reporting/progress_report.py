"""The progress line: every `[progress] report_interval_s` an info line `progress`.

At scale a batch takes minutes to fill; between `shipped batch` lines the daemon would
otherwise say nothing, and a run that discards every rollout would look the same as one
that fills slowly until the stall warning (orchestrator/daemon/reporting/stall.py). The line says:

- `step`: the batch being filled; `queued_samples` ready for it of the `needed_samples`
  a batch takes; `inflight_rollouts` running;
- over the `interval_s` seconds since the previous line (or since the daemon started):
  `rollouts_per_s` (rollouts completed, `Dispatch.rollouts["completed"]`), `discards` by
  reason and `failures` by kind, the reasons and kinds that grew only; by environment,
  the rollouts `scored` and their `mean_reward`, the envs that scored any only; the
  `discarded_bytes` of payload files deleted with discards; and `cpu_s_per_rollout`, the
  daemon process's CPU seconds per completed rollout (None when none completed).

It reads the same `RunSnapshot` as the stall warning, so both name the same step,
samples, discard reasons and failure kinds under the same keys; only their windows
differ (the warning counts since the last shipped batch). No line is logged once nothing
is left to ship (`max_steps` shipped, or stopping).

`progress_line` is the arithmetic, pure; `ProgressReporter` decides when a line is due on
the caller's clock; `serve_progress_report` runs it on trio's clock.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import attrs
import structlog
import trio

from orchestrator.daemon.reporting.run_snapshot import RunSnapshot, grown
from orchestrator.handoff import ProgressLine

log = structlog.get_logger(__name__)


def progress_line(before: RunSnapshot, now: RunSnapshot, elapsed_s: float) -> ProgressLine:
    """The line for the `elapsed_s` seconds from `before` to `now`: the state at `now`,
    the rollouts per second and the discards and failures in between. A rate over no
    time (`elapsed_s <= 0`) is 0."""
    completed = max(0, now.completed - before.completed)
    rate = completed / elapsed_s if elapsed_s > 0 else 0.0
    cpu = round(max(0.0, now.cpu_s - before.cpu_s) / completed, 6) if completed else None
    scored = grown(now.scored, before.scored)
    mean_reward = {
        env: round((now.reward_sums[env] - before.reward_sums.get(env, 0.0)) / n, 4)
        for env, n in scored.items()
    }
    return ProgressLine(
        step=now.step,
        queued_samples=now.queued,
        needed_samples=now.needed,
        inflight_rollouts=now.inflight,
        inflight_limit=now.inflight_limit,
        interval_s=round(max(elapsed_s, 0.0), 1),
        rollouts_per_s=round(rate, 2),
        discards=grown(now.discards, before.discards),
        failures=grown(now.failures, before.failures),
        scored=scored,
        mean_reward=mean_reward,
        discarded_bytes=max(0, now.discarded_bytes - before.discarded_bytes),
        cpu_s_per_rollout=cpu,
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
    _base: RunSnapshot | None = None
    _base_at: float = 0.0
    last: ProgressLine | None = None
    last_at: float | None = None

    @property
    def on(self) -> bool:
        return self.interval_s > 0

    def start(self, now: float, snapshot: RunSnapshot) -> None:
        self._base, self._base_at = snapshot, now

    def check(self, now: float, snapshot: RunSnapshot) -> ProgressLine | None:
        if not self.on:
            return None
        if self._base is None:
            self.start(now, snapshot)
            return None
        if now - self._base_at < self.interval_s:
            return None
        line = progress_line(self._base, snapshot, now - self._base_at)
        self.start(now, snapshot)
        if snapshot.idle:
            return None
        self.last, self.last_at = line, now
        return line

    def next_check(self, now: float) -> float:
        """When a line may next be due: `now` when one is due already (the baseline was
        taken before its caller started asking)."""
        if not self.on:
            return math.inf
        return max(self._base_at + self.interval_s, now)


async def serve_progress_report(
    reporter: ProgressReporter,
    snapshot: Callable[[], RunSnapshot],
    on_line: Callable[[], Awaitable[None]],
    *,
    started_at: float | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Log `progress` every `reporter.interval_s`, reading `snapshot()` then; after each
    line, `on_line()` (the daemon saves its progress, so `orchestrator status` shows the
    same). The first line is due `interval_s` after `started_at` (trio's clock; now when
    None): the daemon passes its start, which its stall warnings count from too, so that
    a slow start-up never puts the first warning before the first line. Runs until
    cancelled; with the reporter off, sleeps."""
    now = trio.current_time()
    reporter.start(now if started_at is None else started_at, snapshot())
    task_status.started()
    while True:
        await trio.sleep_until(reporter.next_check(trio.current_time()))
        line = reporter.check(trio.current_time(), snapshot())
        if line is not None:
            log.info("progress", **line.to_json())
            await on_line()
