"""Command lines as the tests run them: in this process through a `main(argv)`, its exit
code and output captured, or as a real `orchestrator` process. On `sys.path` through
pytest's `pythonpath` (pyproject.toml).

A refusal is one contract for every command: exit code 2, nothing on stdout, one line on
stderr, never a traceback; `refused` (in this process) and `process_refused` (a real
process) check all of it, so a test names only its message.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

Main = Callable[[list[str]], int]

# The command line that starts `orchestrator` as a real process, with the interpreter
# running the tests (its environment, not whatever `orchestrator` is first on PATH).
ORCHESTRATOR = (sys.executable, "-m", "orchestrator.cli")


def config_args(config: Path, *overrides: str, positional: bool = False) -> list[str]:
    """`--config CONFIG --set O1 --set O2 ...`: a command's config and its overrides
    (`KEY=VALUE` in TOML) as the commands read them; the config without `--config` for
    the one that takes it `positional`ly (`check-config`)."""
    sets = [arg for override in overrides for arg in ("--set", override)]
    return [*([] if positional else ["--config"]), str(config), *sets]


def run_cli(
    capsys: pytest.CaptureFixture[str], *argv: str, main: Main | None = None
) -> tuple[int, str, str]:
    """`main(argv)` in this process (`orchestrator`'s unless given: imported only then, so
    payload-gc's tests run its own without the orchestrator): its exit code, the
    `SystemExit` of an argparse error too, and what it wrote to stdout and stderr."""
    if main is None:
        from orchestrator.cli import main
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse errors exit from inside main
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    out, err = capsys.readouterr()
    return code, out, err


def refused(
    capsys: pytest.CaptureFixture[str], *argv: str, prefix: str = "", main: Main | None = None
) -> str:
    """`run_cli` expecting a refusal (see the module docstring), its stderr starting with
    `prefix`. Returns that one line."""
    code, out, err = run_cli(capsys, *argv, main=main)
    _assert_refusal(code, out, err, prefix)
    return err


def process_refused(argv: Sequence[str], *, prefix: str = "", timeout: float = 60) -> str:
    """`argv` run as a real process (`[*ORCHESTRATOR, ...]`), expecting a refusal as
    `refused` does. Returns its one stderr line."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    _assert_refusal(done.returncode, done.stdout, done.stderr, prefix)
    return done.stderr


def _assert_refusal(code: int, out: str, err: str, prefix: str) -> None:
    assert code == 2, (code, err[-3000:])
    assert out == "", out[-3000:]
    assert err.count("\n") == 1, err[-3000:]
    assert err.startswith(prefix), err
    assert "Traceback" not in err
