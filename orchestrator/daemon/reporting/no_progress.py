"""Progress or stop: a run whose rollouts keep finishing with nothing trainable ends itself.

Random tokens over a 151k vocabulary never earn a reward: every group's rewards are all
0, every group is discarded as `no_signal`, and a run left alone discarded 247,056
rollouts in 10 minutes (10 GiB of payload files written and deleted) with both cores busy.
Every reward failing (`reward_failed`), every reply refused, every sample too long, and a
task the policy has solved (every group all at the top reward) look the same: rollouts
finish, none is trainable. The stall warning (`stall.py`) says so each minute; this watch
stops the run, with exit status 2 and one line that names the most common reason, its
count, an example error and what to try (`Dispatch.halt`, as the refusal watch does).

The window is time **while rollouts finish**, not time without a shipped batch: a real run
whose steps take minutes, or that waits for a slow trainer or behind the staleness gate,
queues trainable samples or finishes nothing meanwhile, and neither counts. The watch
stops the run when, since the last trainable sample (any sample the sink queued, since
the start when none was), rollouts were discarded for what they hold (`UNPRODUCTIVE`: not
`stale`, `swept` or `pruned`, which say nothing about the task) for `stop_s` seconds,
counted from the first such discard, and at least `min_units` of them (a few batches'
worth: a hard task's unlucky groups are not a verdict). One trainable sample starts the
window again.

"The task is solved" is its own reason: `no_signal` is the most common discard and every
group it took had all its rewards at the top of the run's reward range, which is the
curriculum's (`batch.curriculum_max_mean_reward`: a group whose mean lies above it is
discarded anyway).

`ProgressWatch` is the logic, pure and clock-free (the caller passes the time and the
snapshot); `serve_progress_watch` runs it on trio's clock.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import structlog
import trio
from payload_gc import human_bytes

from orchestrator.daemon.rejections import top_error
from orchestrator.daemon.reporting.run_snapshot import RunSnapshot, grown
from orchestrator.daemon.reporting.stall import POISONED, most_discarded
from orchestrator.daemon.run_state import RunState

log = structlog.get_logger(__name__)

#: The discard reasons a group earns by what it holds: rollouts discarded for them finished
#: and taught nothing. (`stale`, `swept` and `pruned` are the run's timing, not the task.)
UNPRODUCTIVE = ("no_signal", "curriculum", "untrainable", "failed", "reward_failed")
#: Rollouts the window needs besides its time, in batches (`batch.size` samples each).
MIN_BATCHES = 4
#: How often the watch looks, at most (a quarter of `stop_s` when that is shorter).
CHECK_INTERVAL_S = 1.0


@attrs.frozen
class NoProgress:
    """Why the watch stops the run: `by` ("solved" or "no progress") and the one line."""

    by: str
    line: str


@attrs.frozen
class RewardRange:
    """The run's reward range, the curriculum's: a reward at or above `top` is the task
    solved, one at or below `bottom` never right (`TrainSink`'s `reward_at`)."""

    bottom: float
    top: float


@attrs.define
class ProgressWatch:
    """See the module docstring. `stop_s` 0: never stops a run."""

    stop_s: float
    min_units: int
    rewards: RewardRange
    # The run's figures at the last trainable sample (or the first look), and when the
    # first unproductive discard after it was seen (None: none yet).
    _base: RunSnapshot | None = attrs.field(default=None, init=False)
    _since: float | None = attrs.field(default=None, init=False)

    def check(self, now: float, snapshot: RunSnapshot) -> NoProgress | None:
        """What stops the run at `now`, or None (something trainable came, not long or
        not many enough yet, nothing left to ship, or the watch is off)."""
        if self.stop_s <= 0 or snapshot.idle:
            return None
        base = self._base
        if base is None or snapshot.trainable != base.trainable:
            self._base, self._since = snapshot, None
            return None
        units = sum(_unproductive(snapshot, base).values())
        if not units:
            return None
        if self._since is None:
            self._since = now
            return None
        if now - self._since < self.stop_s or units < self.min_units:
            return None
        return verdict(now - self._since, base, snapshot, self.rewards)


def _unproductive(now: RunSnapshot, base: RunSnapshot) -> dict[str, int]:
    discards = grown(now.discards, base.discards)
    return {reason: n for reason, n in discards.items() if reason in UNPRODUCTIVE}


def verdict(
    window_s: float, base: RunSnapshot, now: RunSnapshot, rewards: RewardRange
) -> NoProgress:
    """The line that ends a run whose rollouts, from `base` to `now` (`window_s`
    seconds), were all discarded for what they hold: the most common reason, its count,
    an example error and what to try; "the task is solved" when it is."""
    discards = _unproductive(now, base)
    units = sum(discards.values())
    top = most_discarded(discards)
    assert top is not None  # the watch asks only once some were discarded
    reason, count = top
    deleted = now.discarded_bytes - base.discarded_bytes
    spent = f"; {human_bytes(deleted)} of payload files written and deleted for them" * (
        deleted > 0
    )
    head = (
        f"nothing trainable for {window_s:.0f} s: {count:,} of the {units:,} rollouts that "
        f"finished were discarded as {reason}"
    )
    if reason == "no_signal":
        at = grown(now.no_signal_at, base.no_signal_at)
        if at.get("top", 0) == count:
            return NoProgress(
                "solved",
                f"stopped: the task is solved: for {window_s:.0f} s every group's rewards "
                f"were all at the top ({rewards.top:g}, batch.curriculum_max_mean_reward), "
                f"{count:,} rollouts without a learning signal{spent}. Try: harder prompts; "
                f"the last version, v{now.applied_version}, is the policy that solved it",
            )
        if at.get("bottom", 0) == count:
            detail = (
                f", every group's rewards all {rewards.bottom:g} (the bottom, "
                "batch.curriculum_min_mean_reward): the model never earned a reward"
            )
            hint = (
                "score a known-good answer with your reward functions, check that the "
                "servers serve the model [model] names, and read a few completions "
                "(max_tokens, the chat template)"
            )
        else:
            detail = ", each group's rewards all equal"
            hint = "rewards with more levels, or more rollouts per group (batch.group_size)"
        return _no_progress(f"{head}{detail}{spent}. Try: {hint}")
    if reason == "reward_failed":
        error = top_error(now.reward_texts, base.reward_texts)
        example = "" if error is None else f", most often {error.kind}: {error.text}"
        hint = (
            "the log's `reward failed` line has the traceback; a module a reward imports "
            "must be installed in the environment the daemon runs in"
        )
        return _no_progress(f"{head}{example}{spent}. Try: {hint}")
    if reason == "failed":
        error = top_error(now.texts, base.texts)
        example = "" if error is None else f", most often {error.kind}: {error.text}"
        kind = "" if error is None else f" ({error.kind})"
        hint = (
            "the log's `rollout failure` lines name each server; docs/operations.md "
            f"§ Faults says what each kind{kind} means and what to change"
        )
        return _no_progress(f"{head}{example}{spent}. Try: {hint}")
    if reason == "untrainable":
        poisoned = top_error(
            {key: n for key, n in now.texts.items() if key[0] == POISONED}, base.texts
        )
        if poisoned is not None and 2 * poisoned.count >= count:
            example = f", their payloads refused, most often: {poisoned.text}"
            hint = "the servers' payload capture (docs/operations.md § Faults)"
        else:
            example = ": longer than batch.max_seq_len, or without loss tokens"
            hint = "a higher batch.max_seq_len, or a lower max_tokens"
        return _no_progress(f"{head}{example}{spent}. Try: {hint}")
    # curriculum
    hint = "a wider batch.curriculum_min_mean_reward .. curriculum_max_mean_reward"
    return _no_progress(
        f"{head}: every group's mean reward outside [{rewards.bottom:g}, {rewards.top:g}]"
        f"{spent}. Try: {hint}"
    )


def _no_progress(line: str) -> NoProgress:
    return NoProgress("no progress", f"error: {line}")


async def serve_progress_watch(
    watch: ProgressWatch,
    snapshot: Callable[[], RunSnapshot],
    state: RunState,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Look at the run every `CHECK_INTERVAL_S` (at most); when `watch` says so, halt it
    (`Dispatch.halt`: the run stops as a first signal stops it, and `orchestrator run`
    prints the line last, exit status 2). Runs until cancelled or the run halts."""
    task_status.started()
    if watch.stop_s <= 0:
        await trio.sleep_forever()
    interval = min(CHECK_INTERVAL_S, watch.stop_s / 4)
    while True:
        await trio.sleep(interval)
        found = watch.check(trio.current_time(), snapshot())
        if found is not None and state.dispatch.halt(found.by, found.line):
            if found.by == "solved":
                log.warning("the task is solved: ending the run", line=found.line)
            else:
                log.error("nothing trainable: ending the run", line=found.line)
            state.notify()
            return
