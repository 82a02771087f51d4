"""Weights markers: step directory names, publishing, and which versions count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.handoff import (
    MODEL_FILE,
    STABLE_MARKER,
    WEIGHTS_FORMAT,
    latest_published_version,
    parse_step_dir,
    publish_weights,
    published_versions,
    weights_step_dir,
)


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step_000000", 0),
        ("step_000007", 7),
        ("step_999999", 999_999),
        ("step_1234567", 1_234_567),
        ("step_7", None),
        ("step_0000007", None),
        ("step_00007", None),
        ("step_000007a", None),
        ("step_-00007", None),
        ("STEP_000007", None),
        ("step_", None),
        ("step_00000\u0663", None),
        (".tmp-step_000007-ab12", None),
        ("v7", None),
    ],
)
def test_parse_step_dir_accepts_only_the_canonical_name(name: str, step: int | None) -> None:
    assert parse_step_dir(name) == step


def test_weights_step_dir_pads_to_six_digits_and_grows(tmp_path: Path) -> None:
    assert weights_step_dir(tmp_path, 7) == tmp_path / "step_000007"
    assert weights_step_dir(tmp_path, 1_234_567) == tmp_path / "step_1234567"
    with pytest.raises(ValueError, match="step must be >= 0"):
        weights_step_dir(tmp_path, -1)


def test_publish_writes_model_then_stable(tmp_path: Path) -> None:
    weights_dir = tmp_path / "run" / "weights"
    step_dir = publish_weights(weights_dir, 3)
    assert step_dir == weights_dir / "step_000003"
    assert (step_dir / STABLE_MARKER).read_bytes() == b""
    model = json.loads((step_dir / MODEL_FILE).read_text())
    assert model["format"] == WEIGHTS_FORMAT
    assert model["step"] == 3
    # Nothing but the two files: the temp files were renamed into place.
    assert sorted(p.name for p in step_dir.iterdir()) == sorted([MODEL_FILE, STABLE_MARKER])


def test_publish_again_rewrites_after_a_cut_short_publish(tmp_path: Path) -> None:
    # A trainer killed between model.json and STABLE left the directory behind.
    step_dir = tmp_path / "step_000002"
    step_dir.mkdir()
    (step_dir / MODEL_FILE).write_text("half")
    assert published_versions(tmp_path) == []
    publish_weights(tmp_path, 2, fsync=False)
    assert published_versions(tmp_path) == [2]
    assert json.loads((step_dir / MODEL_FILE).read_text())["step"] == 2


def test_publish_refuses_v0_and_negative_steps(tmp_path: Path) -> None:
    for step in (0, -1):
        with pytest.raises(ValueError, match="v0 is implicit"):
            publish_weights(tmp_path, step)
    assert list(tmp_path.iterdir()) == []


def test_published_versions_and_latest(tmp_path: Path) -> None:
    weights_dir = tmp_path / "weights"
    assert published_versions(weights_dir) == []
    assert latest_published_version(weights_dir) == 0
    for step in (5, 1, 12):
        publish_weights(weights_dir, step, fsync=False)
    # Not published: no marker, a non-canonical name, a marker that is a directory,
    # a file with a step name, a symlink to a published step.
    (weights_dir / "step_000020").mkdir()
    (weights_dir / "step_000020" / MODEL_FILE).write_text("{}")
    (weights_dir / "step_30").mkdir()
    (weights_dir / "step_30" / STABLE_MARKER).write_text("")
    (weights_dir / "step_000031" / STABLE_MARKER).mkdir(parents=True)
    (weights_dir / "step_000032").write_text("")
    (weights_dir / "step_000040").symlink_to(weights_dir / "step_000012")
    assert published_versions(weights_dir) == [1, 5, 12]
    assert latest_published_version(weights_dir) == 12


def test_published_versions_above_a_version_look_only_at_newer_directories(
    tmp_path: Path,
) -> None:
    weights_dir = tmp_path / "weights"
    for step in (1, 2, 3, 7):
        publish_weights(weights_dir, step, fsync=False)
    assert published_versions(weights_dir, above=2) == [3, 7]
    assert published_versions(weights_dir, above=7) == []
    assert published_versions(weights_dir, above=-1) == published_versions(weights_dir)
