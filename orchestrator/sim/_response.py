"""The simulated server's response bodies: choices in the by-handle or the inline form.

Pure functions from computed arrays to JSON-ready dicts (docs/design.md §4, docs/protocol.md).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from orchestrator.payload import PayloadSegment, encode_inline

from ._model import Generation

__all__ = ["corrupt_segment", "payload_arrays", "render_choice", "render_response"]

# What a `bad_segment` fault puts in `file`: a path that escapes the payload directory.
TRAVERSAL_FILE_NAME = "../../etc/x.bin"


def payload_arrays(
    generation: Generation,
    prompt_len: int,
    *,
    routed_experts: bool,
    sampling_mask: bool,
) -> dict[str, tuple[npt.NDArray[np.generic], int]]:
    """The requested payload fields of one choice: field -> (array, first position).

    Routing rows start at the server's `routing_start`; mask rows at `prompt_len`. The
    order is the order of the fields in the payload file.
    """
    arrays: dict[str, tuple[npt.NDArray[np.generic], int]] = {}
    if routed_experts:
        arrays["routed_experts"] = (generation.routed_experts, generation.routing_start)
    if sampling_mask:
        arrays["sampling_mask"] = (generation.completion.sampling_mask, prompt_len)
    return arrays


def render_choice(
    index: int,
    generation: Generation,
    prompt_len: int,
    payload: dict[str, Any],
) -> dict[str, Any]:
    """One choice: the completion, the positions it starts at, and `payload`'s keys.

    `payload` is `{"payload": [segments]}` (by handle), `{"payload_error": "..."}`, the
    inline fields (`{"routed_experts": {...}, "sampling_mask": {...}}`), or empty.
    """
    completion = generation.completion
    return {
        "index": index,
        "token_ids": completion.token_ids.tolist(),
        "logprobs": completion.logprobs.tolist(),
        "finish_reason": completion.finish_reason,
        "routed_experts_prompt_start": generation.routing_start,
        "prompt_len": prompt_len,
        **payload,
    }


def inline_payload(
    arrays: dict[str, tuple[npt.NDArray[np.generic], int]],
) -> dict[str, Any]:
    """The inline form of a choice's payload: each field's bytes in base64."""
    return {field: encode_inline(array, pos) for field, (array, pos) in arrays.items()}


def segments_payload(segments: list[PayloadSegment]) -> dict[str, Any]:
    """The by-handle form of a choice's payload: its segments."""
    return {"payload": [segment.to_json() for segment in segments]}


def corrupt_segment(segment: PayloadSegment, file_size: int, variant: float) -> PayloadSegment:
    """A `bad_segment` fault: a traversal file name (`variant < 0.5`) or an offset at the
    end of the file, so the segment's bytes lie past it."""
    if variant < 0.5:
        return attrs.evolve(segment, file=TRAVERSAL_FILE_NAME)
    return attrs.evolve(segment, offset=file_size)


def render_response(
    request_id: str, choices: list[dict[str, Any]], prompt_len: int
) -> dict[str, Any]:
    """The whole response body, with vLLM-style token usage."""
    completion_tokens = sum(len(choice["token_ids"]) for choice in choices)
    return {
        "request_id": request_id,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_len,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_len + completion_tokens,
        },
    }
