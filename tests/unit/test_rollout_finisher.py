"""Finishing a group (`RolloutFinisher`): the per-group file check, where a missing file
poisons a rollout unless its version is being collected (the rollout is stale then, not
poisoned); and a group its rewards alone discard, whose files are not read and whose
samples are not built."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import trio
from payload_gc import min_fresh_version

from orchestrator.core.rollouts import Discard, GroupResult
from orchestrator.core.sink import SinkLimits, TrainSink
from orchestrator.core.staleness import Staleness
from orchestrator.core.turns import TurnOutput
from orchestrator.daemon.rollout_finisher import RolloutFinisher
from orchestrator.daemon.rollout_run import RolloutRun
from orchestrator.daemon.run_state import RunState, Shipping, Versions
from orchestrator.payload import PayloadSegment

DIGEST = "0" * 32
MAX_OFF_POLICY = 2
LIMITS = SinkLimits(1, False, Staleness(MAX_OFF_POLICY, 1), 0.0, 1.0, 100)


def run_with_missing_file(root: Path, version: int) -> RolloutRun:
    payload_dir = root / f"v{version}"
    payload_dir.mkdir(parents=True)
    segment = PayloadSegment("sampling_mask", "gone.bin", 0, 4, (1, 8), "int32", DIGEST)
    turn = TurnOutput(
        (7,),
        (0.0,),
        "stop",
        segments={"sampling_mask": segment},
        files=frozenset({str(payload_dir / "gone.bin")}),
    )
    return RolloutRun("g1-r0", version, payload_dir, [1, 2, 3, 4, 7], turns=[(4, turn)])


def finisher(state: RunState, root: Path) -> RolloutFinisher:
    # Only the payload root takes part in the check.
    config: Any = SimpleNamespace(
        payload_root=root,
        payload=SimpleNamespace(fields=("routed_experts",), final_token_route="repeat"),
    )
    return RolloutFinisher(config, state, LIMITS, trio.CapacityLimiter(1))


async def test_a_missing_file_in_a_live_version_poisons_the_rollout(tmp_path: Path) -> None:
    state = RunState(Staleness(MAX_OFF_POLICY, 1), Shipping(0))
    run = run_with_missing_file(tmp_path, version=0)
    await finisher(state, tmp_path).check_files([run])
    assert state.dispatch.failures["poisoned_payload"] == 1
    poisoned = run.turns[0][1].poisoned
    assert poisoned is not None and "gone.bin" in poisoned


async def test_a_version_under_collection_is_stale_not_poisoned(tmp_path: Path) -> None:
    # Version 6 applied: its collection removes everything below the bound, v3 included,
    # and may be under way while the group's files are checked.
    state = RunState(Staleness(MAX_OFF_POLICY, 1), Shipping(0), versions=Versions(applied=6))
    assert state.collecting_below == min_fresh_version(7, MAX_OFF_POLICY) > 3
    run = run_with_missing_file(tmp_path, version=3)
    await finisher(state, tmp_path).check_files([run])
    assert state.dispatch.failures["poisoned_payload"] == 0
    assert run.turns[0][1].poisoned is None


class Reward:
    """An episode whose score is `reward`."""

    def __init__(self, reward: float) -> None:
        self.reward = reward

    async def score(self, completions: Sequence[Any]) -> float:
        return self.reward


def run_with_zero_routing(root: Path, index: int, reward: float) -> RolloutRun:
    """A rollout of a 3-token prompt and a 2-token completion whose routing file holds
    zeros: a row that names expert 0 twice, which only a read of the file shows."""
    payload_dir = root / "v0"
    payload_dir.mkdir(parents=True, exist_ok=True)
    name = f"r{index}.bin"
    (payload_dir / name).write_bytes(bytes(4 * 2 * 2))
    segment = PayloadSegment("routed_experts", name, 0, 0, (4, 2, 2), "uint8")
    turn = TurnOutput(
        np.array([7, 8], np.int32),
        np.array([-0.5, -0.25], np.float32),
        "stop",
        segments={"routed_experts": segment},
        files=frozenset({str(payload_dir / name)}),
    )
    return RolloutRun(
        f"g1-r{index}",
        0,
        payload_dir,
        np.array([1, 2, 3, 7, 8], np.int32),
        turns=[(3, turn)],
        episode=Reward(reward),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("rewards", "discard"),
    [((1.0, 1.0), Discard.NO_SIGNAL), ((2.0, 2.5), Discard.CURRICULUM)],
    ids=["no-signal", "curriculum"],
)
async def test_a_group_its_rewards_discard_is_neither_read_nor_built(
    tmp_path: Path, rewards: tuple[float, float], discard: Discard
) -> None:
    state = RunState(Staleness(MAX_OFF_POLICY, 1), Shipping(0))
    runs = [run_with_zero_routing(tmp_path, i, reward) for i, reward in enumerate(rewards)]

    results = await finisher(state, tmp_path).finish_group("g1", 0, runs, check_files=True)

    # Its files were looked at (their sizes are in the run's account), not read: the
    # routing that repeats an expert went unseen.
    assert state.payload.files_written == 2
    assert state.dispatch.failures["poisoned_payload"] == 0
    assert [(r.reward, r.samples, r.failed) for r in results] == [(x, (), None) for x in rewards]
    assert [r.files for r in results] == [run.turns[0][1].files for run in runs]
    assert state.dispatch.rollouts["completed"] == 2
    # The sink counts every member under the reason the finisher foresaw, and deletes
    # their files.
    sink = TrainSink(LIMITS)
    deleted = sink.admit(GroupResult("g1", 0, results), 1)
    assert sink.counters[discard.value] == 2 and sum(sink.counters.values()) == 2
    assert deleted == sorted(str(tmp_path / "v0" / f"r{i}.bin") for i in range(2))


async def test_a_group_with_signal_is_read_and_built(tmp_path: Path) -> None:
    state = RunState(Staleness(MAX_OFF_POLICY, 1), Shipping(0))
    runs = [run_with_zero_routing(tmp_path, i, reward) for i, reward in enumerate((1.0, 0.0))]

    results = await finisher(state, tmp_path).finish_group("g1", 0, runs, check_files=True)

    assert state.dispatch.failures["poisoned_payload"] == 2
    for result in results:
        (sample,) = result.samples
        assert sample.untrainable is not None and "all-zero routing" in sample.untrainable
    assert state.dispatch.rollouts["poisoned"] == 2


async def test_a_poisoned_reply_in_a_group_its_rewards_discard_counts_as_poisoned(
    tmp_path: Path,
) -> None:
    state = RunState(Staleness(MAX_OFF_POLICY, 1), Shipping(0))
    runs = [run_with_zero_routing(tmp_path, i, 1.0) for i in range(2)]
    # Refused when the reply came (its payload_error, say): known without a read.
    turn = runs[0].turns[0][1]
    runs[0].turns[0] = (3, TurnOutput(turn.completion_ids, turn.logprobs, "stop", poisoned="x"))

    await finisher(state, tmp_path).finish_group("g1", 0, runs, check_files=True)

    assert (state.dispatch.rollouts["poisoned"], state.dispatch.rollouts["completed"]) == (1, 1)
