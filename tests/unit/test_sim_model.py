"""The deterministic MoE model: determinism, routing rules, masks, dtypes, stop tokens."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.sim import (
    SamplingParams,
    SimModel,
    generate,
    prefix_hashes,
    route,
    sample_completion,
)

MODEL = SimModel()


def _tokens(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, MODEL.vocab_size, size=count)


def _assert_distinct_rows(routed: np.ndarray) -> None:
    rows = np.sort(routed.reshape(-1, routed.shape[-1]).astype(np.int64), axis=1)
    assert (np.diff(rows, axis=1) > 0).all(), "an expert repeats within a row"


def test_completion_is_a_pure_function_of_the_request() -> None:
    params = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.9, top_k=20, seed=7)
    first = sample_completion(MODEL, 12345, params, 0)
    again = sample_completion(MODEL, 12345, params, 0)
    np.testing.assert_array_equal(first.token_ids, again.token_ids)
    np.testing.assert_array_equal(first.logprobs, again.logprobs)
    np.testing.assert_array_equal(first.sampling_mask, again.sampling_mask)
    assert first.finish_reason == again.finish_reason


@pytest.mark.parametrize(
    ("prompt_hash", "seed", "index"), [(12346, 7, 0), (12345, 8, 0), (12345, 7, 1)]
)
def test_completion_changes_with_prompt_seed_and_choice(
    prompt_hash: int, seed: int, index: int
) -> None:
    base = sample_completion(MODEL, 12345, SamplingParams(max_tokens=64, seed=7), 0)
    other = sample_completion(MODEL, prompt_hash, SamplingParams(max_tokens=64, seed=seed), index)
    assert base.token_ids.tolist() != other.token_ids.tolist()


def test_completion_lengths_vary_and_finish_reasons_match() -> None:
    reasons = set()
    lengths = set()
    for seed in range(40):
        completion = sample_completion(MODEL, 1, SamplingParams(max_tokens=32, seed=seed), 0)
        length = len(completion.token_ids)
        lengths.add(length)
        reasons.add(completion.finish_reason)
        assert 1 <= length <= 32
        assert len(completion.logprobs) == length
        assert (completion.logprobs <= 0).all()
        eos_positions = np.flatnonzero(completion.token_ids == MODEL.eos_token_id).tolist()
        if completion.finish_reason == "stop":
            assert eos_positions == [length - 1]
        else:
            assert length == 32
            assert eos_positions == []
    assert reasons == {"stop", "length"}
    assert len(lengths) > 5


def test_routing_rows_have_top_k_distinct_experts_in_range() -> None:
    routed = route(MODEL, prefix_hashes(_tokens(500)))
    assert routed.shape == (500, 48, 8)
    assert routed.max() < 128
    _assert_distinct_rows(routed)
    # Ids are spread over every expert, not a handful.
    assert len(np.unique(routed)) == 128


@pytest.mark.parametrize(
    ("num_experts", "dtype"), [(8, np.uint8), (256, np.uint8), (257, np.uint16), (512, np.uint16)]
)
def test_routing_dtype_is_compact(num_experts: int, dtype: type[np.generic]) -> None:
    model = SimModel(layers=4, num_experts=num_experts, top_k=8)
    routed = route(model, prefix_hashes(_tokens(300)))
    assert routed.dtype == dtype
    assert int(routed.max()) < num_experts
    _assert_distinct_rows(routed)


def test_top_k_equal_to_expert_count_routes_to_every_expert() -> None:
    model = SimModel(layers=3, num_experts=8, top_k=8)
    routed = route(model, prefix_hashes(_tokens(50)))
    assert (np.sort(routed, axis=-1) == np.arange(8)).all()


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 6),
    num_experts=st.integers(1, 600),
    top_k_fraction=st.floats(0.0, 1.0),
    tokens=st.lists(st.integers(0, 31999), min_size=1, max_size=40),
)
def test_routing_is_distinct_for_any_shape(
    layers: int, num_experts: int, top_k_fraction: float, tokens: list[int]
) -> None:
    top_k = max(1, round(top_k_fraction * min(num_experts, 16)))
    model = SimModel(layers=layers, num_experts=num_experts, top_k=top_k)
    routed = route(model, prefix_hashes(tokens))
    assert routed.shape == (len(tokens), layers, top_k)
    assert int(routed.max()) < num_experts
    _assert_distinct_rows(routed)


def test_same_prefix_gives_same_routing_rows() -> None:
    tokens = _tokens(300)
    longer = np.concatenate([tokens, _tokens(100, seed=1)])
    short = route(MODEL, prefix_hashes(tokens))
    long = route(MODEL, prefix_hashes(longer))
    np.testing.assert_array_equal(long[:300], short)


def test_routing_row_depends_on_the_whole_prefix() -> None:
    tokens = _tokens(200)
    changed = tokens.copy()
    changed[100] = (changed[100] + 1) % MODEL.vocab_size
    before = route(MODEL, prefix_hashes(tokens))
    after = route(MODEL, prefix_hashes(changed))
    np.testing.assert_array_equal(before[:100], after[:100])
    # Every later position sees a different prefix: its rows differ (all 48 layers equal
    # by chance is vanishingly unlikely).
    differs = (before[100:] != after[100:]).any(axis=(1, 2))
    assert differs.all()


def test_prefix_hashes_depend_on_length_and_tokens() -> None:
    hashes = prefix_hashes([0, 0, 0, 0])
    assert len(set(hashes.tolist())) == 4
    assert prefix_hashes([5, 6]).tolist() == prefix_hashes([5, 6, 7])[:2].tolist()
    assert prefix_hashes([5, 6])[1] != prefix_hashes([6, 5])[1]


def test_sampling_mask_is_padded_with_minus_one_and_starts_with_the_token() -> None:
    params = SamplingParams(max_tokens=200, top_k=20, seed=3)
    completion = sample_completion(MODEL, 99, params, 0)
    mask = completion.sampling_mask
    assert mask.dtype == np.int32
    assert mask.shape[0] == len(completion.token_ids)
    np.testing.assert_array_equal(mask[:, 0], completion.token_ids)
    widths = (mask != -1).sum(axis=1)
    assert widths.min() >= 1
    assert widths.max() == mask.shape[1] <= 20
    assert len(set(widths.tolist())) > 1, "widths should vary"
    for row, width in zip(mask, widths, strict=True):
        assert (row[width:] == -1).all(), "padding only after the allowed ids"
        allowed = row[:width]
        assert len(set(allowed.tolist())) == width
        assert ((allowed >= 0) & (allowed < MODEL.vocab_size)).all()


def test_greedy_masks_are_one_token_wide() -> None:
    completion = sample_completion(MODEL, 5, SamplingParams(max_tokens=50, temperature=0), 0)
    assert completion.sampling_mask.shape == (len(completion.token_ids), 1)


def test_top_p_narrows_masks() -> None:
    wide = sample_completion(MODEL, 5, SamplingParams(max_tokens=100, top_k=40, seed=1), 0)
    narrow = sample_completion(
        MODEL, 5, SamplingParams(max_tokens=100, top_k=40, top_p=0.25, seed=1), 0
    )
    assert (narrow.sampling_mask != -1).sum() < (wide.sampling_mask != -1).sum() / 2


@pytest.mark.parametrize("start", [0, 37, 99])
def test_generate_routes_from_the_start_to_the_second_to_last_token(start: int) -> None:
    prompt = _tokens(100)
    params = SamplingParams(max_tokens=30, seed=2)
    generation = generate(MODEL, prompt, prefix_hashes(prompt), params, 0, routing_start=start)
    completion_len = len(generation.completion.token_ids)
    assert generation.routing_start == start
    assert generation.routed_experts is not None
    assert generation.routed_experts.shape == (100 + completion_len - 1 - start, 48, 8)
    sequence = np.concatenate([prompt, generation.completion.token_ids])
    full = route(MODEL, prefix_hashes(sequence[:-1]))
    np.testing.assert_array_equal(generation.routed_experts, full[start:])


def test_generate_without_routing_samples_the_same_completion() -> None:
    prompt = _tokens(50)
    params = SamplingParams(max_tokens=30, seed=2)
    routed = generate(MODEL, prompt, prefix_hashes(prompt), params, 0, routing_start=0)
    plain = generate(MODEL, prompt, prefix_hashes(prompt), params, 0, routing_start=None)
    assert plain.routed_experts is None
    np.testing.assert_array_equal(plain.completion.token_ids, routed.completion.token_ids)


@pytest.mark.parametrize("start", [-1, 50])
def test_generate_refuses_a_start_outside_the_prompt(start: int) -> None:
    prompt = _tokens(50)
    with pytest.raises(ValueError, match="routing_start"):
        generate(MODEL, prompt, prefix_hashes(prompt), SamplingParams(max_tokens=4), 0, start)


def test_logprobs_are_float32() -> None:
    completion = sample_completion(MODEL, 3, SamplingParams(max_tokens=20, seed=4), 0)
    assert completion.logprobs.dtype == np.float32


def test_a_sampled_stop_token_ends_the_completion() -> None:
    params = SamplingParams(max_tokens=64, top_k=10, seed=5)
    free = sample_completion(MODEL, 77, params, 0)
    assert len(free.token_ids) > 6
    stop = int(free.token_ids[5])
    first = int(np.flatnonzero(free.token_ids == stop)[0])
    stopped = sample_completion(
        MODEL, 77, SamplingParams(max_tokens=64, top_k=10, seed=5, stop_token_ids=[stop, 31999]), 0
    )
    assert stopped.finish_reason == "stop"
    # The stop token is kept, as vLLM keeps it; everything before it is what the free
    # request sampled.
    np.testing.assert_array_equal(stopped.token_ids, free.token_ids[: first + 1])
    np.testing.assert_array_equal(stopped.logprobs, free.logprobs[: first + 1])
    widths = (stopped.sampling_mask >= 0).sum(axis=1)
    assert stopped.sampling_mask.shape[1] == widths.max()
    np.testing.assert_array_equal(
        stopped.sampling_mask, free.sampling_mask[: first + 1, : stopped.sampling_mask.shape[1]]
    )


def test_stop_token_ids_never_sampled_change_nothing() -> None:
    params = SamplingParams(max_tokens=40, seed=6)
    free = sample_completion(MODEL, 8, params, 0)
    unused = next(t for t in range(3, MODEL.vocab_size) if t not in set(free.token_ids.tolist()))
    same = sample_completion(
        MODEL, 8, SamplingParams(max_tokens=40, seed=6, stop_token_ids=[unused]), 0
    )
    np.testing.assert_array_equal(same.token_ids, free.token_ids)
    assert same.finish_reason == free.finish_reason


def test_model_rejects_impossible_shapes() -> None:
    with pytest.raises(ValueError, match="top_k"):
        SimModel(num_experts=4, top_k=8)
    with pytest.raises(ValueError, match="num_experts"):
        SimModel(num_experts=70000)
    with pytest.raises(ValueError, match="eos_token_id"):
        SimModel(vocab_size=2, eos_token_id=2)
