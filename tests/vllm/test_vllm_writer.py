"""Payloads by handle from upstream vLLM: `orchestrator-vllm serve` (the `vllm-writer/`
distribution, pip-installed into the stage venv as a user installs it) in front of a real
vLLM serving the tiny MoE. The rows it writes equal the rows vLLM answers inline for the
same request; the daemon runs end to end by handle against it, and trains on the routing
an inline run of the same seeds got; hostile directories are refused by the server."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import trio
from _vllm_kit import Server, generate, key_file, run_against
from payload_gc import PayloadRootFiles

from orchestrator.commands.launch import launch_run
from orchestrator.config import load_config
from orchestrator.handoff import read_batch
from orchestrator.payload import read_rows
from orchestrator.tasks.chat import ChatTokenizer
from orchestrator.wire import build_generate_request, parse_generate_response

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.toml"


@pytest.fixture
def shared(writer_server: Server) -> Path:
    """The payload root the server and the daemon share (one host here)."""
    assert writer_server.payload_root is not None
    return writer_server.payload_root


def body(request_id: str, prompt: list[int], seed: int, payload_dir: Path | None) -> dict:
    request = build_generate_request(
        request_id=request_id,
        token_ids=prompt,
        seed=seed,
        payload_dir=payload_dir,
        routing_start=0,
        max_tokens=24,
    )
    request["sampling_params"]["temperature"] = 1.0
    return request


def test_rows_by_handle_equal_the_inline_rows(
    writer_server: Server, shared: Path, figure: Callable[[str], None]
) -> None:
    payload_dir = shared / "v0"
    compared = rows = 0
    for length in (16, 300, 1500):
        prompt = [int(t) for t in np.random.default_rng(length).integers(3, 1000, length)]
        for seed in range(3):
            inline = generate(writer_server, body("i", prompt, seed, None))
            handle = generate(writer_server, body("h", prompt, seed, payload_dir))
            assert inline.status_code == handle.status_code == 200, handle.text
            turns = [
                parse_generate_response(
                    reply.content,
                    prompt_len=length,
                    routing_start=0,
                    payload_dir=where,
                    fields=("routed_experts",),
                )
                for reply, where in ((inline, None), (handle, payload_dir))
            ]
            assert turns[0].poisoned is None and turns[1].poisoned is None, turns[1].poisoned
            assert turns[0].completion_ids.tolist() == turns[1].completion_ids.tolist()
            want, start = turns[0].inline["routed_experts"]
            segment = turns[1].segments["routed_experts"]
            assert (segment.pos, segment.rows) == (start, len(want))
            with PayloadRootFiles(shared) as files:
                got = read_rows(files.version(0), segment, 0, segment.rows)
            assert np.array_equal(got, want)
            compared += 1
            rows += len(want)
    figure(f"by handle vs inline, same requests and seeds: {rows} of {rows} rows equal")
    assert compared == 9


@pytest.mark.parametrize(
    "payload_dir",
    ["relative/v0", "{outside}", "{shared}/../v0", "{shared}/linked", "{shared}/linked/v0"],
)
def test_the_server_refuses_a_hostile_payload_dir(
    writer_server: Server, shared: Path, tmp_path: Path, payload_dir: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    link = shared / "linked"
    if not link.is_symlink():
        link.symlink_to(outside)
    spelled = payload_dir.format(shared=shared, outside=outside)
    request = body("x", [5, 6, 7, 8], 0, None)
    request["sampling_params"]["extra_args"] = {"payload_dir": spelled}
    refused = generate(writer_server, request)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["type"] == "BadRequestError", error
    assert list(outside.iterdir()) == []


async def run(server: Server, model: Path, run_dir: Path, steps: int, *more: str):
    # The weights stay the base checkpoint, so two runs of the same seeds sample the same
    # tokens.
    weights = 'inference.weight_update="none"'
    token = key_file(server, run_dir.parent / f"{run_dir.name}-key")
    return await run_against(server, model, run_dir, steps, weights, token, *more)


def routing_by_rollout(batches_dir: Path, steps: int) -> dict[str, tuple[list[int], np.ndarray]]:
    """Tokens and routing of every sample of the run's batches, by rollout id."""
    out = {}
    for step in range(1, steps + 1):
        for sample in read_batch(batches_dir / f"step_{step:06d}").samples:
            assert sample.routed_experts is not None
            out[sample.rollout_id] = (sample.token_ids.tolist(), sample.routed_experts)
    return out


async def test_the_daemon_runs_by_handle_against_the_writer(
    writer_server: Server, model: Path, shared: Path, tmp_path: Path
) -> None:
    # The run's payload root, below the server's (the daemon wipes its own at start).
    root = shared / "run"
    steps = 4
    config, outcome = await run(
        writer_server,
        model,
        tmp_path / "run",
        steps,
        'payload.mode="by_handle"',
        f'payload.root="{root}"',
    )
    # The invariants held (every payload byte read by the trainer, nothing below the
    # bound left); the files were the writer's, and discards and collections took them.
    assert outcome.state.dispatch.failures["poisoned_payload"] == 0
    payload = outcome.state.payload
    assert payload.files_written > 0 and payload.bytes_written > 0
    assert payload.files_deleted["collection"] > 0, payload.files_deleted
    report = json.loads((config.run_dir / "trainer" / "report.json").read_text())
    assert report["payload_bytes"] > 0 and not report["violations"], report
    bound = outcome.state.versions.collected_below
    assert bound > 0
    assert all(int(name[1:]) >= bound for name in os.listdir(root) if name.startswith("v"))


