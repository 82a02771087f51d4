"""`[rewards] executor`: Ray's keys only with Ray, and a missing Ray is one line before
the run starts (check-config says it too)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_ray_keys_need_the_ray_executor(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('run_dir = "run"\n[sim]\ninference_servers = 1\n[rewards]\naddress = "auto"\n')
    with pytest.raises(ConfigError, match=r'rewards\.address = "auto" is for executor = "ray"'):
        load_config(path)
    config = load_config(path, ['rewards.executor="ray"'])
    assert config.rewards.executor == "ray" and config.rewards.address == "auto"


def test_a_missing_ray_is_one_line_from_check_config(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    monkeypatch.chdir(ROOT)
    code = main(["check-config", "configs/demo.toml", "--set", 'rewards.executor="ray"'])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "needs Ray, which is not installed: pip install 'rollout-orchestrator[ray]'" in err
