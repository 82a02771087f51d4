"""Shared by every test: logging configured by one test never leaks into the next, and
the `bind_mount` fixture for the tests of mount points."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import structlog

BindMount = Callable[[Path, Path], AbstractContextManager[None]]


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


@contextmanager
def _bind_mount(source: Path, target: Path) -> Iterator[None]:
    if os.geteuid() != 0:
        pytest.skip("needs root: a bind mount (mount --bind) is set up for this test")
    try:
        done = subprocess.run(
            ["mount", "--bind", str(source), str(target)], capture_output=True, text=True
        )
    except FileNotFoundError:
        pytest.skip("no mount command: cannot set up a bind mount")
    if done.returncode != 0:
        pytest.skip(f"mount --bind failed: {done.stderr.strip() or done.returncode}")
    try:
        yield
    finally:
        if subprocess.run(["umount", str(target)], capture_output=True).returncode != 0:
            # Busy (e.g. a descriptor still open): detach it now, freed when released.
            subprocess.run(["umount", "--lazy", str(target)], check=True)


@pytest.fixture
def bind_mount() -> BindMount:
    """`with bind_mount(source, target):` mounts `source` on `target` for the block (same
    filesystem, so only the mount id tells them apart) and always unmounts after. Skips
    the test with the reason where it cannot: not root, or mounts not allowed (CI runs as
    root)."""
    return _bind_mount
