"""The network-mount scripts refuse what they must, and the test mode really puts the
suites' `tmp_path` on sshfs (tests/support/suite_plugin.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

MOUNT = Path(__file__).resolve().parent / "mount.sh"
UMOUNT = Path(__file__).resolve().parent / "umount.sh"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("args", [(), ("fast",), ("",)])
def test_mount_names_its_modes(args: tuple[str, ...]) -> None:
    done = run(str(MOUNT), *args)
    assert done.returncode == 64
    assert done.stderr.strip() == f"usage: {MOUNT} cache|nocache"
    assert done.stdout == ""


def test_umount_touches_only_what_mount_made(tmp_path: Path) -> None:
    # Anywhere else: refused, and nothing is removed.
    (tmp_path / "mnt").mkdir()
    (tmp_path / "keep").write_text("x")
    done = run(str(UMOUNT), str(tmp_path / "mnt"))
    assert done.returncode == 64
    assert "is not a mount point made by mount.sh" in done.stderr
    # Named like mount.sh's directory, but not one of them.
    state = Path(tempfile.mkdtemp(prefix="orch-netmount.", dir="/tmp"))
    try:
        (state / "mnt").mkdir()
        done = run(str(UMOUNT), str(state / "mnt"))
        assert done.returncode == 64
        assert "holds no sshd_config" in done.stderr
        assert (state / "mnt").is_dir()
    finally:
        shutil.rmtree(state)
    assert (tmp_path / "keep").read_text() == "x"
    assert run(str(UMOUNT)).returncode == 64


def _filesystem_type(path: Path) -> str:
    """The type of the filesystem `path` is on, from /proc/self/mountinfo."""
    best, fstype = "", ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        mount_point = fields[4].replace("\\040", " ")
        after = fields[fields.index("-") + 1]
        inside = str(path) == mount_point or str(path).startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, fstype = mount_point, after
    return fstype


def test_the_mode_puts_tmp_path_on_sshfs(tmp_path: Path) -> None:
    fstype = _filesystem_type(tmp_path.resolve())
    if not os.environ.get("ORCH_TEST_NETMOUNT"):
        assert fstype != "fuse.sshfs"
    else:
        assert fstype == "fuse.sshfs"
