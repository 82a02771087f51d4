"""The train sink: every discard rule with its counter and the exact files it returns,
shared files between branches, the sweep, batch assembly (FIFO, pruning), and `ready`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from orchestrator.core.rollouts import Discard, GroupResult, RolloutResult, Sample
from orchestrator.core.sink import SinkLimits, SinkNotReady, TrainSink, discarded_by_rewards
from orchestrator.core.staleness import Staleness
from orchestrator.handoff import read_batch_file, write_batch_file

# m = 2: batch 4 may hold groups that started at v1 or later.
LIMITS = SinkLimits(
    batch_size=4,
    constant_size=True,
    staleness=Staleness(2),
    curriculum_min_mean_reward=0.0,
    curriculum_max_mean_reward=1.0,
    max_seq_len=16,
)
NEXT_STEP = 4


def path(name: str, k: int = 3) -> str:
    return f"/root/v{k}/{name}.bin"


def branch(
    rollout_id: str,
    *files: str,
    length: int = 6,
    loss_tokens: int = 3,
    untrainable: str | None = None,
) -> Sample:
    return Sample(
        rollout_id=rollout_id,
        token_ids=tuple(range(length)),
        loss_mask=(0,) * (length - loss_tokens) + (1,) * loss_tokens,
        logprobs=(0.0,) * length,
        files=frozenset(files),
        untrainable=untrainable,
    )


def member(
    rollout_id: str,
    reward: float,
    *samples: Sample,
    k: int = 3,
    extra_files: tuple[str, ...] = (),
    failed: str | None = None,
) -> RolloutResult:
    files = frozenset(extra_files).union(*(sample.files for sample in samples))
    return RolloutResult(
        rollout_id=rollout_id,
        dispatch_version=k,
        reward=reward,
        samples=samples,
        files=files,
        failed=failed,
    )


def simple(rollout_id: str, reward: float, k: int = 3) -> RolloutResult:
    """A member with one branch and one file of its own."""
    return member(rollout_id, reward, branch(rollout_id, path(rollout_id, k)), k=k)


def group(group_id: str, start_version: int, *members: RolloutResult) -> GroupResult:
    return GroupResult(group_id=group_id, start_version=start_version, rollouts=members)


def counts(**by_reason: int) -> dict[str, int]:
    expected = {reason.value: 0 for reason in Discard}
    expected.update(by_reason)
    return expected


def assert_balanced(sink: TrainSink) -> None:
    accounted = sink.shipped + sink.queued_samples + sink.abandoned + sum(sink.counters.values())
    assert sink.admitted == accounted


def rollout_ids(sink_or_batch: object) -> list[str]:
    if isinstance(sink_or_batch, TrainSink):
        return [entry.sample.rollout_id for entry in sink_or_batch.queued()]
    assert isinstance(sink_or_batch, list)
    return [sample.rollout_id for sample in sink_or_batch]


# -- limits ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"batch_size": 0}, "'batch_size' must be >= 1"),
        ({"max_seq_len": 0}, "'max_seq_len' must be >= 1"),
        ({"curriculum_min_mean_reward": 0.6, "curriculum_max_mean_reward": 0.4}, "must be <="),
    ],
)
def test_limits_out_of_range_are_rejected(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        attrs.evolve(LIMITS, **change)


# -- admission: each rule, its counter and its files ----------------------------------


def test_a_fresh_group_with_signal_is_queued_with_its_advantages() -> None:
    sink = TrainSink(LIMITS)

    deleted = sink.admit(group("g", 3, simple("a", 1.0), simple("b", 0.0), simple("c", 0.5)), 4)

    assert deleted == []
    assert sink.counters == counts()
    assert [(q.sample.rollout_id, q.sample.reward, q.sample.advantage) for q in sink.queued()] == [
        ("a", 1.0, 0.5),
        ("b", 0.0, -0.5),
        ("c", 0.5, 0.0),
    ]
    first = sink.queued()[0].sample
    assert (first.group_id, first.start_version, first.dispatch_version) == ("g", 3, 3)
    assert (sink.queued_samples, sink.queued_groups, sink.oldest_start_version) == (3, 1, 3)
    assert_balanced(sink)


def test_stale_group_discards_every_member_and_returns_all_their_files() -> None:
    sink = TrainSink(LIMITS)
    forked = member(
        "a",
        1.0,
        branch("a", path("a-turn1", 0), path("a-turn2", 0)),
        branch("a", path("a-turn1", 0), path("a-alt", 0)),
        k=0,
        extra_files=(path("a-unused", 0),),
    )
    stale = group("g", 0, forked, simple("b", 0.0, k=1), member("c", 0.0, k=1, failed="500"))

    # min_fresh_version(4, 2) = 1 > 0
    deleted = sink.admit(stale, NEXT_STEP)

    assert deleted == sorted(
        [
            *(path(name, 0) for name in ("a-turn1", "a-turn2", "a-alt", "a-unused")),
            path("b", 1),
        ]
    )
    # One unit per branch; a member without branches (the failed one) is one unit.
    assert sink.counters == counts(stale=4)
    assert sink.queued_samples == 0
    assert_balanced(sink)


def test_a_group_starting_exactly_at_the_bound_is_fresh() -> None:
    sink = TrainSink(LIMITS)

    assert sink.admit(group("g", 1, simple("a", 1.0), simple("b", 0.0)), NEXT_STEP) == []
    assert sink.queued_samples == 2


def test_failed_members_are_counted_and_their_earlier_turns_deleted() -> None:
    sink = TrainSink(LIMITS)
    failed = member("c", 0.0, extra_files=(path("c-turn1"),), failed="HTTP 500 on turn 2")

    deleted = sink.admit(group("g", 3, simple("a", 1.0), simple("b", 0.0), failed), NEXT_STEP)

    assert deleted == [path("c-turn1")]
    assert sink.counters == counts(failed=1)
    # The mean is over the members that did not fail: (1 + 0) / 2.
    assert [q.sample.advantage for q in sink.queued()] == [0.5, -0.5]
    assert_balanced(sink)


def test_every_member_failed_counts_failed_only() -> None:
    sink = TrainSink(LIMITS)
    all_failed = group(
        "g",
        3,
        member("a", 0.0, extra_files=(path("a"),), failed="timeout"),
        member("b", 0.0, failed="timeout"),
    )

    assert sink.admit(all_failed, NEXT_STEP) == [path("a")]
    assert sink.counters == counts(failed=2)
    assert_balanced(sink)


@pytest.mark.parametrize(
    "bad_branch",
    [
        branch("a", path("a-bad"), untrainable="payload_error: disk full"),
        branch("a", path("a-bad"), loss_tokens=0),
        branch("a", path("a-bad"), length=17),  # max_seq_len = 16
    ],
    ids=["marked", "no-loss-tokens", "too-long"],
)
def test_an_untrainable_branch_is_discarded_and_its_own_files_deleted(bad_branch: Sample) -> None:
    sink = TrainSink(LIMITS)
    forked = member("a", 1.0, branch("a", path("a-good")), bad_branch)

    deleted = sink.admit(group("g", 3, forked, simple("b", 0.0)), NEXT_STEP)

    assert deleted == [path("a-bad")]
    assert sink.counters == counts(untrainable=1)
    assert rollout_ids(sink) == ["a", "b"]
    assert sink.queued()[0].files == {path("a-good")}
    assert_balanced(sink)


def test_a_branch_of_exactly_max_seq_len_is_trainable() -> None:
    sink = TrainSink(LIMITS)

    sink.admit(group("g", 3, member("a", 1.0, branch("a", length=16)), simple("b", 0.0)), 4)

    assert sink.counters == counts()
    assert sink.queued_samples == 2


def test_a_file_shared_with_a_queued_sibling_branch_is_kept() -> None:
    sink = TrainSink(LIMITS)
    turn1 = path("a-turn1")
    forked = member(
        "a",
        1.0,
        branch("a", turn1, path("a-left")),
        branch("a", turn1, path("a-right"), untrainable="too long"),
    )

    deleted = sink.admit(group("g", 3, forked, simple("b", 0.0)), NEXT_STEP)

    assert deleted == [path("a-right")]
    assert sink.refs.is_referenced(turn1)
    assert_balanced(sink)


def test_a_file_shared_by_two_discarded_branches_is_returned_once() -> None:
    sink = TrainSink(LIMITS)
    turn1 = path("a-turn1")
    forked = member(
        "a",
        1.0,
        branch("a", turn1, path("a-left"), loss_tokens=0),
        branch("a", turn1, path("a-right"), untrainable="poisoned"),
    )

    deleted = sink.admit(group("g", 3, forked, simple("b", 0.0)), NEXT_STEP)

    assert deleted == sorted([turn1, path("a-left"), path("a-right")])
    assert sink.counters == counts(untrainable=2)
    assert rollout_ids(sink) == ["b"]


def test_a_member_without_branches_counts_untrainable_and_loses_its_files() -> None:
    sink = TrainSink(LIMITS)
    empty = member("c", 1.0, extra_files=(path("c-turn1"),))

    deleted = sink.admit(group("g", 3, simple("a", 1.0), simple("b", 0.0), empty), NEXT_STEP)

    assert deleted == [path("c-turn1")]
    assert sink.counters == counts(untrainable=1)
    # Its reward still counts in the mean: (1 + 0 + 1) / 3.
    assert [round(q.sample.advantage, 6) for q in sink.queued()] == [0.333333, -0.666667]
    assert_balanced(sink)


def test_files_of_a_queued_member_that_no_branch_references_are_deleted() -> None:
    sink = TrainSink(LIMITS)
    # A turn the environment threw away: the member wrote it, but no branch reads it.
    kept = member("a", 1.0, branch("a", path("a-turn1")), extra_files=(path("a-retry"),))

    deleted = sink.admit(group("g", 3, kept, simple("b", 0.0)), NEXT_STEP)

    assert deleted == [path("a-retry")]
    assert sink.queued_samples == 2


@pytest.mark.parametrize(
    "rewards",
    [(1.0, 1.0, 1.0), (0.0, 0.0), (0.1, 0.1, 0.1)],
    ids=["ones", "zeros", "float-residue"],
)
def test_no_signal_when_every_advantage_is_zero(rewards: tuple[float, ...]) -> None:
    sink = TrainSink(LIMITS)
    members = [simple(f"r{i}", reward) for i, reward in enumerate(rewards)]

    deleted = sink.admit(group("g", 3, *members), NEXT_STEP)

    assert deleted == sorted(path(f"r{i}") for i in range(len(rewards)))
    assert sink.counters == counts(no_signal=len(rewards))
    assert sink.queued_samples == 0
    assert_balanced(sink)


def test_no_signal_counts_remaining_branches_after_untrainable_ones() -> None:
    sink = TrainSink(LIMITS)
    # Mean reward 0.5: the members with signal (1 and 0) have no trainable branch left,
    # and the two that remain sit exactly at the mean.
    members = (
        member("a", 1.0, branch("a", path("a"), untrainable="poisoned")),
        member("d", 0.0, branch("d", path("d"), loss_tokens=0)),
        simple("b", 0.5),
        simple("c", 0.5),
    )

    deleted = sink.admit(group("g", 3, *members), NEXT_STEP)

    assert deleted == sorted(path(name) for name in "abcd")
    assert sink.counters == counts(untrainable=2, no_signal=2)
    assert_balanced(sink)


@pytest.mark.parametrize(
    ("rewards", "queued"),
    [
        ((1.0, 0.0), True),  # mean 0.5
        ((2.0, 0.0), True),  # mean 1.0: the range is inclusive
        ((3.0, 0.0), False),  # mean 1.5
        ((-1.0, 0.0), False),  # mean -0.5
        ((float("nan"), 0.0), False),  # a NaN mean is outside any range
    ],
)
def test_curriculum_rejects_groups_whose_mean_reward_is_outside(
    rewards: tuple[float, float], queued: bool
) -> None:
    sink = TrainSink(LIMITS)

    deleted = sink.admit(group("g", 3, simple("a", rewards[0]), simple("b", rewards[1])), 4)

    if queued:
        assert (deleted, sink.counters, sink.queued_samples) == ([], counts(), 2)
    else:
        assert deleted == [path("a"), path("b")]
        assert sink.counters == counts(curriculum=2)
        assert sink.queued_samples == 0
    assert_balanced(sink)


def test_no_signal_is_judged_before_the_curriculum() -> None:
    sink = TrainSink(LIMITS)

    sink.admit(group("g", 3, simple("a", 5.0), simple("b", 5.0)), NEXT_STEP)

    assert sink.counters == counts(no_signal=2)


@pytest.mark.parametrize(
    ("rewards", "reason"),
    [
        ((0.5, 0.5, 0.5), "no_signal"),
        ((0.1, 0.1, 0.1), "no_signal"),  # float residues of the mean are no signal
        ((0.0, 1.0), None),
        ((2.0, 1.0), "curriculum"),  # mean 1.5
        ((float("nan"), 0.0), "curriculum"),
        ((5.0, 5.0), "no_signal"),  # judged before the curriculum
    ],
)
def test_discarded_by_rewards_foresees_the_sinks_verdict(
    rewards: tuple[float, ...], reason: str | None
) -> None:
    verdict = discarded_by_rewards(rewards, LIMITS)
    assert (verdict.value if verdict is not None else None) == reason
    sink = TrainSink(LIMITS)
    sink.admit(group("g", 3, *(simple(f"r{i}", r) for i, r in enumerate(rewards))), 4)
    assert sink.queued_samples == (len(rewards) if reason is None else 0)


@pytest.mark.parametrize(
    ("rewards", "reason"), [((1.0, 1.0), "no_signal"), ((3.0, 2.0), "curriculum")]
)
def test_a_group_its_rewards_discard_is_counted_whole_under_that_reason(
    rewards: tuple[float, float], reason: str
) -> None:
    sink = TrainSink(LIMITS)
    # Whatever its branches hold (one untrainable), or without branches at all (the
    # daemon builds none for such a group): every member counts under the reason.
    members = (
        member("a", rewards[0], branch("a", path("a"), untrainable="poisoned")),
        simple("b", rewards[1]),
        member("c", rewards[0], extra_files=(path("c"),)),
        member("d", 0.0, extra_files=(path("d"),), failed="request failed"),
    )

    deleted = sink.admit(group("g", 3, *members), NEXT_STEP)

    assert deleted == sorted(path(name) for name in "abcd")
    assert sink.counters == counts(**{reason: 3, "failed": 1})
    assert_balanced(sink)


# -- the sweep ------------------------------------------------------------------------


def test_drop_stale_discards_groups_below_the_bound_wherever_they_are_queued() -> None:
    sink = TrainSink(LIMITS)
    sink.admit(group("g3", 3, simple("a", 1.0), simple("b", 0.0)), NEXT_STEP)
    sink.admit(group("g1", 1, simple("c", 1.0, k=1), simple("d", 0.0, k=2)), NEXT_STEP)
    sink.admit(group("g2", 2, simple("e", 1.0, k=2), simple("f", 0.0, k=2)), NEXT_STEP)
    assert sink.oldest_start_version == 1

    # min_fresh_version(5, 2) = 2: only g1 is stale now.
    deleted = sink.drop_stale(5)

    assert deleted == [path("c", 1), path("d", 2)]
    assert sink.counters == counts(swept=2)
    assert rollout_ids(sink) == ["a", "b", "e", "f"]
    assert (sink.queued_groups, sink.oldest_start_version) == (2, 2)
    assert sink.drop_stale(5) == []
    assert_balanced(sink)


def test_drop_stale_keeps_a_file_a_shipped_sample_references() -> None:
    sink = TrainSink(attrs.evolve(LIMITS, batch_size=2))
    shared = path("shared", 2)
    # Two groups naming one file: the first ships, the second is swept later.
    sink.admit(group("g1", 2, member("a", 1.0, branch("a", shared)), simple("b", 0.0)), 4)
    sink.admit(group("g2", 2, member("c", 1.0, branch("c", shared)), simple("d", 0.0)), 4)
    batch, deleted = sink.assemble(4)
    assert rollout_ids(batch) == ["a", "b"]
    assert deleted == []

    # min_fresh_version(6, 2) = 3 > 2: g2 is stale.
    deleted = sink.drop_stale(6)

    assert deleted == [path("d")]
    assert sink.refs.is_pinned(shared)


# -- ready and assemble ---------------------------------------------------------------


def test_ready_counts_only_fresh_samples() -> None:
    sink = TrainSink(LIMITS)
    sink.admit(group("old", 1, simple("a", 1.0, k=1), simple("b", 0.0, k=1)), NEXT_STEP)
    sink.admit(group("new", 3, simple("c", 1.0), simple("d", 0.0)), NEXT_STEP)

    assert sink.ready(4)
    # For batch 5 the bound is 2, so the two samples of "old" do not count.
    assert not sink.ready(5)


def test_assemble_takes_whole_groups_first_in_first_out() -> None:
    sink = TrainSink(attrs.evolve(LIMITS, batch_size=4))
    for name, start in (("g1", 3), ("g2", 2), ("g3", 3)):
        sink.admit(group(name, start, simple(f"{name}a", 1.0), simple(f"{name}b", 0.0)), 4)

    batch, deleted = sink.assemble(4)

    assert rollout_ids(batch) == ["g1a", "g1b", "g2a", "g2b"]
    assert deleted == []
    assert rollout_ids(sink) == ["g3a", "g3b"]
    assert sink.shipped == 4
    assert all(sink.refs.is_pinned(path(f"{name}a")) for name in ("g1", "g2"))
    assert_balanced(sink)


def test_constant_size_prunes_the_surplus_of_the_last_group() -> None:
    sink = TrainSink(attrs.evolve(LIMITS, batch_size=3))
    sink.admit(group("g1", 3, simple("a", 1.0), simple("b", 0.0)), NEXT_STEP)
    shared = path("c-turn1")
    forked = member(
        "c", 1.0, branch("c", shared, path("c-left")), branch("c", shared, path("c-right"))
    )
    sink.admit(group("g2", 3, forked, simple("d", 0.0)), NEXT_STEP)

    batch, deleted = sink.assemble(4)

    # The last sample shipped is g2's left branch: its files are pinned, the right's not.
    assert (batch[-1].group_id, batch[-1].rollout_id) == ("g2", "c")
    assert sink.refs.is_pinned(path("c-left")) and not sink.refs.is_pinned(path("c-right"))
    assert len(batch) == 3
    # The pruned sibling's own file goes; the turn it shares with a shipped branch stays.
    assert deleted == [path("c-right"), path("d")]
    assert sink.counters == counts(pruned=2)
    assert sink.refs.is_pinned(shared)
    assert sink.queued_samples == 0
    assert_balanced(sink)


def test_without_constant_size_whole_groups_are_taken_until_the_batch_is_full() -> None:
    sink = TrainSink(attrs.evolve(LIMITS, batch_size=3, constant_size=False))
    sink.admit(group("g1", 3, simple("a", 1.0), simple("b", 0.0)), NEXT_STEP)
    sink.admit(group("g2", 3, simple("c", 1.0), simple("d", 0.0)), NEXT_STEP)
    sink.admit(group("g3", 3, simple("e", 1.0), simple("f", 0.0)), NEXT_STEP)

    batch, deleted = sink.assemble(4)

    assert rollout_ids(batch) == ["a", "b", "c", "d"]
    assert deleted == []
    assert sink.counters == counts()
    assert rollout_ids(sink) == ["e", "f"]


def test_assemble_sweeps_stale_groups_first() -> None:
    sink = TrainSink(attrs.evolve(LIMITS, batch_size=2))
    sink.admit(group("old", 1, simple("a", 1.0, k=1), simple("b", 0.0, k=1)), NEXT_STEP)
    sink.admit(group("new", 2, simple("c", 1.0, k=2), simple("d", 0.0, k=2)), NEXT_STEP)

    # min_fresh_version(5, 2) = 2: "old" may not be in batch 5 although it is first.
    batch, deleted = sink.assemble(5)

    assert rollout_ids(batch) == ["c", "d"]
    assert all(q.start_version >= 2 for q in batch)
    assert deleted == [path("a", 1), path("b", 1)]
    assert sink.counters == counts(swept=2)
    assert_balanced(sink)


def test_assemble_when_not_ready_raises_and_changes_nothing() -> None:
    sink = TrainSink(LIMITS)
    sink.admit(group("old", 1, simple("a", 1.0, k=1), simple("b", 0.0, k=1)), NEXT_STEP)
    sink.admit(group("new", 3, simple("c", 1.0), simple("d", 0.0)), NEXT_STEP)

    with pytest.raises(SinkNotReady, match="batch 5 needs 4 fresh queued samples"):
        sink.assemble(5)

    assert rollout_ids(sink) == ["a", "b", "c", "d"]
    assert sink.counters == counts()


# -- shutdown and forgetting ----------------------------------------------------------


def test_drop_all_empties_the_queue_and_returns_its_files() -> None:
    sink = TrainSink(LIMITS)
    sink.admit(group("g1", 3, simple("a", 1.0), simple("b", 0.0)), NEXT_STEP)
    sink.admit(group("g2", 3, simple("c", 1.0), simple("d", 0.0)), NEXT_STEP)

    deleted = sink.drop_all()

    assert deleted == sorted(path(name) for name in "abcd")
    assert (sink.queued_samples, sink.queued_groups, sink.abandoned) == (0, 0, 4)
    assert sink.counters == counts()
    assert sink.refs.held_files == 0
    assert_balanced(sink)


def test_forget_versions_below_drops_pins_of_collected_versions() -> None:
    sink = TrainSink(attrs.evolve(LIMITS, batch_size=2))
    sink.admit(group("g1", 2, simple("a", 1.0, k=2), simple("b", 0.0, k=3)), NEXT_STEP)
    sink.assemble(4)

    assert sink.forget_versions_below(3) == 1

    assert not sink.refs.is_pinned(path("a", 2))
    assert sink.refs.is_pinned(path("b", 3))
    assert sink.refs.pinned_files == 1


def test_an_empty_sink_reports_nothing_queued() -> None:
    sink = TrainSink(LIMITS)

    assert (sink.queued_samples, sink.queued_groups, sink.oldest_start_version) == (0, 0, None)
    assert sink.counters == counts()
    assert not sink.ready(1)
    assert sink.drop_stale(1) == []
    assert sink.drop_all() == []


def test_counters_are_a_copy() -> None:
    sink = TrainSink(LIMITS)
    snapshot = sink.counters

    sink.admit(group("g", 0, simple("a", 1.0, k=0)), NEXT_STEP)

    assert snapshot == counts()
    assert sink.counters == counts(stale=1)


def test_each_queued_sample_carries_its_groups_server_into_the_batch(tmp_path: Path) -> None:
    sink = TrainSink(LIMITS)
    server = "http://10.0.0.5:8000"
    pinned = attrs.evolve(group("g1", 3, simple("a", 1.0), simple("b", 0.0)), server=server)
    sink.admit(pinned, 4)
    sink.admit(group("g2", 3, simple("c", 1.0), simple("d", 0.0)), 4)

    batch, _ = sink.assemble(4)

    assert [q.server for q in batch] == [server, server, None, None]
    write_batch_file(tmp_path / "batch.bin", 4, batch, created_at=0.0, fsync=False)
    shipped = read_batch_file(tmp_path / "batch.bin").samples
    assert [s.server for s in shipped] == [server, server, None, None]
