"""The real daemon against a hostile inference server: one case per attack.

Two local inference servers run the same model; the daemon reaches one directly and the
other through a proxy that rewrites every generate reply (and, for some attacks, plants
traps in the shared payload root). The attacks already stopped also run against
disaggregated prefill/decode deployments (a router in front of a prefill and a decode
server), the prefill side's segment attacked. Canary files live outside the payload root:
after every run each must still exist with its bytes. Attacks that poison only the hostile
server's rollouts must also leave the run whole: the honest server fills the batches, the
local trainer reads every payload byte, and the daemon never stops on a reply.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _hostile_proxy import Exchange, Rewrite, rewriting, serve_hostile_proxy

from orchestrator.commands.launch import launch_run
from orchestrator.config import Config, load_config
from orchestrator.daemon import RunOutcome
from orchestrator.daemon.run_state import RunState
from orchestrator.sim import SimInferenceConfig, serve_inference

DEMO = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"
CANARIES = 10
CANARY_BYTES = 4096
STEPS = 3

pytestmark = pytest.mark.slow


@attrs.frozen
class Arena:
    """A run's directories: the run, and the outside directory holding the canaries."""

    run_dir: Path
    outside: Path
    canaries: dict[str, bytes]

    @property
    def root(self) -> Path:
        return self.run_dir / "payloads"

    def assert_canaries_intact(self) -> None:
        for name, data in self.canaries.items():
            path = self.outside / name
            assert path.is_file() and not path.is_symlink(), f"canary {name} is gone"
            assert path.read_bytes() == data, f"canary {name} was changed"


@pytest.fixture
def arena(tmp_path: Path) -> Arena:
    outside = tmp_path / "outside"
    outside.mkdir()
    canaries = {f"canary{i}": os.urandom(CANARY_BYTES) for i in range(CANARIES)}
    for name, data in canaries.items():
        (outside / name).write_bytes(data)
    return Arena(tmp_path / "run", outside, canaries)


def daemon_config(arena: Arena, urls: list[str], *overrides: str) -> Config:
    return load_config(
        DEMO,
        [
            f'run_dir="{arena.run_dir}"',
            f"max_steps={STEPS}",
            "sim.inference_servers=0",
            "inference.urls=[" + ", ".join(f'"{u}"' for u in urls) + "]",
            "inference.retries=1",
            "inference.retry_backoff_s=0.01",
            "sim.train_time_s=0.02",
            "trainer.poll_interval_s=0.1",
            # Half the demo's batches and rollouts in flight (16, 32): the hostile server
            # still answers many rollouts of every step, the honest one fills the batches.
            "batch.size=8",
            "inference.max_inflight=16",
            # The model both servers run (SimInferenceConfig's default model).
            "payload.layers=48",
            "payload.top_k=8",
            "payload.num_experts=128",
            *overrides,
        ],
    )


@asynccontextmanager
async def fleet(rewrite: Rewrite, *, disaggregated: bool = False) -> AsyncIterator[list[str]]:
    """An honest server and a hostile one (a proxy rewriting a second honest server);
    P/D deployments when `disaggregated`."""
    async with trio.open_nursery() as nursery:
        honest = await nursery.start(
            serve_inference, SimInferenceConfig(disaggregated=disaggregated)
        )
        behind = await nursery.start(
            serve_inference, SimInferenceConfig(fault_seed=1, disaggregated=disaggregated)
        )
        hostile = await nursery.start(serve_hostile_proxy, behind, rewrite)
        yield [honest, hostile]
        nursery.cancel_scope.cancel()


async def run_attack(
    arena: Arena,
    rewrite: Rewrite,
    *overrides: str,
    deadline_s: float = 90,
    disaggregated: bool = False,
) -> RunOutcome:
    """A whole run (`STEPS` batches) with one hostile server; fails past the deadline."""
    if disaggregated:
        overrides = (*overrides, "inference.disaggregated=true")
    async with fleet(rewrite, disaggregated=disaggregated) as urls:
        with trio.fail_after(deadline_s):
            outcome = await launch_run(daemon_config(arena, urls, *overrides))
    arena.assert_canaries_intact()
    assert outcome.state.shipping.next_step == STEPS + 1
    report = json.loads((arena.run_dir / "trainer" / "report.json").read_text())
    assert report["violations"] == [], report["violations"]
    return outcome


