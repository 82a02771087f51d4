"""The generate API: the request body, and the reply parsed into a `TurnOutput`.

Parsing is pure, so every malformed or hostile reply is testable without a socket: a
reply that cannot be read raises `InferenceFailure("malformed")`; a payload that cannot be
trusted comes back as a poisoned turn (docs/design.md §4).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.core.turns import TurnOutput
from orchestrator.payload import (
    BadSegment,
    PayloadSegment,
    RoutingShape,
    check_segment,
    decode_inline,
)


class InferenceFailure(Exception):
    """A request that did not produce a usable answer.

    `kind` is one of "connect" (the server refused or could not be reached: it is
    probably down), "transport" (a connection broke mid-request, e.g. a reused keep-alive
    connection the server had closed), "timeout", "http_5xx", "http_4xx", "malformed",
    "oversized" (a body longer than the generate client's cap: it was not read, and its
    connection closed). All but "http_4xx" are transient: the same request may succeed
    when tried again.
    """

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail

    @property
    def transient(self) -> bool:
        return self.kind != "http_4xx"


def build_generate_request(
    *,
    request_id: str,
    token_ids: Sequence[int],
    max_tokens: int,
    seed: int,
    payload_dir: Path | None,
    fields: Sequence[str],
) -> dict[str, Any]:
    """The JSON body of a generate request (docs/design.md §4)."""
    sampling: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": 0.95,
        "top_k": 50,
        "seed": seed,
    }
    if payload_dir is not None:
        sampling["extra_args"] = {"payload_dir": str(payload_dir)}
    return {
        "request_id": request_id,
        "token_ids": list(token_ids),
        "sampling_params": sampling,
        "return_routed_experts": "routed_experts" in fields,
        "return_sampling_mask": "sampling_mask" in fields,
    }


def _malformed(detail: str) -> InferenceFailure:
    return InferenceFailure("malformed", detail)


def _int_list(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise _malformed(f"{what} must be a list of integers")
    return tuple(value)


def _float_list(value: object, what: str) -> tuple[float, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value
    ):
        raise _malformed(f"{what} must be a list of finite numbers")
    return tuple(float(v) for v in value)


def parse_generate_response(
    body: bytes,
    *,
    prompt_len: int,
    payload_dir: Path | None,
    fields: Sequence[str],
    routing_shape: RoutingShape | None = None,
) -> TurnOutput:
    """Parse and validate a generate response (pure: no file is touched).

    Malformed JSON or a malformed choice raises `InferenceFailure("malformed")`: the
    request is retried. A bad or missing payload does not raise: the turn comes back
    `poisoned`, so the rollout is counted and dropped, never trained on and never a crash.
    Routing that contradicts `routing_shape` (the model's, when known) is poisoned too.
    """
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _malformed(f"response is not JSON ({exc.__class__.__name__})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list) or not doc["choices"]:
        raise _malformed("response has no choices")
    choice = doc["choices"][0]
    if not isinstance(choice, dict):
        raise _malformed("choice must be an object")
    completion = _int_list(choice.get("token_ids"), "token_ids")
    logprobs = _float_list(choice.get("logprobs"), "logprobs")
    if len(logprobs) != len(completion):
        raise _malformed("logprobs and token_ids differ in length")
    finish_reason = choice.get("finish_reason")
    if not isinstance(finish_reason, str):
        raise _malformed("finish_reason must be a string")
    routing_pos = choice.get("routed_experts_prompt_start", 0)
    if not isinstance(routing_pos, int) or isinstance(routing_pos, bool) or routing_pos < 0:
        raise _malformed("routed_experts_prompt_start must be a non-negative integer")
    if not fields:
        return TurnOutput(completion, logprobs, finish_reason, routing_pos)
    if payload_dir is None:
        arrays, poisoned = _inline_arrays(choice, fields)
        if poisoned is None and routing_shape is not None and "routed_experts" in arrays:
            ids = arrays["routed_experts"][0]
            poisoned = routing_shape.problem(ids.shape[1:], ids.dtype.name) or (
                routing_shape.ids_problem(ids)
            )
        return TurnOutput(
            completion, logprobs, finish_reason, routing_pos, inline=arrays, poisoned=poisoned
        )
    segments, files, poisoned = _segments(choice, payload_dir)
    if poisoned is None:
        poisoned = _check_rows(segments, fields, prompt_len, completion, routing_pos)
    routing = segments.get("routed_experts")
    if poisoned is None and routing_shape is not None and routing is not None:
        poisoned = routing_shape.problem(routing.shape[1:], routing.dtype)
    return TurnOutput(
        completion,
        logprobs,
        finish_reason,
        routing_pos,
        segments=segments,
        files=files,
        poisoned=poisoned,
    )


def _inline_arrays(
    choice: dict[str, Any], fields: Sequence[str]
) -> tuple[dict[str, tuple[np.ndarray, int]], str | None]:
    arrays: dict[str, tuple[np.ndarray, int]] = {}
    try:
        for field in fields:
            arrays[field] = decode_inline(choice.get(field), field=field)
    except BadSegment as exc:
        return {}, f"inline {exc}"
    return arrays, None


def _segments(
    choice: dict[str, Any], payload_dir: Path
) -> tuple[dict[str, PayloadSegment], frozenset[str], str | None]:
    """The choice's segments (each checked), their files' paths, and what is wrong."""
    raw = choice.get("payload")
    error = choice.get("payload_error")
    segments: dict[str, PayloadSegment] = {}
    files: set[str] = set()
    problem: str | None = None
    if error is not None:
        problem = f"payload_error: {str(error)[:200]}"
    if not isinstance(raw, list):
        raw = []
        problem = problem or "no payload segments"
    directory = str(payload_dir)
    for item in raw:
        try:
            segment = PayloadSegment.from_reply(item)
            check_segment(segment)
        except BadSegment as exc:
            problem = problem or f"bad segment: {exc}"
            continue
        # Only names that passed validation are ever deleted by the orchestrator.
        files.add(os.path.join(directory, segment.file))
        if segment.field in segments:
            problem = problem or f"two segments for {segment.field}"
        segments[segment.field] = segment
    return segments, frozenset(files), problem


def _check_rows(
    segments: Mapping[str, PayloadSegment],
    fields: Sequence[str],
    prompt_len: int,
    completion: Sequence[int],
    routing_pos: int,
) -> str | None:
    """Rows must match the turn: routing rows up to the last forwarded token, mask rows per
    completion token, both anchored where docs/design.md §4 says."""
    for field in fields:
        if field not in segments:
            return f"missing segment for {field}"
    total = prompt_len + len(completion)
    routing = segments.get("routed_experts")
    if routing is not None and (
        routing.pos != routing_pos or routing.pos + routing.rows != total - 1
    ):
        return (
            f"routed_experts rows {routing.pos}..{routing.pos + routing.rows} do not end at "
            f"position {total - 2}"
        )
    mask = segments.get("sampling_mask")
    if mask is not None and (mask.pos != prompt_len or mask.rows != len(completion)):
        return f"sampling_mask rows do not match the {len(completion)} completion tokens"
    return None
