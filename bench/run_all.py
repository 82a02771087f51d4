"""`make bench`: run every benchmark script in turn; each writes its section of
docs/benchmarks.md. A benchmark that fails is reported and the others still run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Order matters only for reading the output; each script is independent.
SCRIPTS = [
    "gc_vs_rm.py",
    "by_handle_vs_inline.py",
    # System benchmarks (issue 6): the daemon end to end, servers and trainer as processes.
    "system_throughput.py",
    "system_memory.py",
    "system_disk.py",
    # The adaptive in-flight limit against a fixed one on an overloaded fleet (issue 15).
    "system_overload.py",
    # Start-up: check-config and a demo run's first lines, against an older revision.
    "startup_time.py",
    # Real tasks (tokenizer, chat template, rewards in worker processes) against the toy.
    "real_tasks.py",
    # Where a real rollout's cost goes, stage by stage, against an older revision.
    "rollout_profile.py",
    # A verifiers environment against the same task as a dataset env: daemon and env CPU.
    "verifiers_cost.py",
    # Rewards on a local Ray instance against the local worker processes (issue 25).
    "ray_rewards.py",
    # Batches of 256 and 512 rollouts of ~4,500 tokens: lag, memory, batch write and read.
    "system_scale.py",
    # Upstream vLLM (the real-vLLM stage's CPU build) with the by-handle writer, against
    # itself inline (installs that stage's venv once; skipped where it cannot).
    "vllm_by_handle.py",
    # A policy that learns through the loop: curve, trainer step, mismatch, weight loads.
    "learning.py",
    # The pretrained MoE (SmolLM2 upcycled): a bfloat16 server against the float32
    # trainer, routing differences and the mismatch with and without replay (issue 54).
    "real_moe_mismatch.py",
    # Version detection and collection on sshfs over loopback, with and without caches
    # (needs root and /dev/fuse; only the local disk is measured where it cannot mount).
    "system_netmount.py",
    # The longest (builds 2 x 1,000,000 files): last.
    "system_startup.py",
]


def main() -> int:
    failed = []
    for name in SCRIPTS:
        script = HERE / name
        if not script.exists():
            print(f"bench: {name} is not written yet, skipped")
            continue
        print(f"bench: running {name}", flush=True)
        if subprocess.run([sys.executable, str(script)], check=False).returncode != 0:
            failed.append(name)
    if failed:
        print(f"bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
