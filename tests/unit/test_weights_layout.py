"""Weights layouts: ours (`step_000007/STABLE`) and prime-rl's (`step_7/STABLE`), named,
parsed, listed, waited for, and followed by the health prober and the policy watcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
from scripted_servers import Call, ScriptedServers, answer

from orchestrator.commands.inspect import read_run_on_disk
from orchestrator.config import (
    Config,
    ConfigError,
    InferenceConfig,
    InvalidValue,
    TrainerConfig,
    config_to_toml,
    load_config,
)
from orchestrator.core.staleness import Staleness
from orchestrator.daemon.inference.http11 import Reply
from orchestrator.daemon.inference.server_pool import ProbeSettings, ServerPool, serve_health_prober
from orchestrator.daemon.policy import PolicyWatcher
from orchestrator.daemon.run_state import RunState, Shipping, Versions
from orchestrator.daemon.startup import wait_for_version
from orchestrator.handoff import (
    MODEL_FILE,
    STABLE_MARKER,
    STEP_LAYOUTS,
    StepLayout,
    complete_steps,
    latest_published_version,
    parse_step_dir,
    publish_weights,
    published_versions,
    step_dir_name,
    weights_step_dir,
)

A, B = "http://a:1", "http://b:2"
DEMO = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"


def stable(directory: Path) -> Path:
    """A step directory as prime-rl's trainer leaves it: weights, then an empty STABLE."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.safetensors").write_bytes(b"\0" * 8)
    (directory / STABLE_MARKER).touch()
    return directory


@pytest.mark.parametrize(
    ("step", "native", "prime_rl"),
    [
        (0, "step_000000", "step_0"),
        (7, "step_000007", "step_7"),
        (10, "step_000010", "step_10"),
        (999_999, "step_999999", "step_999999"),
        (1_234_567, "step_1234567", "step_1234567"),
    ],
)
def test_each_layout_names_a_step_its_own_way(step: int, native: str, prime_rl: str) -> None:
    assert step_dir_name(step) == step_dir_name(step, "native") == native
    assert step_dir_name(step, "prime-rl") == prime_rl
    assert parse_step_dir(native, "native") == step
    assert parse_step_dir(prime_rl, "prime-rl") == step


@pytest.mark.parametrize("layout", STEP_LAYOUTS)
def test_every_step_reads_back_from_its_name(layout: StepLayout) -> None:
    for step in [*range(0, 1200), 99_999, 100_000, 10**12]:
        assert parse_step_dir(step_dir_name(step, layout), layout) == step


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step_0", 0),
        ("step_7", 7),
        ("step_10", 10),
        ("step_1234567", 1_234_567),
        # Not prime-rl's spelling: leading zeros (ours included), signs, other cases.
        ("step_07", None),
        ("step_00", None),
        ("step_000007", None),
        ("step_-7", None),
        ("step_+7", None),
        ("step_7a", None),
        ("step_ 7", None),
        ("STEP_7", None),
        ("step_", None),
        ("step_\u0663", None),
        ("7", None),
        (".tmp-step_7-ab12", None),
    ],
)
def test_prime_rl_layout_accepts_only_its_canonical_name(name: str, step: int | None) -> None:
    assert parse_step_dir(name, "prime-rl") == step


def test_native_layout_does_not_take_a_prime_rl_name() -> None:
    assert parse_step_dir("step_7") is None
    assert parse_step_dir("step_7", "native") is None
    assert parse_step_dir("step_000007", "prime-rl") is None


def test_an_unknown_layout_is_an_error_not_an_empty_listing(tmp_path: Path) -> None:
    bad: StepLayout = "prime_rl"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="unknown step layout 'prime_rl'"):
        step_dir_name(7, bad)
    with pytest.raises(ValueError, match="unknown step layout"):
        parse_step_dir("step_7", bad)
    with pytest.raises(ValueError, match="unknown step layout"):
        parse_step_dir("not a step", bad)
    # Even where nothing is there to list: a typo must not look like "no version yet".
    with pytest.raises(ValueError, match="unknown step layout"):
        published_versions(tmp_path / "missing", layout=bad)
    with pytest.raises(ValueError, match="unknown step layout"):
        complete_steps(tmp_path, STABLE_MARKER, layout=bad)


