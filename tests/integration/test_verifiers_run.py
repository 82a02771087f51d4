"""A verifiers environment no one changed for this project (demo/verifiers_envs/vf_arith,
verifiers' own API) trains through `[[env]] verifiers = ...`: the daemon, the local fleet
writing routing and masks by handle, the local trainer reading every payload byte, the
collector after every update (configs/verifiers.toml, one small step). Beside it, one eval
of another, multi-turn, verifiers environment (`[[eval.env]]`, vf_twoturn: a second user
turn) at the last version, its turns bridged by a renderer for demo/model's template
(demo/verifiers_envs/qwen3_no_tools)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog.testing
import trio

from orchestrator.commands.launch import launch_run
from orchestrator.commands.summary import check_invariants
from orchestrator.config import load_config
from orchestrator.handoff import BATCH_FILE, read_batch_file

REPO = Path(__file__).resolve().parents[2]
STEPS = 1
#: The renderer that bridges turns on demo/model's template (renderers' `qwen3` refuses
#: its tokenizer: no tool-call tokens), as configs/verifiers.toml names it.
RENDERER = (
    '{name = "custom", import_path = "qwen3_no_tools.Qwen3NoToolsRenderer", '
    'thinking_retention = "all"}'
)
#: The eval: one of vf-twoturn's tasks, twice, once (the last version's; no base model).
EVAL_PROMPTS, EVAL_SAMPLES, EVAL_MAX_TOKENS = 1, 2, 16


@pytest.mark.slow
async def test_a_verifiers_environment_trains_by_handle_and_another_is_evaluated(
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
            # A group whose rewards are all equal is discarded (no_signal) and another is
            # drawn: each costs 4 episodes (1.5 to 2 CPU-s each). Replies of at most 4
            # tokens give a number (reward 0.25) about as often as not, where 16 random
            # tokens nearly always do; with seed 1 the first group already has a signal.
            "seed=1",
            "env.0.max_tokens=4",
            "inference.max_inflight=4",
            "sim.train_time_s=0.02",
            "trainer.poll_interval_s=0.1",
            'eval.env=[{name = "vf-twoturn", verifiers = "vf-twoturn", max_turns = 2, '
            f"max_tokens = {EVAL_MAX_TOKENS}, renderer = {RENDERER}}}]",
            "eval.eval_base_model=false",
            f"eval.num_examples={EVAL_PROMPTS}",
            f"eval.rollouts_per_example={EVAL_SAMPLES}",
        ],
    )
    with structlog.testing.capture_logs() as logs, trio.fail_after(240):
        outcome = await launch_run(config)
    state = outcome.state
    assert state.shipping.last_shipped == STEPS
    assert state.dispatch.failures["trajectory_mismatch"] == 0
    assert state.dispatch.rollouts["completed"] >= STEPS * 4
    # Its rubric's metric reached the env's tally.
    assert "reply_chars" in outcome.sink.by_env["vf-arith"].metrics.means()
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

    # The eval: one line of evals.jsonl, at the last version, every sample scored (each
    # second turn extended the first: no trajectory_mismatch), pass@k of its 0/1 reward.
    (line,) = [json.loads(text) for text in config.evals_file.read_text().splitlines()]
    assert (line["version"], line["step"], line["resumed"]) == (STEPS, STEPS, False)
    assert set(line["envs"]) == {"vf-twoturn"}
    result = line["envs"]["vf-twoturn"]
    samples = EVAL_PROMPTS * EVAL_SAMPLES
    assert (result["samples"], result["failed"], result["failures"]) == (samples, 0, {}), result
    assert (result["prompts"], result["skipped_prompts"], result["versions"]) == (
        EVAL_PROMPTS,
        0,
        [STEPS],
    )
    assert set(result["pass_at"]) == {"1", "2"}
    assert 0 <= result["pass_at"]["1"] <= result["pass_at"]["2"] <= 1
    assert 0 <= result["reward_mean"] <= 1
    # The environment's own metric (vf_twoturn's `first_correct`), averaged.
    assert 0 <= result["metrics"]["first_correct"] <= 1
    # Both turns' completions count: at most max_tokens each.
    assert 2 <= result["completion_tokens_max"] <= 2 * EVAL_MAX_TOKENS
    evaluation = state.evaluation
    assert evaluation.evals == 1 and evaluation.running is None
    assert evaluation.rollouts == {"scored": samples}
    assert evaluation.failures["trajectory_mismatch"] == 0
    assert evaluation.last is not None and evaluation.last.to_json() == line
    (logged,) = [entry for entry in logs if entry["event"] == "eval"]
    assert (logged["env"], logged["version"], logged["samples"]) == ("vf-twoturn", STEPS, samples)
    # The eval's rollouts are apart from training's, which never saw its env.
    assert "vf-twoturn" not in outcome.sink.by_env
