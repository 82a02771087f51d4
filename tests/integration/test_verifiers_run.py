"""A verifiers environment no one changed for this project (demo/verifiers_envs/vf_arith,
verifiers' own API) trains through `[[env]] verifiers = ...`: the daemon, the local fleet
writing routing and masks by handle, the local trainer reading every payload byte, the
collector after every update (configs/verifiers.toml, one small step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from orchestrator.commands.launch import launch_run
from orchestrator.commands.summary import check_invariants
from orchestrator.config import load_config
from orchestrator.handoff import BATCH_FILE, read_batch_file

REPO = Path(__file__).resolve().parents[2]
STEPS = 1


@pytest.mark.slow
async def test_a_verifiers_environment_trains_by_handle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The environment's package importable by its worker, as the config's header says.
    monkeypatch.setenv("PYTHONPATH", str(REPO / "demo" / "verifiers_envs"))
    monkeypatch.chdir(REPO)  # the config's relative paths (demo/model)
    config = load_config(
        REPO / "configs" / "verifiers.toml",
        [
            f'run_dir="{tmp_path / "run"}"',
            f"max_steps={STEPS}",
            "batch.size=4",
            "batch.group_size=4",
            "inference.max_inflight=4",
            "sim.train_time_s=0.02",
            "trainer.poll_interval_s=0.1",
        ],
    )
    with trio.fail_after(240):
        outcome = await launch_run(config)
    state = outcome.state
    assert state.shipping.last_shipped == STEPS
    assert state.dispatch.failures["trajectory_mismatch"] == 0
    assert state.dispatch.rollouts["completed"] >= STEPS * 4
    # Its rubric's metric reached the env's tally.
    assert "reply_chars" in outcome.sink.by_env["vf-arith"].metric_means()
    batch = read_batch_file(config.batches_dir / f"step_{STEPS:06d}" / BATCH_FILE)
    assert {sample.env for sample in batch.samples} == {"vf-arith"}
    assert all(sample.payload["routed_experts"] for sample in batch.samples)
    report = json.loads((config.run_dir / "trainer" / "report.json").read_text())
    assert report["steps"] == STEPS and report["violations"] == []
    invariants = check_invariants(
        handoff=config.handoff,
        settings=config.handoff_settings,
        payload_root=config.payload_root,
        trainer_report=config.run_dir / "trainer" / "report.json",
        last_step=STEPS,
        bound=state.versions.collected_below,
    )
    assert all(invariant.held for invariant in invariants), invariants
