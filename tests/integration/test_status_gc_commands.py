"""`orchestrator status` and `orchestrator gc` on a run directory built by hand, through
`orchestrator.cli.main` (and real processes holding the locks)."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_kit import refused, run_cli
from run_kit import write_run_toml
from sample_kit import train_sample

from orchestrator.handoff import (
    Progress,
    publish_batch,
    publish_weights,
    save_progress,
)

VERSIONS = 12  # v0..v11 on disk
APPLIED = 10  # the docs/design.md §3 test vector: m = 2, v10 applied
M = 2


def _version_size(version: int) -> tuple[int, int]:
    """Files and bytes that `_build_run` puts into `v<version>`."""
    files = version % 3 + 1
    return files, files * 100 * (version + 1)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def config_file(tmp_path: Path, run_dir: Path) -> Path:
    staleness = f"[staleness]\nmax_off_policy_steps = {M}\nmax_async_steps = 1\n"
    return write_run_toml(tmp_path / "run.toml", run_dir, staleness)


def _build_run(run_dir: Path, *, applied: int = APPLIED, progress: bool = True) -> Path:
    """A run as the daemon leaves it: batches 1..applied+1 shipped, v1..applied published,
    progress saved, payload dirs v0..v11 with files. Returns the payload root."""
    for step in range(1, applied + 2):
        publish_batch(run_dir / "batches", step, [train_sample()], fsync=False)
    for step in range(1, applied + 1):
        publish_weights(run_dir / "weights", step, fsync=False)
    if progress:
        save_progress(
            run_dir / "orchestrator",
            Progress(
                step=applied + 1,
                applied_version=applied,
                bound=applied - 1 - M,
                inflight_rollouts=3,
                queued_samples=5,
                discards={"stale": 2, "no_signal": 1, "pruned": 0},
                updated_at=time.time() - 30,
                pid=4242,
            ),
        )
    root = run_dir / "payloads"
    root.mkdir(parents=True)
    (root / ".payload-root").touch()
    for version in range(VERSIONS):
        files, size = _version_size(version)
        directory = root / f"v{version}"
        directory.mkdir()
        for i in range(files):
            (directory / f"{i}.bin").write_bytes(b"x" * (size // files))
    return root


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


@contextlib.contextmanager
def _held_by_child(code: str, *args: str) -> Iterator[int]:
    """Run `code` in another Python process that prints `ready` once it holds a lock and
    holds it until its stdin closes; yields its pid."""
    with subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdin is not None
        assert child.stdout is not None
        try:
            assert child.stdout.readline() == "ready\n"
            yield child.pid
        finally:
            child.stdin.close()
            assert child.wait(timeout=30) == 0


# A time for people, as `format_as_of` writes it.
WHEN = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC, \d+ s ago"

_HOLD_DAEMON_LOCK = """
import sys
from pathlib import Path
from orchestrator.handoff import hold_run_lock
with hold_run_lock(Path(sys.argv[1])):
    print("ready", flush=True)
    sys.stdin.read()
"""

_HOLD_COLLECTOR_LOCK = """
import os, sys
from payload_gc._lock import open_control_dir, try_acquire
from payload_gc._tree import open_root
root = sys.argv[1]
root_fd = open_root(root)
lock = try_acquire(open_control_dir(root_fd, root), root)
print("ready", flush=True)
sys.stdin.read()
lock.release()
"""


# -- status -----------------------------------------------------------------------------


def _table_rows(out: str) -> dict[str, list[str]]:
    """The payload table's rows by entry name (the words of each line)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["entry", "files"])
    rows: dict[str, list[str]] = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        words = line.split()
        rows[words[0]] = words[1:]
    return rows


