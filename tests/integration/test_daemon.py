"""The daemon end to end on the demo config: local servers over loopback HTTP, the local
trainer reading every payload byte, real files, the collector after every update."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import trio
from run_kit import free_port

from orchestrator.commands.launch import launch_run
from orchestrator.commands.summary import check_invariants
from orchestrator.config import Config, load_config
from orchestrator.daemon import RunOutcome
from orchestrator.daemon.run_state import RunState
from orchestrator.errors import UserError
from orchestrator.handoff import BATCH_FILE, read_batch_file, shipped_steps

DEMO = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"


def demo_config(run_dir: Path, *overrides: str) -> Config:
    return load_config(
        DEMO,
        [
            f'run_dir="{run_dir}"',
            "sim.train_time_s=0.02",
            "trainer.poll_interval_s=0.1",
            *overrides,
        ],
    )


def version_dirs(root: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in root.iterdir() if p.name[1:].isdigit())


async def watch_collections(state: RunState, root: Path, seen: list[tuple[int, list[int]]]) -> None:
    """After every settled policy update, record the version dirs left in the root."""
    last = state.versions.settled
    while True:
        await state.wait_changed()
        if state.versions.settled != last and state.versions.collected_below is not None:
            last = state.versions.settled
            dirs = await trio.to_thread.run_sync(version_dirs, root)
            seen.append((state.versions.collected_below, dirs))


async def run_with_watch(config: Config) -> tuple[RunOutcome, list[tuple[int, list[int]]]]:
    seen: list[tuple[int, list[int]]] = []
    outcome: list[RunOutcome] = []
    async with trio.open_nursery() as nursery:

        async def daemon(task_status: trio.TaskStatus[RunState]) -> None:
            outcome.append(await launch_run(config, task_status=task_status))
            nursery.cancel_scope.cancel()

        state = await nursery.start(daemon)
        nursery.start_soon(watch_collections, state, config.payload_root, seen)
    return outcome[0], seen


def assert_invariants(config: Config, outcome: RunOutcome, steps: int) -> None:
    invariants = check_invariants(
        handoff=config.handoff,
        settings=config.handoff_settings,
        payload_root=config.payload_root,
        trainer_report=config.run_dir / "trainer" / "report.json",
        last_step=steps,
        bound=outcome.state.versions.collected_below,
    )
    for invariant in invariants:
        assert invariant.held is True, invariant


@pytest.mark.slow
async def test_demo_config_runs_steps_and_keeps_every_invariant(tmp_path: Path) -> None:
    config = demo_config(tmp_path / "run", "max_steps=5")
    with trio.fail_after(120):
        outcome, seen = await run_with_watch(config)
    state = outcome.state
    assert state.shipping.next_step == 6
    assert state.versions.settled == 5
    assert shipped_steps(config.batches_dir) == [1, 2, 3, 4, 5]
    assert_invariants(config, outcome, 5)
    # After every policy update, nothing below the bound is left in the payload root.
    assert seen, "no policy update was observed"
    for bound, dirs in seen:
        assert all(k >= bound for k in dirs), (bound, dirs)
    # The final bound after v5: min_fresh_version(6, 2) = 3.
    assert state.versions.collected_below == 3
    assert all(k >= 3 for k in version_dirs(config.payload_root))
    report = json.loads((config.run_dir / "trainer" / "report.json").read_text())
    assert report["steps"] == 5 and report["violations"] == []
    # Every shipped sample's payload was by handle and read back by the trainer.
    batch = read_batch_file(config.batches_dir / "step_000005" / BATCH_FILE)
    assert len(batch.samples) == 16
    assert all(s.payload["routed_experts"] for s in batch.samples)
    # Each sample names the server its group ran on (one server per group).
    servers = {s.group_id: s.server for s in batch.samples}
    assert all(s.server == servers[s.group_id] for s in batch.samples)
    assert all(url is not None and url.startswith("http://127.0.0.1:") for url in servers.values())
    # Discarded rollouts' files were deleted at once, not only by the collector.
    assert state.payload.files_deleted["discard"] > 0
    assert state.payload.files_deleted["collection"] > 0


async def test_an_on_policy_run_ships_each_batch_from_the_version_before_it(
    tmp_path: Path,
) -> None:
    # max_async_steps = 0 with a step of slack: every group could go a step off-policy,
    # yet none needs to. The gate sees each group in flight, in the sink or in the batch
    # being written, never in none of them, so it starts no group the batch cannot take.
    config = demo_config(
        tmp_path / "run",
        "max_steps=6",
        "staleness.max_async_steps=0",
        "staleness.max_off_policy_steps=1",
    )
    with trio.fail_after(120):
        outcome = await launch_run(config)
    for step in range(1, 7):
        batch = read_batch_file(config.batches_dir / f"step_{step:06d}" / BATCH_FILE)
        assert {s.start_version for s in batch.samples} == {step - 1}, step
    assert outcome.sink.counters["stale"] == 0


@pytest.mark.slow
async def test_stopped_mid_run_resumes_without_reshipping_or_skipping(tmp_path: Path) -> None:
    config = demo_config(tmp_path / "run", "max_steps=6")
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            state: RunState = await nursery.start(launch_run, config)
            while state.shipping.next_step <= 3:
                await state.wait_changed()
            nursery.cancel_scope.cancel()
    first = shipped_steps(config.batches_dir)
    assert first and first == list(range(1, len(first) + 1))
    mtimes = {
        step: os.stat(config.batches_dir / f"step_{step:06d}" / BATCH_FILE).st_mtime_ns
        for step in first
    }
    # A straggler recreated a version directory far below any bound after the stop.
    straggler = config.payload_root / "v0"
    straggler.mkdir(exist_ok=True)
    (straggler / "late.bin").write_bytes(b"x" * 100)

    with trio.fail_after(120):
        outcome, _ = await run_with_watch(config)
    assert outcome.first_step == first[-1] + 1
    assert shipped_steps(config.batches_dir) == [1, 2, 3, 4, 5, 6]
    for step, mtime in mtimes.items():
        path = config.batches_dir / f"step_{step:06d}" / BATCH_FILE
        assert os.stat(path).st_mtime_ns == mtime, f"batch {step} was rewritten"

    # The resumed run went on with the environment's next prompts: none of the prompts
    # the first run trained on came again (group ids are `g<n>-<prompt id>`).
    def prompts(steps: list[int]) -> set[str]:
        return {
            sample.group_id.split("-", 1)[1]
            for step in steps
            for sample in read_batch_file(
                config.batches_dir / f"step_{step:06d}" / BATCH_FILE
            ).samples
        }

    later = [step for step in range(1, 7) if step not in first]
    assert prompts(first) and prompts(later) and not prompts(first) & prompts(later)
    assert not straggler.exists()
    assert_invariants(config, outcome, 6)


async def test_fresh_run_wipes_a_previous_payload_root(tmp_path: Path) -> None:
    config = demo_config(tmp_path / "run", "max_steps=1")
    root = config.payload_root
    (root / "v7").mkdir(parents=True)
    (root / "v7" / "old.bin").write_bytes(b"old")
    (root / ".payload-root").write_text("")
    with trio.fail_after(60):
        outcome = await launch_run(config)
    assert not (root / "v7").exists()
    assert (root / ".payload-root").exists()
    assert shipped_steps(config.batches_dir) == [1]
    assert outcome.state.versions.settled == 1


async def test_fresh_run_refuses_a_root_it_did_not_create(tmp_path: Path) -> None:
    config = demo_config(tmp_path / "run", "max_steps=1")
    root = config.payload_root
    root.mkdir(parents=True)
    (root / "precious.txt").write_text("not ours")
    with pytest.raises(UserError, match="payload"), trio.fail_after(60):
        await launch_run(config)
    assert (root / "precious.txt").read_text() == "not ours"


def scraped_value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the scrape")


async def test_metrics_endpoint_follows_the_run(tmp_path: Path) -> None:
    port = free_port()
    config = demo_config(tmp_path / "run", "max_steps=3", f'metrics.listen="127.0.0.1:{port}"')
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
            state: RunState = await nursery.start(launch_run, config)
            while state.shipping.next_step <= 2:
                await state.wait_changed()
            response = await client.get(f"http://127.0.0.1:{port}/metrics")
            nursery.cancel_scope.cancel()
    assert response.status_code == 200
    text = response.text
    assert scraped_value(text, "orchestrator_step") >= 2
    assert scraped_value(text, 'orchestrator_rollouts_total{outcome="completed"}') > 0
    assert "orchestrator_event_loop_lag_seconds_bucket" in text
    assert "orchestrator_discards_total" in text
