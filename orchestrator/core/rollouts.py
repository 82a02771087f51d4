"""What a finished rollout group looks like when it reaches the sink.

Values only (no I/O): the dispatcher builds them from inference responses, the sink scores
and queues them, batch assembly turns queued samples into `TrainSample`s.

Vocabulary (docs/design.md §3, §6):
- a *group* is `group_size` rollouts of one prompt (GRPO); its *start version* `g` is the
  applied policy version when its first member was dispatched;
- a *rollout* is one trajectory, dispatched under version `k >= g`; every payload file it
  writes lives in `<root>/v<k>/`;
- a rollout yields one or more *samples*, one per trajectory branch (a branch is a token
  sequence the trainer trains on; branches of one rollout may share payload files).
"""

from __future__ import annotations

import enum
import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs
import numpy as np

from orchestrator.payload import FIELDS, PayloadSegment


class Discard(enum.Enum):
    """Why a rollout or sample left the sink without shipping (docs/design.md §6)."""

    STALE = "stale"  # group start below the bound, at admission or in the sweep
    NO_SIGNAL = "no_signal"  # every advantage zero
    CURRICULUM = "curriculum"  # the group's mean reward is outside the curriculum's range
    UNTRAINABLE = "untrainable"  # no loss tokens, over the sequence length, poisoned payload
    PRUNED = "pruned"  # beyond a constant trainer batch size
    FAILED = "failed"  # the request failed


@attrs.frozen
class Sample:
    """One trainable token sequence (a trajectory branch) and its payload references.

    `payload` holds the stitched by-handle segments per field (all in `payload_dir`);
    `inline` holds the stitched arrays in `encode_inline` form when the run is inline.
    `files` are the absolute paths of every payload file the branch's turns wrote: the
    sink reference-counts them. `untrainable` names why the branch cannot be trained
    (poisoned payload, no loss tokens, too long); such a sample is discarded at admission.
    """

    rollout_id: str
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    payload_dir: str | None = None
    payload: Mapping[str, tuple[PayloadSegment, ...]] = attrs.field(factory=dict)
    inline: Mapping[str, Mapping[str, object]] | None = None
    files: frozenset[str] = frozenset()
    untrainable: str | None = None

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)


@attrs.frozen
class RolloutResult:
    """A finished (or failed) rollout.

    `files` are the absolute paths of every payload file its successful turns wrote
    (names validated, so deleting them can never touch anything outside the payload root).
    A failed rollout (`failed` set) has no samples and no reward.
    """

    rollout_id: str
    dispatch_version: int
    reward: float = 0.0
    samples: tuple[Sample, ...] = ()
    files: frozenset[str] = frozenset()
    failed: str | None = None


@attrs.frozen
class GroupResult:
    """All members of one group, as handed from the dispatcher to the sink.

    `server` is the URL of the inference server every member ran on (a group is pinned
    to one); it goes into each shipped sample so a trainer can name it.
    """

    group_id: str
    start_version: int
    rollouts: tuple[RolloutResult, ...]
    server: str | None = None


def _int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    # Plain ints only: json.dumps cannot write numpy scalars. tolist() turns an array into
    # Python numbers; operator.index turns bools into ints and refuses floats rather than
    # truncating them.
    if isinstance(value, np.ndarray):
        value = value.tolist()
    return tuple(map(operator.index, value))


def _float_tuple(value: Iterable[float]) -> tuple[float, ...]:
    if isinstance(value, np.ndarray):
        value = value.tolist()
    return tuple(map(float, value))


def _segments_by_field(
    value: Mapping[str, Sequence[PayloadSegment]],
) -> Mapping[str, tuple[PayloadSegment, ...]]:
    return MappingProxyType({field: tuple(segments) for field, segments in value.items()})


def _inline_by_field(
    value: Mapping[str, Mapping[str, Any]] | None,
) -> Mapping[str, Mapping[str, Any]] | None:
    if value is None:
        return None
    return MappingProxyType({field: MappingProxyType(dict(obj)) for field, obj in value.items()})


