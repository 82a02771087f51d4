"""The batch file format (docs/design.md §5): `batch.json` and its samples, as pure values.

One JSON document per batch::

    {"format": "rollout-orchestrator.batch/1", "step": 7, "created_at": 1764400000.5,
     "samples": [{"group_id": ..., "rollout_id": ..., "server": "http://...",
                  "start_version": 3, "dispatch_version": 4, "reward": 1.0, "advantage": 0.5,
                  "token_ids": [...], "loss_mask": [...], "logprobs": [...],
                  "payload_dir": "/abs/root/v4",
                  "payload": {"routed_experts": [segment, ...],
                              "sampling_mask": [segment, ...]}}, ...]}

A sample carries its payload by handle (`payload_dir` and `payload`), inline (`inline`),
or not at all; docs/protocol.md § Batches is the full description. Parsing is strict:
unknown keys, wrong types, bools where numbers belong, non-finite floats and lists of
different lengths are all errors, because a trainer must never half-read a batch.
This module does no I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from orchestrator.core.rollouts import TrainSample
from orchestrator.payload import FIELDS, BadSegment, PayloadSegment

BATCH_FORMAT = "rollout-orchestrator.batch/1"
BATCH_FILE = "batch.json"

_SAMPLE_KEYS = frozenset(
    {
        "group_id",
        "rollout_id",
        "start_version",
        "dispatch_version",
        "reward",
        "advantage",
        "token_ids",
        "loss_mask",
        "logprobs",
        "payload_dir",
        "payload",
        "inline",
        "server",
    }
)
_DOCUMENT_KEYS = frozenset({"format", "step", "created_at", "samples"})


class BatchError(Exception):
    """A batch that cannot be trusted: unreadable, malformed, or inconsistent.

    The message is one line naming the file (or the sample) and the problem.
    """


class _Malformed(Exception):
    """A problem at a place inside the document; turned into `BatchError` at the edge."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}" if where else problem)


def decode_sample(obj: object, *, source: str = "sample") -> TrainSample:
    """Parse one sample object, strictly.

    `source` names where the object came from (`".../batch.json: samples[3]"`) and starts
    the error message. Raises `BatchError`.
    """
    try:
        return _parse_sample(obj)
    except _Malformed as exc:
        raise BatchError(f"{source}: {exc}") from None


def _sample_tuple(value: Iterable[TrainSample]) -> tuple[TrainSample, ...]:
    return tuple(value)


@attrs.frozen
class BatchDocument:
    """A parsed `batch.json`: the step, when it was written, and its samples."""

    step: int
    created_at: float
    samples: tuple[TrainSample, ...] = attrs.field(converter=_sample_tuple)


def encode_batch(step: int, samples: Sequence[TrainSample], *, created_at: float) -> bytes:
    """The bytes of `batch.json` for `samples` of batch `step` (UTF-8 JSON, one line).

    Raises ValueError for a step < 1 or a non-finite float in a sample.
    """
    if step < 1:
        raise ValueError(f"batches count from 1, got step {step}")
    document = {
        "format": BATCH_FORMAT,
        "step": step,
        "created_at": created_at,
        "samples": [sample.to_json() for sample in samples],
    }
    return json_line(document)


def json_line(obj: object) -> bytes:
    """`obj` as the hand-off writes JSON files (`batch.json`, weights' `model.json`):
    compact UTF-8 JSON on one line, ending in a newline.

    Raises ValueError for a non-finite float.
    """
    return (json.dumps(obj, allow_nan=False, separators=(",", ":")) + "\n").encode()


