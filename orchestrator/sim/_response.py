"""The simulated server's reply envelope, the same in every reply form: vLLM's
`GenerateResponse` around the choices, vLLM's `ErrorResponse` (`orchestrator.wire.errors`),
and the `bad_segment` fault on a wire segment.

Pure functions to JSON-ready dicts (docs/protocol.md). The choices themselves are the
reply form's (`orchestrator.sim.reply_forms`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

__all__ = [
    "TRAVERSAL_FILE_NAME",
    "corrupt_segment",
    "render_response",
]

# What a `bad_segment` fault appends to the payload directory in `file`: a path that
# escapes it (`<payload_dir>/../../etc/x.bin`).
TRAVERSAL_FILE_NAME = "../../etc/x.bin"


def corrupt_segment(
    segment: dict[str, Any], payload_dir: Path, file_size: int, variant: float
) -> dict[str, Any]:
    """A `bad_segment` fault on a wire segment: a file outside `payload_dir`
    (`variant < 0.5`) or an offset past the end of the file, where no byte of it lies."""
    if variant < 0.5:
        return {**segment, "file": f"{payload_dir}/{TRAVERSAL_FILE_NAME}"}
    return {**segment, "offset": file_size + 1}


def render_response(
    request_id: str,
    choices: list[dict[str, Any]],
    prompt_len: int,
    *,
    kv_transfer_params: dict[str, Any] | None = None,
    model: str = "",
) -> dict[str, Any]:
    """The whole response body (vLLM's `GenerateResponse`, key for key as vLLM 0.30.0
    answers: tests/conformance/golden/vllm_0_30_0_generate.json), with token usage; the
    request id prefixed as vLLM prefixes it; `kv_transfer_params` is a P/D prefill server's
    announcement of its KV blocks; `model` the served model name."""
    completion_tokens = sum(len(choice["token_ids"]) for choice in choices)
    return {
        "request_id": f"generate-tokens-{request_id}",
        "model": model,
        "created": int(time.time()),
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_len,
            "total_tokens": prompt_len + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "mm_placeholders": None,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
    }
