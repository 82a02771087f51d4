"""Fixtures of the fault tests, and the `--kills` option of the crash-and-resume harness.

`pytest tests/fault --kills 100` kills the daemon 100 times instead of the default 20.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The tests run with `--import-mode=importlib`, which puts no test directory on sys.path;
# this one goes there so that the tests can import their shared helpers (`_fault_kit`).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _fault_kit import Children

DEFAULT_KILLS = 20


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kills",
        type=int,
        default=DEFAULT_KILLS,
        help=f"SIGKILLs of the daemon in the crash-and-resume test (default {DEFAULT_KILLS})",
    )


@pytest.fixture
def kills(request: pytest.FixtureRequest) -> int:
    """How many times the crash harness kills the daemon (`--kills`, at least 1)."""
    count: int = request.config.getoption("--kills")
    if count < 1:
        raise pytest.UsageError(f"--kills must be at least 1, got {count}")
    return count


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Children]:
    """A `Children` registry whose processes are all killed when the test ends, pass or fail."""
    registry = Children(tmp_path / "logs")
    try:
        yield registry
    finally:
        registry.kill_all()
