"""What a finished rollout group looks like when it reaches the sink.

Values only (no I/O): the dispatcher builds them from inference responses, the sink scores
and queues them, batch assembly turns queued samples into `TrainSample`s.

Vocabulary (DESIGN §3, §6):
- a *group* is `group_size` rollouts of one prompt (GRPO); its *start version* `g` is the
  applied policy version when its first member was dispatched;
- a *rollout* is one trajectory, dispatched under version `k >= g`; every payload file it
  writes lives in `<root>/v<k>/`;
- a rollout yields one or more *samples*, one per trajectory branch (a branch is a token
  sequence the trainer trains on; branches of one rollout may share payload files).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import attrs

from orchestrator.payload import PayloadSegment


class Discard(enum.Enum):
    """Why a rollout or sample left the sink without shipping (DESIGN §6)."""

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
