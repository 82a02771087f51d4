"""prime-rl's micro batches (orchestrator/handoff/primerl): packing follows prime-rl's
rules, and the rank file written from arrays decodes, with msgspec and prime-rl's field
order, to exactly what msgspec itself would have written for the same values."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.handoff.primerl import (
    MicroBatch,
    MicroBatchArrays,
    PackedSample,
    RoutedExperts,
    decode_rank_file,
    encode_rank_file,
    pack_step,
)


def sample(
    length: int, *, seed: int = 0, routed: str | None = "uint8", loss_from: int = 0
) -> PackedSample:
    rng = np.random.default_rng(seed)
    loss = np.zeros(length, dtype=np.bool_)
    loss[loss_from:] = True
    routing = None
    if routed is not None:
        high = 256 if routed == "uint8" else 1000
        routing = rng.integers(0, high, size=(length, 2, 3)).astype(routed)
    return PackedSample(
        token_ids=rng.integers(0, 2**31 - 1, size=length, dtype=np.int64).astype(np.int32),
        loss_mask=loss,
        advantages=np.where(loss, np.float32(0.25 + seed), np.float32(0)),
        logprobs=rng.standard_normal(length).astype(np.float32),
        temperatures=np.full(length, 0.7, dtype=np.float32),
        env_name=f"env{seed % 3}",
        routed_experts=routing,
    )


def decoded(batches: list[MicroBatchArrays]) -> list[MicroBatch]:
    data = b"".join(bytes(part) for part in encode_rank_file(batches))
    return decode_rank_file(data)


def as_struct(batch: MicroBatchArrays) -> MicroBatch:
    """The same micro batch built the ordinary way, for msgspec to encode itself."""
    routed = None
    if batch.routed_experts is not None:
        array = batch.routed_experts
        routed = RoutedExperts(array.tobytes(), list(array.shape), array.dtype.name)
    return MicroBatch(
        input_ids=batch.input_ids.tolist(),
        loss_mask=batch.loss_mask.tolist(),
        advantages=batch.advantages.tolist(),
        inference_logprobs=batch.inference_logprobs.tolist(),
        position_ids=batch.position_ids.tolist(),
        sequence_lengths=list(batch.sequence_lengths),
        temperatures=batch.temperatures.tolist(),
        env_names=[name for name, count in batch.env_names for _ in range(count)],
        seq_lens=list(batch.seq_lens),
        routed_experts=routed,
    )


def test_the_rank_file_is_what_msgspec_writes_for_the_same_values() -> None:
    samples = [sample(n, seed=i) for i, n in enumerate([5, 17, 3, 40, 1])]
    ranks = pack_step(samples, seq_len=64, data_world_size=1)
    (batches,) = ranks
    ours = decoded(batches)
    reference = msgspec.msgpack.decode(
        msgspec.msgpack.encode([as_struct(b) for b in batches]), type=list[MicroBatch]
    )
    assert ours == reference
    assert any(b.routed_experts is not None for b in ours)
    # Without routing too; and every field is there, the unset ones nil, as msgspec
    # writes an array-like struct (the values differ only in width: float32, uint32).
    plain = pack_step([sample(9, routed=None)], seq_len=16, data_world_size=1)[0]
    raw = msgspec.msgpack.decode(b"".join(bytes(part) for part in encode_rank_file(plain)))
    reference = msgspec.msgpack.decode(msgspec.msgpack.encode([as_struct(plain[0])]))
    assert len(raw[0]) == len(reference[0]) == len(MicroBatch.__struct_fields__)
    assert decoded(plain) == [as_struct(plain[0])]


def test_packing_keeps_every_sample_once_within_seq_len_with_positions_restarting() -> None:
    lengths = [30, 7, 64, 12, 12, 50, 1, 33]
    samples = [sample(n, seed=i) for i, n in enumerate(lengths)]
    (batches,) = pack_step(samples, seq_len=64, data_world_size=1)
    assert sorted(n for b in batches for n in b.sequence_lengths) == sorted(lengths)
    for batch in batches:
        assert batch.tokens <= 64 and sum(batch.sequence_lengths) == batch.tokens
        starts = np.cumsum((0, *batch.sequence_lengths[:-1]))
        for start, length in zip(starts, batch.sequence_lengths, strict=True):
            assert batch.position_ids[start : start + length].tolist() == list(range(length))
    # First fit, longest first: the 64-token sample fills a bin alone.
    assert (64,) in [b.sequence_lengths for b in batches]


def test_every_rank_gets_as_many_micro_batches_and_padding_trains_nothing() -> None:
    samples = [sample(n, seed=i) for i, n in enumerate([60, 60, 60, 10, 10])]
    ranks = pack_step(samples, seq_len=64, data_world_size=4)
    assert len({len(r) for r in ranks}) == 1 and len(ranks) == 4
    batches = [b for r in ranks for b in r]
    real = sum(n for b in batches if b.loss_mask.any() for n in b.sequence_lengths)
    assert real == 200
    # Padding batches are zero-loss copies: no loss token, no advantage.
    for batch in batches:
        if not batch.loss_mask.any():
            assert not batch.advantages.any()


def test_bins_are_split_to_feed_every_rank() -> None:
    samples = [sample(8, seed=i) for i in range(8)]
    ranks = pack_step(samples, seq_len=64, data_world_size=4)
    # One bin would hold all 64 tokens; it is split so every rank trains on real data.
    assert all(batch.loss_mask.any() for rank in ranks for batch in rank)
    assert sorted(sum(b.tokens for b in rank) for rank in ranks) == [16, 16, 16, 16]


def test_routing_and_no_routing_never_share_a_micro_batch_and_dtypes_promote() -> None:
    samples = [sample(5, routed=None), sample(6, seed=1), sample(7, seed=2, routed="uint16")]
    (batches,) = pack_step(samples, seq_len=64, data_world_size=1)
    routed = [b for b in batches if b.routed_experts is not None]
    plain = [b for b in batches if b.routed_experts is None]
    assert [b.sequence_lengths for b in plain] == [(5,)]
    (mixed,) = routed
    assert mixed.routed_experts is not None and mixed.routed_experts.dtype == np.uint16
    assert mixed.routed_experts.shape == (13, 2, 3)
    back = decoded(batches)
    by_len = {sum(b.sequence_lengths): b for b in back}
    got = by_len[13].routed_experts
    assert got is not None and got.dtype == "uint16" and got.shape == [13, 2, 3]
    rows = np.frombuffer(got.data, dtype="<u2").reshape(13, 2, 3)
    expected = {7: samples[2], 6: samples[1]}
    start = 0
    for length in by_len[13].sequence_lengths:
        source = expected[length].routed_experts
        assert source is not None
        np.testing.assert_array_equal(rows[start : start + length], source)
        start += length


def test_bad_steps_are_refused() -> None:
    with pytest.raises(ValueError, match="over seq_len"):
        pack_step([sample(65)], seq_len=64, data_world_size=1)
    with pytest.raises(ValueError, match="at least one"):
        pack_step([], seq_len=64, data_world_size=1)
    with pytest.raises(ValueError, match=">= 1"):
        pack_step([sample(3)], seq_len=64, data_world_size=0)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    ranks=st.integers(1, 5),
    seq_len=st.integers(40, 100),
)
def test_any_step_packs_losslessly(lengths: list[int], ranks: int, seq_len: int) -> None:
    samples = [sample(n, seed=i % 7, loss_from=n // 2) for i, n in enumerate(lengths)]
    packed = pack_step(samples, seq_len=seq_len, data_world_size=ranks)
    assert len(packed) == ranks and len({len(r) for r in packed}) == 1
    trained = [b for r in packed for b in r if b.loss_mask.any()]
    # Every sample's loss tokens appear exactly once, in trained batches.
    assert sum(int(b.loss_mask.sum()) for b in trained) == sum(n - n // 2 for n in lengths)
    for rank in packed:
        for batch, back in zip(rank, decoded(rank), strict=True):
            assert back.input_ids == batch.input_ids.tolist()
            assert len(back.env_names) == batch.tokens <= seq_len
