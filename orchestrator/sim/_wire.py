"""The simulated server's request bodies: vLLM's `GenerateRequest`, parsed and checked.

Pure functions, no I/O. A body the server refuses raises `RequestRefused` with the HTTP
status and one line naming the field: `BadRequest` (400) for a malformed body, a
top-level key vLLM's `GenerateRequest` does not define, or `stream: true`;
`ModelNotFound` (404) for a `model` other than the served one, as vLLM answers.

Stricter than vLLM in one way on purpose: vLLM ignores top-level keys it does not know
(with a warning), this server refuses them, so a client that sends keys a real server
would silently drop (say, a request flag for something that is in fact a server setting)
fails its tests here. Unknown keys inside `sampling_params` are ignored, as vLLM's
`SamplingParams` has many knobs this simulator has no use for.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path, PurePosixPath
from typing import Any

import attrs

from ._model import SamplingParams, SimModel

__all__ = [
    "GENERATE_REQUEST_KEYS",
    "BadRequest",
    "GenerateRequest",
    "ModelNotFound",
    "RequestRefused",
    "WeightUpdate",
    "parse_generate_request",
    "parse_weight_update",
]

#: The top-level fields of vLLM's `GenerateRequest` (tokens in, tokens out). Only
#: `request_id`, `token_ids`, `sampling_params`, `model` and `stream` mean anything here;
#: the others are accepted and ignored.
GENERATE_REQUEST_KEYS = frozenset(
    {
        "request_id",
        "token_ids",
        "token_offsets",
        "features",
        "content_parts",
        "sampling_params",
        "model",
        "reasoning_ended",
        "reasoning_parser_kwargs",
        "return_token_ids",
        "output_mode",
        "stream",
        "stream_options",
        "cache_salt",
        "priority",
        "kv_transfer_params",
        "ec_transfer_params",
    }
)

# A client asking for hundreds of samples of one prompt is a bug, not a workload.
MAX_CHOICES = 64

_STEP_SUFFIX = re.compile(r"step_(\d+)")


class RequestRefused(Exception):
    """A request the server refuses: `status` and vLLM's error `kind`; the message is one
    line."""

    status = 400
    kind = "BadRequestError"


class BadRequest(RequestRefused):
    """A body that is not a valid request (HTTP 400)."""


class ModelNotFound(RequestRefused):
    """A request for a model the server does not serve (HTTP 404, as vLLM answers)."""

    status = 404
    kind = "NotFoundError"


@attrs.frozen
class GenerateRequest:
    """One `POST /inference/v1/generate` body, checked.

    `logprobs`: the request asked for the sampled tokens' logprobs (`sampling_params.
    logprobs` not null). `routing_start`: the first position whose routing rows the reply
    carries (`routed_experts_prompt_start`). `payload_dir` set asks prime-rl's extension
    to write the arrays to a file there (by handle); upstream vLLM ignores it.
    """

    request_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    n: int
    logprobs: bool
    routing_start: int
    payload_dir: Path | None
    model: str | None = None
    kv_transfer_params: dict[str, Any] | None = attrs.field(default=None, eq=False, hash=False)


@attrs.frozen
class WeightUpdate:
    """One `POST /update_weights` body: the directory and the version its name carries."""

    weight_dir: str
    version: int | None


def _load_object(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise BadRequest(f"body is not JSON: {str(exc).splitlines()[0]}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"body must be a JSON object, got {type(obj).__name__}")
    return obj


def _is_int(value: object) -> bool:
    # JSON booleans parse as Python bools, which are ints: never accept them as numbers.
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(obj: dict[str, Any], key: str, default: int | None, where: str) -> int:
    """`obj[key]`, an integer; absent or null is `default` (None: required)."""
    value = obj.get(key)
    if value is None:
        value = default
    if not _is_int(value):
        kind = "missing" if value is None else f"not an integer ({value!r})"
        raise BadRequest(f"{where}{key} is {kind}")
    assert isinstance(value, int)
    return value


def _number(obj: dict[str, Any], key: str, default: float, where: str) -> float:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise BadRequest(f"{where}{key} is not a number ({value!r})")
    return float(value)


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


def _stop_token_ids(params: dict[str, Any]) -> tuple[int, ...]:
    value = params.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(type(token) is int for token in value):
        raise BadRequest("sampling_params.stop_token_ids must be a list of integers")
    return tuple(value)


def _logprobs(params: dict[str, Any]) -> bool:
    """Whether logprobs were asked for: vLLM's `logprobs` is null (none) or the number of
    top logprobs beside the sampled token's (-1: the whole vocabulary)."""
    value = params.get("logprobs")
    if value is None:
        return False
    if not _is_int(value) or value < -1:
        raise BadRequest(
            f"sampling_params.logprobs must be null or an integer >= -1, got {value!r}"
        )
    return True


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


def _kv_transfer_params(obj: dict[str, Any]) -> dict[str, Any] | None:
    value = obj.get("kv_transfer_params")
    if value is not None and not isinstance(value, dict):
        raise BadRequest(f"kv_transfer_params must be an object, got {type(value).__name__}")
    return value


def _top_level(obj: dict[str, Any], served_model_name: str) -> tuple[str, str | None]:
    """The request id and the model named; refuses unknown keys, streaming and a model
    the server does not serve."""
    unknown = sorted(str(key) for key in obj if key not in GENERATE_REQUEST_KEYS)
    if unknown:
        raise BadRequest(
            f"unknown key {unknown[0]!r}: not a field of vLLM's GenerateRequest"
            + (f" (nor {', '.join(repr(k) for k in unknown[1:])})" if unknown[1:] else "")
        )
    stream = obj.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {stream!r}")
    if stream:
        raise BadRequest("stream: true is refused: streaming is not simulated")
    request_id = obj.get("request_id")
    if request_id is None:
        # vLLM's default: a random id.
        request_id = uuid.uuid4().hex
    if not isinstance(request_id, str):
        raise BadRequest(f"request_id must be a string, got {request_id!r}")
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {model!r}")
    if model and model != served_model_name:
        raise ModelNotFound(f"The model `{model}` does not exist.")
    return request_id, model


def parse_generate_request(
    body: bytes, model: SimModel, *, max_model_len: int, served_model_name: str
) -> GenerateRequest:
    """Parse and check a generate request for `model`, served as `served_model_name`.

    Raises `BadRequest` naming the first key that is unknown, missing, mistyped or out of
    range, or when prompt plus `max_tokens` exceeds `max_model_len`; `ModelNotFound` when
    the request names another model. An absent `max_tokens` is what is left of
    `max_model_len` after the prompt (vLLM's default); an absent `request_id` a random one.
    """
    obj = _load_object(body)
    request_id, requested_model = _top_level(obj, served_model_name)
    token_ids = _token_ids(obj, model)
    prompt_len = len(token_ids)
    params = obj.get("sampling_params")
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    where = "sampling_params."
    n = _integer(params, "n", 1, where)
    if not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"sampling_params.n must be in [1, {MAX_CHOICES}], got {n}")
    left = max_model_len - prompt_len
    if left < 1:
        raise BadRequest(
            f"prompt ({prompt_len} tokens) leaves no room below max_model_len ({max_model_len})"
        )
    try:
        sampling = SamplingParams(
            max_tokens=_integer(params, "max_tokens", left, where),
            temperature=_number(params, "temperature", 1.0, where),
            top_p=_number(params, "top_p", 1.0, where),
            top_k=_integer(params, "top_k", -1, where),
            seed=_integer(params, "seed", 0, where),
            stop_token_ids=_stop_token_ids(params),
        )
    except ValueError as exc:
        raise BadRequest(f"sampling_params: {exc}") from None
    if sampling.max_tokens > left:
        raise BadRequest(
            f"prompt ({prompt_len} tokens) + max_tokens ({sampling.max_tokens}) "
            f"exceeds max_model_len ({max_model_len})"
        )
    routing_start = _integer(params, "routed_experts_prompt_start", 0, where)
    if not 0 <= routing_start < prompt_len:
        raise BadRequest(
            f"sampling_params.routed_experts_prompt_start must be in [0, {prompt_len}) "
            f"(a prompt position), got {routing_start}"
        )
    return GenerateRequest(
        request_id=request_id,
        token_ids=token_ids,
        sampling=sampling,
        n=n,
        logprobs=_logprobs(params),
        routing_start=routing_start,
        payload_dir=_payload_dir(params),
        model=requested_model,
        kv_transfer_params=_kv_transfer_params(obj),
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


def parse_collective_rpc(body: bytes) -> tuple[str, dict[str, Any]]:
    """vLLM's `/collective_rpc` body: `{"method", "args"?, "kwargs"?}`, its method and
    kwargs. Raises `BadRequest` as vLLM does for a body without a method."""
    obj = _load_object(body)
    method = obj.get("method")
    if not isinstance(method, str) or not method:
        raise BadRequest("Missing 'method' in request body")
    kwargs = obj.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("kwargs must be an object")
    return method, kwargs


def parse_new_version(body: bytes) -> str:
    """vLLM's `/update_weight_version` body: `{"new_version": "<text>"}`."""
    new_version = _load_object(body).get("new_version")
    if not isinstance(new_version, str):
        raise BadRequest("new_version must be a string")
    return new_version
