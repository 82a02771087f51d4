"""The generate API: the request body, and the reply parsed into a `TurnOutput`.

One dialect, the real one (docs/protocol.md): vLLM's tokens-in/tokens-out
`GenerateRequest`, answered as upstream vLLM answers it or as prime-rl's extension does
(packed arrays inline, or segments by handle). Parsing is pure, so every malformed or
hostile reply is testable without a socket: a reply that cannot be read raises
`InferenceFailure("malformed")`; a payload that cannot be trusted comes back as a poisoned
turn (docs/design.md §4).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.core.turns import TurnOutput
from orchestrator.payload import BadSegment, PayloadSegment, RoutingShape, is_json_int
from orchestrator.wire.arrays import (
    ROUTING_DTYPES,
    WireFormatError,
    decode_mask_csr,
    decode_mask_lists,
    decode_npy,
    decode_packed,
)
from orchestrator.wire.segments import segment_from_wire

#: The top-level keys vLLM's `GenerateRequest` defines that this client may send.
REQUEST_KEYS = frozenset({"request_id", "model", "token_ids", "sampling_params"})
#: The `SamplingParams` keys this client sends (`extra_args.payload_dir` by handle).
SAMPLING_KEYS = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "logprobs",
        "routed_experts_prompt_start",
        "extra_args",
    }
)


class InferenceFailure(Exception):
    """A request that did not produce a usable answer.

    `kind` is one of "connect" (the server refused or could not be reached: it is
    probably down), "transport" (a connection broke mid-request, e.g. a reused keep-alive
    connection the server had closed), "timeout", "http_5xx", "http_4xx", "malformed"
    (a reply that cannot be read: asking the same server again would get the same),
    "oversized" (a body longer than the generate client's cap: it was not read, and its
    connection closed). "connect", "transport", "timeout" and "http_5xx" are transient:
    the same request may succeed when tried again.
    """

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail

    @property
    def transient(self) -> bool:
        return self.kind in {"connect", "transport", "timeout", "http_5xx"}


def build_generate_request(
    *,
    request_id: str,
    token_ids: Sequence[int],
    max_tokens: int,
    seed: int,
    payload_dir: Path | None,
    routing_start: int | None,
    model: str = "",
) -> dict[str, Any]:
    """The JSON body of a generate request: only keys vLLM's `GenerateRequest` defines.

    `routing_start` (sent only when the daemon wants routing) asks for routing rows from
    that position on: the daemon holds the earlier ones from the rollout's previous turns.
    Whether a server captures routing and masks at all is its own setting, not a request
    field; `payload_dir` asks prime-rl's extension to write them by handle.
    """
    sampling: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": 0.95,
        "top_k": 50,
        "seed": seed,
        # The sampled token's logprob (vLLM returns it with the top-1).
        "logprobs": 1,
    }
    if routing_start is not None:
        sampling["routed_experts_prompt_start"] = routing_start
    if payload_dir is not None:
        sampling["extra_args"] = {"payload_dir": str(payload_dir)}
    body: dict[str, Any] = {"request_id": request_id}
    if model:
        body["model"] = model
    body["token_ids"] = list(token_ids)
    body["sampling_params"] = sampling
    return body


def _malformed(detail: str) -> InferenceFailure:
    return InferenceFailure("malformed", detail)


def _token_ids(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise _malformed("token_ids must be a list of non-negative integers")
    return tuple(value)


def _logprobs(choice: Mapping[str, Any], tokens: int) -> tuple[float, ...]:
    """The sampled tokens' logprobs: prime-rl's packed ``completion_logprobs``, else
    upstream's ``logprobs.content[i].logprob``."""
    packed = choice.get("completion_logprobs")
    if packed is not None:
        try:
            values = decode_packed(packed, "completion_logprobs", dtypes=("float32",), ndim=1)
        except WireFormatError as exc:
            raise _malformed(str(exc)) from None
        if not np.isfinite(values).all():
            raise _malformed("completion_logprobs holds a value that is not finite")
        result: tuple[float, ...] = tuple(values.tolist())
    else:
        logprobs = choice.get("logprobs")
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        if not isinstance(content, list):
            raise _malformed(
                "no logprobs: neither completion_logprobs nor logprobs.content "
                "(does the request's sampling_params.logprobs reach the server?)"
            )
        result = tuple(_content_logprob(item) for item in content)
    if len(result) != tokens:
        raise _malformed(f"{len(result)} logprobs for {tokens} completion tokens")
    return result


