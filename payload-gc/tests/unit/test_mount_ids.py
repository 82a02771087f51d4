"""Mount identities: equal on the root's mount, different across a bind mount of the
same filesystem, links never followed, and the fallbacks agree with each other. These
test payload_gc/_mounts.py itself: its fallbacks (no `statx`, no /proc) have no public face.
What a collection does with them: payload-gc/tests/integration/test_bind_mounts.py.

The bind-mount tests need root (`mount --bind`); they skip with the reason otherwise,
and always unmount in teardown.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import payload_gc._mounts as mounts
import pytest
from payload_gc._mounts import entry_mount_id, fd_mount_id

if TYPE_CHECKING:
    from suite_plugin import BindMount

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@attrs.frozen
class _Tree:
    root: Path
    root_fd: int


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[_Tree]:
    """`root/` holding a plain subdirectory `sub`, a file `f`, and `bindmnt` (a plain
    directory until the `bound` fixture mounts it)."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "bindmnt").mkdir()
    (root / "f").write_bytes(b"x")
    fd = os.open(root, _DIR_FLAGS)
    try:
        yield _Tree(root, fd)
    finally:
        os.close(fd)


@pytest.fixture
def bound(tree: _Tree, tmp_path: Path, bind_mount: BindMount) -> Iterator[Path]:
    """`root/bindmnt` bind-mounted to `outside/` (same filesystem); unmounted after."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary").write_text("outside")
    with bind_mount(outside, tree.root / "bindmnt"):
        yield outside


def _open_id(parent: int, name: str) -> tuple[str, int]:
    fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
    try:
        return fd_mount_id(fd)
    finally:
        os.close(fd)


def test_a_plain_subdirectory_and_a_file_are_on_the_root_mount(tree: _Tree) -> None:
    root_id = fd_mount_id(tree.root_fd)
    assert entry_mount_id(tree.root_fd, "sub") == root_id
    assert entry_mount_id(tree.root_fd, "f") == root_id
    assert _open_id(tree.root_fd, "sub") == root_id


def test_a_vanished_entry_raises(tree: _Tree) -> None:
    with pytest.raises(FileNotFoundError):
        entry_mount_id(tree.root_fd, "nope")


def test_a_bind_mount_of_the_same_filesystem_has_another_id(tree: _Tree, bound: Path) -> None:
    assert (tree.root / "bindmnt" / "canary").read_text() == "outside"
    # st_dev cannot tell: this is the case the mount id is for.
    assert (tree.root / "bindmnt").stat().st_dev == tree.root.stat().st_dev
    root_id = fd_mount_id(tree.root_fd)
    assert root_id[0] == "mnt"
    assert entry_mount_id(tree.root_fd, "bindmnt") != root_id
    # By name and by open descriptor, the same identity.
    assert _open_id(tree.root_fd, "bindmnt") == entry_mount_id(tree.root_fd, "bindmnt")


def test_a_link_to_a_mount_point_is_not_followed(tree: _Tree, bound: Path) -> None:
    (tree.root / "link").symlink_to("bindmnt")
    (tree.root / "link_out").symlink_to(bound)
    root_id = fd_mount_id(tree.root_fd)
    assert entry_mount_id(tree.root_fd, "link") == root_id
    assert entry_mount_id(tree.root_fd, "link_out") == root_id


def test_without_statx_the_proc_fallback_agrees_with_the_root(
    tree: _Tree, bound: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As with a libc that has no statx: both sides must use /proc/self/fdinfo, or a
    # plain subdirectory would look like a mount point (and one would look plain).
    monkeypatch.setattr(mounts, "_statx", None)
    root_id = fd_mount_id(tree.root_fd)
    assert root_id[0] == "mnt"
    assert entry_mount_id(tree.root_fd, "sub") == root_id
    assert entry_mount_id(tree.root_fd, "f") == root_id
    assert entry_mount_id(tree.root_fd, "bindmnt") != root_id
    assert entry_mount_id(tree.root_fd, "bindmnt") == _open_id(tree.root_fd, "bindmnt")


def test_without_any_mount_id_devices_are_compared(
    tree: _Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mounts, "_statx", None)
    monkeypatch.setattr(mounts, "_fdinfo_mount_id", lambda fd: None)
    root_id = fd_mount_id(tree.root_fd)
    assert root_id == ("dev", tree.root.stat().st_dev)
    assert entry_mount_id(tree.root_fd, "sub") == root_id
    assert _open_id(tree.root_fd, "sub") == root_id
