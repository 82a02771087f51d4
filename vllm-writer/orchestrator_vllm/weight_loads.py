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

The endpoint changes the model and its refusals name paths, so on a server started with
`--api-key` (or `VLLM_API_KEY`) it wants the same bearer token as the generate endpoint
(`authorized`): vLLM's own check guards only `/v1`, `/v2`, `/inference` and `/cohere`,
and runs inside this middleware. Without the token: vLLM's 401 `{"error":
"Unauthorized"}`, before anything is read from disk.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from collections.abc import Iterable
from typing import Any

from orchestrator_vllm.checkpoints import version_of
from orchestrator_vllm.errors import error_body

CHECK_METHOD = "orchestrator_check_weights"
LOAD_METHOD = "orchestrator_load_weights"
#: vLLM's answer to a request without the bearer token its `--api-key` wants.
UNAUTHORIZED = {"error": "Unauthorized"}


def api_tokens(app: Any) -> list[str]:
    """The bearer tokens vLLM's own authentication middleware was registered with on
    `app` (its `--api-key`, or `VLLM_API_KEY`); [] for an open server."""
    for middleware in getattr(app, "user_middleware", ()):
        if getattr(middleware.cls, "__name__", "") == "AuthenticationMiddleware":
            return list(middleware.kwargs.get("tokens") or ())
    return []


def authorized(headers: Iterable[tuple[bytes, bytes]], tokens: list[str]) -> bool:
    """Whether a request with `headers` (ASGI's) carries one of `tokens` as
    `Authorization: Bearer`, compared in constant time as vLLM compares it; True when
    there are no tokens."""
    if not tokens:
        return True
    value = dict(headers).get(b"authorization", b"").decode("latin-1")
    scheme, _, token = value.partition(" ")
    digest = hashlib.sha256(token.encode()).digest()
    matches = [secrets.compare_digest(digest, hashlib.sha256(t.encode()).digest()) for t in tokens]
    return scheme.lower() == "bearer" and any(matches)


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
