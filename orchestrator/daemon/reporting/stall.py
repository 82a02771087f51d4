"""The stall watch: a warning when no batch has shipped for `[progress] stall_warning_s`.

A run can go quiet with nothing wrong at info level: every sample longer than
`batch.max_seq_len` (discarded as `untrainable`), every reply unparseable (retried as
`malformed`), a trainer that stopped publishing. The watch notices that no batch has
shipped for `stall_warning_s` seconds (since the daemon started, or since its last
shipped batch) and logs `no batch shipped` at warning level, then again every
`stall_warning_s` while it lasts, with what holds the batch up:

- the step being filled, the samples queued and the samples a batch needs;
- whether the staleness gate is closed (the trainer has not published the version the
  batch waits for) or the sink lacks samples;
- the discards by reason and the failures by kind **since the last shipped batch** (since
  the start when none shipped yet), and the most common error text over that time.

`StallWatch` is the logic, pure and clock-free (the caller passes the time);
`serve_stall_watch` runs it on trio's clock.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import structlog
import trio

from orchestrator.core.rollouts import Discard
from orchestrator.daemon.rejections import top_error
from orchestrator.daemon.reporting.run_snapshot import RunSnapshot, grown
from orchestrator.handoff import TopError

log = structlog.get_logger(__name__)

#: The failure kind of a reply whose payload was refused (`RejectionLog` kinds).
POISONED = "poisoned_payload"

#: What a discard reason usually means when it takes every sample, for the warning.
DISCARD_HINTS = {
    "untrainable": "samples longer than batch.max_seq_len, without loss tokens or poisoned",
    "failed": "requests that failed for good: see the failures",
    "reward_failed": "reward functions that raised, hung or killed their worker: see the log",
    "stale": "groups older than the staleness bound when they finished",
    "swept": "queued groups no batch took before they went stale",
    "no_signal": "groups whose rewards are all equal",
    "curriculum": "groups whose mean reward is outside batch.curriculum_*",
    "pruned": "surplus samples of a batch",
}
#: The reasons a group's rewards decide, whatever its samples (`discarded_by_rewards`).
BY_REWARDS = (Discard.NO_SIGNAL.value, Discard.CURRICULUM.value)


@attrs.frozen
class Recent:
    """Discards, failures and the most common error since the last shipped batch."""

    discards: Mapping[str, int]
    failures: Mapping[str, int]
    top_error: TopError | None
    # The most common reason a payload was refused (a poisoned turn's rollout is
    # discarded as untrainable): what the hint names when it explains the discards.
    top_poisoned: TopError | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "discards": dict(self.discards),
            "failures": dict(self.failures),
            "top_error": None if self.top_error is None else self.top_error.to_json(),
        }


@attrs.frozen
class StallReport:
    """What one stall warning says."""

    quiet_s: float
    shipped_before: bool  # False: no batch shipped since the daemon started
    step: int
    queued: int
    needed: int
    gate_open: bool
    applied_version: int
    recent: Recent
    settling: bool = False

    def log_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "quiet_s": round(self.quiet_s, 1),
            "since": "last shipped batch" if self.shipped_before else "start",
            "step": self.step,
            "queued_samples": self.queued,
            "needed_samples": self.needed,
            "discards": dict(self.recent.discards),
            "failures": dict(self.recent.failures),
            "top_error": None
            if self.recent.top_error is None
            else self.recent.top_error.describe(),
        }
        if not self.gate_open and self.settling:
            # The watcher finishes an update before it looks for the next version: a
            # collection that cannot end (the payload root's lock held) stops the run here.
            fields["waiting_for"] = (
                f"the update to v{self.applied_version} to finish: its payload collection "
                "has not ended (see the warnings: the payload root's lock?)"
            )
        elif not self.gate_open:
            fields["waiting_for"] = (
                f"the trainer: batch {self.step} may ship once a newer version than "
                f"v{self.applied_version} is applied"
            )
        hint = discard_hint(self.recent)
        if hint is not None:
            fields["hint"] = hint
        return fields


def discard_hint(recent: Recent) -> str | None:
    """What the most common discard reason most likely means.

    A group its rewards discard (`no_signal`, `curriculum`) could ship nothing whatever
    its samples held, and counts under that reason whole: when other reasons took samples
    too, the most common of those is what keeps the batches from filling (samples too
    long hide behind a majority of groups without signal), and the hint names it.
    `untrainable` is mostly poisoned payloads when the servers' replies were refused about
    as often (each refused turn discards its rollout): then the refusal's own text is the
    cause, not the generic one (a server without routing capture once read as "samples too
    long")."""
    discards = recent.discards
    dominant = most_discarded({r: n for r, n in discards.items() if r not in BY_REWARDS})
    besides = ""
    if dominant is None:
        dominant = most_discarded(discards)
    elif any(discards.get(reason) for reason in BY_REWARDS):
        besides = f" besides {' and '.join(BY_REWARDS)}"
    if dominant is None or dominant[0] not in DISCARD_HINTS:
        return None
    reason, count = dominant
    poisoned = recent.top_poisoned
    if reason == "untrainable" and poisoned is not None:
        refused = recent.failures.get(POISONED, 0)
        if 2 * refused >= count:
            return (
                f"most discards{besides} are untrainable: the servers' payloads were refused "
                f"({refused} replies), most often: {poisoned.text}"
            )
    return f"most discards{besides} are {reason}: {DISCARD_HINTS[reason]}"


def most_discarded(discards: Mapping[str, int]) -> tuple[str, int] | None:
    """The reason with the most discards (the first of equals), or None when none."""
    best = max(discards.items(), key=lambda item: item[1], default=None)
    return best if best is not None and best[1] > 0 else None


@attrs.define
class StallWatch:
    """Whether no batch has shipped for `stall_s` seconds, and what to say about it.

    Times are the caller's clock (trio's in the daemon). `shipped` is called with every
    shipped batch; `check` returns a report when a warning is due (at most one every
    `stall_s` seconds); `next_check` says when to ask again. `stall_s = 0`: never.
    """

    stall_s: float
    started_at: float
    shipped_at: float | None = None
    _baseline: RunSnapshot | None = None
    _warned_at: float | None = None

    @property
    def quiet_since(self) -> float:
        return self.started_at if self.shipped_at is None else self.shipped_at

    def shipped(self, now: float, snapshot: RunSnapshot) -> None:
        """A batch shipped at `now`; `snapshot` are the counts right after it."""
        self.shipped_at = now
        self._baseline = snapshot
        self._warned_at = None

    def recent(self, snapshot: RunSnapshot) -> Recent:
        """The counts of `snapshot` since the last shipped batch (since the start if none)."""
        base = self._baseline or RunSnapshot(0, 0, 0, True, 0, False)
        poisoned = {key: n for key, n in snapshot.texts.items() if key[0] == POISONED}
        return Recent(
            grown(snapshot.discards, base.discards),
            grown(snapshot.failures, base.failures),
            top_error(snapshot.texts, base.texts),
            top_error(poisoned, base.texts),
        )

    def check(self, now: float, snapshot: RunSnapshot) -> StallReport | None:
        """The warning due at `now`, or None (not quiet long enough, warned too recently,
        nothing left to ship, or the watch is off)."""
        if self.stall_s <= 0 or snapshot.idle:
            return None
        quiet = now - self.quiet_since
        if quiet < self.stall_s:
            return None
        if self._warned_at is not None and now - self._warned_at < self.stall_s:
            return None
        self._warned_at = now
        return StallReport(
            quiet_s=quiet,
            shipped_before=self.shipped_at is not None,
            step=snapshot.step,
            queued=snapshot.queued,
            needed=snapshot.needed,
            gate_open=snapshot.gate_open,
            applied_version=snapshot.applied_version,
            recent=self.recent(snapshot),
            settling=snapshot.settling,
        )

    def next_check(self, now: float) -> float:
        """When a warning may next be due (always later than `now`)."""
        if self.stall_s <= 0:
            return math.inf
        last = self.quiet_since if self._warned_at is None else self._warned_at
        due = last + self.stall_s
        return due if due > now else now + self.stall_s


async def serve_stall_watch(
    watch: StallWatch,
    snapshot: Callable[[], RunSnapshot],
    on_warning: Callable[[], Awaitable[None]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Warn (`no batch shipped`) whenever `watch` says so, reading `snapshot()` then;
    after each warning, `on_warning()` (the daemon saves its progress, so `orchestrator
    status` shows the same). Runs until cancelled; with the watch off, sleeps."""
    task_status.started()
    while True:
        await trio.sleep_until(watch.next_check(trio.current_time()))
        report = watch.check(trio.current_time(), snapshot())
        if report is not None:
            log.warning("no batch shipped", **report.log_fields())
            await on_warning()
