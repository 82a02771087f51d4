"""The real model through the stage: SmolLM2-135M-Instruct built from its PyPI wheel
(`real_model`: `orchestrator_trainer.pretrained`, cached beside the venv), dense and
upcycled to a Mixtral mixture of experts, served by `orchestrator-vllm serve` with the
flags of routed experts. The MoE routes every decisive (token, layer) row as
transformers' router computes it from the checkpoint the server holds, before and after
a checkpoint is loaded through `/update_weights`; the dense model answers a chat prompt
greedily as transformers does, before and after. Skipped with the reason where the
wheel cannot be downloaded."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from _vllm_kit import (
    RealModelUnavailable,
    Server,
    generate,
    install_writer,
    real_model,
    reference,
    update_weights,
    vllm_server,
)
from test_real_vllm import NEAR_TIE, greedy_body, inline_turn

from orchestrator.sim.checkpoints import write_checkpoint
from orchestrator.tasks.chat import ChatTokenizer

QUESTION = [{"role": "user", "content": "What is 12 + 7? Answer with just the number."}]


def built(kind: str) -> Path:
    try:
        return real_model(kind)
    except RealModelUnavailable as exc:
        pytest.skip(f"the real model cannot be built here: {exc}")


@contextlib.contextmanager
def serve(model: Path, tmp_path: Path, *, routing: bool) -> Iterator[tuple[Server, float]]:
    """`orchestrator-vllm serve` of `model`, and the seconds it took to be ready."""
    install_writer()
    root = tmp_path / "payloads"
    root.mkdir()
    flags = ("--enforce-eager", "--no-enable-prefix-caching")
    started = time.monotonic()
    with vllm_server(model, tmp_path / "vllm", *flags, writer_root=root, routing=routing) as server:
        yield server, time.monotonic() - started


def answered(server: Server, prompt: list[int], checkpoint: Path, *, routing: bool):  # type: ignore[no-untyped-def]
    """Whether the server's greedy completion of `prompt` (past the model's eos, as
    transformers' reference generates) equals transformers' from `checkpoint`, and (with
    `routing`) per routing row whether it equals transformers' top-k and whether that
    row is decisive."""
    body = greedy_body(prompt, 12, routing=routing)
    body["sampling_params"]["ignore_eos"] = True
    reply = generate(server, body)
    assert reply.status_code == 200, reply.text
    turn = inline_turn(reply.content, prompt) if routing else None
    completion = turn.completion_ids.tolist() if turn else reply.json()["choices"][0]["token_ids"]
    job: dict = {"prompt": prompt, "max_tokens": 12}
    if routing:
        job["routing"] = (prompt + completion)[:-1]
    expected = reference(checkpoint, job)
    greedy = expected["completion"] == completion
    if turn is None:
        return greedy, None, None
    served, _ = turn.inline["routed_experts"]
    want = np.asarray(expected["experts"])
    equal = (np.sort(served, axis=-1) == np.sort(want, axis=-1)).all(axis=-1)
    decisive = np.asarray(expected["margins"]) >= NEAR_TIE
    return greedy, equal, decisive


def test_the_upcycled_moe_routes_as_the_checkpoint_it_holds(
    tmp_path: Path, figure: Callable[[str], None]
) -> None:
    moe = built("moe")
    prompt = ChatTokenizer.load(moe).render_prompt(QUESTION).tolist()
    with serve(moe, tmp_path, routing=True) as (server, ready_s):
        figure(f"real MoE (374M, float32): orchestrator-vllm ready in {ready_s:.0f} s")
        checkpoint = tmp_path / "step_1"
        for version in (0, 1):
            if version:
                write_checkpoint(moe, version, checkpoint)
                answer = update_weights(server, checkpoint)
                assert answer.status_code == 200, answer.text
                assert answer.json()["version"] == "1"
            greedy, equal, decisive = answered(
                server, prompt, checkpoint if version else moe, routing=True
            )
            figure(
                f"real MoE v{version}: {int(equal.sum())} of {equal.size} routing rows equal "
                f"transformers', {int((~decisive).sum())} near-ties; greedy equal: {greedy}"
            )
            assert equal[decisive].all(), np.argwhere(~equal & decisive)[:5]


def test_the_dense_model_answers_as_the_checkpoint_it_holds(
    tmp_path: Path, figure: Callable[[str], None]
) -> None:
    dense = built("dense")
    prompt = ChatTokenizer.load(dense).render_prompt(QUESTION).tolist()
    with serve(dense, tmp_path, routing=False) as (server, ready_s):
        figure(f"real dense (135M, float32): orchestrator-vllm ready in {ready_s:.0f} s")
        checkpoint = tmp_path / "step_1"
        for version in (0, 1):
            if version:
                write_checkpoint(dense, version, checkpoint)
                answer = update_weights(server, checkpoint)
                assert answer.status_code == 200, answer.text
            greedy, _, _ = answered(server, prompt, checkpoint if version else dense, routing=False)
            assert greedy, f"the greedy answer after loading v{version} is not that checkpoint's"
