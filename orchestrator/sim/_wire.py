"""The simulated server's request bodies: parsing and checking JSON into typed values.

Pure functions, no I/O. Every problem raises `BadRequest` with one line that names the
field, which the server answers with HTTP 400. Unknown keys are ignored, as vLLM does:
clients send sampler knobs this simulator has no use for.
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

import attrs

from ._model import SamplingParams, SimModel

__all__ = [
    "BadRequest",
    "GenerateRequest",
    "WeightUpdate",
    "parse_generate_request",
    "parse_weight_update",
]

# A client asking for hundreds of samples of one prompt is a bug, not a workload.
MAX_CHOICES = 64

_STEP_SUFFIX = re.compile(r"step_(\d+)")


class BadRequest(Exception):
    """A request body the server refuses (HTTP 400); the message is one line."""


@attrs.frozen
class GenerateRequest:
    """One `POST /inference/v1/generate` body, checked.

    `payload_dir` set means "by handle": arrays go to a file there, segments in the reply.
    """

    request_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    n: int
    payload_dir: Path | None
    return_routed_experts: bool
    return_sampling_mask: bool


@attrs.frozen
class WeightUpdate:
    """One `POST /update_weights` body: the directory and the version its name carries."""

    weight_dir: str
    version: int | None


def _load_object(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"body must be a JSON object, got {type(obj).__name__}")
    return obj


def _integer(obj: dict[str, Any], key: str, default: int | None, where: str) -> int:
    value = obj.get(key, default)
    # JSON booleans parse as Python bools, which are ints: never accept them as numbers.
    if not isinstance(value, int) or isinstance(value, bool):
        kind = "missing" if value is None else f"not an integer ({value!r})"
        raise BadRequest(f"{where}{key} is {kind}")
    return value


def _number(obj: dict[str, Any], key: str, default: float, where: str) -> float:
    value = obj.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise BadRequest(f"{where}{key} is not a number ({value!r})")
    return float(value)


def _flag(obj: dict[str, Any], key: str) -> bool:
    value = obj.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false, got {value!r}")
    return value


def _token_ids(obj: dict[str, Any], model: SimModel) -> tuple[int, ...]:
    tokens = obj.get("token_ids")
    if not isinstance(tokens, list) or not tokens:
        raise BadRequest("token_ids must be a non-empty list of integers")
    # `type(t) is int` rather than isinstance: JSON true/false parse as bools, which are
    # ints. One pass each for types and range keeps an 8,000-token prompt near a millisecond.
    if not all(type(token) is int for token in tokens):
        bad = next(token for token in tokens if type(token) is not int)
        raise BadRequest(f"token_ids holds a non-integer ({bad!r})")
    low, high = min(tokens), max(tokens)
    if low < 0 or high >= model.vocab_size:
        bad = low if low < 0 else high
        raise BadRequest(f"token_ids holds {bad}, outside the vocabulary [0, {model.vocab_size})")
    return tuple(tokens)


def _payload_dir(params: dict[str, Any]) -> Path | None:
    extra = params.get("extra_args")
    if extra is None:
        return None
    if not isinstance(extra, dict):
        raise BadRequest("sampling_params.extra_args must be an object")
    value = extra.get("payload_dir")
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("/"):
        raise BadRequest(
            f"sampling_params.extra_args.payload_dir must be an absolute path, got {value!r}"
        )
    return Path(value)


def parse_generate_request(body: bytes, model: SimModel, *, max_model_len: int) -> GenerateRequest:
    """Parse and check a generate request for `model`.

    Raises `BadRequest` naming the first field that is missing, mistyped or out of range,
    or when prompt plus `max_tokens` exceeds `max_model_len`.
    """
    obj = _load_object(body)
    request_id = obj.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise BadRequest("request_id must be a non-empty string")
    token_ids = _token_ids(obj, model)
    params = obj.get("sampling_params")
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    where = "sampling_params."
    n = _integer(params, "n", 1, where)
    if not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"sampling_params.n must be in [1, {MAX_CHOICES}], got {n}")
    try:
        sampling = SamplingParams(
            max_tokens=_integer(params, "max_tokens", None, where),
            temperature=_number(params, "temperature", 1.0, where),
            top_p=_number(params, "top_p", 1.0, where),
            top_k=_integer(params, "top_k", -1, where),
            seed=_integer(params, "seed", 0, where),
        )
    except ValueError as exc:
        raise BadRequest(f"sampling_params: {exc}") from None
    total = len(token_ids) + sampling.max_tokens
    if total > max_model_len:
        raise BadRequest(
            f"prompt ({len(token_ids)} tokens) + max_tokens ({sampling.max_tokens}) "
            f"exceeds max_model_len ({max_model_len})"
        )
    return GenerateRequest(
        request_id=request_id,
        token_ids=token_ids,
        sampling=sampling,
        n=n,
        payload_dir=_payload_dir(params),
        return_routed_experts=_flag(obj, "return_routed_experts"),
        return_sampling_mask=_flag(obj, "return_sampling_mask"),
    )


def parse_weight_update(body: bytes) -> WeightUpdate:
    """Parse `{"weight_dir": "..."}`; the version is N of a trailing `step_N`, else None.

    Raises `BadRequest` when the body is not an object with a non-empty string weight_dir.
    """
    obj = _load_object(body)
    weight_dir = obj.get("weight_dir")
    if not isinstance(weight_dir, str) or not weight_dir:
        raise BadRequest("weight_dir must be a non-empty string")
    match = _STEP_SUFFIX.fullmatch(PurePosixPath(weight_dir).name)
    return WeightUpdate(weight_dir=weight_dir, version=int(match.group(1)) if match else None)
