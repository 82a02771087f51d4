"""Properties of the train sink over random runs of admit / drop_stale / assemble / collect.

Invariants checked after every operation:
- no assembled batch holds a group whose start version is below `min_fresh_version(step, m)`;
- a file is never returned for deletion while a queued sample holds it or a shipped sample
  references it (unless the version collector already removed its directory);
- no file is returned twice, and at the end every file that no shipped sample references
  has been returned exactly once (no leak, no double delete);
- constant-size batches have exactly `batch_size` samples; others are whole groups;
- every admitted unit is shipped, queued, abandoned or counted under exactly one reason;
- pinned files are exactly the shipped files the collector has not removed (bounded memory).
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import PurePosixPath
from typing import TypeVar

import attrs
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from payload_gc import min_fresh_version, parse_version

from orchestrator.core.rollouts import GroupResult, RolloutResult, Sample, TrainSample
from orchestrator.core.sink import SinkLimits, SinkNotReady, TrainSink
from orchestrator.core.staleness import Staleness

MAX_SEQ_LEN = 8


@attrs.frozen
class BranchSpec:
    length: int
    loss_tokens: int
    untrainable: bool
    shares_first_turn: bool


@attrs.frozen
class MemberSpec:
    failed: bool
    reward: float
    version_lag: int
    branches: tuple[BranchSpec, ...]
    extra_file: bool


@attrs.frozen
class Admit:
    age: int  # start version = next_step - 1 - age (so age > m is stale on arrival)
    members: tuple[MemberSpec, ...]


@attrs.frozen
class DropStale:
    pass


@attrs.frozen
class Assemble:
    collect: bool  # whether the trainer read it and the collector ran before the next op


Operation = Admit | DropStale | Assemble


T = TypeVar("T")


def weighted(choices: list[tuple[st.SearchStrategy[T], int]]) -> st.SearchStrategy[T]:
    """One of `choices`, each as often as its weight (`one_of` weighs equal strategies as
    one, and Hypothesis favours the first elements of `sampled_from`)."""
    pool = [strategy for strategy, weight in choices for _ in range(weight)]
    return st.sampled_from(pool).flatmap(lambda strategy: strategy)


# Weighted towards trainable groups, so that queues fill up and batches get assembled.
# (Hypothesis favours the first elements of `sampled_from`: rare cases go last.)
branches = st.builds(
    BranchSpec,
    length=st.sampled_from([*range(2, MAX_SEQ_LEN + 1), MAX_SEQ_LEN + 1]),
    loss_tokens=st.sampled_from([*[2, 1] * 4, 0]),
    untrainable=st.sampled_from([*[False] * 8, True]),
    shares_first_turn=st.booleans(),
)
some_branches = st.lists(branches, min_size=1, max_size=3).map(tuple)
members = st.builds(
    MemberSpec,
    failed=st.sampled_from([*[False] * 8, True]),
    # Mostly 0 and 1 (signal, mean inside the curriculum); 2.0 pushes a mean above it.
    reward=st.sampled_from([*[0.0, 1.0] * 4, 0.5, 2.0]),
    version_lag=st.integers(0, 2),
    branches=weighted([(some_branches, 8), (st.just(()), 1)]),
    extra_file=st.booleans(),
)
limits = st.builds(
    SinkLimits,
    batch_size=st.integers(1, 5),
    constant_size=st.booleans(),
    staleness=st.integers(0, 3).map(lambda m: Staleness(m, max_async_steps=0)),
    curriculum_min_mean_reward=st.just(0.0),
    curriculum_max_mean_reward=st.just(1.0),
    max_seq_len=st.just(MAX_SEQ_LEN),
)


def operations(m: int) -> st.SearchStrategy[Operation]:
    # Age m is the edge: fresh on arrival, stale after one more batch. Age m + 1 is stale
    # on arrival.
    ages = st.one_of(st.integers(0, m + 1), st.just(m))
    admits = st.builds(
        Admit, age=ages, members=st.lists(members, min_size=2, max_size=4).map(tuple)
    )
    assembles = st.builds(Assemble, collect=st.booleans())
    return weighted([(admits, 4), (assembles, 2), (st.just(DropStale()), 1)])


@st.composite
def runs(draw: st.DrawFn) -> tuple[SinkLimits, list[Operation]]:
    """Limits and a sequence of operations whose ages are relative to those limits."""
    chosen = draw(limits)
    m = chosen.staleness.max_off_policy_steps
    ops = draw(st.lists(operations(m), min_size=20, max_size=40))
    return chosen, ops


def version_of(path: str) -> int:
    version = parse_version(PurePosixPath(path).parent.name)
    assert version is not None
    return version


@attrs.define
class Run:
    """Drives a sink and keeps the facts needed to check it from outside."""

    sink: TrainSink
    next_step: int = 1
    forgotten_below: int = -(10**9)
    names: itertools.count[int] = attrs.field(factory=itertools.count)
    every_file: set[str] = attrs.field(factory=set)
    shipped_files: set[str] = attrs.field(factory=set)
    returned: Counter[str] = attrs.field(factory=Counter)
    admitted_units: int = 0
    admission_order: dict[str, int] = attrs.field(factory=dict)

    @property
    def m(self) -> int:
        return self.sink.limits.staleness.max_off_policy_steps

    def branch(self, rollout_id: str, spec: BranchSpec, first_turn: str) -> Sample:
        own_turn = f"{PurePosixPath(first_turn).parent}/{next(self.names)}.bin"
        return Sample(
            rollout_id=rollout_id,
            token_ids=tuple(range(spec.length)),
            loss_mask=(0,) * (spec.length - spec.loss_tokens) + (1,) * spec.loss_tokens,
            logprobs=(0.0,) * spec.length,
            files=frozenset({own_turn, first_turn} if spec.shares_first_turn else {own_turn}),
            untrainable="poisoned" if spec.untrainable else None,
        )

    def member(self, spec: MemberSpec, start: int) -> RolloutResult:
        rollout_id = f"r{next(self.names)}"
        version = start + spec.version_lag
        # The first turn, which branches may share, or the turn a failed member finished.
        first_turn = f"/root/v{version}/{next(self.names)}.bin"
        samples = (
            ()
            if spec.failed
            else tuple(self.branch(rollout_id, branch, first_turn) for branch in spec.branches)
        )
        files = set().union(*(sample.files for sample in samples))
        if spec.extra_file:
            files.add(first_turn)
        self.every_file |= files
        self.admitted_units += 1 if spec.failed or not samples else len(samples)
        return RolloutResult(
            rollout_id=rollout_id,
            dispatch_version=version,
            reward=spec.reward,
            samples=samples,
            files=frozenset(files),
            failed="HTTP 500" if spec.failed else None,
        )

    def build(self, op: Admit) -> GroupResult:
        start = max(0, self.next_step - 1 - op.age)
        rollouts = tuple(self.member(spec, start) for spec in op.members)
        group_id = f"g{next(self.names)}"
        self.admission_order[group_id] = len(self.admission_order)
        return GroupResult(group_id=group_id, start_version=start, rollouts=rollouts)

    def deleted(self, files: list[str]) -> None:
        assert files == sorted(set(files))
        queued_files = {path for queued in self.sink.queued() for path in queued.files}
        for path in files:
            assert path in self.every_file, f"{path} was never written"
            self.returned[path] += 1
            assert self.returned[path] == 1, f"{path} returned twice"
            assert path not in queued_files, f"{path} returned while a queued sample holds it"
            if path in self.shipped_files:
                assert version_of(path) < self.forgotten_below, f"{path} is shipped"

    def check_batch(
        self, step: int, batch: list[TrainSample], files_of: dict[int, frozenset[str]]
    ) -> None:
        limits = self.sink.limits
        bound = min_fresh_version(step, self.m)
        assert all(queued.start_version >= bound for queued in batch)
        if limits.constant_size:
            assert len(batch) == limits.batch_size
        else:
            assert len(batch) >= limits.batch_size
        # Whole groups leave the queue (with constant_size, the last one's surplus is pruned).
        remaining = {queued.sample.group_id for queued in self.sink.queued()}
        assert not remaining & {queued.group_id for queued in batch}, "a group was split"
        order = [self.admission_order[queued.group_id] for queued in batch]
        assert order == sorted(order), "groups were not taken first in, first out"
        for sample in batch:
            self.shipped_files |= files_of[id(sample)]

    def check_state(self) -> None:
        sink = self.sink
        assert sink.admitted == self.admitted_units
        accounted = sink.shipped + sink.queued_samples + sink.abandoned
        assert sink.admitted == accounted + sum(sink.counters.values())
        assert sink.queued_samples == len(sink.queued())
        still_pinned = {
            path for path in self.shipped_files if version_of(path) >= self.forgotten_below
        }
        assert sink.refs.pinned_files == len(still_pinned)

    def apply(self, op: Operation) -> None:
        sink = self.sink
        if isinstance(op, Admit):
            self.deleted(sink.admit(self.build(op), self.next_step))
        elif isinstance(op, DropStale):
            self.deleted(sink.drop_stale(self.next_step))
        elif not sink.ready(self.next_step):
            before = (sink.queued(), sink.counters)
            with pytest.raises(SinkNotReady):
                sink.assemble(self.next_step)
            assert (sink.queued(), sink.counters) == before
        else:
            step = self.next_step
            # The sink ships the very samples it queued; their files stay its bookkeeping.
            files_of = {id(queued.sample): queued.files for queued in sink.queued()}
            batch, files = sink.assemble(step)
            self.check_batch(step, batch, files_of)
            self.deleted(files)
            self.next_step += 1
            if op.collect:
                # The trainer read batch `step` and published v{step}; the collector then
                # removed every v<k> below min_fresh_version(step + 1, m).
                bound = min_fresh_version(step + 1, self.m)
                sink.forget_versions_below(bound)
                self.forgotten_below = max(self.forgotten_below, bound)
        self.check_state()


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(runs())
def test_sink_invariants_hold_over_random_runs(
    run_spec: tuple[SinkLimits, list[Operation]],
) -> None:
    limits, ops = run_spec
    run = Run(TrainSink(limits))
    for op in ops:
        run.apply(op)

    # Shown by --hypothesis-show-statistics: most runs should assemble several batches.
    batches = run.next_step - 1
    event(f"batches assembled: {'5+' if batches >= 5 else batches}")
    run.deleted(run.sink.drop_all())
    run.check_state()
    assert run.sink.refs.held_files == 0
    for path in run.every_file:
        if path not in run.shipped_files:
            assert run.returned[path] == 1, f"{path} leaked"
        elif version_of(path) >= run.forgotten_below:
            assert run.returned[path] == 0
