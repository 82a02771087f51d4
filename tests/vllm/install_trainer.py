"""Install the reference trainer (`orchestrator-trainer`) and what it imports (the clone's
`payload-gc/`, the orchestrator, `trainer/`) into the real-vLLM stage's venv, as a user installs
it beside vLLM, and pytest for its tests:

    python3 tests/vllm/install_trainer.py VENV_PYTHON

Constrained to the venv's own packages (`pip freeze`), so nothing of vLLM's changes;
then the clone's three folders again without dependencies, since pip keeps an installed
version it finds equal and the code changes with the clone. Stdlib only; uv's pip where
uv is (vllm_env.py `installer`).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from vllm_env import installer

ROOT = Path(__file__).resolve().parents[2]
LOCAL = (ROOT / "payload-gc", ROOT, ROOT / "trainer")
TEST_TOOLS = ("pytest", "pytest-trio")


def install(python: str) -> Path:
    """Install into the venv of `python`; the trainer's command."""
    pip = [python, "-m", "pip", "--disable-pip-version-check", "-q"]
    install = installer(Path(python))
    frozen = subprocess.run(
        [*pip, "freeze", "--exclude-editable"], check=True, capture_output=True, text=True
    ).stdout
    pins = [line for line in frozen.splitlines() if "==" in line and " @ " not in line]
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as constraints:
        constraints.write("\n".join(pins) + "\n")
        constraints.flush()
        local = [str(path) for path in LOCAL]
        subprocess.run([*install, "-c", constraints.name, *local, *TEST_TOOLS], check=True)
    again = installer(Path(python), reinstall=True)
    subprocess.run([*again, "--no-deps", *local], check=True)
    return Path(python).parent / "orchestrator-trainer"


if __name__ == "__main__":
    print(install(sys.argv[1]))
