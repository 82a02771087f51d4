"""The payload-gc command, in-process through main(argv) and once as a real process."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_kit import refused, run_cli
from payload_gc import init_root
from payload_gc.cli import main
from payload_trees import lock_by_another_host, make_version


def _make_tree(root: Path, versions: int = 6, files: int = 3) -> None:
    # Sizes that differ by version: a wrong version's bytes would show.
    for version in range(versions):
        make_version(root, version, files, size=10 * (version + 1), byte=b"\x00")


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_cli(capsys, *argv, main=main)


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    return refused(capsys, *argv, prefix="payload-gc: error: ", main=main)


def test_dry_run_deletes_nothing_and_lists_what_the_real_run_deletes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _make_tree(tmp_path)
    before = _snapshot(tmp_path)
    root = str(tmp_path)
    code, out, _ = _run(capsys, "--root", root, "--step", "5", "--max-off-policy-steps", "2",
                        "--dry-run", "--json")  # fmt: skip
    assert code == 0
    assert _snapshot(tmp_path) == before
    assert not (tmp_path / ".payload-gc").exists()  # a dry run takes no lock
    dry = json.loads(out)
    assert (dry["root"], dry["bound"], dry["dry_run"]) == (root, 3, True)

    code, out, _ = _run(capsys, "--root", root, "--below", "3", "--json")
    assert code == 0
    real = json.loads(out)
    assert real["dry_run"] is False
    assert real["outcome"] == "complete"
    assert real["delete"] == dry["delete"]
    assert real["totals"] == dry["totals"] == {"dirs": 3, "files": 9, "bytes": 180}
    assert [d["name"] for d in real["delete"]] == ["v0", "v1", "v2"]
    assert {k["name"]: k["reason"] for k in dry["keep"]} == {
        "v3": "at or above the bound",
        "v4": "at or above the bound",
        "v5": "at or above the bound",
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == [".payload-gc", "v3", "v4", "v5"]


def test_human_output_first_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _make_tree(tmp_path, versions=3, files=2)
    code, out, _ = _run(capsys, "--root", str(tmp_path), "--below", "2", "--dry-run")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "DRY RUN: nothing was deleted"
    assert lines[1] == f"would delete 2 directories, 4 files, 60 bytes from {tmp_path} (bound v2)"
    assert any(line.split()[:2] == ["v2", "keep"] for line in lines)
    assert lines[-1] == "total that would be deleted: 2 directories, 4 files, 60 bytes"

    code, out, _ = _run(capsys, "--root", str(tmp_path), "--below", "2", "--workers", "1")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"deleted 2 directories, 4 files, 60 bytes from {tmp_path} (bound v2)"
    assert any(line.split()[:4] == ["v1", "deleted", "2", "40"] for line in lines)
    assert lines[-1].startswith("total deleted: 2 directories, 4 files, 60 bytes in ")
    assert lines[-1].endswith("s (complete)")


def test_refuses_an_unmarked_root_holding_other_things(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _make_tree(tmp_path, versions=2)
    (tmp_path / ".bashrc").write_text("a home directory, perhaps")
    before = _snapshot(tmp_path)
    err = _refused(capsys, "--root", str(tmp_path), "--below", "5")
    assert "no .payload-root marker" in err
    assert "--init" in err
    assert _snapshot(tmp_path) == before
    # --init marks it, then the same command collects.
    code, out, _ = _run(capsys, "--root", str(tmp_path), "--below", "5", "--init")
    assert code == 0
    assert out.startswith("deleted 2 directories")
    assert (tmp_path / ".payload-root").is_file()
    assert (tmp_path / ".bashrc").exists()


def test_non_canonical_version_names_are_kept_and_said_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _make_tree(tmp_path, versions=2)
    (tmp_path / "v010").mkdir()
    (tmp_path / "v00").mkdir()
    # Not version directories: without a marker, the root is suspicious.
    err = _refused(capsys, "--root", str(tmp_path), "--below", "20")
    assert "no .payload-root marker" in err
    assert "'v00'" in err
    init_root(tmp_path)
    code, out, _ = _run(capsys, "--root", str(tmp_path), "--below", "20", "--dry-run")
    assert code == 0
    reason = "not a canonical version name (v<k> without leading zeros)"
    for name in ("v00", "v010"):
        [row] = [
            line.split(maxsplit=4) for line in out.splitlines() if line.startswith(f"  {name} ")
        ]
        assert row[1] == "keep"
        assert row[4] == reason
    code, out, _ = _run(capsys, "--root", str(tmp_path), "--below", "20")
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("v")) == ["v00", "v010"]


def test_init_alone_marks_and_exits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "new"
    code, out, _ = _run(capsys, "--root", str(root), "--init")
    assert code == 0
    assert out == f"marked {root} as a payload root (.payload-root)\n"
    assert sorted(p.name for p in root.iterdir()) == [".payload-root"]
    code, out, _ = _run(capsys, "--root", str(root), "--init", "--json")
    assert (code, json.loads(out)) == (0, {"root": str(root), "marked": True})


def test_only_version_dirs_or_empty_needs_no_marker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "--root", str(tmp_path), "--below", "5", "--json")
    assert code == 0
    assert json.loads(out)["totals"] == {"dirs": 0, "files": 0, "bytes": 0}


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--below", "3"],
        ["--root", "{root}"],
        ["--root", "{root}", "--below", "x"],
        ["--root", "{root}", "--below", "3", "--step", "4"],
        ["--root", "{root}", "--step", "4"],
        ["--root", "{root}", "--max-off-policy-steps", "2"],
        ["--root", "{root}", "--step", "4", "--max-off-policy-steps", "-1"],
        ["--root", "{root}", "--below", "3", "--workers", "0"],
        ["--root", "{root}", "--below", "3", "--bogus"],
        ["--root", "{root}/missing", "--below", "3"],
        ["--root", "{root}/file", "--below", "3"],
        ["--root", "{root}/link", "--below", "3"],
        ["--root", "/", "--init"],
        ["--root", "{root}/link", "--init"],
    ],
)
def test_every_refusal_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    (tmp_path / "v0").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "v0", target_is_directory=True)
    _refused(capsys, *(arg.replace("{root}", str(tmp_path)) for arg in argv))
    assert (tmp_path / "v0").is_dir()


def test_held_lock_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "v0").mkdir()
    lock_by_another_host(tmp_path)
    err = _refused(capsys, "--root", str(tmp_path), "--below", "3")
    assert "is locked by pid" in err
    assert (tmp_path / "v0").is_dir()


def test_partial_collection_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _make_tree(tmp_path, versions=2)
    v1 = (tmp_path / "v1").stat().st_ino
    real_unlink = os.unlink

    def unlink(path: str, *, dir_fd: int | None = None) -> None:
        # Tests run as root too, where chmod cannot provoke EACCES: inject it instead.
        if path == "0.bin" and dir_fd is not None and os.fstat(dir_fd).st_ino == v1:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", unlink)
    code, out, _ = _run(capsys, "--root", str(tmp_path), "--below", "2")
    assert code == 1
    assert "PARTIAL: 1 entries could not be deleted entirely:" in out
    assert "  v1: v1/0.bin: Permission denied" in out
    assert out.splitlines()[-1].endswith("(partial)")


def test_real_process(tmp_path: Path) -> None:
    _make_tree(tmp_path, versions=4, files=2)
    init_root(tmp_path)
    command = [sys.executable, "-m", "payload_gc", "--root", str(tmp_path), "--below", "2"]
    dry = subprocess.run([*command, "--dry-run", "--json"], capture_output=True, text=True)
    assert (dry.returncode, dry.stderr) == (0, "")
    assert json.loads(dry.stdout)["totals"]["dirs"] == 2
    real = subprocess.run(command, capture_output=True, text=True)
    assert (real.returncode, real.stderr) == (0, "")
    assert real.stdout.startswith(f"deleted 2 directories, 4 files, 60 bytes from {tmp_path}")
    bad = subprocess.run([*command[:3], "--root", str(tmp_path / "nope"), "--below", "1"],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr == f"payload-gc: error: payload root {tmp_path / 'nope'} does not exist\n"
