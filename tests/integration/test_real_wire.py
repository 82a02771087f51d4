"""The daemon end to end against servers answering in each real reply form: prime-rl's
extension by handle and inline, upstream vLLM inline, over loopback HTTP with the local
trainer reading every payload byte; and the two ways a real server can be set up wrong
for the run, each refused with its reason instead of training on nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from orchestrator.commands.summary import check_invariants
from orchestrator.config import Config, load_config
from orchestrator.daemon.run import run_daemon
from orchestrator.daemon.run_state import RunState
from orchestrator.handoff import BATCH_FILE, read_batch, read_batch_file

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.toml"
STEPS = 3


def form_config(run_dir: Path, form: str, mode: str, *overrides: str) -> Config:
    return load_config(
        DEMO,
        [
            f'run_dir="{run_dir}"',
            f"max_steps={STEPS}",
            "sim.train_time_s=0.02",
            "trainer.poll_interval_s=0.1",
            f'sim.reply_form="{form}"',
            f'payload.mode="{mode}"',
            *overrides,
        ],
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("form", "mode"),
    [("prime-rl", "by_handle"), ("prime-rl", "inline"), ("upstream", "inline")],
)
async def test_each_real_reply_form_trains_with_routing_and_keeps_every_invariant(
    tmp_path: Path, form: str, mode: str
) -> None:
    config = form_config(tmp_path / "run", form, mode)
    with trio.fail_after(120):
        outcome = await run_daemon(config)
    assert outcome.state.next_step == STEPS + 1
    assert outcome.state.failures["poisoned_payload"] == 0
    invariants = check_invariants(
        batches_dir=config.batches_dir,
        payload_root=config.payload_root,
        trainer_report=config.run_dir / "trainer" / "report.json",
        last_step=STEPS,
        bound=outcome.state.bound,
    )
    assert all(invariant.held is True for invariant in invariants), invariants
    report = json.loads((config.run_dir / "trainer" / "report.json").read_text())
    assert report["violations"] == [] and report["dropped"] == []
    assert report["samples"] == STEPS * 16
    # The trainer got routing for every position of every sample it trained on (one byte
    # per expert id at least), read from files by handle or decoded inline.
    lengths = [
        sample.length
        for step in range(1, STEPS + 1)
        for sample in read_batch_file(config.batches_dir / f"step_{step:06d}" / BATCH_FILE).samples
    ]
    assert report["payload_bytes"] >= sum(lengths) * 48 * 8
    if mode == "inline":
        # Every sample of the last batch carries routing over its whole sequence;
        # multi-turn samples were stitched from turns that each asked for their new rows.
        batch = read_batch(config.batches_dir / f"step_{STEPS:06d}")
        for sample in batch.samples:
            assert sample.routed_experts is not None
            assert sample.routed_experts.shape == (sample.length, 48, 8)
            assert sample.sampling_mask is not None
            assert sample.sampling_mask.shape[0] == sample.length


async def run_briefly(config: Config, seconds: float) -> RunState:
    async with trio.open_nursery() as nursery:
        state: RunState = await nursery.start(run_daemon, config)
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()
    return state


@pytest.mark.slow
async def test_an_upstream_server_asked_for_files_is_refused_with_the_reason(
    tmp_path: Path,
) -> None:
    # Upstream vLLM has no by-handle mode: it ignores extra_args.payload_dir and answers
    # inline. Nothing may train on that, and the reason must say what to change.
    config = form_config(tmp_path / "run", "upstream", "by_handle")
    state = await run_briefly(config, 4)
    assert state.next_step == 1
    assert state.failures["poisoned_payload"] > 0
    top = state.rejections.most_common("poisoned_payload", 1)
    assert "payload_dir" in top[0][0], top


@pytest.mark.slow
async def test_a_server_without_routing_capture_is_refused_with_the_reason(
    tmp_path: Path,
) -> None:
    config = form_config(tmp_path / "run", "prime-rl", "inline", "sim.capture_routed_experts=false")
    state = await run_briefly(config, 4)
    assert state.next_step == 1
    assert state.failures["poisoned_payload"] > 0
    top = state.rejections.most_common("poisoned_payload", 1)
    assert "routed_experts" in top[0][0], top