def decode_batch(data: bytes, *, source: str) -> BatchDocument:
    """Parse the bytes of `batch.json`; `source` (the file) starts every error message.

    Raises `BatchError` for invalid UTF-8 or JSON, an unknown format, or any malformed
    field or sample.
    """
    try:
        # Decode first: json.loads(bytes) would guess UTF-16/32 from the first bytes.
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BatchError(f"{source}: not UTF-8 text ({exc.reason})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BatchError(
            f"{source}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise BatchError(f"{source}: invalid JSON: nested too deeply") from None
    try:
        return _parse_document(obj)
    except _Malformed as exc:
        raise BatchError(f"{source}: {exc}") from None


def _parse_document(obj: object) -> BatchDocument:
    if not isinstance(obj, dict):
        raise _Malformed("", f"expected a JSON object, got {_json_type(obj)}")
    _check_keys(obj, required=_DOCUMENT_KEYS, allowed=_DOCUMENT_KEYS, where="")
    if obj["format"] != BATCH_FORMAT:
        raise _Malformed("format", f"unknown format {obj['format']!r} (expected {BATCH_FORMAT!r})")
    step = _int(obj["step"], "step")
    if step < 1:
        raise _Malformed("step", f"batches count from 1, got {step}")
    created_at = _float(obj["created_at"], "created_at")
    raw_samples = obj["samples"]
    if not isinstance(raw_samples, list):
        raise _Malformed("samples", f"expected a list, got {_json_type(raw_samples)}")
    samples = []
    for index, raw in enumerate(raw_samples):
        try:
            samples.append(_parse_sample(raw))
        except _Malformed as exc:
            raise _Malformed(f"samples[{index}]", str(exc)) from None
    return BatchDocument(step=step, created_at=created_at, samples=samples)


def _parse_sample(obj: object) -> TrainSample:
    if not isinstance(obj, dict):
        raise _Malformed("", f"expected a JSON object, got {_json_type(obj)}")
    required = _SAMPLE_KEYS - {"payload_dir", "payload", "inline", "server"}
    _check_keys(obj, required=required, allowed=_SAMPLE_KEYS, where="")
    payload_dir = obj.get("payload_dir")
    if payload_dir is not None and not isinstance(payload_dir, str):
        raise _Malformed("payload_dir", f"expected a string, got {_json_type(payload_dir)}")
    try:
        return TrainSample(
            group_id=_str(obj["group_id"], "group_id"),
            rollout_id=_str(obj["rollout_id"], "rollout_id"),
            start_version=_int(obj["start_version"], "start_version"),
            dispatch_version=_int(obj["dispatch_version"], "dispatch_version"),
            reward=_float(obj["reward"], "reward"),
            advantage=_float(obj["advantage"], "advantage"),
            token_ids=_int_list(obj["token_ids"], "token_ids"),
            loss_mask=_int_list(obj["loss_mask"], "loss_mask"),
            logprobs=_float_list(obj["logprobs"], "logprobs"),
            payload=_parse_payload(obj.get("payload")),
            payload_dir=payload_dir,
            inline=_parse_inline(obj.get("inline")),
            server=_str(obj["server"], "server") if "server" in obj else None,
        )
    except ValueError as exc:
        raise _Malformed("", str(exc)) from None


def _parse_payload(obj: object) -> dict[str, list[PayloadSegment]]:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise _Malformed("payload", f"expected an object, got {_json_type(obj)}")
    payload: dict[str, list[PayloadSegment]] = {}
    for field, raw_segments in obj.items():
        if field not in FIELDS:
            raise _Malformed("payload", f"unknown field {field!r}")
        if not isinstance(raw_segments, list):
            raise _Malformed(f"payload.{field}", f"expected a list, got {_json_type(raw_segments)}")
        segments = payload[field] = []
        for index, raw in enumerate(raw_segments):
            try:
                segments.append(PayloadSegment.from_json(raw))
            except BadSegment as exc:
                raise _Malformed(f"payload.{field}[{index}]", str(exc)) from None
    return payload


def _parse_inline(obj: object) -> dict[str, Mapping[str, Any]] | None:
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise _Malformed("inline", f"expected an object, got {_json_type(obj)}")
    for field, value in obj.items():
        if field not in FIELDS:
            raise _Malformed("inline", f"unknown field {field!r}")
        if not isinstance(value, dict):
            raise _Malformed(f"inline.{field}", f"expected an object, got {_json_type(value)}")
    return obj


def _check_keys(
    obj: Mapping[str, object], *, required: frozenset[str], allowed: frozenset[str], where: str
) -> None:
    missing = sorted(required - obj.keys())
    if missing:
        raise _Malformed(where, f"missing key(s) {', '.join(missing)}")
    unknown = sorted(obj.keys() - allowed)
    if unknown:
        raise _Malformed(where, f"unknown key(s) {', '.join(unknown)}")


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise _Malformed(where, f"expected a string, got {_json_type(value)}")
    return value


def _int(value: object, where: str) -> int:
    # JSON booleans parse as Python bools, which are ints: never accept them as numbers.
    if type(value) is not int:
        raise _Malformed(where, f"expected an integer, got {_json_type(value)}")
    return value


def _float(value: object, where: str) -> float:
    if type(value) is not float and type(value) is not int:
        raise _Malformed(where, f"expected a number, got {_json_type(value)}")
    if not math.isfinite(value):
        raise _Malformed(where, "expected a finite number")
    return float(value)


# Batches hold hundreds of thousands of numbers: each list is checked in one pass at C
# speed (the set of element types, numpy's isfinite), and only a list that fails is
# walked in Python, to name its first bad element.


def _int_list(value: object, where: str) -> list[int]:
    if not isinstance(value, list):
        raise _Malformed(where, f"expected a list, got {_json_type(value)}")
    if not set(map(type, value)) <= {int}:
        for index, item in enumerate(value):
            _int(item, f"{where}[{index}]")
    return value


def _float_list(value: object, where: str) -> list[float]:
    if not isinstance(value, list):
        raise _Malformed(where, f"expected a list, got {_json_type(value)}")
    if not (
        set(map(type, value)) <= {float, int}
        and np.isfinite(np.asarray(value, dtype=np.float64)).all()
    ):
        for index, item in enumerate(value):
            _float(item, f"{where}[{index}]")
    return value
