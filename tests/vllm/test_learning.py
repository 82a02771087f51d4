"""The whole loop learns: real vLLM (`orchestrator-vllm serve`, routing by handle, each
version loaded through `/update_weights`), the daemon and the reference trainer
(`orchestrator-trainer`), on configs/learn.toml (tests/vllm/learning_run.py)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

from _vllm_kit import Server
from learning_run import MARGIN, learning_run


def test_a_policy_learns_through_the_loop_on_the_weights_the_trainer_published(
    writer_server: Server, tmp_path: Path, figure: Callable[[str], None]
) -> None:
    # A larger step than the demo's, for half its steps.
    steps = 20
    curve = learning_run(
        tmp_path / "run",
        f"max_steps={steps}",
        "train.learning_rate=0.003",
        "eval.num_examples=16",
        server=writer_server,
    )
    for line in curve.lines():
        figure(f"learning run, {steps} steps: {line}")
    assert curve.learned, curve.lines()
    assert curve.last - curve.first >= MARGIN
    lines = [
        json.loads(line) for line in (tmp_path / "run" / "trainer.jsonl").read_text().splitlines()
    ]
    assert [line["step"] for line in lines] == list(range(1, steps + 1))
    # Every on-policy token was sampled by the weights the trainer held: the server runs
    # each version it was told to load, experts included (float32 on both sides).
    measured = [line["mismatch_kl"] for line in lines if line["mismatch_kl"] is not None]
    assert len(measured) >= steps // 2, measured
    assert max(measured) < 1e-6, measured


def test_router_replay_lowers_the_on_policy_mismatch(
    tmp_path: Path, figure: Callable[[str], None]
) -> None:
    # The server in bfloat16, the trainer in float32: routing near-ties fall differently
    # on the two sides, as between a real inference engine and a trainer. Replaying the
    # server's experts leaves only the numerics; without it, the flipped experts count.
    curve = learning_run(
        tmp_path / "run",
        "max_steps=4",
        "train.learning_rate=1e-5",
        "eval.eval_base_model=false",
        "eval.num_examples=1",
        server_flags=("--dtype=bfloat16",),
    )
    pairs = [
        (with_replay, without)
        for with_replay, without in zip(curve.mismatch, curve.mismatch_no_replay, strict=True)
        if with_replay is not None and without is not None
    ]
    assert len(pairs) >= 2, curve
    figure(
        "on-policy mismatch KL, bfloat16 server, float32 trainer: "
        + ", ".join(f"{w:.1e} with replay / {wo:.1e} without" for w, wo in pairs)
    )
    assert all(with_replay < without for with_replay, without in pairs), pairs
    assert statistics.median(without / with_replay for with_replay, without in pairs) >= 5, pairs


def test_servers_that_keep_old_weights_are_named_by_the_mismatch(
    writer_server: Server, tmp_path: Path, figure: Callable[[str], None]
) -> None:
    # `weight_update = "none"` with a trainer that pushes nothing: the daemon applies each
    # version, the server keeps serving version 0. Every invariant of the run holds; the
    # trainer's mismatch is what tells.
    run_dir = tmp_path / "run"
    curve = learning_run(
        run_dir,
        "max_steps=4",
        # Large steps: each version is far from version 0.
        "train.learning_rate=0.02",
        'inference.weight_update="none"',
        "eval.eval_base_model=false",
        "eval.num_examples=1",
        server=writer_server,
    )
    # Version 0's samples are the server's own; every later version is not.
    late = [kl for kl in curve.mismatch[1:] if kl is not None]
    figure(
        "on-policy mismatch KL, a server that kept version 0: "
        + ", ".join("-" if kl is None else f"{kl:.2g}" for kl in curve.mismatch)
    )
    assert late and min(late) > 0.01, curve.mismatch
    warnings = [
        json.loads(line)["event"]
        for line in (run_dir / "trainer.log").read_text().splitlines()
        if "training-inference mismatch" in line
    ]
    assert warnings, "no mismatch warning"
    assert "do not run the weights of version" in warnings[-1]
