"""`trainer.jsonl` lines and the mismatch warning."""

from __future__ import annotations

import json
import math
from pathlib import Path

from orchestrator_trainer.step_log import (
    FORMAT,
    Mismatch,
    StepRecord,
    append_record,
    mismatch_warning,
)


def record(**fields: object) -> StepRecord:
    values: dict[str, object] = {
        "step": 3,
        "version": 2,
        "samples": 16,
        "tokens": 200,
        "loss": -0.01,
        "grad_norm": 0.5,
        "clipped_share": 0.0,
        "reward_mean": 0.4,
        "seconds": 1.0,
        "on_policy_samples": 8,
        "mismatch_kl": 1e-7,
        "mismatch_kl_no_replay": 1e-3,
        "mismatch_by_server": {"http://a": 1e-7},
    }
    values.update(fields)
    return StepRecord(**values)  # type: ignore[arg-type]


def test_each_step_is_one_json_line_the_report_reads(tmp_path: Path) -> None:
    path = tmp_path / "run" / "trainer.jsonl"
    append_record(path, record(step=1, version=0))
    append_record(path, record(loss=math.nan, mismatch_kl=None))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 3]
    assert lines[0]["format"] == FORMAT and lines[0]["mismatch_by_server"] == {"http://a": 1e-7}
    assert lines[1]["loss"] is None and lines[1]["mismatch_kl"] is None


def test_mismatch_sums_per_token_overall_and_per_server() -> None:
    mismatch = Mismatch()
    assert mismatch.mean is None
    mismatch.add("http://a", 0.3, 3)
    mismatch.add("http://b", 0.0, 1)
    mismatch.add(None, 0.1, 1)
    assert math.isclose(mismatch.mean or 0, 0.4 / 5) and mismatch.samples == 3
    means = mismatch.server_means()
    assert means.keys() == {"http://a", "http://b", "unknown"}
    assert math.isclose(means["http://a"], 0.1) and means["http://b"] == 0.0


def test_a_mismatch_over_the_threshold_names_the_version_and_the_worst_server() -> None:
    assert mismatch_warning(record(), 0.01) is None
    assert mismatch_warning(record(mismatch_kl=None), 0.01) is None
    high = record(mismatch_kl=0.5, mismatch_by_server={"http://a": 1e-6, "http://b": 0.9})
    line = mismatch_warning(high, 0.01)
    assert line is not None and "\n" not in line
    assert "version 2" in line and "http://b 0.9" in line and "http://a" not in line