async def run_for(arena: Arena, rewrite: Rewrite, seconds: float) -> RunState:
    """The daemon for `seconds` (for attacks after which nothing can ship), then stopped."""
    async with fleet(rewrite) as urls, trio.open_nursery() as nursery:
        state: RunState = await nursery.start(launch_run, daemon_config(arena, urls))
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()
    arena.assert_canaries_intact()
    return state


def routing(exchange: Exchange) -> dict[str, Any]:
    """The reply's routing segment (under P/D the prefill side's, the first of two)."""
    segments = [s for s in exchange.segments if s["field"] == "routed_experts"]
    assert len(segments) in (1, 2), segments
    return segments[0]


# -- must fix ------------------------------------------------------------------------------


async def test_a_version_dir_swapped_for_a_link_never_lets_the_daemon_delete_outside(
    arena: Arena,
) -> None:
    swapped: list[Path] = []
    # Replies are rewritten in worker threads, several at once: one swaps at a time.
    swapping = threading.Lock()
    attempts = itertools.count()

    def change(exchange: Exchange) -> None:
        payload_dir = exchange.payload_dir
        assert payload_dir is not None
        with swapping:
            if not swapped:
                # The real directory goes aside (under a name that is not a version) and
                # a link to the outside directory takes its place. A server may recreate
                # the directory between the two steps (it writes on demand): then the
                # swap is tried again at the next reply.
                aside = payload_dir.with_name(f"moved-{payload_dir.name}-{next(attempts)}")
                try:
                    payload_dir.rename(aside)
                    payload_dir.symlink_to(arena.outside, target_is_directory=True)
                except OSError:
                    pass
                else:
                    swapped.append(payload_dir)
        for index, segment in enumerate(exchange.segments):
            segment["file"] = str(payload_dir / f"canary{index}")
            segment["offset"] = 0

    state = await run_for(arena, rewriting(change), seconds=6)
    assert swapped, "the attack never ran"
    # Every rollout of that version was refused, and its files were left alone.
    assert state.dispatch.failures["poisoned_payload"] > 0
    assert state.payload.files_deleted["discard"] >= 0


@pytest.mark.parametrize("key", ["fill", "digest_offset", "digest_nbytes"])
async def test_stitching_keys_from_a_server_are_a_rejection_not_a_crash(
    arena: Arena, key: str
) -> None:
    def change(exchange: Exchange) -> None:
        segment = routing(exchange)
        if key == "fill":
            segment.update(file="", offset=0, digest="", fill=-1)
        else:
            segment[key] = 0

    outcome = await run_attack(arena, rewriting(change))
    assert outcome.state.dispatch.failures["poisoned_payload"] > 0


async def test_routing_of_another_model_is_rejected_before_it_ships(arena: Arena) -> None:
    def change(exchange: Exchange) -> None:
        # The same bytes read as uint16 with top-4: plausible sizes, the wrong model.
        segment = routing(exchange)
        segment.update(dtype="uint16", shape=[48, 4])

    outcome = await run_attack(arena, rewriting(change))
    assert outcome.state.dispatch.failures["poisoned_payload"] > 0


async def test_a_zero_sized_dimension_is_rejected(arena: Arena) -> None:
    def change(exchange: Exchange) -> None:
        segment = routing(exchange)
        segment["shape"] = [0, 8]

    outcome = await run_attack(arena, rewriting(change))
    assert outcome.state.dispatch.failures["poisoned_payload"] > 0


async def test_claimed_sizes_are_not_counted_as_written(arena: Arena) -> None:
    def change(exchange: Exchange) -> None:
        routing(exchange)["rows"] = 10**12

    outcome = await run_attack(arena, rewriting(change))
    state = outcome.state
    assert state.dispatch.failures["poisoned_payload"] > 0
    # What is on disk: a few MB per step, never the petabytes the replies claim.
    assert 0 < state.payload.bytes_written < 10**9


