"""The per-group file check of finished rollouts (`RolloutFinisher.check_files`): a missing
file poisons a rollout, unless its version is being collected (the rollout is stale then,
not poisoned)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import trio
from payload_gc import min_fresh_version

from orchestrator.core.staleness import Staleness
from orchestrator.core.turns import TurnOutput
from orchestrator.daemon.rollout_finisher import RolloutFinisher
from orchestrator.daemon.rollout_run import RolloutRun
from orchestrator.daemon.run_state import RunState, Shipping, Versions
from orchestrator.payload import PayloadSegment

DIGEST = "0" * 32
MAX_OFF_POLICY = 2


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
    config: Any = SimpleNamespace(payload_root=root)
    return RolloutFinisher(config, state, trio.CapacityLimiter(1))


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
