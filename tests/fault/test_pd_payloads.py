"""The real daemon against a hostile disaggregated prefill/decode deployment, by handle.

Two local P/D deployments (each a router in front of a prefill and a decode server) run
the same model; the daemon reaches one directly and the other through a proxy that
rewrites every generate reply and may change what the sides wrote. The row both sides
computed (the prompt's last token) is checked, not trusted: a decode side that wrote
another routing for it poisons the rollout with a reason, counted, and the run goes on.
Segments that name files outside the request's payload directory, on the decode side or
as a third file, are refused as from any server. Canary files live outside the payload
root and must keep their bytes; the honest deployment fills every batch, which the local
trainer reads byte for byte.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _hostile_proxy import Exchange, Rewrite, rewriting, serve_hostile_proxy

from orchestrator.commands.launch import launch_run
from orchestrator.config import load_config
from orchestrator.daemon import RunOutcome
from orchestrator.sim import SimInferenceConfig, serve_inference

DEMO = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"
STEPS = 3

pytestmark = pytest.mark.slow


@asynccontextmanager
async def pd_fleet(rewrite: Rewrite) -> AsyncIterator[list[str]]:
    """An honest P/D deployment, and a hostile one (a proxy in front of a second)."""
    async with trio.open_nursery() as nursery:
        honest = await nursery.start(serve_inference, SimInferenceConfig(disaggregated=True))
        behind = await nursery.start(
            serve_inference, SimInferenceConfig(disaggregated=True, fault_seed=1)
        )
        hostile = await nursery.start(serve_hostile_proxy, behind, rewrite)
        yield [honest, hostile]
        nursery.cancel_scope.cancel()


def sides(exchange: Exchange) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The prefill side's segments and the decode side's (the router lists them so)."""
    files = list(dict.fromkeys(segment["file"] for segment in exchange.segments))
    assert len(files) == 2, files
    prefill = [s for s in exchange.segments if s["file"] == files[0]]
    decode = [s for s in exchange.segments if s["file"] == files[1]]
    return prefill, decode


async def run_attack(tmp_path: Path, rewrite: Rewrite) -> RunOutcome:
    outside = tmp_path / "outside"
    outside.mkdir()
    canaries = {f"canary{i}": os.urandom(1024) for i in range(3)}
    for name, data in canaries.items():
        (outside / name).write_bytes(data)
    run_dir = tmp_path / "run"
    async with pd_fleet(rewrite) as urls:
        config = load_config(
            DEMO,
            [
                f'run_dir="{run_dir}"',
                f"max_steps={STEPS}",
                "sim.inference_servers=0",
                "inference.urls=[" + ", ".join(f'"{u}"' for u in urls) + "]",
                "inference.disaggregated=true",
                "inference.retries=1",
                "inference.retry_backoff_s=0.01",
                "sim.train_time_s=0.02",
                "trainer.poll_interval_s=0.1",
                "payload.layers=48",
                "payload.top_k=8",
                "payload.num_experts=128",
                # Half the demo's batches and rollouts in flight (16, 32): the hostile
                # deployment still answers many of them.
                "batch.size=8",
                "inference.max_inflight=16",
            ],
        )
        with trio.fail_after(90):
            outcome = await launch_run(config)
    for name, data in canaries.items():
        path = outside / name
        assert path.is_file() and not path.is_symlink() and path.read_bytes() == data, name
    assert outcome.state.shipping.next_step == STEPS + 1
    report = json.loads((run_dir / "trainer" / "report.json").read_text())
    assert report["violations"] == [] and report["dropped"] == [], report
    return outcome


def reasons(outcome: RunOutcome) -> list[str]:
    return [
        text for text, _ in outcome.state.dispatch.rejections.most_common("poisoned_payload", 100)
    ]


async def test_a_decode_side_that_disagrees_on_the_shared_row_is_poisoned(
    tmp_path: Path,
) -> None:
    changed: list[str] = []

    def change(exchange: Exchange) -> None:
        _, decode = sides(exchange)
        (routing,) = [s for s in decode if s["field"] == "routed_experts"]
        # The decode's first row is the prompt's last token, which the prefill computed
        # too: give one of its experts another id (still a valid one).
        with open(routing["file"], "r+b") as file:
            file.seek(routing["offset"])
            first = file.read(1)[0]
            file.seek(routing["offset"])
            file.write(bytes([(first + 1) % 128]))
        changed.append(routing["file"])

    outcome = await run_attack(tmp_path, rewriting(change))
    assert changed, "the attack never ran"
    assert outcome.state.dispatch.failures["poisoned_payload"] > 0
    assert outcome.state.dispatch.rollouts["poisoned"] > 0
    disagreements = [r for r in reasons(outcome) if "disagree" in r]
    assert disagreements, reasons(outcome)[:5]
    assert all("prefill and decode" in r for r in disagreements)


@pytest.mark.parametrize("attack", ["decode traversal", "third file outside"])
async def test_segments_outside_payload_dir_from_a_pd_reply_are_refused(
    tmp_path: Path, attack: str
) -> None:
    def change(exchange: Exchange) -> None:
        payload_dir = exchange.payload_dir
        assert payload_dir is not None
        _, decode = sides(exchange)
        target = f"{payload_dir}/../../../outside/canary0"
        if attack == "decode traversal":
            decode[0]["file"] = target
            decode[0]["offset"] = 0
        else:
            exchange.segments.append({**decode[-1], "file": target, "offset": 0})

    outcome = await run_attack(tmp_path, rewriting(change))
    assert outcome.state.dispatch.failures["poisoned_payload"] > 0
    assert any("traversal" in reason for reason in reasons(outcome)), reasons(outcome)[:5]
