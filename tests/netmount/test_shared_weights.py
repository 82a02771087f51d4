"""New weights written by another host are seen at the first probe after them, however
long the filesystem client caches listings (docs/design.md §5, Shared filesystems).

In the network-mount mode (`ORCH_TEST_NETMOUNT=cache`) the weights directory is on sshfs,
whose default cache serves a directory's listing for 20 s, and the trainer's writes go to
the server's side of it, as from another host. A probe that listed the directory would miss
them; one that opens the exact path must not. Without the mode they run on a local disk.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import trio
from scripted_servers import Call, ScriptedServers, answer

from orchestrator.config import Config, InferenceConfig, TrainerConfig
from orchestrator.daemon.inference.http11 import Reply
from orchestrator.daemon.inference.server_pool import ServerPool
from orchestrator.daemon.policy import PolicyWatcher
from orchestrator.daemon.run_state import RunState, Shipping
from orchestrator.handoff import (
    STABLE_MARKER,
    newest_published_version,
    publish_weights,
    published_versions,
)

A = "http://a:1"

# The `server_side` fixture (conftest.py): where another host's write of a path lands.
ServerSide = Callable[[Path], Path]


def test_a_version_another_host_publishes_is_found_by_the_next_probe(
    tmp_path: Path, server_side: ServerSide
) -> None:
    weights_dir = tmp_path / "weights"
    server = server_side(weights_dir)
    server.mkdir()
    for step in (1, 2, 3):
        # The client has just listed the directory (a watcher's poll, `status`), and looked
        # for the step: both answers may now be cached.
        assert published_versions(weights_dir, above=step - 1) == []
        assert newest_published_version(weights_dir, above=step - 1, up_to=step) is None
        publish_weights(server, step, fsync=False)
        assert newest_published_version(weights_dir, above=step - 1, up_to=step) == step


def test_a_marker_written_after_its_directory_was_seen_is_found(
    tmp_path: Path, server_side: ServerSide
) -> None:
    weights_dir = tmp_path / "weights"
    server = server_side(weights_dir)
    (server / "step_000004").mkdir(parents=True)
    # The step directory is known to the client, and its (empty) listing too.
    assert os.listdir(weights_dir) == ["step_000004"]
    assert os.listdir(weights_dir / "step_000004") == []
    assert newest_published_version(weights_dir, above=3, up_to=4) is None
    (server / "step_000004" / STABLE_MARKER).touch()
    assert newest_published_version(weights_dir, above=3, up_to=4) == 4


async def test_the_policy_watcher_applies_another_hosts_version_at_its_next_probe(
    tmp_path: Path, server_side: ServerSide
) -> None:
    config = Config(
        run_dir=tmp_path / "run",
        inference=InferenceConfig(urls=(A,), retries=0),
        trainer=TrainerConfig(force_polling=True, poll_interval_s=1.0),
    )
    config.payload_root.mkdir(parents=True)
    config.weights_dir.mkdir(parents=True)
    loaded: list[str] = []

    def handler(call: Call) -> Reply:
        loaded.append(Path(call.json()["weight_dir"]).name)
        return answer()

    async def sweep() -> None:
        pass

    # Batches 1 and 2 have shipped.
    state = RunState(config.staleness, Shipping(0, next_step=3))
    async with ScriptedServers(handler) as client:
        watcher = PolicyWatcher(
            config=config,
            state=state,
            client=client,
            pool=ServerPool.of(config.inference.urls, on_change=lambda: None),
            sweep=sweep,
            file_limiter=trio.CapacityLimiter(1),
        )
        for step in (1, 2):
            await watcher.check_for_new_version()
            assert state.versions.applied == step - 1
            # A listing, as a polling watcher makes, just before the trainer publishes.
            assert published_versions(config.weights_dir, above=step - 1) == []
            publish_weights(server_side(config.weights_dir), step, fsync=False)
            await watcher.check_for_new_version()
            assert state.versions.applied == step
    assert loaded == ["step_000001", "step_000002"]
