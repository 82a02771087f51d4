"""Fixtures of payload-gc's unit tests: the tests of its private walk (test_tree.py)
start from an open root."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def root_fd(tmp_path: Path) -> Iterator[int]:
    """`tmp_path` opened as a directory, never through a link, closed after."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)
