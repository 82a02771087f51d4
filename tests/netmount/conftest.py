"""Fixtures of the shared-filesystem tests: where another host writes a path.

These tests run in every mode. With `ORCH_TEST_NETMOUNT` set, their `tmp_path` is on the
sshfs mount (tests/support/suite_plugin.py) and `server_side` names the server's own
directory behind it, so a test can write as a trainer on another host would: past the
client's caches. Without it both are the same local directory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


def _mount_point_of(path: Path) -> Path | None:
    """The sshfs mount point `path` is under (mount.sh's `<state>/mnt`), or None."""
    for parent in (path, *path.parents):
        if parent.name == "mnt" and (parent.parent / "export").is_dir() and parent.is_mount():
            return parent
    return None


@pytest.fixture
def server_side(tmp_path: Path) -> Callable[[Path], Path]:
    """`server_side(path)`: the server's side of `path`, a path under `tmp_path`: where
    another host's write lands (mount.sh's `<state>/export/...`); on a local disk, the
    path itself."""
    mount_point = _mount_point_of(tmp_path)

    def translate(path: Path) -> Path:
        if mount_point is None:
            return path
        return mount_point.parent / "export" / path.relative_to(mount_point)

    return translate