def test_weights_step_dir_follows_the_layout(tmp_path: Path) -> None:
    assert weights_step_dir(tmp_path, 7) == tmp_path / "step_000007"
    assert weights_step_dir(tmp_path, 7, layout="prime-rl") == tmp_path / "step_7"
    with pytest.raises(ValueError, match="step must be >= 0"):
        weights_step_dir(tmp_path, -1, layout="prime-rl")


def test_publish_in_the_prime_rl_layout(tmp_path: Path) -> None:
    weights_dir = tmp_path / "broadcasts"
    step_dir = publish_weights(weights_dir, 3, layout="prime-rl", fsync=False)
    assert step_dir == weights_dir / "step_3"
    assert (step_dir / STABLE_MARKER).is_file()
    assert json.loads((step_dir / MODEL_FILE).read_text())["step"] == 3
    assert [p.name for p in weights_dir.iterdir()] == ["step_3"]
    assert published_versions(weights_dir, layout="prime-rl") == [3]
    # The native layout does not see it.
    assert published_versions(weights_dir) == []


def test_published_versions_in_the_prime_rl_layout(tmp_path: Path) -> None:
    weights_dir = tmp_path / "broadcasts"
    assert published_versions(weights_dir, layout="prime-rl") == []
    assert latest_published_version(weights_dir, layout="prime-rl") == 0
    for step in (1, 5, 12):
        stable(weights_dir / f"step_{step}")
    # Not prime-rl versions: a non-canonical name, our own spelling, no marker (a
    # broadcast in progress), a marker that is a directory, a file with a step name, a
    # symlink to a published step.
    stable(weights_dir / "step_07")
    stable(weights_dir / "step_000020")
    (weights_dir / "step_30").mkdir()
    (weights_dir / "step_30" / "model.safetensors").write_bytes(b"")
    (weights_dir / "step_31" / STABLE_MARKER).mkdir(parents=True)
    (weights_dir / "step_32").write_text("")
    (weights_dir / "step_40").symlink_to(weights_dir / "step_12")
    assert published_versions(weights_dir, layout="prime-rl") == [1, 5, 12]
    assert published_versions(weights_dir, above=5, layout="prime-rl") == [12]
    assert latest_published_version(weights_dir, layout="prime-rl") == 12
    # The same directory read in our layout sees only our spelling.
    assert published_versions(weights_dir) == [20]


def test_the_config_key_defaults_to_native_and_refuses_other_values(tmp_path: Path) -> None:
    urls = InferenceConfig(urls=(A,))
    assert Config(run_dir=tmp_path, inference=urls).trainer.weights_layout == "native"
    config = Config(
        run_dir=tmp_path, inference=urls, trainer=TrainerConfig(weights_layout="prime-rl")
    )
    assert config.trainer.weights_layout == "prime-rl"
    with pytest.raises(InvalidValue, match='must be one of "native", "prime-rl"'):
        TrainerConfig(weights_layout="prime_rl")  # type: ignore[arg-type]


def test_the_config_file_key_reads_back_and_names_a_misspelling(tmp_path: Path) -> None:
    config = load_config(DEMO, [f'run_dir="{tmp_path}"', 'trainer.weights_layout="prime-rl"'])
    assert config.trainer.weights_layout == "prime-rl"
    dumped = tmp_path / "dumped.toml"
    dumped.write_text(config_to_toml(config))
    assert load_config(dumped) == config
    with pytest.raises(ConfigError, match=r'trainer\.weights_layout = "prime_rl" must be one of'):
        load_config(DEMO, [f'run_dir="{tmp_path}"', 'trainer.weights_layout="prime_rl"'])


def test_status_reads_the_latest_version_in_the_configured_layout(tmp_path: Path) -> None:
    weights_dir = tmp_path / "broadcasts"
    config = load_config(
        DEMO,
        [
            f'run_dir="{tmp_path / "run"}"',
            f'trainer.weights_dir="{weights_dir}"',
            'trainer.weights_layout="prime-rl"',
        ],
    )
    config.run_dir.mkdir()
    for step in (1, 2):
        stable(weights_dir / f"step_{step}")
    stable(weights_dir / "step_000009")
    (weights_dir / "step_3").mkdir()  # no STABLE yet
    assert read_run_on_disk(config).published_version == 2