async def test_a_reply_too_deep_to_parse_is_a_rejection(arena: Arena) -> None:
    def rewrite(exchange: Exchange) -> bytes:
        return b"[" * 200_000 + b"]" * 200_000

    outcome = await run_attack(arena, rewrite)
    assert outcome.state.dispatch.failures["malformed"] > 0


async def test_an_oversized_reply_is_cut_off_and_counted(arena: Arena) -> None:
    # Valid JSON padded past the by-handle cap (a few MiB at most).
    def rewrite(exchange: Exchange) -> bytes:
        return json.dumps(exchange.reply).encode() + b" " * (8 << 20)

    outcome = await run_attack(arena, rewrite)
    assert outcome.state.dispatch.failures["oversized"] > 0


async def test_garbage_instead_of_json_is_a_rejection(arena: Arena) -> None:
    outcome = await run_attack(arena, lambda exchange: os.urandom(4096))
    assert outcome.state.dispatch.failures["malformed"] > 0


# -- stopped before, kept as regression cases ----------------------------------------------


def _file_attack(arena: Arena, name_of: Callable[[Exchange], str]) -> Rewrite:
    def change(exchange: Exchange) -> None:
        segment = routing(exchange)
        segment.update(file=name_of(exchange), offset=0)

    return rewriting(change)


def _plant_link(arena: Arena) -> Callable[[Exchange], str]:
    def name_of(exchange: Exchange) -> str:
        assert exchange.payload_dir is not None
        link = exchange.payload_dir / f"evil-{exchange.request['request_id']}"
        link.symlink_to(arena.outside / "canary0")
        return str(link)

    return name_of


ATTACKS = ["traversal", "absolute", "symlinked_file", "past_the_end", "huge_shape", "bad_dtype"]
# Under P/D the containment attacks (a segment naming a file outside payload_dir).
PD_ATTACKS = ["traversal", "absolute", "symlinked_file"]


@pytest.mark.parametrize(
    ("attack", "disaggregated"),
    [(attack, False) for attack in ATTACKS] + [(attack, True) for attack in PD_ATTACKS],
    ids=[*ATTACKS, *(f"{attack}-pd" for attack in PD_ATTACKS)],
)
async def test_attacks_already_stopped_stay_stopped(
    arena: Arena, attack: str, disaggregated: bool
) -> None:
    if attack == "traversal":
        rewrite = _file_attack(arena, lambda e: f"{e.payload_dir}/../../../outside/canary0")
    elif attack == "absolute":
        rewrite = _file_attack(arena, lambda e: str(arena.outside / "canary0"))
    elif attack == "symlinked_file":
        rewrite = _file_attack(arena, _plant_link(arena))
    elif attack == "past_the_end":
        rewrite = rewriting(lambda e: routing(e).update(offset=1 << 40))
    elif attack == "huge_shape":
        rewrite = rewriting(lambda e: routing(e).update(rows=1 << 20, shape=[1 << 20, 1 << 20]))
    else:
        rewrite = rewriting(lambda e: routing(e).update(dtype="float64"))
    outcome = await run_attack(arena, rewrite, disaggregated=disaggregated)
    assert outcome.state.dispatch.failures["poisoned_payload"] > 0


async def test_a_wrong_digest_costs_its_sample_not_the_batch(arena: Arena) -> None:
    # The daemon never reads payload bytes, so it ships these; the trainer's reader
    # drops each such sample, names its server, and trains on the rest.
    def change(exchange: Exchange) -> None:
        segment = routing(exchange)
        # A digest the bytes do not have (real servers send none; ours may).
        segment["digest"] = "f" * 32 if segment.get("digest") != "f" * 32 else "e" * 32

    async with fleet(rewriting(change)) as urls:
        config = daemon_config(arena, urls)
        with trio.fail_after(90):
            outcome = await launch_run(config)
    arena.assert_canaries_intact()
    assert outcome.state.shipping.next_step == STEPS + 1
    report = json.loads((arena.run_dir / "trainer" / "report.json").read_text())
    assert report["violations"] == []
    assert report["dropped"], "no corrupt sample reached the trainer"
    assert {d["server"] for d in report["dropped"]} == {urls[1]}
