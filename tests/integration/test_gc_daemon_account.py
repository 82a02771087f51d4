"""The daemon learns its disk use without walking the payload root (docs/design.md §8): a
run on the demo config walks the root once, at its end, for the summary; the collector
after every update looks at no kept version; and the running account it keeps instead
holds only files that are on disk, at their sizes on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import payload_gc._scan as scan
import pytest
import trio

import orchestrator.daemon.run as daemon_run
from orchestrator.commands.launch import launch_run
from orchestrator.config import Config, load_config
from orchestrator.daemon import RunOutcome
from orchestrator.daemon.payload_files.disk import tree_bytes
from orchestrator.daemon.run_state import RunState

DEMO = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"


def _config(run_dir: Path) -> Config:
    return load_config(
        DEMO,
        [
            f'run_dir="{run_dir}"',
            "sim.train_time_s=0.02",
            "trainer.poll_interval_s=0.1",
            "max_steps=5",
        ],
    )


@pytest.mark.slow
async def test_a_run_walks_the_root_only_at_its_end_and_its_account_matches_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    walks: list[str] = []
    measured_during_run: list[str] = []
    real_measure_tree = daemon_run.measure_tree
    real_measure_dir = scan.measure_dir

    async def measure_tree(root: Path, **kwargs: Any) -> tuple[int, int]:
        walks.append(str(root))
        return await real_measure_tree(root, **kwargs)

    def measure_dir(*args: Any) -> Any:
        if not walks:
            measured_during_run.append(str(args[1]))
        return real_measure_dir(*args)

    monkeypatch.setattr(daemon_run, "measure_tree", measure_tree)
    monkeypatch.setattr(scan, "measure_dir", measure_dir)
    config = _config(tmp_path / "run")
    peaks_at_collections: list[tuple[int, int]] = []
    outcome: list[RunOutcome] = []
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:

            async def daemon(task_status: trio.TaskStatus[RunState]) -> None:
                outcome.append(await launch_run(config, task_status=task_status))
                nursery.cancel_scope.cancel()

            state: RunState = await nursery.start(daemon)
            bound = state.versions.collected_below
            while True:
                await state.wait_changed()
                assert state.payload.bytes == state.payload.account.bytes >= 0
                if state.versions.collected_below != bound:
                    bound = state.versions.collected_below
                    peaks_at_collections.append((state.payload.peak_bytes, state.payload.bytes))

    state = outcome[0].state
    assert state.shipping.next_step == 6
    # One walk, for the summary at the end; none while the run went on: neither after
    # each shipped batch nor by the collector after each policy update.
    assert walks == [str(config.payload_root)]
    assert measured_during_run == []
    assert peaks_at_collections, "no collection was observed"
    assert all(peak > 0 and peak >= after for peak, after in peaks_at_collections)
    assert state.payload.peak_bytes > 0
    assert state.payload.bytes_written > 0
    # Every file the account holds is on disk at that size, in a version not collected.
    assert state.versions.collected_below is not None
    account = state.payload.account
    for (version, name), size in account.items():
        assert version >= state.versions.collected_below
        assert (config.payload_root / f"v{version}" / name).stat().st_size == size
    _, on_disk = tree_bytes(config.payload_root)
    assert account.bytes <= on_disk
    # The summary's "at exit" figure is that walk's.
    assert state.payload.bytes == on_disk
