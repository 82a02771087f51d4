"""`[inference] weight_update`: each protocol against local servers that answer it as the
real ones do (prime-rl's extension; upstream vLLM's dev-mode endpoints, and its refusal of
prime-rl's body), and the daemon end to end with each, over loopback HTTP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import structlog.testing
import trio

from orchestrator.commands.launch import launch_run
from orchestrator.config import Config, load_config
from orchestrator.daemon.inference.client import load_weights, post_generate
from orchestrator.daemon.inference.http11 import HTTP11Client
from orchestrator.daemon.run_state import RunState
from orchestrator.daemon.startup import check_moe_reload
from orchestrator.errors import UserError
from orchestrator.sim import SimInferenceConfig, serve_inference
from orchestrator.sim._model import SimModel
from orchestrator.wire import ControlCall, InferenceFailure, weight_update_plan

SIM = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"
STEPS = 3


async def health(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        answer: dict[str, Any] = (await client.get(f"{url}/health")).json()
    return answer


async def test_vllm_protocol_loads_through_the_dev_endpoints(tmp_path: Path) -> None:
    weight_dir = tmp_path / "weights" / "step_7"
    async with trio.open_nursery() as nursery, HTTP11Client() as client:
        config = SimInferenceConfig(model=SimModel(), reply_form="upstream")
        url = await nursery.start(serve_inference, config)
        await load_weights(client, url, weight_update_plan("vllm", weight_dir, 7))
        state = await health(url)
        assert (state["version"], state["weight_dir"]) == (7, str(weight_dir))

        # prime-rl's body is refused as upstream vLLM refuses it, and the failure says why.
        with pytest.raises(InferenceFailure) as refused:
            await load_weights(client, url, weight_update_plan("prime-rl", weight_dir, 8))
        assert "update_weights HTTP 400" in str(refused.value)
        assert "Missing 'update_info'" in str(refused.value)
        assert 'weight_update = "vllm"' in str(refused.value)
        nursery.cancel_scope.cancel()


async def test_a_failed_vllm_update_still_resumes_the_server(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery, HTTP11Client() as client:
        config = SimInferenceConfig(model=SimModel(), reply_form="upstream")
        url = await nursery.start(serve_inference, config)
        plan = weight_update_plan("vllm", tmp_path / "step_1", 1)
        broken = attrs.evolve(
            plan,
            calls=(plan.calls[0], ControlCall("/collective_rpc", {"method": "no_such"})),
        )
        with pytest.raises(InferenceFailure, match="collective_rpc HTTP 400"):
            await load_weights(client, url, broken)
        # Paused by the first call, resumed by the plan's finally: a generate answers
        # (200; any other answer raises).
        with trio.fail_after(10):
            body = {"request_id": "r", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
            reply = await post_generate(client, url, body)
        assert json.loads(reply)["choices"]
        nursery.cancel_scope.cancel()


def run_config(run_dir: Path, form: str, weight_update: str, *more: str) -> Config:
    return load_config(
        SIM,
        [
            f'run_dir="{run_dir}"',
            f"max_steps={STEPS}",
            "sim.train_time_s=0.02",
            "trainer.poll_interval_s=0.1",
            f'sim.reply_form="{form}"',
            'payload.mode="inline"',
            f'inference.weight_update="{weight_update}"',
            *more,
        ],
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("form", "weight_update"), [("upstream", "vllm"), ("upstream", "none"), ("prime-rl", "none")]
)
async def test_a_run_trains_past_its_first_version_with_each_protocol(
    tmp_path: Path, form: str, weight_update: str
) -> None:
    config = run_config(tmp_path / "run", form, weight_update)
    with structlog.testing.capture_logs() as logs, trio.fail_after(120):
        outcome = await launch_run(config)
    assert outcome.state.shipping.next_step == STEPS + 1
    assert outcome.state.versions.applied >= STEPS - 1
    # The local servers log each version they load: "vllm" loaded every version the
    # daemon applied into both, up to the last; "none" never told them. (The daemon
    # applies the newest published version: one the trainer superseded before a probe
    # saw it is never applied, so the applied versions may skip one.)
    loaded = sorted(e["version"] for e in logs if e["event"] == "weights updated")
    if weight_update == "vllm":
        versions = sorted(set(loaded))
        assert loaded == sorted(2 * versions)
        assert versions[-1] == outcome.state.versions.applied
    else:
        assert loaded == []
    assert not [e for e in logs if e["event"] == "weight update failed"]


@pytest.mark.slow
async def test_prime_rl_updates_against_upstream_vllm_are_refused_with_the_fix(
    tmp_path: Path,
) -> None:
    # What a run against upstream vLLM met: its first policy update refused. The daemon
    # now names the setting that fixes it.
    config = run_config(tmp_path / "run", "upstream", "prime-rl", "inference.retries=0")
    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            state: RunState = await nursery.start(launch_run, config)
            with trio.fail_after(60):
                while not any(e["event"] == "inference server down" for e in logs):
                    await state.wait_changed()
            nursery.cancel_scope.cancel()
    failed = [e for e in logs if e["event"] == "weight update failed"]
    assert failed and 'weight_update = "vllm"' in failed[0]["error"]
    down = [e for e in logs if e["event"] == "inference server down"]
    assert "did not load v1" in down[0]["reason"]


async def test_a_moe_run_against_a_vllm_that_drops_experts_is_refused_at_start(
    tmp_path: Path,
) -> None:
    # vLLM 0.30.0 reloads a MoE checkpoint without its expert weights: the run (routing
    # requested, so a MoE) is refused before anything is wiped or dispatched.
    config = run_config(tmp_path / "run", "upstream", "vllm", 'sim.vllm_version="0.30.0"')
    assert "routed_experts" in config.payload.fields
    with (
        structlog.testing.capture_logs() as logs,
        trio.fail_after(30),
        pytest.raises(UserError) as refused,
    ):
        await launch_run(config)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("vLLM 0.30.0 does not reload a mixture-of-experts model's")
    assert "orchestrator-vllm serve" in message
    assert 'weight_update = "prime-rl"' in message
    events = {e["event"] for e in logs}
    assert "fresh run" not in events
    assert "weights updated" not in events
    assert not config.payload_root.exists()  # the fresh-run wipe creates it
    assert not config.batches_dir.exists() or not any(config.batches_dir.iterdir())


@pytest.mark.parametrize(
    ("version", "weight_update", "more"),
    [
        ("0.31.0", "vllm", ()),  # a release that reloads experts
        ("0.30.0", "none", ()),  # the trainer pushes the weights
        ("0.30.0", "vllm", ("payload.fields=[]",)),  # a dense model
    ],
)
async def test_runs_the_defect_does_not_touch_start(
    tmp_path: Path, version: str, weight_update: str, more: tuple[str, ...]
) -> None:
    config = run_config(
        tmp_path / "run", "upstream", weight_update, f'sim.vllm_version="{version}"', *more
    )
    with structlog.testing.capture_logs() as logs, trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            state: RunState = await nursery.start(launch_run, config)
            while state.shipping.next_step < 2:
                await state.wait_changed()
            nursery.cancel_scope.cancel()
    assert not [e for e in logs if e["log_level"] == "warning" and "vLLM" in e["event"]]


async def test_a_version_that_cannot_be_read_is_warned_about_not_refused(
    tmp_path: Path,
) -> None:
    config = run_config(tmp_path / "run", "upstream", "vllm")
    async with trio.open_nursery() as nursery:
        url = await nursery.start(
            serve_inference,
            SimInferenceConfig(model=SimModel(), reply_form="upstream", vllm_version=None),
        )
        with structlog.testing.capture_logs() as logs, trio.fail_after(30):
            await check_moe_reload(config, [url, "http://127.0.0.1:9"])
        nursery.cancel_scope.cancel()
    warned = [e for e in logs if e["log_level"] == "warning"]
    assert len(warned) == 1
    assert "cannot check the servers' vLLM version" in warned[0]["event"]
    assert warned[0]["servers"] == [url, "http://127.0.0.1:9"]
