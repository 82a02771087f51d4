"""The embedded fleet follows `[model]` (issue 55, finding 3): its servers take the
vocabulary size and eos id of the tokenizer the run loads, unless `[sim]` sets them. With
Qwen3's 151k tokenizer the servers kept 32,000 ids and refused every prompt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import trio
from demo_run import DEMO_MODEL, small_demo_config
from qwen3_tokenizer import QWEN3_MISSING, qwen3_tokenizer

from orchestrator.commands.launch import launch_run
from orchestrator.handoff import shipped_steps
from orchestrator.sim.fleet import sim_model
from orchestrator.tasks.build import load_tokenizer, model_tokens

pytestmark = pytest.mark.slow


def model_ending_with_im_start(folder: Path) -> Path:
    """demo/model with another end-of-turn token, <|im_start|> (id 1), and no
    generation config: a vocabulary and an eos id that are neither the simulator's
    defaults nor the demo's."""
    shutil.copytree(DEMO_MODEL, folder)
    (folder / "generation_config.json").unlink()
    path = folder / "tokenizer_config.json"
    settings = json.loads(path.read_text())
    settings["eos_token"] = "<|im_start|>"
    path.write_text(json.dumps(settings))
    return folder


def test_the_fleet_takes_the_tokenizers_vocabulary_and_eos(tmp_path: Path) -> None:
    model = model_ending_with_im_start(tmp_path / "model")
    config = small_demo_config(tmp_path / "run", f'model.tokenizer="{model}"')
    tokens = model_tokens(load_tokenizer(config))
    assert tokens == (1024, 1)
    served = sim_model(config, tokens)
    assert (served.vocab_size, served.eos_token_id) == (1024, 1)
    # What [sim] sets wins, each key alone.
    kept = small_demo_config(tmp_path / "run", "sim.vocab_size=4096")
    assert sim_model(kept, (1024, 1)).vocab_size == 4096
    assert sim_model(kept, (1024, 1)).eos_token_id == 1
    # No tokenizer (the toy environment): the simulator's defaults.
    assert (sim_model(kept).vocab_size, sim_model(kept).eos_token_id) == (4096, 2)


async def test_a_run_with_qwen3s_tokenizer_trains_against_the_embedded_fleet(
    tmp_path: Path,
) -> None:
    folder = qwen3_tokenizer()
    if folder is None:
        pytest.skip(QWEN3_MISSING)
    config = small_demo_config(
        tmp_path / "run",
        "rewards.workers=1",
        f'model.tokenizer="{folder}"',
        "max_steps=1",
        "eval.env=[]",
        "sim.inference_servers=1",
    )
    with trio.fail_after(120):
        outcome = await launch_run(config)
    assert shipped_steps(config.batches_dir) == [1]
    failures = dict(outcome.state.dispatch.failures)
    assert not failures, failures
