"""The daemon end to end against servers answering in each real reply form: prime-rl's
extension by handle and inline, upstream vLLM inline, each also under disaggregated
prefill/decode (a router in front of a prefill and a decode server), over loopback HTTP
with the local trainer reading every payload byte; and the two ways a real server can be
set up wrong for the run, each refused with its reason instead of training on nothing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from orchestrator.commands.launch import launch_run
from orchestrator.commands.summary import check_invariants
from orchestrator.config import Config, load_config
from orchestrator.daemon.run_state import RunState
from orchestrator.handoff import (
    BATCH_FILE,
    HANDOFF_FORMATS,
    HandoffSettings,
    NativeFormat,
    Shipment,
    TrainSample,
    read_batch,
    read_batch_file,
)

DEMO = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"
STEPS = 3
#: Samples per batch, and the most rollouts in flight: half the demo's (16, 32), for a
#: shorter run. Every reply form and mode is exercised by each of its rollouts alike.
BATCH, INFLIGHT = 8, 16


def form_config(run_dir: Path, form: str, mode: str, *overrides: str) -> Config:
    # Each form with its own weight update: prime-rl's extension, or vLLM's dev endpoints.
    weight_update = "vllm" if form == "upstream" else "prime-rl"
    return load_config(
        DEMO,
        [
            f'run_dir="{run_dir}"',
            f"max_steps={STEPS}",
            "sim.train_time_s=0.02",
            "trainer.poll_interval_s=0.1",
            f'sim.reply_form="{form}"',
            f'payload.mode="{mode}"',
            f'inference.weight_update="{weight_update}"',
            f"batch.size={BATCH}",
            f"inference.max_inflight={INFLIGHT}",
            *overrides,
        ],
    )


@pytest.mark.slow
@pytest.mark.parametrize("disaggregated", [False, True], ids=["aggregated", "pd"])
@pytest.mark.parametrize(
    ("form", "mode"),
    [("prime-rl", "by_handle"), ("prime-rl", "inline"), ("upstream", "inline")],
)
async def test_each_real_reply_form_trains_with_routing_and_keeps_every_invariant(
    tmp_path: Path, form: str, mode: str, disaggregated: bool
) -> None:
    config = form_config(
        tmp_path / "run", form, mode, f"inference.disaggregated={str(disaggregated).lower()}"
    )
    with trio.fail_after(120):
        outcome = await launch_run(config)
    assert outcome.state.shipping.next_step == STEPS + 1
    assert outcome.state.dispatch.failures["poisoned_payload"] == 0
    invariants = check_invariants(
        handoff=config.handoff,
        settings=config.handoff_settings,
        payload_root=config.payload_root,
        trainer_report=config.run_dir / "trainer" / "report.json",
        last_step=STEPS,
        bound=outcome.state.versions.collected_below,
    )
    assert all(invariant.held is True for invariant in invariants), invariants
    report = json.loads((config.run_dir / "trainer" / "report.json").read_text())
    assert report["violations"] == [] and report["dropped"] == []
    assert report["samples"] == STEPS * BATCH
    # The trainer got routing for every position of every sample it trained on (one byte
    # per expert id at least), read from files by handle or decoded inline.
    lengths = [
        sample.length
        for step in range(1, STEPS + 1)
        for sample in read_batch_file(config.batches_dir / f"step_{step:06d}" / BATCH_FILE).samples
    ]
    assert report["payload_bytes"] >= sum(lengths) * 48 * 8
    if mode == "by_handle" and disaggregated:
        # Every shipped sample's routing comes from both sides' files: the prefill's for
        # the prompt, the decode's after it.
        for step in range(1, STEPS + 1):
            batch_file = read_batch_file(config.batches_dir / f"step_{step:06d}" / BATCH_FILE)
            for shipped in batch_file.samples:
                files = {segment.file for segment in shipped.payload["routed_experts"]}
                assert len(files) >= 2
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
        state: RunState = await nursery.start(launch_run, config)
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
    assert state.shipping.next_step == 1
    assert state.dispatch.failures["poisoned_payload"] > 0
    top = state.dispatch.rejections.most_common("poisoned_payload", 1)
    assert "payload_dir" in top[0][0], top


@pytest.mark.slow
async def test_a_server_without_routing_capture_is_refused_with_the_reason(
    tmp_path: Path,
) -> None:
    config = form_config(tmp_path / "run", "prime-rl", "inline", "sim.capture_routed_experts=false")
    state = await run_briefly(config, 4)
    assert state.shipping.next_step == 1
    assert state.dispatch.failures["poisoned_payload"] > 0
    top = state.dispatch.rejections.most_common("poisoned_payload", 1)
    assert "routed_experts" in top[0][0], top


def record_shipped_arrays(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """Every sample's token ids, routing and mask, by rollout id, read (digests verified)
    right after its batch is published: once the trainer has read a batch, its oldest
    payload versions are collected by design."""
    samples: dict[str, dict[str, Any]] = {}

    class PublishThenRead(NativeFormat):
        # Runs in the daemon's shipping worker thread, before the step counts as shipped.
        def ship(
            self, settings: HandoffSettings, step: int, train_samples: Sequence[TrainSample]
        ) -> Shipment:
            shipment = super().ship(settings, step, train_samples)
            batch = read_batch(shipment.path, verify=True)
            for sample in batch.samples:
                samples[sample.rollout_id] = {
                    "token_ids": sample.token_ids,
                    "routed_experts": sample.routed_experts,
                    "sampling_mask": sample.sampling_mask,
                }
            return shipment

    monkeypatch.setitem(HANDOFF_FORMATS, "native", PublishThenRead())
    return samples


@pytest.mark.slow
async def test_pd_inline_and_by_handle_ship_bitwise_equal_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same seed under P/D, once inline (the router merges the routing) and once by
    handle (the daemon stitches both sides' files): a rollout both runs shipped has the
    same tokens, routing and masks, dtype and bytes."""
    shipped = {}
    for mode in ("inline", "by_handle"):
        config = form_config(
            tmp_path / mode,
            "prime-rl",
            mode,
            "inference.disaggregated=true",
            # The demo's batches: enough rollouts that both runs ship at least 8 alike.
            "batch.size=16",
            "inference.max_inflight=32",
        )
        with monkeypatch.context() as patch:
            samples = record_shipped_arrays(patch)
            with trio.fail_after(120):
                outcome = await launch_run(config)
        assert outcome.state.shipping.next_step == STEPS + 1
        assert outcome.state.dispatch.failures["poisoned_payload"] == 0
        assert len(samples) == STEPS * 16
        shipped[mode] = samples
    both = shipped["inline"].keys() & shipped["by_handle"].keys()
    # Groups start in the same order from the same seed; which finish first varies.
    assert len(both) >= 8, (len(shipped["inline"]), len(both))
    for rollout_id in both:
        for field, inline in shipped["inline"][rollout_id].items():
            by_handle = shipped["by_handle"][rollout_id][field]
            assert isinstance(inline, np.ndarray) and isinstance(by_handle, np.ndarray)
            assert inline.dtype == by_handle.dtype, (rollout_id, field)
            assert inline.tobytes() == by_handle.tobytes(), (rollout_id, field)
