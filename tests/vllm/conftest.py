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

from _vllm_kit import Server, install_writer, tiny_model, update_weights, vllm_server

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


#: The token the shared writer is closed with: `/update_weights` wants it too.
WRITER_KEY = "sk-tiny-writer-91c4"


@pytest.fixture(scope="session")
def writer_process(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One `orchestrator-vllm serve` of the MoE for the stage (a server's start costs
    about 30 s on 2 cores), closed with `--api-key`, writing payloads below its own root;
    runs put their payload roots below it. Use `writer_server`, which loads the base
    model first.

    No prefix cache: a request whose prompt hits it computes the positions after the
    cached blocks by another kernel path, whose sums can flip a near-tie between two
    experts (18 of 4,159 rows at a 4,096-token prompt of the wide model). The same
    request must be computed the same way to be compared by handle and inline."""
    install_writer()
    root = tmp_path_factory.mktemp("shared") / "payloads"
    root.mkdir()
    with vllm_server(
        model,
        tmp_path_factory.mktemp("writer"),
        "--enforce-eager",
        "--no-enable-prefix-caching",
        writer_root=root,
        api_key=WRITER_KEY,
    ) as server:
        yield server


@pytest.fixture
def writer_server(writer_process: Server, model: Path) -> Server:
    """The stage's writer holding the base model, as a freshly started one does (a fresh
    run's version 0): what a test before loaded is replaced first."""
    answer = update_weights(writer_process, model)
    assert answer.status_code == 200, answer.text
    return writer_process
