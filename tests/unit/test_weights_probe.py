"""Looking for the next policy version by its exact path (`newest_published_version`), and
the policy watcher's probes: the timer, the watcher, a failing probe, the shipped bound."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import hypothesis.strategies as st
import pytest
import structlog
import trio
from hypothesis import HealthCheck, given, settings
from scripted_servers import Call, ScriptedServers, answer

from orchestrator.config import Config, InferenceConfig, TrainerConfig
from orchestrator.daemon.inference.http11 import Reply
from orchestrator.daemon.inference.server_pool import ServerPool
from orchestrator.daemon.policy import PolicyWatcher
from orchestrator.daemon.run_state import RunState, Shipping
from orchestrator.handoff import (
    MODEL_FILE,
    STABLE_MARKER,
    StepLayout,
    newest_complete_step,
    newest_published_version,
    publish_weights,
    published_versions,
    step_dir_name,
)

A = "http://a:1"


def test_the_newest_candidate_published_is_found(tmp_path: Path) -> None:
    for step in (1, 2, 3, 5):
        publish_weights(tmp_path, step, fsync=False)
    assert newest_published_version(tmp_path, above=0, up_to=9) == 5
    assert newest_published_version(tmp_path, above=0, up_to=4) == 3
    assert newest_published_version(tmp_path, above=2, up_to=3) == 3
    # Nothing above the applied version, or no candidate at all.
    assert newest_published_version(tmp_path, above=5, up_to=9) is None
    assert newest_published_version(tmp_path, above=3, up_to=4) is None
    assert newest_published_version(tmp_path, above=5, up_to=5) is None
    assert newest_published_version(tmp_path, above=7, up_to=2) is None


def test_a_missing_directory_has_no_version_and_a_file_is_an_error(tmp_path: Path) -> None:
    assert newest_published_version(tmp_path / "missing", above=0, up_to=3) is None
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        newest_published_version(tmp_path / "file", above=0, up_to=3)
    # With no candidate the directory is not even opened.
    assert newest_published_version(tmp_path / "file", above=3, up_to=3) is None


def test_an_unknown_layout_is_an_error_even_without_candidates(tmp_path: Path) -> None:
    bad: StepLayout = "prime_rl"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="unknown step layout 'prime_rl'"):
        newest_published_version(tmp_path, above=3, up_to=3, layout=bad)


def test_only_what_the_listing_counts_is_found(tmp_path: Path) -> None:
    """Every step directory the listing refuses, the probe refuses too."""
    publish_weights(tmp_path, 1, fsync=False)
    # v2: no marker yet. v3: the marker is a directory. v4: a file where the directory
    # goes. v5: a link to a published step. v6: the other layout's spelling. v7: the
    # marker is a FIFO, which must neither count nor block the open.
    (tmp_path / "step_000002").mkdir()
    (tmp_path / "step_000002" / MODEL_FILE).write_text("{}")
    (tmp_path / "step_000003" / STABLE_MARKER).mkdir(parents=True)
    (tmp_path / "step_000004").write_text("")
    (tmp_path / "step_000005").symlink_to(tmp_path / "step_000001")
    (tmp_path / "step_6").mkdir()
    (tmp_path / "step_6" / STABLE_MARKER).touch()
    (tmp_path / "step_000007").mkdir()
    os.mkfifo(tmp_path / "step_000007" / STABLE_MARKER)
    assert published_versions(tmp_path) == [1]
    assert newest_published_version(tmp_path, above=0, up_to=7) == 1
    assert newest_published_version(tmp_path, above=1, up_to=7) is None
    assert newest_published_version(tmp_path, above=0, up_to=7, layout="prime-rl") == 6


def test_a_marker_that_links_to_a_file_counts_as_in_the_listing(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_text("")
    (tmp_path / "step_000002").mkdir()
    (tmp_path / "step_000002" / STABLE_MARKER).symlink_to(tmp_path / "elsewhere")
    assert published_versions(tmp_path) == [2]
    assert newest_published_version(tmp_path, above=0, up_to=2) == 2


def test_older_candidates_than_the_exact_probes_are_listed(tmp_path: Path) -> None:
    # A resumed run may have more candidates than it opens; the oldest are listed.
    publish_weights(tmp_path, 3, fsync=False)
    assert newest_complete_step(tmp_path, STABLE_MARKER, above=0, up_to=40, exact_probes=4) == 3
    assert newest_complete_step(tmp_path, STABLE_MARKER, above=3, up_to=40, exact_probes=4) is None
    publish_weights(tmp_path, 38, fsync=False)
    publish_weights(tmp_path, 41, fsync=False)
    assert newest_complete_step(tmp_path, STABLE_MARKER, above=0, up_to=40, exact_probes=4) == 38


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    states=st.dictionaries(
        st.integers(0, 30),
        st.sampled_from(["published", "no marker", "marker dir", "file", "link", "other layout"]),
        max_size=12,
    ),
    above=st.integers(-2, 32),
    width=st.integers(0, 32),
    exact_probes=st.integers(1, 20),
    layout=st.sampled_from(["native", "prime-rl"]),
)
def test_the_probe_agrees_with_the_listing(
    tmp_path: Path,
    states: dict[int, str],
    above: int,
    width: int,
    exact_probes: int,
    layout: StepLayout,
) -> None:
    """Whatever the directory holds: the newest version in `above + 1 .. up_to` that the
    listing counts, and only that, whether it is opened or listed."""
    weights_dir = tmp_path / "weights"
    shutil.rmtree(weights_dir, ignore_errors=True)
    weights_dir.mkdir()
    other: StepLayout = "native" if layout == "prime-rl" else "prime-rl"
    target = weights_dir / "target"
    target.mkdir()
    (target / STABLE_MARKER).touch()
    for step, state in states.items():
        path = weights_dir / step_dir_name(step, layout)
        if state == "published" and step > 0:
            publish_weights(weights_dir, step, layout=layout, fsync=False)
        elif state == "published":  # v0 is never published: a complete directory by hand
            path.mkdir()
            (path / STABLE_MARKER).touch()
        elif state == "no marker":
            path.mkdir()
        elif state == "marker dir":
            (path / STABLE_MARKER).mkdir(parents=True)
        elif state == "file":
            path.write_text("")
        elif state == "link":
            path.symlink_to(target)
        else:
            other_path = weights_dir / step_dir_name(step, other)
            if other_path != path:
                other_path.mkdir(exist_ok=True)
                (other_path / STABLE_MARKER).touch()
    up_to = above + width
    listed = [v for v in published_versions(weights_dir, above=above, layout=layout) if v <= up_to]
    expected = listed[-1] if listed else None
    found = newest_complete_step(
        weights_dir,
        STABLE_MARKER,
        above=above,
        up_to=up_to,
        layout=layout,
        exact_probes=exact_probes,
    )
    assert found == expected


# --- The policy watcher's probes ----------------------------------------------------------


def watcher_for(
    tmp_path: Path, *, force_polling: bool, poll_interval_s: float, next_step: int
) -> tuple[PolicyWatcher, RunState, list[str], ScriptedServers]:
    config = Config(
        run_dir=tmp_path / "run",
        inference=InferenceConfig(urls=(A,), retries=0),
        trainer=TrainerConfig(force_polling=force_polling, poll_interval_s=poll_interval_s),
    )
    config.payload_root.mkdir(parents=True)
    loaded: list[str] = []

    def handler(call: Call) -> Reply:
        loaded.append(Path(call.json()["weight_dir"]).name)
        return answer()

    state = RunState(config.staleness, Shipping(0, next_step=next_step))
    client = ScriptedServers(handler)

    async def sweep() -> None:
        pass

    watcher = PolicyWatcher(
        config=config,
        state=state,
        client=client,
        pool=ServerPool.of(config.inference.urls, on_change=lambda: None),
        sweep=sweep,
        file_limiter=trio.CapacityLimiter(1),
    )
    return watcher, state, loaded, client


async def applied(state: RunState, version: int) -> None:
    # A hang guard, not a timing assertion: the probes run every 0.05 s.
    with trio.fail_after(20):
        while state.versions.applied < version:
            await state.wait_changed()


@pytest.mark.parametrize("force_polling", [True, False])
async def test_the_watcher_applies_each_version_its_batch_allows(
    tmp_path: Path, force_polling: bool
) -> None:
    # Real time: the probes and the collector run in worker threads.
    watcher, state, loaded, client = watcher_for(
        tmp_path, force_polling=force_polling, poll_interval_s=0.05, next_step=3
    )
    weights_dir = watcher.config.weights_dir
    async with client, trio.open_nursery() as nursery:
        await nursery.start(watcher.serve)
        publish_weights(weights_dir, 1, fsync=False)
        await applied(state, 1)
        # v3's batch has not shipped: v3 is another run's leftover until it has.
        publish_weights(weights_dir, 3, fsync=False)
        await watcher.check_for_new_version()
        assert state.versions.applied == 1
        publish_weights(weights_dir, 2, fsync=False)
        await applied(state, 2)
        state.shipping.next_step = 4
        state.notify()
        await applied(state, 3)
        nursery.cancel_scope.cancel()
    assert state.versions.applied == 3
    assert loaded == ["step_000001", "step_000002", "step_000003"]


async def test_nothing_is_opened_when_no_batch_shipped_past_the_applied_version(
    tmp_path: Path,
) -> None:
    watcher, state, _, client = watcher_for(
        tmp_path, force_polling=True, poll_interval_s=0.05, next_step=1
    )
    # Even a weights directory that cannot be opened is not looked at.
    watcher.config.weights_dir.parent.mkdir(parents=True, exist_ok=True)
    watcher.config.weights_dir.write_text("")
    with structlog.testing.capture_logs() as logs:
        async with client:
            await watcher.check_for_new_version()
    assert state.versions.applied == 0
    assert logs == []


async def test_a_failing_probe_is_logged_once_and_tried_again(tmp_path: Path) -> None:
    watcher, state, _, client = watcher_for(
        tmp_path, force_polling=True, poll_interval_s=0.05, next_step=2
    )
    weights_dir = watcher.config.weights_dir
    weights_dir.parent.mkdir(parents=True, exist_ok=True)
    # A file where the weights directory goes: each probe fails to open it.
    weights_dir.write_text("")
    with structlog.testing.capture_logs() as logs:
        async with client:
            for _ in range(3):
                await watcher.check_for_new_version()
            weights_dir.unlink()
            publish_weights(weights_dir, 1, fsync=False)
            await watcher.check_for_new_version()
    assert state.versions.applied == 1
    events = [(entry["event"], entry["log_level"]) for entry in logs]
    assert events[:2] == [
        ("cannot look for new weights; trying again", "warning"),
        ("looking for new weights works again", "info"),
    ]
    assert "Not a directory" in logs[0]["error"]
