"""Fixtures the unit tests share."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from payload_gc._tree import open_root


@pytest.fixture
def root_fd(tmp_path: Path) -> Iterator[int]:
    """`tmp_path` opened as a payload root (payload_gc's no-follow open), closed after."""
    fd = open_root(str(tmp_path))
    try:
        yield fd
    finally:
        os.close(fd)
