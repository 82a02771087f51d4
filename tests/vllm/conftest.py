"""The real-vLLM stage (`make test-vllm`): upstream vLLM, CPU build, serving a tiny
mixture-of-experts model made here, on loopback (`_vllm_kit.py`).

Without `ORCH_VLLM_PYTHON` these tests are not collected at all (tests/conftest.py), so
`make test` never starts a server.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# The tests run with `--import-mode=importlib`, which puts no test directory on sys.path;
# this one goes there so that the tests can import their shared helpers (`_vllm_kit`).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _vllm_kit import Server, tiny_model, vllm_server

#: The figures the tests measured (routing rows compared, ...), printed once at the end
#: of the session instead of with every passed test's captured output.
FIGURES: list[str] = []


@pytest.fixture
def figure() -> Callable[[str], None]:
    """Record one line of the stage's figures."""
    return FIGURES.append


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("figures")
        for line in FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def model() -> Path:
    """The tiny model, built once (cached beside the venv)."""
    return tiny_model()


@pytest.fixture(scope="session")
def eager_server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One eager, dev-mode server for the tests that do not need flags of their own."""
    with vllm_server(model, tmp_path_factory.mktemp("vllm"), "--enforce-eager") as server:
        yield server
