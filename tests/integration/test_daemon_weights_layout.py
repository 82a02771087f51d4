"""The daemon end to end with a trainer that publishes in prime-rl's layout
(`<weights_dir>/step_7/STABLE`): it follows every version and ships every batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from orchestrator.commands.launch import launch_run
from orchestrator.config import load_config
from orchestrator.handoff import published_versions, shipped_steps

DEMO = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"


@pytest.mark.slow
async def test_the_daemon_follows_a_trainer_publishing_in_the_prime_rl_layout(
    tmp_path: Path,
) -> None:
    # Where prime-rl's trainer broadcasts: <output_dir>/broadcasts/step_N/STABLE.
    weights_dir = tmp_path / "prime-rl" / "broadcasts"
    config = load_config(
        DEMO,
        [
            f'run_dir="{tmp_path / "run"}"',
            "max_steps=3",
            "sim.train_time_s=0.02",
            "trainer.poll_interval_s=0.1",
            f'trainer.weights_dir="{weights_dir}"',
            'trainer.weights_layout="prime-rl"',
        ],
    )
    with trio.fail_after(120):
        outcome = await launch_run(config)
    assert outcome.state.versions.settled == 3
    assert shipped_steps(config.batches_dir) == [1, 2, 3]
    # The local trainer published in prime-rl's layout, and only there.
    assert sorted(p.name for p in weights_dir.iterdir()) == ["step_1", "step_2", "step_3"]
    assert published_versions(weights_dir, layout="prime-rl") == [1, 2, 3]
    # Batches keep our layout.
    assert sorted(p.name for p in config.batches_dir.iterdir()) == [
        "step_000001",
        "step_000002",
        "step_000003",
    ]
