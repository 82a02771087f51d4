"""A fresh run over a payload root whose `v0` is a bind mount: the daemon refuses to start.
payload-gc's own handling of mount points (never entered, by the CLI, the API or a wipe)
is payload-gc/tests/integration/test_bind_mounts.py.

This test needs root (`mount --bind`); it skips with the reason otherwise, and always
unmounts in teardown.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from payload_gc import init_root

from orchestrator.commands.launch import launch_run
from orchestrator.config import load_config
from orchestrator.errors import UserError

if TYPE_CHECKING:
    from suite_plugin import BindMount


DEMO = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"


async def test_a_fresh_run_refuses_to_start_over_a_mount_point_it_cannot_wipe(
    tmp_path: Path, bind_mount: BindMount
) -> None:
    # A fresh run's versions start again at v0: a bind-mounted v0 left by the wipe would
    # be written through by servers and refused by the daemon for every rollout.
    config = load_config(DEMO, [f'run_dir="{tmp_path / "run"}"', "max_steps=1"])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary.txt").write_text("canary\n")
    init_root(config.payload_root)
    (config.payload_root / "v0").mkdir()
    with bind_mount(outside, config.payload_root / "v0"):
        with pytest.raises(UserError, match=r"v0 \(mount point\)"):
            await launch_run(config)
        assert (outside / "canary.txt").read_text() == "canary\n"
