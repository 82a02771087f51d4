"""The train sink: scores finished groups, discards what cannot be trained, queues the rest
and assembles batches from the queue (docs/design.md §3, §6).

Pure logic: no I/O, no clock, no trio. The sink never deletes a file itself. Every
operation returns the absolute paths of payload files that just became safe to delete (no
queued sample holds them and no shipped sample references them); the daemon deletes them
in a worker thread. Files of shipped samples are left to the version collector.

Accounting. Discards are counted by `Discard` reason, in *units*: a rollout that has
samples counts one unit per sample (branch); a rollout without samples (a failed request,
or a rollout that produced nothing to train on) counts one unit. Every admitted unit ends
up exactly once as shipped, queued, abandoned (`drop_all`) or counted under one reason, so
`admitted == shipped + queued_samples + abandoned + sum(counters.values())` always holds.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence

import attrs

from orchestrator.core.payload_refs import PayloadRefs
from orchestrator.core.rollouts import (
    Discard,
    GroupResult,
    MetricMeans,
    RolloutResult,
    Sample,
    TrainSample,
)
from orchestrator.core.staleness import Staleness

# Advantages are differences of float means: a group whose rewards are all equal can leave
# residues of a few ulps, which are no learning signal.
_ZERO_ADVANTAGE = 1e-9


class SinkNotReady(RuntimeError):
    """`assemble` was called without enough fresh queued samples for a batch."""


@attrs.frozen
class SinkLimits:
    """What the sink accepts and how big a batch is.

    `batch_size` samples make a batch; with `constant_size`, exactly that many (the surplus
    of the last group taken is pruned), otherwise whole groups until at least that many.
    `staleness` decides which groups are too old (docs/design.md §3). A group whose mean
    reward lies outside `[curriculum_min_mean_reward, curriculum_max_mean_reward]` is
    discarded. A sample with more than `max_seq_len` tokens is untrainable.

    Raises `ValueError` for a limit out of range.
    """

    batch_size: int = attrs.field(validator=attrs.validators.ge(1))
    constant_size: bool
    staleness: Staleness
    curriculum_min_mean_reward: float
    curriculum_max_mean_reward: float
    max_seq_len: int = attrs.field(validator=attrs.validators.ge(1))

    def __attrs_post_init__(self) -> None:
        if not self.curriculum_min_mean_reward <= self.curriculum_max_mean_reward:
            raise ValueError(
                f"curriculum_min_mean_reward ({self.curriculum_min_mean_reward}) must be "
                f"<= curriculum_max_mean_reward ({self.curriculum_max_mean_reward})"
            )


@attrs.frozen
class QueuedSample:
    """A scored sample waiting in the queue: the `TrainSample` a batch will carry as is,
    and the payload files it holds (the sink's bookkeeping, not part of the batch)."""

    sample: TrainSample
    files: frozenset[str]


@attrs.frozen
class _QueuedGroup:
    group_id: str
    start_version: int
    samples: tuple[QueuedSample, ...]


@attrs.frozen
class _Verdict:
    """What admission decided for one group: counts by reason and the samples to queue;
    for a group whose equal rewards discard it (`no_signal`), where that reward lies
    (`reward_at`: "top", "bottom" or None)."""

    discards: Mapping[Discard, int]
    queued: tuple[QueuedSample, ...]
    reward_at: str | None = None


def reward_at(reward: float, limits: SinkLimits) -> str | None:
    """Where a reward lies in the curriculum's range, which is what a run takes for the
    range of its rewards (a group whose mean lies outside is discarded): "top" at or above
    `curriculum_max_mean_reward` (the task solved), "bottom" at or below
    `curriculum_min_mean_reward` (never right), else None."""
    if reward >= limits.curriculum_max_mean_reward - _ZERO_ADVANTAGE:
        return "top"
    if reward <= limits.curriculum_min_mean_reward + _ZERO_ADVANTAGE:
        return "bottom"
    return None


def _units(rollout: RolloutResult) -> int:
    """How many accounting units a rollout is (see the module docstring)."""
    if rollout.failed is not None or not rollout.samples:
        return 1
    return len(rollout.samples)


def _group_files(group: GroupResult) -> set[str]:
    """Every payload file a group's members wrote or reference."""
    files: set[str] = set()
    for rollout in group.rollouts:
        files.update(rollout.files)
        for sample in rollout.samples:
            files.update(sample.files)
    return files


def _is_trainable(sample: Sample, max_seq_len: int) -> bool:
    return (
        sample.untrainable is None
        and sample.loss_tokens > 0
        and len(sample.token_ids) <= max_seq_len
    )


def _judge(group: GroupResult, limits: SinkLimits, bound: int) -> _Verdict:
    """Apply the admission rules, in order, to a finished group (see `TrainSink.admit`)."""
    discards = dict.fromkeys(Discard, 0)
    if group.start_version < bound:
        discards[Discard.STALE] = sum(_units(rollout) for rollout in group.rollouts)
        return _Verdict(discards, ())

    scored = [rollout for rollout in group.rollouts if rollout.failed is None]
    for rollout in group.rollouts:
        if rollout.failed is not None:
            discards[rollout.failure] += 1
    if not scored:
        return _Verdict(discards, ())
    by_rewards = discarded_by_rewards([rollout.reward for rollout in scored], limits)
    if by_rewards is not None:
        discards[by_rewards] += sum(_units(rollout) for rollout in scored)
        at = reward_at(scored[0].reward, limits) if by_rewards is Discard.NO_SIGNAL else None
        return _Verdict(discards, (), at)
    mean_reward = math.fsum(rollout.reward for rollout in scored) / len(scored)

    survivors: list[QueuedSample] = []
    for rollout in scored:
        if not rollout.samples:
            # It ran to the end but yielded no branch: nothing to train on.
            discards[Discard.UNTRAINABLE] += 1
        for sample in rollout.samples:
            if not _is_trainable(sample, limits.max_seq_len):
                discards[Discard.UNTRAINABLE] += 1
                continue
            survivors.append(
                QueuedSample(
                    TrainSample(
                        group_id=group.group_id,
                        rollout_id=sample.rollout_id,
                        start_version=group.start_version,
                        dispatch_version=rollout.dispatch_version,
                        reward=rollout.reward,
                        advantage=rollout.reward - mean_reward,
                        token_ids=sample.token_ids,
                        loss_mask=sample.loss_mask,
                        logprobs=sample.logprobs,
                        payload=sample.payload,
                        payload_dir=sample.payload_dir if sample.payload else None,
                        inline=sample.inline,
                        server=group.server,
                        env=group.env,
                        temperature=group.temperature,
                    ),
                    sample.files,
                )
            )

    # The rewards differ, but the branches left may not (the others were untrainable).
    if _without_signal(queued.sample.advantage for queued in survivors):
        discards[Discard.NO_SIGNAL] = len(survivors)
        return _Verdict(discards, ())
    return _Verdict(discards, tuple(survivors))


def discarded_by_rewards(rewards: Sequence[float], limits: SinkLimits) -> Discard | None:
    """Why a group whose scored (non-failed) members have `rewards` ships nothing,
    whatever their branches hold, or `None`: the rewards are all equal, so no advantage
    is left (`NO_SIGNAL`), or their mean lies outside the curriculum's range
    (`CURRICULUM`). `rewards` is not empty.

    `TrainSink.admit` applies it before it looks at any branch; the daemon asks first,
    so that it neither reads the files of such a group nor builds its samples."""
    mean = math.fsum(rewards) / len(rewards)
    if _without_signal(reward - mean for reward in rewards):
        return Discard.NO_SIGNAL
    # Written as "not inside" so that a NaN mean reward is rejected too.
    if not limits.curriculum_min_mean_reward <= mean <= limits.curriculum_max_mean_reward:
        return Discard.CURRICULUM
    return None


def _without_signal(advantages: Iterable[float]) -> bool:
    return all(abs(advantage) < _ZERO_ADVANTAGE for advantage in advantages)


@attrs.define
class EnvTally:
    """What the sink saw of one environment's groups: rollouts scored and their rewards,
    discards by reason (units, as `TrainSink.counters`), samples shipped."""

    scored: int = 0
    reward_sum: float = 0.0
    discards: Counter[str] = attrs.field(factory=Counter)
    shipped: int = 0
    # The environment's own metrics of the scored rollouts.
    metrics: MetricMeans = attrs.field(factory=MetricMeans)

    @property
    def mean_reward(self) -> float | None:
        """The mean reward of the scored rollouts (None before the first)."""
        return self.reward_sum / self.scored if self.scored else None


@attrs.define
class TrainSink:
    """Scores finished groups, queues trainable samples FIFO and assembles batches.

    Every method that discards returns the payload files to delete now, sorted, each once.
    """

    limits: SinkLimits
    _refs: PayloadRefs = attrs.field(factory=PayloadRefs, init=False)
    _queue: deque[_QueuedGroup] = attrs.field(factory=deque, init=False)
    _counters: dict[Discard, int] = attrs.field(
        factory=lambda: dict.fromkeys(Discard, 0), init=False
    )
    _queued_samples: int = attrs.field(default=0, init=False)
    _admitted: int = attrs.field(default=0, init=False)
    _shipped: int = attrs.field(default=0, init=False)
    _abandoned: int = attrs.field(default=0, init=False)
    _by_env: dict[str, EnvTally] = attrs.field(factory=dict, init=False)
    _trainable: int = attrs.field(default=0, init=False)
    _no_signal_at: Counter[str] = attrs.field(factory=Counter, init=False)

    # -- state, read-only ---------------------------------------------------------------

    @property
    def counters(self) -> Mapping[str, int]:
        """Discarded units by reason (`Discard` value), every reason present (a copy)."""
        return {reason.value: count for reason, count in self._counters.items()}

    @property
    def by_env(self) -> Mapping[str, EnvTally]:
        """The tally of each environment groups came from (its name: "" when unnamed)."""
        return self._by_env

    @property
    def queued_samples(self) -> int:
        """Samples waiting in the queue."""
        return self._queued_samples

    @property
    def queued_groups(self) -> int:
        """Groups waiting in the queue."""
        return len(self._queue)

    @property
    def oldest_start_version(self) -> int | None:
        """The lowest start version among queued groups, or `None` when the queue is empty."""
        return min((group.start_version for group in self._queue), default=None)

    @property
    def trainable(self) -> int:
        """Samples ever queued: trainable ones, whatever became of them later."""
        return self._trainable

    @property
    def no_signal_at(self) -> Mapping[str, int]:
        """The `no_signal` units of groups whose equal rewards all lay at the "top" or the
        "bottom" of the curriculum's range (`reward_at`), by where (a copy)."""
        return dict(self._no_signal_at)

    @property
    def admitted(self) -> int:
        """Units admitted so far (see the module docstring for what a unit is)."""
        return self._admitted

    @property
    def shipped(self) -> int:
        """Samples shipped in assembled batches so far."""
        return self._shipped

    @property
    def abandoned(self) -> int:
        """Samples dropped by `drop_all` (not a discard: nothing was wrong with them)."""
        return self._abandoned

    @property
    def refs(self) -> PayloadRefs:
        """The reference counts (read them; the sink owns the changes)."""
        return self._refs

    def queued(self) -> list[QueuedSample]:
        """The queued samples, oldest group first (a copy)."""
        return [sample for group in self._queue for sample in group.samples]

    # -- operations ---------------------------------------------------------------------

    def admit(self, group: GroupResult, next_step: int) -> list[str]:
        """Score a finished group and queue its trainable samples; return files to delete.

        `next_step` is the next batch to be assembled. The rules, in order:

        1. *stale*: the group's start version is below `min_fresh_version(next_step, m)`:
           every member is discarded.
        2. *failed* / *reward_failed*: each failed member is discarded (its request, or its
           reward, failed).
        3. *no_signal* / *curriculum* by the rewards alone (`discarded_by_rewards`): the
           non-failed members' rewards are all equal, or their mean is outside the
           curriculum's range: each of them is discarded, whatever its branches hold
           (the daemon builds no branch for such a group).
        4. advantages: each member's reward minus the mean reward of the non-failed ones.
        5. *untrainable*: a branch marked untrainable, without loss tokens or longer than
           `max_seq_len` is discarded (so is a member that yielded no branch).
        6. *no_signal*: every remaining advantage is zero (or nothing remains).
        7. the remaining samples are queued as one group, holding their files.

        Returned: every file of the group (a member's `files` and its samples' `files`)
        that no queued or shipped sample references, so the files of discarded members
        and branches go at once while a file shared with a queued sibling stays.
        """
        bound = self.limits.staleness.min_fresh_version(next_step)
        verdict = _judge(group, self.limits, bound)
        self._admitted += sum(_units(rollout) for rollout in group.rollouts)
        tally = self._by_env.setdefault(group.env, EnvTally())
        for rollout in group.rollouts:
            if rollout.failed is None:
                tally.scored += 1
                tally.reward_sum += rollout.reward
                tally.metrics.add(rollout.metrics)
        for reason, count in verdict.discards.items():
            self._counters[reason] += count
            if count:
                tally.discards[reason.value] += count
        if verdict.reward_at is not None:
            self._no_signal_at[verdict.reward_at] += verdict.discards[Discard.NO_SIGNAL]
        self._trainable += len(verdict.queued)
        if verdict.queued:
            for queued in verdict.queued:
                self._refs.hold(queued.files)
            self._queue.append(_QueuedGroup(group.group_id, group.start_version, verdict.queued))
            self._queued_samples += len(verdict.queued)
        return sorted(self._refs.orphans(_group_files(group)))

    def drop_stale(self, next_step: int) -> list[str]:
        """The sweep: discard queued groups whose start version is below
        `min_fresh_version(next_step, m)` (counted `swept`: they arrived in time, and no
        batch took them); return files to delete."""
        bound = self.limits.staleness.min_fresh_version(next_step)
        kept: deque[_QueuedGroup] = deque()
        dropped: list[QueuedSample] = []
        for group in self._queue:
            if group.start_version < bound:
                dropped.extend(group.samples)
            else:
                kept.append(group)
        self._queue = kept
        self._counters[Discard.SWEPT] += len(dropped)
        self._tally(dropped, Discard.SWEPT)
        return self._leave(dropped)

    def ready(self, next_step: int) -> bool:
        """Whether the queue holds enough fresh samples to assemble batch `next_step`."""
        bound = self.limits.staleness.min_fresh_version(next_step)
        fresh = sum(len(group.samples) for group in self._queue if group.start_version >= bound)
        return fresh >= self.limits.batch_size

    def assemble(self, step: int) -> tuple[list[TrainSample], list[str]]:
        """Take batch `step` off the queue; return its samples and the files to delete.

        Stale groups are swept first, so the batch never holds a group whose start version
        is below `min_fresh_version(step, m)`. Then whole groups are taken oldest first:
        with `constant_size`, exactly `batch_size` samples (the surplus of the last group
        taken is discarded as `pruned`); otherwise whole groups until there are at least
        `batch_size`. The shipped samples' files are pinned: from now on only the version
        collector deletes them.

        Raises `SinkNotReady` (changing nothing) unless `ready(step)`.
        """
        if not self.ready(step):
            raise SinkNotReady(
                f"batch {step} needs {self.limits.batch_size} fresh queued samples; "
                f"the queue holds {self._queued_samples} in {len(self._queue)} groups"
            )
        deletable = self.drop_stale(step)
        batch: list[QueuedSample] = []
        while len(batch) < self.limits.batch_size:
            batch.extend(self._queue.popleft().samples)
        pruned: list[QueuedSample] = []
        if self.limits.constant_size:
            batch, pruned = batch[: self.limits.batch_size], batch[self.limits.batch_size :]

        # Pin before releasing, so a file the batch shares with a pruned sibling stays.
        for queued in batch:
            self._refs.pin(queued.files)
        shipped_files = self._leave(batch)
        assert not shipped_files, "a pinned file was reported deletable"
        self._shipped += len(batch)
        for queued in batch:
            self._by_env.setdefault(queued.sample.env, EnvTally()).shipped += 1
        self._counters[Discard.PRUNED] += len(pruned)
        self._tally(pruned, Discard.PRUNED)
        deletable.extend(self._leave(pruned))
        return [queued.sample for queued in batch], sorted(set(deletable))

    def _tally(self, samples: Iterable[QueuedSample], reason: Discard) -> None:
        """Queued samples discarded for `reason`, in their environments' tallies."""
        for queued in samples:
            self._by_env.setdefault(queued.sample.env, EnvTally()).discards[reason.value] += 1

    def unship(self, samples: Sequence[TrainSample]) -> None:
        """`samples` of the last assembled batch did not ship after all: the writer could
        not read their payload (prime-rl's hand-off reads it when it writes the step).
        They are counted `untrainable` instead of shipped, in their env's tally too; their
        files stay pinned for the version collector, like a shipped sample's.

        Raises ValueError for more than were shipped.
        """
        if len(samples) > self._shipped:
            raise ValueError(f"cannot unship {len(samples)} of {self._shipped} shipped samples")
        self._shipped -= len(samples)
        self._counters[Discard.UNTRAINABLE] += len(samples)
        for sample in samples:
            tally = self._by_env.setdefault(sample.env, EnvTally())
            tally.shipped -= 1
            tally.discards[Discard.UNTRAINABLE.value] += 1

    def drop_all(self) -> list[str]:
        """Empty the queue (shutdown); return the files to delete.

        The dropped samples are counted as `abandoned`, not as a discard: nothing was wrong
        with them, the run is just ending (a resumed run starts with an empty queue).
        """
        dropped = [queued for group in self._queue for queued in group.samples]
        self._queue.clear()
        self._abandoned += len(dropped)
        return self._leave(dropped)

    def forget_versions_below(self, bound: int) -> int:
        """Forget pinned files in `v<k>` directories with `k < bound`, after the version
        collector removed them; returns how many pins were forgotten."""
        return self._refs.drop_versions_below(bound)

    # -- internals ----------------------------------------------------------------------

    def _leave(self, samples: Iterable[QueuedSample]) -> list[str]:
        """Release the holds of samples that left the queue; return files now deletable."""
        deletable: set[str] = set()
        count = 0
        for queued in samples:
            count += 1
            deletable.update(self._refs.release(queued.files))
        self._queued_samples -= count
        return sorted(deletable)
