"""Payload roots built for a test: version directories `v<k>` of small files, as servers
leave them. On `sys.path` through pytest's `pythonpath` (pyproject.toml)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


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
