"""Small pieces many suites share: a free port, a run's config file as the command tests
write it.

On `sys.path` through pytest's `pythonpath` (pyproject.toml), like the other modules of
`tests/support/`.
"""

from __future__ import annotations

import socket
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_run_toml(path: Path, run_dir: Path, extra: str = "") -> Path:
    """`path`, a run's config file as the command tests write it: its `run_dir`, one
    local server in `[sim]` (the commands that read it start none), then `extra` (TOML
    sections of the test's own). Returns `path`."""
    path.write_text(f'run_dir = "{run_dir}"\n[sim]\ninference_servers = 1\n{extra}')
    return path
