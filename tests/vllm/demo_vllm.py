"""`make demo-vllm`: the demo's real tasks against a real upstream vLLM (CPU build) serving
the tiny mixture-of-experts model with `orchestrator-vllm serve`, routing inline, each
checkpoint the local trainer writes loaded through prime-rl's `/update_weights` (vLLM
0.30.0's own reload leaves the experts unloaded). Run through tests/vllm/run.sh,
which provides the stage's venv."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Run as a script: the kit, and the demo's config helpers it uses (tests/support).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _vllm_kit import ROOT, against_vllm, install_writer, tiny_model, vllm_server

RUN_DIR = ROOT / "run" / "demo-vllm"


def main() -> int:
    model = tiny_model()
    subprocess.run(["rm", "-rf", str(RUN_DIR)], check=True)
    writer_root = RUN_DIR / "server-payloads"
    writer_root.mkdir(parents=True)
    install_writer()
    print(f"starting orchestrator-vllm on {model} (about 30 s) ...", flush=True)
    with vllm_server(model, RUN_DIR / "vllm", "--enforce-eager", writer_root=writer_root) as server:
        print(f"vLLM ready at {server.url}; its log: {server.log}", flush=True)
        overrides = against_vllm(RUN_DIR, server, model, "max_steps=10")
        command = [sys.executable, "-m", "orchestrator.cli", "run", "--config", "configs/demo.toml"]
        for override in overrides:
            command += ["--set", override]
        return subprocess.run(command, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
