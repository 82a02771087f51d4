"""The command line: `check-config`, `--config`/`--set` arguments, and the shipped configs."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from cli_kit import refused

from orchestrator.cli import main
from orchestrator.config import (
    ConfigError,
    add_config_arguments,
    config_from_args,
    load_config,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MINIMAL = 'run_dir = "run"\n[inference]\nurls = ["http://inference-0:8000"]\n'


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_check_config_prints_the_resolved_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(MINIMAL, encoding="utf-8")
    assert main(["check-config", str(path), "--set", "seed=5"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    document = tomllib.loads(out)
    assert document["run_dir"] == str(tmp_path / "run")
    assert document["seed"] == 5
    assert document["staleness"] == {"max_off_policy_steps": 2, "max_async_steps": 1}
    header = out.split("\n\n", 1)[0]
    assert "# " in header
    assert "payload mode: inline (auto: one inference host and not multi_node)" in header
    assert f"payload root: {tmp_path / 'run' / 'payloads'}" in header
    assert f"batches_dir:  {tmp_path / 'run' / 'batches'}" in header
    assert f"weights_dir:  {tmp_path / 'run' / 'weights'}" in header


def test_check_config_output_is_a_loadable_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The demo's model and datasets are relative paths, taken from the directory the
    # command runs in (here tmp_path, as for run_dir): put the demo's folder there.
    (tmp_path / "demo").symlink_to(CONFIGS.parent / "demo")
    assert main(["check-config", str(CONFIGS / "demo.toml")]) == 0
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(capsys.readouterr().out, encoding="utf-8")
    assert load_config(resolved) == load_config(CONFIGS / "demo.toml")


@pytest.mark.parametrize(
    ("argv_tail", "named"),
    [
        (["--set", "batch.size=0"], "batch.size = 0 must be >= 1"),
        (["--set", "staleness.max_of_policy_steps=1"], "unknown key"),
        (["--set", "nonsense"], "expected KEY=VALUE"),
    ],
)
def test_check_config_error_is_one_stderr_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv_tail: list[str], named: str
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(MINIMAL, encoding="utf-8")
    prefix = "orchestrator check-config: error: "
    err = refused(capsys, "check-config", str(path), *argv_tail, prefix=prefix)
    assert named in err


def test_check_config_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "check-config", str(tmp_path / "absent.toml"))
    assert err == (
        f"orchestrator check-config: error: {tmp_path / 'absent.toml'}: no such config file\n"
    )


def test_check_config_invalid_toml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text('run_dir = "run\n', encoding="utf-8")
    assert f"{path}: invalid TOML at line 1" in refused(capsys, "check-config", str(path))


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return parser.parse_args(argv)


def test_config_arguments(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(MINIMAL, encoding="utf-8")
    args = parse(["--config", str(path), "--set", "seed=1", "--set", "max_steps=4"])
    assert args.overrides == ["seed=1", "max_steps=4"]
    config = config_from_args(args)
    assert (config.seed, config.max_steps) == (1, 4)
    assert parse(["--config", str(path)]).overrides == []


def test_config_argument_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse([])
    assert "--config" in capsys.readouterr().err


def test_config_from_args_raises_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no such config file"):
        config_from_args(parse(["--config", str(tmp_path / "absent.toml")]))


def test_demo_config_is_what_the_demo_needs(tmp_path: Path) -> None:
    config = load_config(CONFIGS / "demo.toml")
    assert config.run_dir == tmp_path / "run" / "demo"
    assert config.max_steps == 20
    assert config.payload.mode == "by_handle"
    assert config.by_handle is True
    assert config.sim.inference_servers == 2
    assert config.sim.trainer is True
    assert (config.sim.layers, config.sim.top_k, config.sim.num_experts) == (48, 8, 128)
    assert (config.batch.size, config.batch.group_size) == (16, 4)
    assert config.staleness.max_off_policy_steps == 2
    assert config.staleness.max_async_steps == 1


def test_multi_node_config_is_a_cluster_config(tmp_path: Path) -> None:
    config = load_config(CONFIGS / "multi-node.toml", [f"run_dir={tmp_path / 'run'}"])
    assert config.inference.multi_node is True
    assert len(config.inference_hosts) > 1
    assert config.by_handle is True
    assert config.trainer.force_polling is True
    assert config.sim.inference_servers == 0
    assert config.sim.trainer is False
    # The shipped file (without overrides) loads too: its paths are absolute.
    assert load_config(CONFIGS / "multi-node.toml").payload.root is not None


@pytest.mark.parametrize("name", ["demo.toml", "multi-node.toml", "prime-rl.toml"])
def test_every_key_of_the_shipped_configs_is_commented(name: str) -> None:
    # A newcomer reads these first: every key sits in a block that opens with a comment.
    lines = (CONFIGS / name).read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        if "=" in line and not line.startswith(("#", " ")):
            block_start = index
            while block_start > 0 and lines[block_start - 1].strip():
                block_start -= 1
            assert lines[block_start].startswith(("#", "[")), f"{name}: {line!r} lacks a comment"
            block = lines[block_start:index]
            assert any(above.startswith("#") for above in block), f"{name}: {line!r} uncommented"


def test_check_config_leaves_a_reward_library_to_the_workers(tmp_path: Path) -> None:
    # The demo scores with math_answer; checking its config loads the function but not
    # math-verify (sympy), which only a reward worker imports (`math_answer.prepare`).
    (tmp_path / "demo").symlink_to(CONFIGS.parent / "demo")
    probe = (
        "import sys\n"
        "from orchestrator.cli import main\n"
        f"assert main(['check-config', {str(CONFIGS / 'demo.toml')!r}]) == 0\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('math_verify', 'sympy'))\n"
        "sys.exit(f'imported {loaded[:3]}' if loaded else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
