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
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import attrs
import numpy as np

from orchestrator.core.arrays import ARRAY_EQ, float_array, frozen_arrays, mask_array, token_array
from orchestrator.core.environments import DEFAULT_TEMPERATURE
from orchestrator.payload import FIELDS, PayloadSegment


class Discard(enum.Enum):
    """Why a rollout or sample left the sink without shipping (docs/design.md §6)."""

    STALE = "stale"  # group start below the bound when it finished (at admission)
    SWEPT = "swept"  # queued in time, but the bound passed it before a batch took it
    NO_SIGNAL = "no_signal"  # every advantage zero
    CURRICULUM = "curriculum"  # the group's mean reward is outside the curriculum's range
    UNTRAINABLE = "untrainable"  # no loss tokens, over the sequence length, poisoned payload
    PRUNED = "pruned"  # beyond a constant trainer batch size
    FAILED = "failed"  # the request failed
    REWARD_FAILED = "reward_failed"  # its reward could not be computed (raised, hung, ...)


@attrs.frozen
class Sample:
    """One trainable token sequence (a trajectory branch) and its payload references.

    `token_ids` are int32, `loss_mask` bool (completion tokens), `logprobs` float32 (0 on
    prompt positions). `payload` holds the stitched by-handle segments per field (all in
    `payload_dir`); `inline` holds the stitched arrays (one row per position) when the
    run is inline.
    `files` are the absolute paths of every payload file the branch's turns wrote: the
    sink reference-counts them. `untrainable` names why the branch cannot be trained
    (poisoned payload, no loss tokens, too long); such a sample is discarded at admission.
    """

    rollout_id: str
    token_ids: np.ndarray = attrs.field(converter=token_array, eq=ARRAY_EQ, hash=False)
    loss_mask: np.ndarray = attrs.field(converter=mask_array, eq=ARRAY_EQ, hash=False)
    logprobs: np.ndarray = attrs.field(converter=float_array, eq=ARRAY_EQ, hash=False)
    payload_dir: str | None = None
    payload: Mapping[str, tuple[PayloadSegment, ...]] = attrs.field(factory=dict)
    inline: Mapping[str, np.ndarray] | None = attrs.field(
        default=None, converter=frozen_arrays, eq=ARRAY_EQ, hash=False
    )
    files: frozenset[str] = frozenset()
    untrainable: str | None = None

    @property
    def loss_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))


@attrs.frozen
class RolloutResult:
    """A finished (or failed) rollout.

    `files` are the absolute paths of every payload file its successful turns wrote
    (names validated, so deleting them can never touch anything outside the payload root).
    A failed rollout (`failed` set) has no samples and no reward; `failure` says under
    which reason the sink discards it (the request failed, or its reward did).
    """

    rollout_id: str
    dispatch_version: int
    reward: float = 0.0
    samples: tuple[Sample, ...] = ()
    files: frozenset[str] = frozenset()
    failed: str | None = None
    failure: Discard = Discard.FAILED
    # What its environment measured besides the reward (an environment that drives its
    # own turns reports them: a verifiers rubric's metrics), by name.
    metrics: Mapping[str, float] = attrs.field(factory=dict)


@attrs.define
class MetricMeans:
    """Environments' own metrics (`RolloutResult.metrics`) averaged by name, each over
    the rollouts that reported it: a metric one rollout lacks is not counted as 0."""

    _sums: dict[str, float] = attrs.field(factory=dict)
    _counts: Counter[str] = attrs.field(factory=Counter)

    def add(self, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self._sums[name] = self._sums.get(name, 0.0) + value
            self._counts[name] += 1

    def means(self) -> dict[str, float]:
        """Each metric's mean, by name in order."""
        return {name: self._sums[name] / self._counts[name] for name in sorted(self._sums)}


@attrs.frozen
class GroupResult:
    """All members of one group, as handed from the dispatcher to the sink.

    `server` is the URL of the inference server every member ran on (a group is pinned
    to one); it goes into each shipped sample so a trainer can name it, as do `env` (the
    environment its prompt came from) and `temperature` (its sampling temperature, which
    a trainer that recomputes logprobs needs). `dispatched_at`
    (on the daemon's clock) and `dispatched_step` (the batch being filled then) say when
    it was dispatched, for the in-flight limit (orchestrator/core/inflight.py).
    """

    group_id: str
    start_version: int
    rollouts: tuple[RolloutResult, ...]
    server: str | None = None
    env: str = ""
    temperature: float = DEFAULT_TEMPERATURE
    dispatched_at: float | None = None
    dispatched_step: int | None = None


def _segments_by_field(
    value: Mapping[str, Sequence[PayloadSegment]],
) -> Mapping[str, tuple[PayloadSegment, ...]]:
    return MappingProxyType({field: tuple(segments) for field, segments in value.items()})


@attrs.frozen
class TrainSample:
    """One training sample of a batch: a token sequence with its loss data and payload.

    Per position, as read-only arrays: `token_ids` (int32), `loss_mask` (bool: true where
    position `i` is trained on, the completion tokens), `logprobs` (float32, the
    inference logprob, 0 on prompt positions). The payload comes by handle (`payload_dir`
    plus segments per field, already stitched so that they cover the sample's positions),
    inline (per field, the stitched array, one row per position), or not at all (no
    payload fields requested, or routing dropped because of a gap).
    `server` is the URL of the inference server that generated the rollout, when known
    (a reader names it when it drops the sample for a bad payload); `env` the environment
    its prompt came from; `temperature` the temperature it was sampled at.

    Raises ValueError when the fields are inconsistent (lengths, versions, payload forms).
    """

    group_id: str
    rollout_id: str
    start_version: int
    dispatch_version: int
    reward: float
    advantage: float
    token_ids: np.ndarray = attrs.field(converter=token_array, eq=ARRAY_EQ, hash=False)
    loss_mask: np.ndarray = attrs.field(converter=mask_array, eq=ARRAY_EQ, hash=False)
    logprobs: np.ndarray = attrs.field(converter=float_array, eq=ARRAY_EQ, hash=False)
    payload: Mapping[str, tuple[PayloadSegment, ...]] = attrs.field(
        factory=dict, converter=_segments_by_field
    )
    payload_dir: str | None = None
    inline: Mapping[str, np.ndarray] | None = attrs.field(
        default=None, converter=frozen_arrays, eq=ARRAY_EQ, hash=False
    )
    server: str | None = None
    env: str = ""
    temperature: float = DEFAULT_TEMPERATURE

    def __attrs_post_init__(self) -> None:
        length = len(self.token_ids)
        if length == 0:
            raise ValueError("token_ids is empty")
        if len(self.loss_mask) != length or len(self.logprobs) != length:
            raise ValueError(
                f"token_ids, loss_mask and logprobs differ in length "
                f"({length}, {len(self.loss_mask)}, {len(self.logprobs)})"
            )
        if not np.isfinite(self.logprobs).all():
            raise ValueError("logprobs holds a value that is not finite")
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
        for field, array in (self.inline or {}).items():
            if field not in FIELDS:
                raise ValueError(f"unknown inline field {field!r}")
            if array.ndim < 2 or array.shape[0] != length:
                raise ValueError(
                    f"inline {field} has shape {list(array.shape)}, the sample needs {length} rows"
                )