async def test_the_routing_trained_on_by_handle_is_the_routing_inline(
    writer_server: Server,
    model: Path,
    shared: Path,
    tmp_path: Path,
    figure: Callable[[str], None],
) -> None:
    # Two runs of the same seeds, one by handle through the writer, one inline; with a
    # staleness bound that collects nothing in 3 steps, every batch can be read after.
    steps = 3
    keep = "staleness.max_off_policy_steps=4"
    handle_config, _ = await run(
        writer_server,
        model,
        tmp_path / "handle",
        steps,
        keep,
        'payload.mode="by_handle"',
        f'payload.root="{shared / "compare"}"',
    )
    inline_config, _ = await run(writer_server, model, tmp_path / "inline", steps, keep)
    by_handle = routing_by_rollout(handle_config.batches_dir, steps)
    inline = routing_by_rollout(inline_config.batches_dir, steps)
    same = [rid for rid in by_handle.keys() & inline.keys() if by_handle[rid][0] == inline[rid][0]]
    assert len(same) >= len(by_handle) // 2, (len(same), len(by_handle))
    equal = sum(np.array_equal(by_handle[rid][1], inline[rid][1]) for rid in same)
    rows = sum(len(by_handle[rid][1]) for rid in same)
    figure(
        f"daemon by handle vs inline: {equal} of {len(same)} samples with the same tokens "
        f"have equal routing ({rows} rows; {len(by_handle)} samples by handle)"
    )
    assert equal == len(same)


#: vf-twoturn as an `[[env]]`: its two turns bridged by the renderer for the tiny model's
#: template (demo/verifiers_envs/qwen3_no_tools: renderers' own `qwen3` refuses its
#: tokenizer, its `default` renders each turn anew), and a shaping reward plugged in by
#: verifiers' own config (the tiny model never answers right: without it every group's
#: rewards are equal, and none trains).
TWOTURN = (
    'env=[{name = "vf-twoturn", verifiers = "vf-twoturn", max_tokens = 16, max_turns = 2, '
    'renderer = {name = "custom", import_path = "qwen3_no_tools.Qwen3NoToolsRenderer", '
    'thinking_retention = "all"}, args = {taskset = {task = {rewards = {gives_a_number = '
    '{fn = "vf_twoturn:gives_a_number", weight = 0.25}}}}}}]'
)
#: The `--set`s of each env (none: configs/verifiers.toml's own, vf-arith) and its turns.
VERIFIERS_ENVS = {"vf-arith": ((), 1), "vf-twoturn": ((TWOTURN,), 2)}


def loss_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The [start, end) of each run of loss positions: one per sampled turn."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [(int(start), int(end)) for start, end in zip(edges[::2], edges[1::2], strict=True)]


@pytest.mark.parametrize("env", sorted(VERIFIERS_ENVS))
async def test_a_verifiers_environment_trains_by_handle_against_the_writer(
    writer_server: Server,
    model: Path,
    shared: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: str,
) -> None:
    # The demo's verifiers taskset, unchanged, its package importable by its worker; the
    # tiny model's own tokenizer and chat template render its prompts (verifiers' side)
    # and vLLM samples every call, through the daemon, routing by handle.
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "demo" / "verifiers_envs"))
    overrides, turns = VERIFIERS_ENVS[env]
    run_dir = tmp_path / "run"
    steps = 1
    config = load_config(
        ROOT / "configs" / "verifiers.toml",
        [
            f'run_dir="{run_dir}"',
            f"max_steps={steps}",
            f'model.tokenizer="{model}"',
            "batch.size=4",
            "batch.group_size=4",
            "inference.max_inflight=8",
            "sim.inference_servers=0",
            f'inference.urls=["{writer_server.url}"]',
            key_file(writer_server, tmp_path / "key"),
            'inference.weight_update="none"',
            "sim.trainer=true",
            "sim.train_time_s=0.05",
            'payload.mode="by_handle"',
            f'payload.root="{shared / "verifiers" / env}"',
            'payload.fields=["routed_experts"]',
            "trainer.poll_interval_s=0.1",
            *overrides,
        ],
    )
    with trio.fail_after(600):
        outcome = await launch_run(config)
    state = outcome.state
    assert state.shipping.last_shipped == steps
    assert state.dispatch.failures["trajectory_mismatch"] == 0
    assert state.dispatch.failures["poisoned_payload"] == 0
    assert outcome.sink.by_env[env].scored >= 4
    tokenizer = ChatTokenizer.load(model).tokenizer
    for sample in read_batch(config.batches_dir / f"step_{steps:06d}").samples:
        assert sample.routed_experts is not None
        # Every turn the env took is in the sample: its completion trained on, and between
        # two, what the renderer bridged them with (the next user turn).
        runs = loss_runs(sample.loss_mask)
        assert len(runs) == turns, runs
        for (_, end), (start, _) in itertools.pairwise(runs):
            bridge = tokenizer.decode(sample.token_ids[end:start].tolist())
            assert "<|im_start|>user\nYou said " in bridge, bridge
    report = json.loads((config.run_dir / "trainer" / "report.json").read_text())
    assert report["payload_bytes"] > 0 and not report["violations"], report
