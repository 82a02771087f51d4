"""A step's samples packed into prime-rl's micro batches, one list per data rank (pure).

prime-rl's trainer (`src/prime_rl/trainer/batch.py`, `prepare_batch`) takes, per data
rank, a list of micro batches: samples packed back to back into sequences of at most
`seq_len` tokens, each sample's positions counting from 0 again, and every rank gets the
same number of micro batches (FSDP steps all ranks together). This module does the same
packing over arrays, with the same rules:

1. samples are packed first-fit, longest first, into bins of at most `seq_len` tokens; a
   sample with routing never shares a bin with one without;
2. with several ranks, the bins with the most tokens are split in two (longest sample
   first onto the lighter half) until there are at least as many bins as ranks, and a
   multiple of them when splitting allows;
3. zero-loss copies of the first bin fill the count up to a multiple of the ranks;
4. bins go to ranks by balanced partition of their token counts, the same number each.

Token counts stand in for prime-rl's compute estimate (its `bin_cost` without a model
config is the same).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

__all__ = ["MicroBatchArrays", "PackedSample", "pack_step"]


@attrs.frozen(eq=False)
class PackedSample:
    """One sample as a micro batch takes it: per position its token id, whether it is in
    the loss, its advantage (the sample's on loss positions, 0 elsewhere), its inference
    logprob and sampling temperature; the environment's name; routed experts
    ``[length, layers, top_k]`` or None."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    logprobs: np.ndarray
    temperatures: np.ndarray
    env_name: str
    routed_experts: np.ndarray | None = None

    @property
    def length(self) -> int:
        return len(self.token_ids)


@attrs.frozen(eq=False)
class MicroBatchArrays:
    """One micro batch: the fields of prime-rl's `MicroBatch`, as arrays.

    `sequence_lengths` and `seq_lens` are the packed samples' lengths (prime-rl keeps
    both); `env_names` holds one name per position; `routed_experts` is
    ``[tokens, layers, top_k]`` in the widest dtype of the packed samples, or None.

    Not part of prime-rl's `MicroBatch` (the rank file leaves them out):
    `sample_indices` are the packed samples' indices in `pack_step`'s `samples`, in
    order, so a writer can say which sample each sequence is; `padding` marks a
    zero-loss copy (rule 3), which keeps its template's `sample_indices`.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    inference_logprobs: np.ndarray
    position_ids: np.ndarray
    sequence_lengths: tuple[int, ...]
    temperatures: np.ndarray
    env_names: tuple[tuple[str, int], ...]  # (name, positions) runs, in order
    routed_experts: np.ndarray | None = None
    sample_indices: tuple[int, ...] = ()
    padding: bool = False

    @property
    def tokens(self) -> int:
        return len(self.input_ids)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return self.sequence_lengths


def pack_step(
    samples: Sequence[PackedSample], *, seq_len: int, data_world_size: int
) -> list[list[MicroBatchArrays]]:
    """The micro batches of each data rank (see the module docstring).

    Raises ValueError for a sample longer than `seq_len` (the daemon discards those before
    they queue), for no samples, or for a bad `seq_len` or `data_world_size`.
    """
    if seq_len < 1 or data_world_size < 1:
        raise ValueError(
            f"seq_len and data_world_size must be >= 1, got {seq_len}, {data_world_size}"
        )
    if not samples:
        raise ValueError("a step needs at least one sample")
    for index, sample in enumerate(samples):
        if sample.length > seq_len:
            raise ValueError(f"sample {index} has {sample.length} tokens, over seq_len {seq_len}")
    bins = _first_fit_decreasing(samples, seq_len)
    if data_world_size > 1:
        target = max(-(-len(bins) // data_world_size) * data_world_size, data_world_size)
        _split_until(bins, samples, target)
    micro_batches = [_materialize(samples, members) for members in bins]
    padding = -len(micro_batches) % data_world_size
    micro_batches.extend(_zero_loss(micro_batches[0]) for _ in range(padding))
    return _distribute(micro_batches, data_world_size)


def _first_fit_decreasing(samples: Sequence[PackedSample], seq_len: int) -> list[list[int]]:
    order = sorted(range(len(samples)), key=lambda i: -samples[i].length)
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in order:
        sample = samples[index]
        routed = sample.routed_experts is not None
        for slot, members in enumerate(bins):
            fits = loads[slot] + sample.length <= seq_len
            if fits and (samples[members[0]].routed_experts is not None) == routed:
                members.append(index)
                loads[slot] += sample.length
                break
        else:
            bins.append([index])
            loads.append(sample.length)
    return bins


def _split_until(bins: list[list[int]], samples: Sequence[PackedSample], target: int) -> None:
    """Split the heaviest splittable bin in two until there are `target` bins."""
    while len(bins) < target:
        splittable = [i for i, members in enumerate(bins) if len(members) > 1]
        if not splittable:
            return
        heaviest = max(splittable, key=lambda i: sum(samples[m].length for m in bins[i]))
        left: list[int] = []
        right: list[int] = []
        left_load = right_load = 0
        for member in sorted(bins[heaviest], key=lambda m: -samples[m].length):
            if left_load <= right_load:
                left.append(member)
                left_load += samples[member].length
            else:
                right.append(member)
                right_load += samples[member].length
        bins[heaviest] = left
        bins.append(right)


def _materialize(samples: Sequence[PackedSample], members: Sequence[int]) -> MicroBatchArrays:
    packed = [samples[i] for i in members]
    routing = [s.routed_experts for s in packed]
    routed: np.ndarray | None = None
    if routing[0] is not None:
        arrays = [r for r in routing if r is not None]
        dtype = np.result_type(*(r.dtype for r in arrays))
        routed = np.concatenate([r.astype(dtype, copy=False) for r in arrays])
    return MicroBatchArrays(
        input_ids=np.concatenate([s.token_ids for s in packed]),
        loss_mask=np.concatenate([s.loss_mask for s in packed]),
        advantages=np.concatenate([s.advantages for s in packed]),
        inference_logprobs=np.concatenate([s.logprobs for s in packed]),
        position_ids=np.concatenate([np.arange(s.length, dtype=np.int32) for s in packed]),
        sequence_lengths=tuple(s.length for s in packed),
        temperatures=np.concatenate([s.temperatures for s in packed]),
        env_names=tuple((s.env_name, s.length) for s in packed),
        routed_experts=routed,
        sample_indices=tuple(members),
    )


def _zero_loss(template: MicroBatchArrays) -> MicroBatchArrays:
    """A copy of `template` that trains nothing: what pads a step's micro batches up to a
    multiple of the ranks (prime-rl's dummy batch)."""
    return attrs.evolve(
        template,
        loss_mask=np.zeros_like(template.loss_mask),
        advantages=np.zeros_like(template.advantages),
        padding=True,
    )


def _distribute(micro_batches: list[MicroBatchArrays], ranks: int) -> list[list[MicroBatchArrays]]:
    """The same number of micro batches per rank, token loads balanced: heaviest first,
    each to the lightest rank that still has room (ties to the lowest rank)."""
    per_rank = len(micro_batches) // ranks
    order = sorted(range(len(micro_batches)), key=lambda i: (-micro_batches[i].tokens, i))
    assigned: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for index in order:
        open_ranks = [r for r in range(ranks) if len(assigned[r]) < per_rank]
        rank = min(open_ranks, key=lambda r: (loads[r], r))
        assigned[rank].append(index)
        loads[rank] += micro_batches[index].tokens
    return [[micro_batches[i] for i in sorted(indices)] for indices in assigned]
