"""Payload roots built for a test: version directories `v<k>` of small files, as servers
leave them, and the lock a collector on another host holds. On `sys.path` through
pytest's `pythonpath` (pyproject.toml). Also a directory whose listing is refused."""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest


def make_version(
    root: Path,
    version: int,
    files: int = 3,
    size: int = 10,
    *,
    byte: bytes = b"x",
    names: Sequence[str] | None = None,
) -> Path:
    """`<root>/v<version>` with `files` files `0.bin`, `1.bin`, ... (or `names`), each
    `size` times `byte`. Returns the directory."""
    directory = root / f"v{version}"
    directory.mkdir(parents=True)
    for name in names if names is not None else [f"{i}.bin" for i in range(files)]:
        (directory / name).write_bytes(byte * size)
    return directory


def make_tree(root: Path, versions: int, files: int = 3, size: int = 10) -> None:
    """`v0` .. `v<versions - 1>` in `root`, each as `make_version` makes it."""
    for version in range(versions):
        make_version(root, version, files, size)


def lock_by_another_host(root: Path, host: str = "other-node-17", pid: int = 4242) -> None:
    """`<root>/.payload-gc/lock` as a collector running on `host` writes it (host, pid,
    time, token). A process on another host cannot be checked from here, so no collector
    here takes the lock over: each reports it held (`LockHeld`, exit status 2)."""
    control = root / ".payload-gc"
    control.mkdir(parents=True, exist_ok=True)
    owner = {"host": host, "pid": pid, "time": time.time(), "token": "0123456789abcdef"}
    (control / "lock").write_text(json.dumps(owner))


def refuse_listing(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    """Listing `directory` by descriptor (as payload-gc's walk does) fails with EACCES for
    the rest of the test. Injected: root, which CI runs as, bypasses permissions."""
    real_scandir = os.scandir
    refused_ino = directory.stat().st_ino

    def scandir(path: int | str = ".") -> object:
        if isinstance(path, int) and os.fstat(path).st_ino == refused_ino:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
