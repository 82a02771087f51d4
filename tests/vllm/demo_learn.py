"""`make demo-learn`: a policy that learns through the loop (tests/vllm/learning_run.py,
configs/learn.toml). Prints the reward of the first and last steps, the eval before and
after; exits 1 when the policy did not learn by the documented margin. Run through
tests/vllm/run.sh, which provides the stage's venv."""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script: the kit, and the demo's config helpers it uses (tests/support).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _vllm_kit import ROOT
from learning_run import learning_run

RUN_DIR = ROOT / "run" / "learn"


def main() -> int:
    curve = learning_run(RUN_DIR, *sys.argv[1:], log=lambda line: print(line, flush=True))
    print("\n".join(curve.lines()))
    print(f"curves: {RUN_DIR / 'report.html'}")
    return 0 if curve.learned else 1


if __name__ == "__main__":
    sys.exit(main())
