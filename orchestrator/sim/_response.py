"""The simulated server's response bodies, in the form of the server family it imitates.

Pure functions from computed arrays to JSON-ready dicts (docs/protocol.md), built on the
encoders of `orchestrator.wire`, so the daemon's tests read exactly what they write:

- **prime-rl** (prime-rl's vLLM extension): the sampled tokens' logprobs packed in
  ``completion_logprobs`` (``logprobs`` null), routing packed with its ``start`` in the
  dtype the reply's ids need (uint8 when every id fits, else uint16: decided per reply),
  the sampling mask in CSR form, or, by handle, ``payload`` segments naming one file per
  choice (routing and mask null then). ``payload_error`` is this project's extension: a
  choice whose file could not be written says why, with ``payload`` null.
- **upstream** (vLLM as released): ``logprobs.content`` entries, routing as a base64
  ``.npy`` in the model's capture dtype, the mask as one list of ids per token. Upstream
  vLLM has no by-handle mode.

Every choice carries every key of its form (null when not captured or not asked for).
Errors take vLLM's `ErrorResponse` shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from orchestrator.wire.arrays import (
    encode_mask_csr,
    encode_mask_lists,
    encode_npy,
    encode_packed,
    routing_dtype_for,
)

from ._model import Completion

__all__ = [
    "TRAVERSAL_FILE_NAME",
    "corrupt_segment",
    "error_body",
    "narrow_routing",
    "primerl_choice",
    "render_response",
    "upstream_choice",
]

# What a `bad_segment` fault appends to the payload directory in `file`: a path that
# escapes it (`<payload_dir>/../../etc/x.bin`).
TRAVERSAL_FILE_NAME = "../../etc/x.bin"


def error_type(status: int) -> str:
    """vLLM's error type for an HTTP status."""
    if status == 404:
        return "NotFoundError"
    if status >= 500:
        return "InternalServerError"
    return "BadRequestError"


def error_body(status: int, message: str) -> dict[str, Any]:
    """vLLM's `ErrorResponse`: `{"error": {"message", "type", "param", "code"}}`."""
    return {
        "error": {
            "message": " ".join(message.split()),
            "type": error_type(status),
            "param": None,
            "code": status,
        }
    }


def narrow_routing(ids: npt.NDArray[np.unsignedinteger]) -> npt.NDArray[np.unsignedinteger]:
    """Routing ids as prime-rl sends them: uint8 when every id of this reply fits."""
    narrowed: npt.NDArray[np.unsignedinteger] = ids.astype(routing_dtype_for(ids), copy=False)
    return narrowed


def primerl_choice(
    index: int,
    completion: Completion,
    *,
    logprobs: bool,
    routing: tuple[npt.NDArray[np.unsignedinteger], int] | None = None,
    mask: npt.NDArray[np.int32] | None = None,
    payload: list[dict[str, Any]] | None = None,
    payload_error: str | None = None,
) -> dict[str, Any]:
    """One choice in prime-rl's form.

    `routing` is (ids already narrowed, first position), inline; `mask` the ``-1`` padded
    mask, inline; `payload` the wire segments by handle (``[]``: by handle, nothing
    captured); `payload_error` why the by-handle file is missing.
    """
    choice: dict[str, Any] = {
        "index": index,
        "token_ids": completion.token_ids.tolist(),
        "finish_reason": completion.finish_reason,
        "logprobs": None,
        "completion_logprobs": (
            encode_packed(completion.logprobs.astype(np.float32)) if logprobs else None
        ),
        "routed_experts": None if routing is None else encode_packed(routing[0], start=routing[1]),
        "sampling_mask": None if mask is None else encode_mask_csr(mask),
        "payload": payload,
    }
    if payload_error is not None:
        choice["payload_error"] = payload_error
    return choice


def _content(completion: Completion) -> list[dict[str, Any]]:
    """vLLM's `logprobs.content`: the sampled token of each step and its logprob."""
    return [
        {"token": f"token_id:{token}", "logprob": logprob, "bytes": None, "top_logprobs": []}
        for token, logprob in zip(
            completion.token_ids.tolist(), completion.logprobs.tolist(), strict=True
        )
    ]


def upstream_choice(
    index: int,
    completion: Completion,
    *,
    logprobs: bool,
    routing: npt.NDArray[np.unsignedinteger] | None = None,
    mask: npt.NDArray[np.int32] | None = None,
) -> dict[str, Any]:
    """One choice in upstream vLLM's form (`routing` in the model's dtype)."""
    return {
        "index": index,
        "token_ids": completion.token_ids.tolist(),
        "finish_reason": completion.finish_reason,
        "logprobs": {"content": _content(completion)} if logprobs else None,
        "routed_experts": None if routing is None else encode_npy(routing),
        "sampling_mask": None if mask is None else encode_mask_lists(mask),
    }


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
) -> dict[str, Any]:
    """The whole response body (vLLM's `GenerateResponse`), with token usage;
    `kv_transfer_params` is a P/D prefill server's announcement of its KV blocks."""
    completion_tokens = sum(len(choice["token_ids"]) for choice in choices)
    return {
        "request_id": request_id,
        "choices": choices,
        "prompt_logprobs": None,
        "kv_transfer_params": kv_transfer_params,
        "usage": {
            "prompt_tokens": prompt_len,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_len + completion_tokens,
        },
    }
