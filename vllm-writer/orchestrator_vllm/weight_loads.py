"""prime-rl's `POST /update_weights {"weight_dir": DIR}` on upstream vLLM: a full Hugging
Face checkpoint loaded into every worker, mixture-of-experts layers included.

1. every worker checks DIR against the checkpoint the model started from, from the
   safetensors headers only (`checkpoints.py`): missing, partial, cut short, or a tensor
   of another name, shape or dtype is a 400 with the reason, and nothing is touched, so
   the server keeps serving its previous weights;
2. generation is paused with `mode="keep"` (requests in flight are frozen where they
   are, and go on under the new weights, as prime-rl's in-flight updates do);
3. every worker loads DIR through the model's own weight loader (`worker.WeightLoader`);
4. the prefix cache is reset (cached prefixes were computed by the old weights), and
   the version (N of `step_N`) recorded as vLLM's weight version;
5. generation resumes, whatever happened before.

Answers 200 `{"status": "ok", "weight_dir", "version", "load_s"}`; 500 with the reason
when a load fails half-way (the weights are then mixed: load a checkpoint again).
"""

from __future__ import annotations

import os
import time
from typing import Any

from orchestrator_vllm.checkpoints import version_of
from orchestrator_vllm.errors import error_body

CHECK_METHOD = "orchestrator_check_weights"
LOAD_METHOD = "orchestrator_load_weights"


async def update_weights(engine: Any, weight_dir: Any) -> tuple[int, dict[str, Any]]:
    """Load `weight_dir` into the engine's workers (module docstring): status and body."""
    if not isinstance(weight_dir, str) or not os.path.isabs(weight_dir):
        return 400, error_body(400, f"weight_dir must be an absolute path, got {weight_dir!r}")
    problems = [p for p in await engine.collective_rpc(CHECK_METHOD, args=(weight_dir,)) if p]
    if problems:
        return 400, error_body(400, f"cannot load {weight_dir}: {problems[0]}")
    version = version_of(weight_dir)
    started = time.perf_counter()
    await engine.pause_generation(mode="keep")
    try:
        await engine.collective_rpc(LOAD_METHOD, args=(weight_dir,))
        await engine.reset_prefix_cache()
        await engine.update_weight_version(version)
    except Exception as exc:  # the engine's own error, whatever it is: the caller's 500
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        return 500, error_body(500, f"loading {weight_dir} failed: {message}")
    finally:
        await engine.resume_generation()
    return 200, {
        "status": "ok",
        "weight_dir": weight_dir,
        "version": version,
        "load_s": round(time.perf_counter() - started, 3),
    }
