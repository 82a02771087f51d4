"""Bad input for real tasks is one line and exit 2, from `check-config` and from `run`
before anything is touched: a missing dataset, a mapped column it lacks, a tokenizer
without a chat template, a reward or factory path that does not import or is not
callable, a plugin without its methods. The
payload root a failed start finds is left as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_kit import refused
from demo_run import DEMO_CONFIG, DEMO_MODEL, demo_paths

from orchestrator.cli import main


def overrides(run_dir: Path, *more: str) -> list[str]:
    base = [*demo_paths(run_dir), *more]
    return [arg for override in base for arg in ("--set", override)]


def model_without_template(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(DEMO_MODEL, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


CASES = {
    "missing dataset": (
        lambda tmp: [f'env.0.dataset="{tmp / "nowhere.jsonl"}"'],
        "env[0].dataset: dataset {tmp}/nowhere.jsonl: no such file or folder",
    ),
    "absent column": (
        lambda tmp: ['env.0.prompt="query"'],
        "env[0].prompt = 'query'",
    ),
    "no chat template": (
        lambda tmp: [f'model.tokenizer="{model_without_template(tmp)}"'],
        "model.tokenizer: the tokenizer in {tmp}/model has no chat template",
    ),
    "reward does not import": (
        lambda tmp: ['env.1.rewards=["no_such_rewards_module:score"]'],
        "env[1].rewards[0]: ",
    ),
    "factory does not import": (
        lambda tmp: ['env=[{name = "p", factory = "no_such_games:make", rewards = ["x:y"]}]'],
        "env[0].factory: factory 'no_such_games:make': module 'no_such_games' does not import",
    ),
    "plugin without its methods": (
        lambda tmp: ['env=[{name = "p", factory = "builtins:dict"}]'],
        "env[0].factory: builtins:dict built a dict without a prompt() method",
    ),
    "reward not callable": (
        lambda tmp: ['env.1.rewards=["orchestrator.rewards:__doc__"]'],
        "env[1].rewards[0]: ",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_check_config_names_the_problem_in_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    change, expected = CASES[case]
    err = refused(
        capsys, "check-config", str(DEMO_CONFIG), *overrides(tmp_path / "run", *change(tmp_path))
    )
    assert expected.format(tmp=tmp_path) in err, err


@pytest.mark.parametrize("case", ["missing dataset", "reward does not import"])
def test_run_refuses_before_touching_the_payload_root(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    change, expected = CASES[case]
    run_dir = tmp_path / "run"
    # What an earlier run left: a fresh start would wipe it, a refused one must not.
    left = run_dir / "payloads" / "v3" / "left.bin"
    left.parent.mkdir(parents=True)
    left.write_bytes(b"x" * 10)
    code = main(["run", "--config", str(DEMO_CONFIG), *overrides(run_dir, *change(tmp_path))])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert expected.format(tmp=tmp_path) in err, err
    assert left.read_bytes() == b"x" * 10


def test_a_config_with_the_old_env_table_is_told_where_its_keys_went(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "old.toml"
    old.write_text('run_dir = "r"\n[inference]\nurls = ["http://a:1"]\n[env]\nname = "mixed"\n')
    err = refused(capsys, "check-config", str(old))
    assert "[env] is a single table" in err and "[sim]" in err