def test_status_text(config_file: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _build_run(run_dir)
    before = _snapshot(root)
    code, out, err = run_cli(capsys, "status", "--config", str(config_file))
    assert (code, err) == (0, "")
    assert _snapshot(root) == before
    lines = out.splitlines()
    assert lines[0] == f"run {run_dir}"
    facts = {
        line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
        for line in lines[1:]
        if line.startswith("  ") and ":" in line
    }
    assert facts["daemon"] == "not running"
    assert facts["last shipped"] == "step 11"
    assert facts["published"] == "v10 (latest weights)"
    assert facts["applied"] == "v10"
    assert facts["last collection"] == "bound v7"
    assert re.fullmatch(
        r"3 rollouts, 5 queued samples \(as of \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC, 3\d s ago\)",
        facts["in flight"],
    )
    assert facts["discards"] == "no_signal 1, stale 2"
    # The next collection follows v11: bound min_fresh_version(12, 2) = 9.
    assert facts["next collection"] == "after v11 is applied: bound v9 (max_off_policy_steps 2)"

    assert f"payload root {root}" in lines
    rows = _table_rows(out)
    for version in range(VERSIONS):
        files, _ = _version_size(version)
        verdict = ["remove"] if version < 9 else ["keep", "(at", "or", "above", "the", "bound)"]
        assert rows[f"v{version}"][0] == str(files)
        assert rows[f"v{version}"][-len(verdict) :] == verdict
    assert rows[".payload-root"][:2] == ["-", "-"]
    total_files = sum(_version_size(v)[0] for v in range(VERSIONS))
    removed_files = sum(_version_size(v)[0] for v in range(9))
    assert lines[-1].startswith(f"total: 12 version directories, {total_files} files, ")
    assert f"; the next collection removes 9 directories, {removed_files} files, " in lines[-1]


def test_status_json_follows_applied_version_and_m(
    config_file: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _build_run(run_dir, applied=6)
    code, out, _ = run_cli(
        capsys, "status", "--config", str(config_file), "--json",
        "--set", "staleness.max_off_policy_steps=3",
    )  # fmt: skip
    assert code == 0
    doc: dict[str, Any] = json.loads(out)
    assert doc["run_dir"] == str(run_dir)
    assert doc["daemon"]["running"] is False
    assert doc["last_shipped_step"] == 7
    assert doc["latest_published_version"] == 6
    assert doc["max_off_policy_steps"] == 3
    assert doc["progress_problem"] is None
    progress = doc["progress"]
    assert progress["applied_version"] == 6
    assert (progress["inflight_rollouts"], progress["queued_samples"]) == (3, 5)
    assert progress["discards"] == {"stale": 2, "no_signal": 1, "pruned": 0}
    assert progress["pid"] == 4242
    assert 29 <= progress["age_s"] < 120
    # After v7: bound min_fresh_version(8, 3) = 4.
    assert doc["next_collection"] == {"after_version": 7, "bound": 4}
    payload = doc["payload_root"]
    assert (payload["exists"], payload["marked"], payload["problem"]) == (True, True, None)
    entries = {e["name"]: e for e in payload["entries"]}
    for version in range(VERSIONS):
        entry = entries[f"v{version}"]
        assert (entry["files"], entry["bytes"]) == _version_size(version)
        assert entry["removed_by_next_collection"] is (version < 4)
        assert entry["reason"] == (None if version < 4 else "at or above the bound")
    assert entries[".payload-root"]["removed_by_next_collection"] is False
    sizes = [_version_size(v) for v in range(VERSIONS)]
    assert payload["totals"] == {
        "dirs": VERSIONS,
        "files": sum(f for f, _ in sizes),
        "bytes": sum(b for _, b in sizes),
    }
    assert payload["next_collection_removes"] == {
        "dirs": 4,
        "files": sum(f for f, _ in sizes[:4]),
        "bytes": sum(b for _, b in sizes[:4]),
    }


def test_status_sees_a_running_daemon(
    config_file: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _build_run(run_dir)
    with _held_by_child(_HOLD_DAEMON_LOCK, str(run_dir / "orchestrator")) as pid:
        code, out, _ = run_cli(capsys, "status", "--config", str(config_file), "--json")
        assert code == 0
        daemon = json.loads(out)["daemon"]
        assert daemon["running"] is True
        assert f"pid={pid}" in daemon["holder"]
        code, out, _ = run_cli(capsys, "status", "--config", str(config_file))
        assert re.search(rf"  daemon:          running \(pid {pid} on \S+, started {WHEN}\)", out)
    code, out, _ = run_cli(capsys, "status", "--config", str(config_file))
    # When it started for people, not the lock file's epoch.
    assert re.search(
        rf"  daemon:          not running \(last: pid {pid} on \S+, started {WHEN}\)", out
    )


def test_status_of_a_run_without_progress_or_payload_root(
    config_file: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir.mkdir()
    code, out, err = run_cli(capsys, "status", "--config", str(config_file))
    assert (code, err) == (0, "")
    assert "  progress:        none: " in out
    assert out.rstrip().endswith(f"payload root {run_dir / 'payloads'} does not exist yet")
    assert "next collection: unknown (no applied version saved)" in out
    code, out, _ = run_cli(capsys, "status", "--config", str(config_file), "--json")
    doc = json.loads(out)
    assert (doc["progress"], doc["progress_problem"], doc["next_collection"]) == (
        None,
        "missing",
        None,
    )
    assert doc["payload_root"]["exists"] is False
    assert doc["payload_root"]["entries"] == []


def test_status_without_progress_still_measures_the_root(
    config_file: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _build_run(run_dir, progress=False)
    code, out, _ = run_cli(capsys, "status", "--config", str(config_file), "--json")
    assert code == 0
    payload = json.loads(out)["payload_root"]
    assert payload["next_collection_removes"] is None
    v3 = next(e for e in payload["entries"] if e["name"] == "v3")
    assert (v3["files"], v3["bytes"], v3["removed_by_next_collection"]) == (
        *_version_size(3),
        None,
    )
    code, out, _ = run_cli(capsys, "status", "--config", str(config_file))
    assert _table_rows(out)["v3"][-1] == "?"


def test_status_of_a_missing_run_is_one_line(
    config_file: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(capsys, "status", "--config", str(config_file))
    assert err == (
        f"orchestrator status: error: run directory {run_dir} does not exist "
        f"(run_dir in {config_file})\n"
    )


def test_status_bad_config_is_one_line(
    config_file: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir.mkdir()
    err = refused(capsys, "status", "--config", str(config_file), "--set", "staleness.max_of=1")
    assert err.startswith("orchestrator status: error: ")
    assert "staleness.max_of" in err


# -- gc ---------------------------------------------------------------------------------


def test_gc_dry_run_lists_exactly_what_gc_then_deletes(
    config_file: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _build_run(run_dir)
    before = _snapshot(root)
    code, out, err = run_cli(capsys, "gc", "--config", str(config_file), "--dry-run", "--json")
    assert (code, err) == (0, "")
    assert _snapshot(root) == before
    assert not (root / ".payload-gc").exists()  # a dry run takes no lock
    dry = json.loads(out)
    # applied v10, m = 2: bound min_fresh_version(11, 2) = 8 (never the next one, 9).
    assert (dry["root"], dry["bound"], dry["dry_run"]) == (str(root), 8, True)
    assert dry["run"]["applied_version"] == APPLIED
    assert [d["name"] for d in dry["delete"]] == [f"v{v}" for v in range(8)]
    assert [k["name"] for k in dry["keep"]] == ["v8", "v9", "v10", "v11", ".payload-root"]

    code, out, err = run_cli(capsys, "gc", "--config", str(config_file), "--json")
    assert (code, err) == (0, "")
    real = json.loads(out)
    assert (real["dry_run"], real["outcome"], real["errors"]) == (False, "complete", [])
    assert real["delete"] == dry["delete"]
    assert real["totals"] == dry["totals"]
    assert real["totals"]["files"] == sum(_version_size(v)[0] for v in range(8))
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [".payload-gc", ".payload-root", "v8", "v9", "v10", "v11"]
    )
    audit = (root / ".payload-gc" / "audit.jsonl").read_text().splitlines()
    assert len(audit) == 1
    assert json.loads(audit[0])["bound"] == 8


def test_gc_human_output(
    config_file: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _build_run(run_dir)
    files = sum(_version_size(v)[0] for v in range(8))
    size = sum(_version_size(v)[1] for v in range(8))
    totals = f"8 directories, {files} files, {size} bytes"

    code, out, _ = run_cli(capsys, "gc", "--config", str(config_file), "--dry-run")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "DRY RUN: nothing was deleted"
    assert lines[1] == f"would delete {totals} from {root} (bound v8)"
    assert lines[2].startswith(
        "bound v8 = min_fresh_version(applied v10 + 1, max_off_policy_steps 2); "
        "applied version saved at "
    )
    assert any(line.split()[:2] == ["v7", "delete"] for line in lines)
    assert any(line.split()[:2] == ["v8", "keep"] for line in lines)
    assert lines[-1] == f"total that would be deleted: {totals}"

    code, out, _ = run_cli(capsys, "gc", "--config", str(config_file))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"deleted {totals} from {root} (bound v8)"
    files_v7, size_v7 = _version_size(7)
    assert any(line.split()[:4] == ["v7", "deleted", str(files_v7), f"{size_v7 / 1024:.1f}"]
               for line in lines)  # fmt: skip
    assert lines[-1].startswith(f"total deleted: {totals} in ")
    assert lines[-1].endswith(" s (complete)")

    # Nothing left below the bound: a second collection deletes nothing.
    code, out, _ = run_cli(capsys, "gc", "--config", str(config_file))
    assert code == 0
    assert out.startswith(f"deleted 0 directories, 0 files, 0 bytes from {root} (bound v8)")


def test_gc_while_another_collector_holds_the_lock(
    config_file: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _build_run(run_dir)
    with _held_by_child(_HOLD_COLLECTOR_LOCK, str(root)) as pid:
        before = _snapshot(root)
        err = refused(capsys, "gc", "--config", str(config_file))
        assert err.startswith(f"orchestrator gc: error: payload root {root} is locked by pid {pid}")
        assert _snapshot(root) == before
        # A dry run takes no lock, so it still works.
        code, _, _ = run_cli(capsys, "gc", "--config", str(config_file), "--dry-run")
        assert code == 0
    code, out, _ = run_cli(capsys, "gc", "--config", str(config_file), "--json")
    assert code == 0
    assert json.loads(out)["totals"]["dirs"] == 8


def test_gc_works_while_the_daemon_holds_its_run_lock(
    config_file: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _build_run(run_dir)
    with _held_by_child(_HOLD_DAEMON_LOCK, str(run_dir / "orchestrator")):
        code, out, _ = run_cli(capsys, "gc", "--config", str(config_file), "--json")
    assert code == 0
    assert json.loads(out)["totals"]["dirs"] == 8


@pytest.mark.parametrize("dry_run", [False, True])
def test_gc_without_progress_refuses(
    config_file: Path, run_dir: Path, capsys: pytest.CaptureFixture[str], dry_run: bool
) -> None:
    root = _build_run(run_dir, progress=False)
    before = _snapshot(root)
    err = refused(capsys, "gc", "--config", str(config_file), *(["--dry-run"] if dry_run else []))
    assert err.startswith("orchestrator gc: error: no applied version is known (")
    assert "progress.json is missing" in err
    assert _snapshot(root) == before


def test_gc_with_unreadable_progress_refuses(
    config_file: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _build_run(run_dir)
    (run_dir / "orchestrator" / "progress.json").write_text("{not json")
    before = _snapshot(root)
    err = refused(capsys, "gc", "--config", str(config_file))
    assert "progress.json is unreadable" in err
    assert _snapshot(root) == before


def test_gc_refusals_are_one_line(
    config_file: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(capsys, "gc", "--config", str(config_file))
    assert err == (
        f"orchestrator gc: error: run directory {run_dir} does not exist "
        f"(run_dir in {config_file})\n"
    )
    root = _build_run(run_dir)
    (root / ".payload-root").unlink()
    (root / "notes.txt").write_text("somebody's files")
    err = refused(capsys, "gc", "--config", str(config_file))
    assert "has no .payload-root marker" in err
    assert "'notes.txt'" in err
    assert (root / "v0").is_dir()
    other = run_dir / "elsewhere"
    err = refused(capsys, "gc", "--config", str(config_file), "--set", f'payload.root="{other}"')
    assert err == f"orchestrator gc: error: payload root {other} does not exist\n"


def test_status_reports_an_unsafe_root_and_lagging_progress(
    config_file: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _build_run(run_dir)
    # A crash between shipping batch 12 and saving progress: the batch dirs are the truth.
    publish_batch(run_dir / "batches", APPLIED + 2, [train_sample()], fsync=False)
    real_root = root.rename(run_dir / "real-payloads")
    root.symlink_to(real_root, target_is_directory=True)
    code, out, err = run_cli(capsys, "status", "--config", str(config_file))
    assert (code, err) == (0, "")
    assert "  last shipped:    step 12 (progress.json says 11)\n" in out
    assert out.rstrip().endswith(
        f"payload root {root} is a symbolic link; refusing (pass the real directory)"
    )
    code, out, _ = run_cli(capsys, "status", "--config", str(config_file), "--json")
    doc = json.loads(out)
    assert doc["last_shipped_step"] == 12
    assert doc["progress"]["step"] == 11
    assert "is a symbolic link" in doc["payload_root"]["problem"]
    assert doc["payload_root"]["entries"] == []


@pytest.mark.parametrize("dry_run", [False, True])
def test_gc_refuses_a_symlinked_payload_root(
    config_file: Path, run_dir: Path, capsys: pytest.CaptureFixture[str], dry_run: bool
) -> None:
    root = _build_run(run_dir)
    real_root = root.rename(run_dir / "real-payloads")
    root.symlink_to(real_root, target_is_directory=True)
    before = _snapshot(real_root)
    err = refused(capsys, "gc", "--config", str(config_file), *(["--dry-run"] if dry_run else []))
    assert err == (
        f"orchestrator gc: error: payload root {root} is a symbolic link; "
        "refusing (pass the real directory)\n"
    )
    assert _snapshot(real_root) == before