async def test_start_up_waits_for_the_version_in_the_prime_rl_layout(tmp_path: Path) -> None:
    # Real time: the autojump clock would jump while the probe runs in a worker thread.
    weights_dir = tmp_path / "broadcasts"
    done = trio.Event()

    async def wait() -> None:
        await wait_for_version(weights_dir, 2, poll_interval_s=0.01, layout="prime-rl")
        done.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            # Our spelling of v2, and v2 without its marker, are not v2 in this layout.
            stable(weights_dir / "step_000002")
            (weights_dir / "step_2").mkdir()
            await trio.sleep(0.2)
            assert not done.is_set()
            (weights_dir / "step_2" / STABLE_MARKER).touch()
            await done.wait()


async def test_a_recovered_server_loads_the_prime_rl_step_dir(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    posted: list[tuple[str, object]] = []

    def handler(call: Call) -> Reply:
        if call.path == "/update_weights":
            url = call.origin
            posted.append((url, call.json()["weight_dir"]))
        return answer()

    settings = ProbeSettings(
        weights_dir=tmp_path / "broadcasts",
        weights_layout="prime-rl",
        interval_s=1.0,
        request_timeout_s=2.0,
        unavailable_deadline_s=30.0,
    )
    state = RunState(Staleness(), Shipping(0), versions=Versions(applied=7))
    pool = ServerPool.of([A, B], on_change=lambda: None)
    pool.mark_down(A, "refused")
    async with (
        ScriptedServers(handler) as client,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(serve_health_prober, pool, client, settings, state)
        await trio.sleep(1.5)
        assert A not in pool.down_since
        assert posted == [(A, str(tmp_path / "broadcasts" / "step_7"))]
        nursery.cancel_scope.cancel()


async def test_the_watcher_follows_versions_published_in_the_prime_rl_layout(
    tmp_path: Path,
) -> None:
    # Real time: the watcher's filesystem watch and the collector run in worker threads.
    weights_dir = tmp_path / "prime-rl-output" / "broadcasts"
    config = Config(
        run_dir=tmp_path / "run",
        inference=InferenceConfig(urls=(A, B), retries=0),
        trainer=TrainerConfig(
            weights_dir=weights_dir,
            weights_layout="prime-rl",
            force_polling=True,
            poll_interval_s=0.05,
        ),
    )
    config.payload_root.mkdir(parents=True)
    # The step directory each server was told to load, by directory name.
    posted: dict[str, set[str]] = {}

    def handler(call: Call) -> Reply:
        assert call.path == "/update_weights"
        weight_dir = Path(call.json()["weight_dir"])
        url = call.origin
        assert weight_dir.parent == weights_dir
        posted.setdefault(weight_dir.name, set()).add(url)
        return answer()

    # Batches 1..3 have shipped: v4 and later would be another run's leftovers.
    state = RunState(config.staleness, Shipping(0, next_step=4))
    sweeps: list[int] = []

    async def sweep() -> None:
        sweeps.append(state.versions.applied)

    async def settled(version: int) -> None:
        with trio.fail_after(10):
            while state.versions.settled < version:
                await state.wait_changed()

    async with (
        ScriptedServers(handler) as client,
        trio.open_nursery() as nursery,
    ):
        watcher = PolicyWatcher(
            config=config,
            state=state,
            client=client,
            pool=ServerPool.of(config.inference.urls, on_change=lambda: None),
            sweep=sweep,
            file_limiter=trio.CapacityLimiter(1),
        )
        await nursery.start(watcher.serve)
        stable(weights_dir / "step_1")
        await settled(1)
        assert posted == {"step_1": {A, B}}

        # Neither another spelling of a step, nor a step still being written, nor a step
        # whose batch has not shipped is a version to load.
        stable(weights_dir / "step_02")
        stable(weights_dir / "step_000002")
        (weights_dir / "step_2").mkdir()
        stable(weights_dir / "step_5")
        await watcher.check_for_new_version()
        assert state.versions.applied == 1

        (weights_dir / "step_2" / STABLE_MARKER).touch()
        await settled(2)
        stable(weights_dir / "step_3")
        await settled(3)
        nursery.cancel_scope.cancel()

    assert state.versions.applied == 3
    assert posted == {"step_1": {A, B}, "step_2": {A, B}, "step_3": {A, B}}
    assert sweeps == [1, 2, 3]
