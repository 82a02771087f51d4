"""`[trainer] format`, `data_world_size`, `seq_len`: their defaults and checks, and the
prime-rl example config (configs/prime-rl.toml)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config import (
    BatchConfig,
    Config,
    ConfigError,
    InferenceConfig,
    TrainerConfig,
    load_config,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MINIMAL = 'run_dir = "run"\n[inference]\nurls = ["http://inference-0:8000"]\n'
PRIME_RL = ['trainer.format="prime-rl"', 'trainer.weights_layout="prime-rl"']


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


@pytest.fixture
def minimal(tmp_path: Path) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(MINIMAL, encoding="utf-8")
    return path


def test_the_defaults_ship_native_batches(minimal: Path) -> None:
    config = load_config(minimal)
    assert config.trainer.format == "native"
    assert (config.trainer.data_world_size, config.trainer.seq_len) == (1, 0)
    # seq_len 0 is batch.max_seq_len.
    assert config.train_seq_len == config.batch.max_seq_len == 8192


def test_prime_rl_format_with_its_layout_and_ranks(minimal: Path) -> None:
    config = load_config(minimal, [*PRIME_RL, "trainer.data_world_size=8", "trainer.seq_len=16384"])
    assert config.trainer.format == "prime-rl"
    assert (config.trainer.data_world_size, config.train_seq_len) == (8, 16384)


def test_prime_rl_format_needs_prime_rl_weights_layout_one_error_naming_both(
    minimal: Path,
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(minimal, ['trainer.format="prime-rl"'])
    message = str(caught.value)
    assert "\n" not in message
    assert 'trainer.format = "prime-rl"' in message
    assert 'requires trainer.weights_layout = "prime-rl"' in message
    assert '(got "native")' in message


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ('trainer.format="megatron"', 'trainer.format = "megatron" must be one of'),
        ("trainer.data_world_size=0", "trainer.data_world_size = 0 must be >= 1"),
        ("trainer.seq_len=-1", "trainer.seq_len = -1 must be >= 0"),
        ("trainer.seq_len=4096", "trainer.seq_len = 4096 must be 0 or >= batch.max_seq_len"),
    ],
)
def test_bad_values_are_one_line_naming_the_key(minimal: Path, override: str, named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config(minimal, [*PRIME_RL, "batch.max_seq_len=8192", override])


def test_seq_len_may_equal_or_exceed_max_seq_len(minimal: Path) -> None:
    for seq_len in (8192, 10000):
        config = load_config(minimal, [*PRIME_RL, f"trainer.seq_len={seq_len}"])
        assert config.train_seq_len == seq_len


def test_direct_construction_runs_the_same_checks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.format"):
        Config(
            run_dir=tmp_path / "run",
            inference=InferenceConfig(urls=("http://a:1",)),
            trainer=TrainerConfig(format="prime-rl"),
        )
    with pytest.raises(ConfigError, match=r"trainer\.seq_len"):
        Config(
            run_dir=tmp_path / "run",
            inference=InferenceConfig(urls=("http://a:1",)),
            batch=BatchConfig(max_seq_len=100),
            trainer=TrainerConfig(seq_len=99),
        )


def test_the_prime_rl_config_points_at_one_prime_rl_output_dir(tmp_path: Path) -> None:
    config = load_config(CONFIGS / "prime-rl.toml")
    assert config.trainer.format == config.trainer.weights_layout == "prime-rl"
    assert config.batches_dir.name == "rollouts" and config.weights_dir.name == "broadcasts"
    assert config.batches_dir.parent == config.weights_dir.parent
    assert config.trainer.data_world_size > 1
    assert config.train_seq_len >= config.batch.max_seq_len
    assert config.by_handle is True
    # prime-rl's micro batch carries routed experts only.
    assert config.payload.fields == ("routed_experts",)
    assert (config.payload.layers, config.payload.top_k) != (0, 0)
    assert config.sim.inference_servers == 0 and config.sim.trainer is False


def test_check_config_accepts_the_prime_rl_config_and_says_what_it_ships(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check-config", str(CONFIGS / "prime-rl.toml")]) == 0
    out = capsys.readouterr().out
    header = out.split("\n\n", 1)[0]
    assert "ships:        prime-rl micro batches (step_7/rank_R.bin for 16 data rank(s)" in header
    assert tomllib.loads(out)["trainer"]["format"] == "prime-rl"
    assert main(["check-config", str(CONFIGS / "sim.toml")]) == 0
    assert "ships:        native batches (step_000007/batch.bin)" in capsys.readouterr().out
