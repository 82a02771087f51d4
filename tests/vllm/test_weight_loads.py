"""`orchestrator-vllm serve` answers prime-rl's `POST /update_weights {"weight_dir"}` on
the mixture-of-experts model, where vLLM 0.30.0's own reload leaves the experts unloaded:
after loading checkpoint k the server answers greedily, and routes every decisive
(token, layer) row, as `transformers` does from checkpoint k; a directory that is
missing, partial, cut short or of another shape is refused with the reason and the
server keeps the weights it had."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from _vllm_kit import Server, generate, key_file, reference, run_against, update_weights
from test_real_vllm import NEAR_TIE, greedy_body, inline_turn

from orchestrator.handoff import read_batch
from orchestrator.sim.checkpoints import write_checkpoint


def served_as(server: Server, checkpoint: Path) -> tuple[bool, np.ndarray, np.ndarray]:
    """Whether the server's greedy tokens equal transformers' from `checkpoint`, and per
    routing row whether it equals transformers' top-k, and whether that row is decisive."""
    prompt = list(range(300, 332))
    reply = generate(server, greedy_body(prompt, 16))
    assert reply.status_code == 200, reply.text
    turn = inline_turn(reply.content, prompt)
    tokens = prompt + turn.completion_ids.tolist()
    expected = reference(checkpoint, {"routing": tokens[:-1], "prompt": prompt, "max_tokens": 16})
    served, _ = turn.inline["routed_experts"]
    want = np.asarray(expected["experts"])
    equal = (np.sort(served, axis=-1) == np.sort(want, axis=-1)).all(axis=-1)
    decisive = np.asarray(expected["margins"]) >= NEAR_TIE
    return expected["completion"] == turn.completion_ids.tolist(), equal, decisive


def test_each_checkpoint_loaded_is_served_as_transformers_computes_it(
    writer_server: Server, model: Path, tmp_path: Path, figure: Callable[[str], None]
) -> None:
    for version in (1, 2, 0):
        checkpoint = model if version == 0 else tmp_path / f"step_{version}"
        if version:
            write_checkpoint(model, version, checkpoint)
        answer = update_weights(writer_server, checkpoint)
        assert answer.status_code == 200, answer.text
        # N of a trainer's step_N; the base folder's name otherwise.
        assert answer.json()["version"] == (str(version) if version else model.name)
        greedy, equal, decisive = served_as(writer_server, checkpoint)
        assert greedy, f"greedy tokens after loading v{version} are not that checkpoint's"
        assert equal[decisive].all(), np.argwhere(~equal & decisive)[:5]
        figure(
            f"MoE load of v{version} ({answer.json()['load_s']} s): {int(equal.sum())} of "
            f"{equal.size} routing rows equal transformers', {int((~decisive).sum())} near-ties"
        )


def cut_short(source: Path, out: Path) -> None:
    shutil.copytree(source, out)
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def without_one_tensor(source: Path, out: Path) -> None:
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, out)
    tensors = load_file(out / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def reshaped(source: Path, out: Path) -> None:
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, out)
    tensors = load_file(out / "model.safetensors")
    tensors["model.layers.0.mlp.gate.weight"] = tensors["model.layers.0.mlp.gate.weight"][:4]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def garbage_header(source: Path, out: Path) -> None:
    shutil.copytree(source, out)
    (out / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{nope")


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (None, "cannot list"),
        (cut_short, "cut short"),
        (without_one_tensor, "partial: model.layers.1.mlp.experts.3.up_proj.weight missing"),
        (reshaped, "model.layers.0.mlp.gate.weight does not fit the model"),
        (garbage_header, "malformed safetensors header"),
    ],
)
def test_a_checkpoint_that_cannot_load_is_refused_and_the_weights_stay(
    writer_server: Server, model: Path, tmp_path: Path, make, reason: str
) -> None:
    kept = tmp_path / "step_5"
    write_checkpoint(model, 5, kept)
    assert update_weights(writer_server, kept).status_code == 200
    bad = tmp_path / "step_6"
    if make is not None:
        make(kept, bad)
    answer = update_weights(writer_server, bad)
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert reason in message and str(bad) in message, message
    greedy, equal, decisive = served_as(writer_server, kept)
    assert greedy and equal[decisive].all()


def test_an_update_without_the_servers_token_is_refused(writer_server: Server, model: Path) -> None:
    for headers in ({}, {"authorization": "Bearer sk-wrong"}):
        answer = httpx.post(
            f"{writer_server.url}/update_weights",
            json={"weight_dir": str(model)},
            headers=headers,
            timeout=30,
        )
        assert (answer.status_code, answer.json()) == (401, {"error": "Unauthorized"})


def test_vllms_own_update_weights_body_still_reaches_vllm(writer_server: Server) -> None:
    answer = httpx.post(
        f"{writer_server.url}/update_weights", json={}, headers=writer_server.headers, timeout=30
    )
    # vLLM's dev-mode /update_weights wants a weight-transfer `update_info`.
    assert answer.status_code == 400 and "update_info" in json.dumps(answer.json())


async def test_routing_shipped_after_each_update_is_that_versions_routers(
    writer_server: Server, model: Path, tmp_path: Path, figure: Callable[[str], None]
) -> None:
    # The daemon unchanged, `weight_update = "prime-rl"` against the writer, a checkpoint
    # per version, a tight staleness bound so that later versions get rollouts: the
    # routing of the rollouts dispatched under version k is what transformers' router
    # computes from checkpoint k. Inline, so that the batches can be read after the run
    # (by handle, collections delete their files; the writer's rows by handle equal
    # these, tests/vllm/test_vllm_writer.py).
    steps = 5
    config, outcome = await run_against(
        writer_server,
        model,
        tmp_path / "run",
        steps,
        'inference.weight_update="prime-rl"',
        "staleness.max_off_policy_steps=1",
        key_file(writer_server, tmp_path),
    )
    assert outcome.state.versions.applied >= 2
    by_version: dict[int, list] = {}
    for step in range(1, steps + 1):
        for sample in read_batch(config.batches_dir / f"step_{step:06d}").samples:
            by_version.setdefault(sample.dispatch_version, []).append(sample)
    assert max(by_version) >= 2, sorted(by_version)
    for version, samples in sorted(by_version.items()):
        checkpoint = model if version == 0 else config.weights_dir / f"step_{version:06d}"
        shares = []
        for sample in samples[:2]:
            tokens = sample.token_ids.tolist()
            expected = reference(checkpoint, {"routing": tokens[:-1]})
            want = np.asarray(expected["experts"])
            served = sample.routed_experts[: len(tokens) - 1]
            equal = (np.sort(served, axis=-1) == np.sort(want, axis=-1)).all(axis=-1)
            decisive = np.asarray(expected["margins"]) >= NEAR_TIE
            shares.append(float(equal[decisive].mean()))
        figure(
            f"run, dispatch v{version}: decisive routing rows equal to checkpoint "
            f"v{version}'s router: {', '.join(f'{s:.0%}' for s in shares)}"
        )
        # A rollout may see an update land mid-generation (paused and kept): its rows
        # after it are the next version's. The first rollouts of a version are its own.
        assert max(shares) == 1.0, (version, shares)
