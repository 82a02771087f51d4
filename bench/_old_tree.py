"""Shared by the benchmarks that measure the old code beside the new in one run: a checkout
of an older revision that this checkout's Python runs.

The machines are noisy, so a target such as "3x cheaper" is measured as a ratio between
two runs made minutes apart on one machine. `old_tree(rev)` checks `rev` out (a detached
git worktree kept under the user's cache, reused while the revision is the same) with its
bytecode compiled, and `python_path(tree)` is the PYTHONPATH under which this checkout's
virtual environment imports that tree's packages instead of its own (the editable installs
come from `.pth` files, after PYTHONPATH). The dependencies are this checkout's: a
benchmark of an old revision measures its code, not its lock file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rollout-orchestrator"
#: The source folders of the project's packages, relative to a checkout's root.
PACKAGE_DIRS = (".", "gc", "vllm-writer")


def resolve(rev: str) -> str:
    """`rev`'s full commit id (a clear error where git does not know it)."""
    done = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        sys.exit(f"bench: no commit {rev!r} in {ROOT}")
    return done.stdout.strip()


def old_tree(rev: str) -> Path:
    """A checkout of `rev` with its bytecode compiled."""
    commit = resolve(rev)
    tree = CACHE / "bench-trees" / commit[:12]
    if not (tree / ".git").exists():
        tree.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=True)
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), commit],
            check=True,
        )
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", str(tree)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return tree


def python_path(tree: Path) -> str:
    """The PYTHONPATH that makes this virtual environment import `tree`'s packages."""
    return os.pathsep.join(str(tree / folder) for folder in PACKAGE_DIRS)