@attrs.frozen
class TrainSample:
    """One training sample of a batch: a token sequence with its loss data and payload.

    `loss_mask[i]` is 1 where position `i` is trained on (completion tokens), 0 on prompt
    positions; `logprobs[i]` is the inference logprob (0.0 on prompt positions). The
    payload comes by handle (`payload_dir` plus segments per field, already stitched so
    that they cover the sample's positions), inline (per field, the `encode_inline` form),
    or not at all (no payload fields requested, or routing dropped because of a gap).
    `server` is the URL of the inference server that generated the rollout, when known
    (a reader names it when it drops the sample for a bad payload).

    Raises ValueError when the fields are inconsistent (lengths, versions, payload forms).
    """

    group_id: str
    rollout_id: str
    start_version: int
    dispatch_version: int
    reward: float
    advantage: float
    token_ids: tuple[int, ...] = attrs.field(converter=_int_tuple)
    loss_mask: tuple[int, ...] = attrs.field(converter=_int_tuple)
    logprobs: tuple[float, ...] = attrs.field(converter=_float_tuple)
    payload: Mapping[str, tuple[PayloadSegment, ...]] = attrs.field(
        factory=dict, converter=_segments_by_field
    )
    payload_dir: str | None = None
    inline: Mapping[str, Mapping[str, Any]] | None = attrs.field(
        default=None, converter=_inline_by_field
    )
    server: str | None = None

    def __attrs_post_init__(self) -> None:
        length = len(self.token_ids)
        if length == 0:
            raise ValueError("token_ids is empty")
        if len(self.loss_mask) != length or len(self.logprobs) != length:
            raise ValueError(
                f"token_ids, loss_mask and logprobs differ in length "
                f"({length}, {len(self.loss_mask)}, {len(self.logprobs)})"
            )
        if not set(self.loss_mask) <= {0, 1}:
            raise ValueError("loss_mask holds a value other than 0 and 1")
        if self.start_version < 0 or self.dispatch_version < self.start_version:
            raise ValueError(
                f"versions must satisfy 0 <= start_version <= dispatch_version, "
                f"got {self.start_version} and {self.dispatch_version}"
            )
        if self.payload and self.inline is not None:
            raise ValueError("a sample carries its payload by handle or inline, not both")
        if bool(self.payload) != (self.payload_dir is not None):
            raise ValueError("payload_dir and payload come together")
        if self.payload_dir is not None and not os.path.isabs(self.payload_dir):
            raise ValueError(f"payload_dir must be an absolute path, got {self.payload_dir!r}")
        for field, segments in self.payload.items():
            if field not in FIELDS:
                raise ValueError(f"unknown payload field {field!r}")
            if not segments:
                raise ValueError(f"payload field {field!r} has no segments")
            if any(segment.field != field for segment in segments):
                raise ValueError(f"payload field {field!r} holds a segment of another field")
        for field in self.inline or {}:
            if field not in FIELDS:
                raise ValueError(f"unknown inline field {field!r}")

    @property
    def payload_fields(self) -> frozenset[str]:
        """The payload fields this sample carries, by handle or inline."""
        return frozenset(self.payload) | frozenset(self.inline or {})

    def to_json(self) -> dict[str, Any]:
        """The sample's JSON object; `server`, `payload_dir`/`payload` and `inline` only
        when set."""
        obj: dict[str, Any] = {
            "group_id": self.group_id,
            "rollout_id": self.rollout_id,
            "start_version": self.start_version,
            "dispatch_version": self.dispatch_version,
            "reward": self.reward,
            "advantage": self.advantage,
            "token_ids": list(self.token_ids),
            "loss_mask": list(self.loss_mask),
            "logprobs": list(self.logprobs),
        }
        if self.server is not None:
            obj["server"] = self.server
        if self.payload:
            obj["payload_dir"] = self.payload_dir
            obj["payload"] = {
                field: [segment.to_json() for segment in segments]
                for field, segments in self.payload.items()
            }
        if self.inline is not None:
            obj["inline"] = {field: dict(value) for field, value in self.inline.items()}
        return obj