def _content_logprob(item: object) -> float:
    value = item.get("logprob") if isinstance(item, dict) else None
    # JSON has no infinities; Python's parser would accept the literal -Infinity.
    if not isinstance(value, int | float) or isinstance(value, bool) or not np.isfinite(value):
        raise _malformed("logprobs.content[].logprob must be a finite number")
    return float(value)


def parse_generate_response(
    body: bytes,
    *,
    prompt_len: int,
    routing_start: int,
    payload_dir: Path | None,
    fields: Sequence[str],
    routing_shape: RoutingShape | None = None,
) -> TurnOutput:
    """Parse and validate a generate response (pure: no file is touched).

    `routing_start` is what the request asked for; `fields` are the payload fields the
    run trains with. Malformed JSON or a malformed choice raises
    `InferenceFailure("malformed")`. A bad or missing payload does not raise: the turn
    comes back `poisoned`, so the rollout is counted and dropped, never trained on and
    never a crash. Routing that contradicts `routing_shape` (the model's, when known) is
    poisoned too.
    """
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise _malformed(f"response is not JSON ({exc.__class__.__name__})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list) or not doc["choices"]:
        raise _malformed("response has no choices")
    choice = doc["choices"][0]
    if not isinstance(choice, dict):
        raise _malformed("choice must be an object")
    completion = _token_ids(choice.get("token_ids"))
    logprobs = _logprobs(choice, len(completion))
    finish_reason = choice.get("finish_reason")
    if not isinstance(finish_reason, str):
        raise _malformed("finish_reason must be a string")
    turn = TurnOutput(completion, logprobs, finish_reason)
    if not fields:
        return turn
    rows = _Rows(prompt_len, len(completion), routing_start)
    if payload_dir is None:
        return _inline_turn(turn, choice, fields, rows, routing_shape)
    return _by_handle_turn(turn, choice, fields, rows, payload_dir, routing_shape)


class _Rows:
    """Where a turn's payload rows must lie: routing from at most the requested start to
    the last token run forward (every token but the last sampled one); masks over the
    completion tokens."""

    def __init__(self, prompt_len: int, completion_len: int, routing_start: int) -> None:
        self.prompt_len = prompt_len
        self.completion_len = completion_len
        self.routing_start = routing_start
        self.routing_end = prompt_len + completion_len - 1

    def routing_problem(self, pos: int, rows: int) -> str | None:
        if pos < 0 or pos + rows != self.routing_end or pos > self.routing_start:
            return (
                f"routed_experts rows {pos}..{pos + rows} do not span positions "
                f"{self.routing_start}..{self.routing_end} (requested start to the last "
                "token run forward)"
            )
        return None

    def mask_problem(self, pos: int, rows: int) -> str | None:
        if pos != self.prompt_len or rows != self.completion_len:
            return (
                f"sampling_mask rows {pos}..{pos + rows} are not the "
                f"{self.completion_len} completion tokens from {self.prompt_len}"
            )
        return None


_NO_ROUTING = (
    "the reply carries no routed_experts: is routing capture on in the server "
    "(vLLM's enable_return_routed_experts)?"
)


def _inline_turn(
    turn: TurnOutput,
    choice: Mapping[str, Any],
    fields: Sequence[str],
    rows: _Rows,
    routing_shape: RoutingShape | None,
) -> TurnOutput:
    arrays: dict[str, tuple[np.ndarray, int]] = {}
    try:
        if "routed_experts" in fields:
            value = choice.get("routed_experts")
            if value is None:
                by_handle = bool(choice.get("payload"))
                return _poisoned(
                    turn,
                    "the reply is by handle, but the request was inline"
                    if by_handle
                    else _NO_ROUTING,
                )
            ids, pos = _inline_routing(value, rows)
            wrong = rows.routing_problem(pos, len(ids)) or _ids_problem(ids, routing_shape)
            if wrong is not None:
                return _poisoned(turn, wrong)
            arrays["routed_experts"] = (ids, pos)
        if "sampling_mask" in fields:
            mask = _inline_mask(choice.get("sampling_mask"), rows.completion_len)
            if mask is not None:
                arrays["sampling_mask"] = (mask, rows.prompt_len)
    except WireFormatError as exc:
        return _poisoned(turn, f"inline {exc}")
    return TurnOutput(turn.completion_ids, turn.logprobs, turn.finish_reason, inline=arrays)


def _inline_routing(value: object, rows: _Rows) -> tuple[np.ndarray, int]:
    """Routing ids and the position of their first row, from prime-rl's packed form (its
    ``start`` says where the rows begin) or upstream vLLM's ``.npy`` (the rows end at the
    last token run forward, so their count says where they begin)."""
    if isinstance(value, str):
        ids = decode_npy(value, "routed_experts", dtypes=ROUTING_DTYPES, ndim=3)
        return ids, rows.routing_end - len(ids)
    ids = decode_packed(
        value, "routed_experts", dtypes=ROUTING_DTYPES, ndim=3, extra_keys=("start",)
    )
    assert isinstance(value, dict)  # decode_packed checked it
    start = value["start"]
    if not is_json_int(start) or start < 0:
        raise WireFormatError("routed_experts.start must be a non-negative integer")
    return ids, start


def _inline_mask(value: object, tokens: int) -> np.ndarray | None:
    """The turn's mask, ``int32 [tokens, widest]``; None when the server kept no set for
    any token (it then sends null: every position falls back to the full vocabulary)."""
    if value is None:
        return None
    if isinstance(value, list):
        mask = decode_mask_lists(value, "sampling_mask", tokens=tokens)
    else:
        mask = decode_mask_csr(value, "sampling_mask", tokens=tokens)
    return mask if mask.shape[1] else None


def _ids_problem(ids: np.ndarray, routing_shape: RoutingShape | None) -> str | None:
    if ids.size and int(ids.min()) < 0:
        return f"negative routed expert id {int(ids.min())}"
    if routing_shape is None:
        return None
    return routing_shape.problem(ids.shape[1:]) or routing_shape.ids_problem(ids)


def _by_handle_turn(
    turn: TurnOutput,
    choice: Mapping[str, Any],
    fields: Sequence[str],
    rows: _Rows,
    payload_dir: Path,
    routing_shape: RoutingShape | None,
) -> TurnOutput:
    """The turn with its segments, the files they name (the only files the daemon ever
    deletes on a server's word), and what is wrong with them."""
    raw = choice.get("payload")
    segments: dict[str, PayloadSegment] = {}
    files: set[str] = set()
    problem: str | None = None
    error = choice.get("payload_error")
    if error is not None:
        problem = f"payload_error: {str(error)[:200]}"
    if not isinstance(raw, list):
        inline = any(choice.get(field) is not None for field in ("routed_experts", "sampling_mask"))
        if problem is None and inline:
            problem = (
                "the server answered inline, not by handle: it ignores "
                "extra_args.payload_dir (upstream vLLM?); set payload.mode = 'inline'"
            )
        raw = []
    directory = str(payload_dir)
    for item in raw:
        try:
            segment = segment_from_wire(item, payload_dir)
        except BadSegment as exc:
            problem = problem or f"bad segment: {exc}"
            continue
        files.add(f"{directory}/{segment.file}")
        if segment.field in segments:
            problem = problem or f"two segments for {segment.field}"
        segments[segment.field] = segment
    if problem is None:
        problem = _segments_problem(segments, fields, rows, routing_shape)
    kept = {field: s for field, s in segments.items() if field in fields}
    return TurnOutput(
        turn.completion_ids,
        turn.logprobs,
        turn.finish_reason,
        segments=kept,
        files=frozenset(files),
        poisoned=problem,
    )


def _segments_problem(
    segments: Mapping[str, PayloadSegment],
    fields: Sequence[str],
    rows: _Rows,
    routing_shape: RoutingShape | None,
) -> str | None:
    if "routed_experts" in fields:
        routing = segments.get("routed_experts")
        if routing is None:
            return _NO_ROUTING
        problem = rows.routing_problem(routing.pos, routing.rows)
        if problem is None and routing_shape is not None:
            problem = routing_shape.problem(routing.shape[1:])
        if problem is not None:
            return problem
    mask = segments.get("sampling_mask")
    if "sampling_mask" in fields and mask is not None:
        return rows.mask_problem(mask.pos, mask.rows)
    return None


def _poisoned(turn: TurnOutput, problem: str) -> TurnOutput:
    return TurnOutput(turn.completion_ids, turn.logprobs, turn.finish_reason, poisoned=problem)
