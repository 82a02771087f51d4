"""The hand-off formats' registry, and the one seam every format-dependent place goes
through: a toy third format registered here is shipped by the daemon, resumed over by
start-up, checked by the config, described by `check-config` and read by the local
trainer, without any of them naming it."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest
import trio
from sample_kit import train_sample

from orchestrator.commands.check_config import derived_values_comment
from orchestrator.config import Config, ConfigError, InferenceConfig, TrainerConfig, load_config
from orchestrator.daemon.shipper import ship_step
from orchestrator.daemon.startup import find_start_point
from orchestrator.errors import UserError
from orchestrator.handoff import (
    HANDOFF_FORMATS,
    NATIVE_FORMAT,
    PRIME_RL_FORMAT,
    DroppedSample,
    HandoffSettings,
    Shipment,
    StepLayout,
    StepProblem,
    StepRead,
    TrainSample,
    UnknownFormat,
    format_names,
    handoff_format,
)
from orchestrator.sim.trainer import SimTrainerConfig, serve_trainer

TOY_FILE = "toy.json"


@attrs.define
class ToyFormat:
    """A third format: `step_N/toy.json` holding the samples' rollout ids. It cannot ship
    for more than one data rank, and refuses to resume over a `foreign` file."""

    name = "toy"
    weights_layout: StepLayout | None = "prime-rl"
    shipped_with: list[HandoffSettings] = attrs.Factory(list)

    def describe(self, settings: HandoffSettings) -> str:
        return f"toy steps in {settings.batches_dir.name}"

    def check(self, settings: HandoffSettings) -> str | None:
        if settings.data_world_size != 1:
            return f"ships for one data rank only (got {settings.data_world_size})"
        return None

    def ship(
        self, settings: HandoffSettings, step: int, samples: Sequence[TrainSample]
    ) -> Shipment:
        self.shipped_with.append(settings)
        path = self.step_dir(settings, step)
        path.mkdir(parents=True)
        (path / TOY_FILE).write_text(json.dumps([s.rollout_id for s in samples]))
        dropped = DroppedSample(0, "g", "lost", None, "payload_missing", "/nowhere", "gone")
        return Shipment(path, len(samples), (dropped,), micro_batches=7)

    def shipped_steps(self, settings: HandoffSettings) -> list[int]:
        if not settings.batches_dir.exists():
            return []
        return sorted(
            int(path.name.removeprefix("toy_"))
            for path in settings.batches_dir.glob("toy_*")
            if (path / TOY_FILE).is_file()
        )

    def refuse_resume(self, settings: HandoffSettings) -> None:
        if (settings.batches_dir / "foreign").exists():
            raise UserError(f"{settings.batches_dir} holds a foreign step")

    def step_dir(self, settings: HandoffSettings, step: int) -> Path:
        return settings.batches_dir / f"toy_{step}"

    def is_step_shipped(self, settings: HandoffSettings, step_dir: Path) -> bool:
        return (step_dir / TOY_FILE).is_file()

    def read_step(
        self, settings: HandoffSettings, step_dir: Path, step: int, *, verify: bool
    ) -> StepRead:
        rollouts = json.loads((step_dir / TOY_FILE).read_text())
        problem = StepProblem("bad_batch", str(step_dir / TOY_FILE), "toy problem")
        return StepRead(len(rollouts), 0, (problem,))


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> ToyFormat:
    handoff = ToyFormat()
    monkeypatch.setitem(HANDOFF_FORMATS, "toy", handoff)
    return handoff


def config(tmp_path: Path, **trainer: object) -> Config:
    return Config(
        run_dir=tmp_path / "run",
        inference=InferenceConfig(urls=("http://a:1",)),
        trainer=TrainerConfig(**trainer),  # type: ignore[arg-type]
    )


def test_the_registry_holds_native_then_prime_rl() -> None:
    assert format_names() == ("native", "prime-rl")
    assert handoff_format("native") is NATIVE_FORMAT
    assert handoff_format("prime-rl") is PRIME_RL_FORMAT
    assert [handoff.name for handoff in HANDOFF_FORMATS.values()] == list(format_names())


def test_an_unknown_format_is_one_error_listing_the_known_ones() -> None:
    with pytest.raises(UnknownFormat) as caught:
        handoff_format("megatron")
    assert str(caught.value) == 'unknown trainer format "megatron" (known: "native", "prime-rl")'
    assert isinstance(caught.value, ValueError)
    assert caught.value.name == "megatron"
    with pytest.raises(UnknownFormat, match="megatron"):
        handoff_format("megatron").shipped_steps(HandoffSettings(Path("/nonexistent")))


def test_a_registered_format_is_listed_and_known(toy: ToyFormat) -> None:
    assert format_names() == ("native", "prime-rl", "toy")
    assert handoff_format("toy") is toy
    with pytest.raises(UnknownFormat, match=re.escape('(known: "native", "prime-rl", "toy")')):
        handoff_format("megatron")


def test_the_config_accepts_only_registered_formats(tmp_path: Path, toy: ToyFormat) -> None:
    assert config(tmp_path, format="toy").trainer.format == "toy"
    path = tmp_path / "c.toml"
    path.write_text(f'run_dir = "{tmp_path / "run"}"\n[inference]\nurls = ["http://a:1"]\n')
    assert load_config(path, ['trainer.format="toy"']).trainer.format == "toy"
    with pytest.raises(ConfigError) as caught:
        load_config(path, ['trainer.format="megatron"'])
    message = str(caught.value)
    assert "\n" not in message
    assert message.endswith(
        '(--set trainer.format): trainer.format = "megatron" must be one of "native", '
        '"prime-rl", "toy"'
    )


def test_the_config_runs_the_format_s_check_naming_the_key(tmp_path: Path, toy: ToyFormat) -> None:
    with pytest.raises(ConfigError) as caught:
        config(tmp_path, format="toy", data_world_size=2)
    assert str(caught.value) == ('trainer.format = "toy" ships for one data rank only (got 2)')


def test_check_config_says_what_the_format_ships(tmp_path: Path, toy: ToyFormat) -> None:
    comment = derived_values_comment(config(tmp_path, format="toy"))
    assert "#   ships:        toy steps in batches\n" in comment


def test_the_settings_come_from_the_config(tmp_path: Path) -> None:
    settings = config(tmp_path, format="native", data_world_size=3, seq_len=9000).handoff_settings
    assert settings == HandoffSettings(
        batches_dir=tmp_path / "run" / "batches",
        weights_layout="native",
        data_world_size=3,
        seq_len=9000,
        env_name="mixed",
    )


async def ship(run: Config, step: int, samples: list[TrainSample]) -> Shipment:
    """Ship as the daemon does: through the format the registry holds for the config."""
    return await ship_step(handoff_format(run.trainer.format), run.handoff_settings, step, samples)


async def test_the_daemon_ships_and_lists_through_the_format(
    tmp_path: Path, toy: ToyFormat
) -> None:
    run = config(tmp_path, format="toy")
    shipment = await ship(run, 3, [train_sample(rollout_id=name) for name in "ab"])
    assert shipment.path == run.batches_dir / "toy_3"
    assert (shipment.samples, shipment.micro_batches) == (2, 7)
    assert [drop.rollout_id for drop in shipment.dropped] == ["lost"]
    assert toy.shipped_with == [run.handoff_settings]
    assert json.loads((shipment.path / TOY_FILE).read_text()) == ["a", "b"]
    assert handoff_format("toy").shipped_steps(run.handoff_settings) == [3]
    # Native's listing does not see the toy's steps.
    assert handoff_format("native").shipped_steps(HandoffSettings(run.batches_dir)) == []
    assert handoff_format("toy").shipped_steps(HandoffSettings(run.batches_dir)) == [3]


async def test_start_up_resumes_by_the_format_s_rules(tmp_path: Path, toy: ToyFormat) -> None:
    run = config(tmp_path, format="toy")
    state = tmp_path / "state"
    assert (
        find_start_point(handoff_format("toy"), HandoffSettings(run.batches_dir), state).resumed
        is False
    )
    await ship(run, 1, [train_sample(rollout_id="a")])
    await ship(run, 2, [train_sample(rollout_id="b")])
    start = find_start_point(handoff_format("toy"), HandoffSettings(run.batches_dir), state)
    assert (start.resume_step, start.resumed) == (2, True)
    # The native format sees nothing shipped there.
    assert (
        find_start_point(handoff_format("native"), HandoffSettings(run.batches_dir), state).resumed
        is False
    )
    (run.batches_dir / "foreign").touch()
    with pytest.raises(UserError, match="holds a foreign step"):
        find_start_point(handoff_format("toy"), HandoffSettings(run.batches_dir), state)


def test_the_local_trainer_checks_the_format(tmp_path: Path, toy: ToyFormat) -> None:
    with pytest.raises(ValueError, match=re.escape('format "toy" ships for one data rank only')):
        SimTrainerConfig(
            batches_dir=tmp_path / "b",
            weights_dir=tmp_path / "w",
            train_time_s=0,
            max_steps=1,
            format="toy",
            data_world_size=2,
        )
    with pytest.raises(UnknownFormat):
        SimTrainerConfig(
            batches_dir=tmp_path / "b",
            weights_dir=tmp_path / "w",
            train_time_s=0,
            max_steps=1,
            format="megatron",
        )


async def test_the_local_trainer_waits_and_reads_through_the_format(
    tmp_path: Path, toy: ToyFormat
) -> None:
    run = config(tmp_path, format="toy")
    await ship(run, 1, [train_sample(rollout_id=name) for name in "abc"])
    trainer = SimTrainerConfig(
        batches_dir=run.batches_dir,
        weights_dir=tmp_path / "weights",
        train_time_s=0,
        max_steps=1,
        weights_layout="prime-rl",
        format="toy",
    )
    async with trio.open_nursery() as nursery:
        # The live stats; the trainer returns once v1 is published.
        stats = await nursery.start(serve_trainer, trainer)
    assert (tmp_path / "weights" / "step_1" / "STABLE").is_file()
    # What the toy's `read_step` found: its samples, and its problem as a violation.
    assert (stats.last_step, stats.samples) == (1, 3)
    assert [(v.kind, v.message) for v in stats.violations] == [("bad_batch", "toy problem")]
