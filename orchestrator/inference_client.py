"""Talking to inference servers: one generate request per turn, and `update_weights`.

Parsing is pure (`parse_generate_response`), so every malformed or hostile response is
testable without a socket. The one blocking check, that segment files exist as regular
files of the right size, runs in a worker thread.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import numpy as np
from payload_gc import PayloadRootFiles

from orchestrator.http11 import HTTP11Client, HTTPFailure
from orchestrator.payload import (
    BadSegment,
    PayloadError,
    PayloadSegment,
    RoutingShape,
    check_segment,
    check_within,
    decode_inline,
    open_version_dir,
    regular_file_size,
)

GENERATE_PATH = "/inference/v1/generate"
UPDATE_WEIGHTS_PATH = "/update_weights"
JSON_HEADERS = (("content-type", "application/json"),)


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


@attrs.frozen
class TurnOutput:
    """What one turn (one generate request, one choice) returned.

    `files` are absolute paths of payload files this turn wrote whose names passed
    validation: the only files the orchestrator will ever delete on its own. `poisoned`
    names why the payload cannot be trusted (a bad segment, `payload_error`); the tokens
    are still usable for the episode, but the rollout is never trained on.
    """

    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    routing_pos: int
    segments: Mapping[str, PayloadSegment] = attrs.field(factory=dict)
    inline: Mapping[str, tuple[np.ndarray, int]] = attrs.field(factory=dict)
    files: frozenset[str] = frozenset()
    poisoned: str | None = None


def build_generate_request(
    *,
    request_id: str,
    token_ids: Sequence[int],
    max_tokens: int,
    seed: int,
    payload_dir: Path | None,
    fields: Sequence[str],
) -> dict[str, Any]:
    """The JSON body of a generate request (DESIGN §4)."""
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
    completion token, both anchored where DESIGN §4 says."""
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


@attrs.frozen
class TurnFiles:
    """A turn's payload files as found on disk: what is wrong with them (`None` when
    nothing is, or when the turn was poisoned already) and the size of each of its files
    that exists as a regular file, by name."""

    problem: str | None
    sizes: Mapping[str, int]


def check_turn_files(turn: TurnOutput, *, files: PayloadRootFiles, version: int) -> TurnFiles:
    """Look at the turn's files in `v<version>` of the open payload root (payload_gc's
    fd-relative, no-follow access: a version directory that is a link or a mount point
    is refused): each must be a regular file holding its segments' bytes. Blocking: one
    `lstat` per file."""
    checked = turn.poisoned is None and bool(turn.segments)
    try:
        directory = open_version_dir(files, version)
    except PayloadError as exc:
        return TurnFiles(str(exc) if checked else None, {})
    sizes: dict[str, int] = {}
    problem: str | None = None
    for path in sorted(turn.files):
        name = path.rpartition("/")[2]
        try:
            sizes[name] = regular_file_size(directory, name)
        except PayloadError as exc:
            problem = problem or str(exc)
    if not checked:
        return TurnFiles(None, sizes)
    if problem is None:
        try:
            for segment in turn.segments.values():
                check_within(segment, sizes[segment.file])
        except PayloadError as exc:
            problem = str(exc)
    return TurnFiles(problem, sizes)


class _OneChunk(httpx.AsyncByteStream):
    """A request body that is one bytes object, iterated without an async generator.

    httpx's own body stream is an async generator; when a request is cancelled mid-send
    (a stale group being cancelled) it is left unfinished and trio warns when it is
    garbage collected (encode/httpx#3686). A plain iterator object has nothing to leak.
    """

    def __init__(self, data: bytes) -> None:
        self._data = data

    def __aiter__(self) -> _OneChunkIterator:
        return _OneChunkIterator(self._data)


class _OneChunkIterator:
    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data

    def __aiter__(self) -> _OneChunkIterator:
        return self

    async def __anext__(self) -> bytes:
        if self._data is None:
            raise StopAsyncIteration
        data, self._data = self._data, None
        return data


async def _post_json(
    client: httpx.AsyncClient, url: str, body: Mapping[str, Any]
) -> httpx.Response:
    data = json.dumps(body, separators=(",", ":")).encode()
    request = client.build_request(
        "POST", url, content=data, headers={"content-type": "application/json"}
    )
    request.stream = _OneChunk(data)
    return await client.send(request)


def _transport_failure(url: str, exc: httpx.TransportError) -> InferenceFailure:
    # Only a refused or unreachable connection says the server is down; a connection that
    # broke mid-request is retried like any transient failure.
    kind = "connect" if isinstance(exc, httpx.ConnectError) else "transport"
    return InferenceFailure(kind, f"{url}: {exc.__class__.__name__}")


async def post_generate(client: HTTP11Client, url: str, body: Mapping[str, Any]) -> bytes:
    """POST one generate request; the caller puts the deadline around it.

    Raises `InferenceFailure` for connection errors and non-200 answers.
    """
    data = json.dumps(body, separators=(",", ":")).encode()
    try:
        reply = await client.request("POST", url.rstrip("/") + GENERATE_PATH, data, JSON_HEADERS)
    except HTTPFailure as exc:
        raise InferenceFailure(exc.kind, exc.detail) from None
    if reply.status >= 500:
        raise InferenceFailure("http_5xx", f"{url}: HTTP {reply.status}")
    if reply.status != 200:
        raise InferenceFailure("http_4xx", f"{url}: HTTP {reply.status} {reply.text()!r}")
    return reply.body


async def post_update_weights(client: httpx.AsyncClient, url: str, weight_dir: Path) -> None:
    """Tell one server to load `weight_dir`. Raises `InferenceFailure` when it does not."""
    try:
        response = await _post_json(
            client, url.rstrip("/") + UPDATE_WEIGHTS_PATH, {"weight_dir": str(weight_dir)}
        )
    except httpx.TimeoutException:
        raise InferenceFailure("timeout", f"{url}: update_weights timed out") from None
    except httpx.TransportError as exc:
        raise _transport_failure(url, exc) from None
    if response.status_code != 200:
        kind = "http_5xx" if response.status_code >= 500 else "http_4xx"
        raise InferenceFailure(kind, f"{url}: update_weights HTTP {response.status_code}")
