"""`orchestrator run` checks everything that can fail at start-up before it changes anything:
an unusable directory, a metrics port in use, an unresolvable metrics host are one line on
stderr and exit code 2, and the payload root (which a fresh run wipes) and `progress.json`
are left as they were."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"


def run_orchestrator(
    run_dir: Path, payload_root: Path, *overrides: str
) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "orchestrator.cli",
        "run",
        "--config",
        str(DEMO),
        "--set",
        f'run_dir="{run_dir}"',
        "--set",
        f'payload.root="{payload_root}"',
        "--set",
        "max_steps=1",
        *(arg for override in overrides for arg in ("--set", override)),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def marked_payload_root(tmp_path: Path) -> Path:
    """A payload root the fresh-run wipe would accept (it has the marker), holding a canary."""
    root = tmp_path / "payloads"
    (root / "v3").mkdir(parents=True)
    (root / ".payload-root").write_text("")
    (root / "v3" / "canary.bin").write_bytes(b"still here")
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes() if path.is_file() else b"<dir>"
        for path in sorted(root.rglob("*"))
    }


def assert_refused(result: subprocess.CompletedProcess[str], pattern: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert re.fullmatch(f"orchestrator run: error: {pattern}", lines[0]), lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_run_dir_below_a_regular_file_is_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    # Below a regular file nothing can be created, not even by root (CI runs as root).
    (tmp_path / "not-a-dir").write_text("a file")
    run_dir = tmp_path / "not-a-dir" / "run"
    root = marked_payload_root(tmp_path)
    before = tree(root)

    result = run_orchestrator(run_dir, root)

    assert_refused(
        result,
        re.escape(f"run_dir {run_dir} is not a writable directory: ")
        + re.escape(f"{tmp_path / 'not-a-dir'} is not a directory"),
    )
    assert tree(root) == before


def test_an_unwritable_batches_dir_is_refused_before_the_wipe_and_progress(
    tmp_path: Path,
) -> None:
    (tmp_path / "not-a-dir").write_text("a file")
    run_dir = tmp_path / "run"
    root = marked_payload_root(tmp_path)
    before = tree(root)

    result = run_orchestrator(
        run_dir, root, f'trainer.batches_dir="{tmp_path / "not-a-dir" / "batches"}"'
    )

    assert_refused(result, r"trainer\.batches_dir .+ is not a writable directory: .+")
    assert tree(root) == before
    assert not (run_dir / "orchestrator" / "progress.json").exists()


def test_a_metrics_port_in_use_is_refused_before_the_wipe_and_progress(
    tmp_path: Path, busy_port: int
) -> None:
    run_dir = tmp_path / "run"
    root = marked_payload_root(tmp_path)
    before = tree(root)

    result = run_orchestrator(run_dir, root, f'metrics.listen="127.0.0.1:{busy_port}"')

    assert_refused(
        result,
        re.escape(f'metrics.listen = "127.0.0.1:{busy_port}": cannot listen there: ')
        + "address already in use",
    )
    assert tree(root) == before
    assert not (run_dir / "orchestrator" / "progress.json").exists()
    assert not (run_dir / "batches").exists() or not any((run_dir / "batches").iterdir())


def test_an_unresolvable_metrics_host_is_refused_before_the_wipe_and_progress(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    root = marked_payload_root(tmp_path)
    before = tree(root)

    result = run_orchestrator(run_dir, root, 'metrics.listen="name.invalid:9100"')

    assert_refused(
        result,
        re.escape('metrics.listen = "name.invalid:9100": cannot resolve the host ')
        + "'name.invalid': .+",
    )
    assert tree(root) == before
    assert not (run_dir / "orchestrator" / "progress.json").exists()


def test_the_metrics_listener_bound_up_front_is_the_one_that_serves(tmp_path: Path) -> None:
    # The bound socket is handed over, not bound a second time: the run serves on it.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = run_orchestrator(
        tmp_path / "run",
        tmp_path / "payloads",
        f'metrics.listen="127.0.0.1:{port}"',
        "sim.train_time_s=0.05",
        "trainer.poll_interval_s=0.1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f'"url": "http://127.0.0.1:{port}/metrics"' in result.stderr
    assert "== run summary ==" in result.stderr
