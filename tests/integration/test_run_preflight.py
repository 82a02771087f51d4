"""`orchestrator run` checks everything that can fail at start-up before it changes anything:
an unusable directory, a metrics port in use, an unresolvable metrics host are one line on
stderr and exit code 2, and the payload root (which a fresh run wipes) and `progress.json`
are left as they were."""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_kit import ORCHESTRATOR, config_args, process_refused

DEMO = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"


def run_command(run_dir: Path, payload_root: Path, *overrides: str) -> list[str]:
    sets = (f'run_dir="{run_dir}"', f'payload.root="{payload_root}"', "max_steps=1")
    return [*ORCHESTRATOR, "run", *config_args(DEMO, *sets, *overrides)]


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


def assert_refused(command: list[str], pattern: str) -> None:
    """`command` refuses in one line, `orchestrator run: error: ` and `pattern`."""
    line = process_refused(command)
    assert re.fullmatch(f"orchestrator run: error: {pattern}\n", line), line


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

    assert_refused(
        run_command(run_dir, root),
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

    batches_dir = tmp_path / "not-a-dir" / "batches"
    command = run_command(run_dir, root, f'trainer.batches_dir="{batches_dir}"')

    assert_refused(command, r"trainer\.batches_dir .+ is not a writable directory: .+")
    assert tree(root) == before
    assert not (run_dir / "orchestrator" / "progress.json").exists()


def test_a_metrics_port_in_use_is_refused_before_the_wipe_and_progress(
    tmp_path: Path, busy_port: int
) -> None:
    run_dir = tmp_path / "run"
    root = marked_payload_root(tmp_path)
    before = tree(root)

    assert_refused(
        run_command(run_dir, root, f'metrics.listen="127.0.0.1:{busy_port}"'),
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

    assert_refused(
        run_command(run_dir, root, 'metrics.listen="name.invalid:9100"'),
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
    command = run_command(
        tmp_path / "run",
        tmp_path / "payloads",
        f'metrics.listen="127.0.0.1:{port}"',
        "sim.train_time_s=0.05",
        "trainer.poll_interval_s=0.1",
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f'"url": "http://127.0.0.1:{port}/metrics"' in result.stderr
    assert "== run summary ==" in result.stderr
