"""`configs/pd.toml`, the disaggregated prefill/decode example: it loads, is the demo with
each local server a P/D deployment by handle, and every key is explained; and the config
rules that used to refuse by handle under P/D now take it."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config import config_to_toml, load_config
from orchestrator.sim.fleet import sim_inference_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_the_pd_example_is_the_demo_under_prefill_decode_by_handle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # run_dir is relative to where the command runs
    config = load_config(CONFIGS / "pd.toml")
    demo = load_config(CONFIGS / "sim.toml")
    assert config.run_dir == tmp_path / "run" / "pd"
    assert config.inference.disaggregated is True
    assert config.payload.mode == "by_handle" and config.by_handle is True
    assert config.sim.inference_servers == 2 and config.sim.trainer is True
    assert all(sim_inference_config(config, i).disaggregated for i in range(2))
    # Otherwise the demo: the same run, batches, model and fleet settings.
    assert config.batch == demo.batch and config.staleness == demo.staleness
    assert config.sim == demo.sim and config.env == demo.env
    # Inline works too, and the file round-trips.
    inline = load_config(CONFIGS / "pd.toml", ['payload.mode="inline"'])
    assert inline.by_handle is False and inline.inference.disaggregated is True
    path = tmp_path / "resolved.toml"
    path.write_text(config_to_toml(config))
    assert load_config(path) == config


def test_every_key_of_the_pd_example_is_commented() -> None:
    lines = (CONFIGS / "pd.toml").read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        if "=" in line and not line.startswith(("#", " ")):
            block_start = index
            while block_start > 0 and lines[block_start - 1].strip():
                block_start -= 1
            block = lines[block_start:index]
            assert any(above.startswith("#") for above in block), f"{line!r} uncommented"
