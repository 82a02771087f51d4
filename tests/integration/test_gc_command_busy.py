"""`orchestrator gc` on a run whose payload root holds busy files (deleted while still
open elsewhere): exit status 0, the busy directory said as such; and its dry run, which
measures what it would delete and the kept versions only with `--measure-kept`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from run_kit import write_run_toml

from orchestrator.cli import main
from orchestrator.handoff import Progress, save_progress

NFS = ".nfs000000000123abcd00000001"
APPLIED = 10
M = 2
BOUND = APPLIED - M  # min_fresh_version(applied + 1, m)


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    staleness = f"[staleness]\nmax_off_policy_steps = {M}\nmax_async_steps = 1\n"
    return write_run_toml(tmp_path / "run.toml", tmp_path / "run", staleness)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    save_progress(
        run_dir / "orchestrator",
        Progress(
            step=APPLIED + 1,
            applied_version=APPLIED,
            bound=None,
            inflight_rollouts=0,
            queued_samples=0,
            discards={},
            updated_at=time.time(),
            pid=4242,
        ),
    )
    payloads = run_dir / "payloads"
    payloads.mkdir(parents=True)
    (payloads / ".payload-root").touch()
    for version in range(APPLIED + 2):
        (payloads / f"v{version}").mkdir()
        for i in range(2):
            (payloads / f"v{version}" / f"{i}.bin").write_bytes(b"x" * 50)
    (payloads / "v3" / NFS).write_bytes(b"held open by a reader on another host")
    return payloads


def test_gc_with_busy_files_exits_0_and_names_them(
    config_file: Path, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["gc", "--config", str(config_file), "--dry-run", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["bound"] == BOUND
    v3 = next(d for d in dry["delete"] if d["name"] == "v3")
    assert (v3["files"], v3["bytes"], v3["busy_files"]) == (2, 100, 1)
    # Kept versions are not measured unless asked.
    assert all(k["files"] is None for k in dry["keep"])

    assert main(["gc", "--config", str(config_file)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        f"deleted {BOUND - 1} directories, {2 * BOUND} files, {100 * BOUND} bytes "
        f"from {root} (bound v{BOUND})"
    )
    assert "BUSY: 1 directories left only for busy files:" in out
    assert f"  v3: 1 busy file (v3/{NFS}): " in out
    assert out.splitlines()[-1].endswith("(busy)")
    assert sorted(p.name for p in (root / "v3").iterdir()) == [NFS]
    line = json.loads((root / ".payload-gc" / "audit.jsonl").read_text().splitlines()[-1])
    assert line["outcome"] == "busy"

    # Closed: gone from the directory; the next collection removes v3.
    (root / "v3" / NFS).unlink()
    assert main(["gc", "--config", str(config_file), "--json"]) == 0
    real = json.loads(capsys.readouterr().out)
    assert (real["outcome"], real["busy"]) == ("complete", [])
    assert [d["name"] for d in real["delete"]] == ["v3"]


def test_gc_dry_run_measures_kept_versions_on_request(
    config_file: Path, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["gc", "--config", str(config_file), "--dry-run", "--measure-kept", "--json"]
    assert main(argv) == 0
    dry = json.loads(capsys.readouterr().out)
    kept = {k["name"]: (k["files"], k["bytes"]) for k in dry["keep"]}
    assert kept[f"v{BOUND}"] == (2, 100)
    assert kept[".payload-root"] == (None, None)


def test_measure_kept_without_a_dry_run_is_refused(
    config_file: Path, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["gc", "--config", str(config_file), "--measure-kept"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert "--measure-kept goes with --dry-run" in err
