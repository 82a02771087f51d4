"""A deterministic stand-in for a mixture-of-experts language model.

Nothing here is learned: every output is a pure function of its inputs, computed with
vectorised counter-based hashing, so a test can recompute what a server returned and
the local fleet costs milliseconds per request instead of a GPU.

- Completions (tokens, float32 logprobs, finish reason, sampling masks) are drawn from a
  numpy generator seeded by the request: the prompt, the sampling seed and the choice
  index. A sampled stop token (the model's EOS or one of the request's `stop_token_ids`)
  ends the completion, as in vLLM: the stop token is its last token.
- Routing rows depend only on the token prefix that ends at their position, like a real
  batch-invariant model: a later turn that recomputes a position gets the same experts,
  so the rows of a position are the same whichever turn returns them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Literal

import attrs
import numpy as np
import numpy.typing as npt

from orchestrator.payload import compact_routed_experts

__all__ = [
    "Completion",
    "Generation",
    "SamplingParams",
    "SimModel",
    "generate",
    "prefix_hashes",
    "route",
    "sample_completion",
]

UInt64Array = npt.NDArray[np.uint64]

# splitmix64's constants (Steele, Lea and Flood): a cheap bijective 64-bit finaliser whose
# output bits all depend on every input bit, which is what turns counters into randomness.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
# An odd base is invertible modulo 2**64, which lets the rolling prefix hash below be
# computed with one cumulative sum instead of a Python loop over tokens.
_BASE = 0x100000001B3
_BASE_INVERSE = pow(_BASE, -1, 2**64)

# When the request does not bound the sampler (top_k disabled), masks are at most this wide.
_UNBOUNDED_MASK_WIDTH = 64


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value}")


def _top_k_fits(instance: SimModel, _: attrs.Attribute[int], value: int) -> None:
    if value > instance.num_experts:
        raise ValueError(f"top_k ({value}) must not exceed num_experts ({instance.num_experts})")


def _expert_count(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    # uint16 is the widest routing dtype the payload protocol has.
    if not 1 <= value <= 2**16:
        raise ValueError(f"{attribute.name} must be in [1, 65536], got {value}")


@attrs.frozen
class SimModel:
    """The shape of the simulated model and the seed that makes it this model.

    Raises `ValueError` from the constructor when a field is out of range.
    """

    layers: int = attrs.field(default=48, validator=_positive)
    num_experts: int = attrs.field(default=128, validator=_expert_count)
    top_k: int = attrs.field(default=8, validator=[_positive, _top_k_fits])
    vocab_size: int = attrs.field(default=32000, validator=attrs.validators.ge(2))
    eos_token_id: int = attrs.field(default=2, validator=attrs.validators.ge(0))
    seed: int = attrs.field(default=0, validator=attrs.validators.ge(0))

    def __attrs_post_init__(self) -> None:
        if self.eos_token_id >= self.vocab_size:
            raise ValueError(
                f"eos_token_id ({self.eos_token_id}) must be below vocab_size ({self.vocab_size})"
            )


def _int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


@attrs.frozen
class SamplingParams:
    """The sampler settings of one request (vLLM's names and meanings).

    `top_k <= 0` disables top-k; `temperature == 0` is greedy (masks one token wide).
    Sampling any of `stop_token_ids` (or the model's EOS) ends the completion.
    """

    max_tokens: int = attrs.field(validator=_positive)
    temperature: float = attrs.field(default=1.0, validator=attrs.validators.ge(0.0))
    top_p: float = attrs.field(
        default=1.0, validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)]
    )
    top_k: int = -1
    seed: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)


@attrs.frozen
class Completion:
    """One sampled continuation of a prompt.

    `sampling_mask` row `i` holds the token ids the sampler allowed for completion token
    `i` (the sampled one first), padded with `-1` to the widest row.
    """

    token_ids: npt.NDArray[np.int64]
    logprobs: npt.NDArray[np.float32]
    finish_reason: Literal["stop", "length"]
    sampling_mask: npt.NDArray[np.int32]


def _splitmix64(values: UInt64Array) -> UInt64Array:
    """splitmix64's finaliser over an array (wrapping uint64 arithmetic, no Python loop)."""
    z = values + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _powers(base: int, count: int) -> UInt64Array:
    """`base**0 .. base**(count-1)` modulo 2**64."""
    powers = np.empty(count, dtype=np.uint64)
    if count:
        powers[0] = 1
        powers[1:] = np.cumprod(np.full(count - 1, base, dtype=np.uint64))
    return powers


def prefix_hashes(tokens: npt.ArrayLike) -> UInt64Array:
    """Hash of every token prefix: element `p` is a function of `tokens[0..p]` only.

    A polynomial rolling hash `sum(t_i * B**(p-i))`, computed for all `p` at once as
    `B**p * cumsum(t_i * B**-i)` modulo 2**64, then mixed with the position so prefixes of
    different lengths never share a hash by construction.
    """
    shifted = np.asarray(tokens, dtype=np.int64).astype(np.uint64) + np.uint64(1)
    count = shifted.shape[0]
    rolling = _powers(_BASE, count) * np.cumsum(shifted * _powers(_BASE_INVERSE, count))
    positions = np.arange(count, dtype=np.uint64)
    return _splitmix64(rolling ^ _splitmix64(positions))


def _coprime_strides(num_experts: int) -> npt.NDArray[np.int32]:
    """Strides that visit every expert before repeating: those coprime to `num_experts`."""
    candidates = np.arange(1, max(num_experts, 2), dtype=np.int32)
    coprime: npt.NDArray[np.int32] = candidates[np.gcd(candidates, num_experts) == 1]
    return coprime


# Each layer routes through a fixed set of this many expert tuples (a power of two, so
# a hash picks one with a mask). Plenty for a simulator, and it makes routing a single
# gather of whole rows: no per-element arithmetic on the [rows, layers, top_k] block.
_PATTERNS_PER_LAYER = 4096


# A pure function of the model, built once per model and shared read-only: building the
# patterns costs more than routing a long request.
@functools.lru_cache(maxsize=8)
def _routing_patterns(model: SimModel) -> npt.NDArray[np.unsignedinteger]:
    """Per layer, `_PATTERNS_PER_LAYER` tuples of `top_k` distinct experts.

    A tuple is an arithmetic progression `start + stride * j` modulo the expert count with
    a stride coprime to it (so no expert repeats), seen through a fixed random permutation
    of the layer's experts (so ids look scattered). Shape `[layers * patterns, top_k]`,
    compact dtype (uint8 for at most 256 experts, else uint16).
    """
    layers, experts, top_k = model.layers, model.num_experts, model.top_k
    rng = np.random.default_rng([model.seed, layers, experts, top_k])
    permutations = rng.permuted(np.tile(np.arange(experts), (layers, 1)), axis=1)
    shape = (layers, _PATTERNS_PER_LAYER, 1)
    start = rng.integers(0, experts, size=shape)
    stride = rng.choice(_coprime_strides(experts), size=shape)
    slots = (start + stride * np.arange(top_k)) % experts
    patterns = permutations[np.arange(layers)[:, None, None], slots]
    compact = compact_routed_experts(patterns, experts).reshape(-1, top_k)
    compact.flags.writeable = False
    return compact


def route(model: SimModel, hashes: UInt64Array) -> npt.NDArray[np.unsignedinteger]:
    """Routed expert ids `[len(hashes), layers, top_k]` for positions with these prefix hashes.

    Each `(position, layer)` gets `top_k` distinct experts, a tuple the position's prefix
    hash picks among the layer's fixed patterns. The dtype is uint8 for at most 256
    experts, else uint16 (`compact_routed_experts`).
    """
    layers = model.layers
    layer_salts = _splitmix64(np.arange(layers, dtype=np.uint64) + np.uint64(model.seed) * _GOLDEN)
    keys = _splitmix64(hashes[:, None] ^ layer_salts[None, :])
    picks = (keys & np.uint64(_PATTERNS_PER_LAYER - 1)).astype(np.intp)
    picks += np.arange(layers, dtype=np.intp) * _PATTERNS_PER_LAYER
    routed: npt.NDArray[np.unsignedinteger] = np.take(_routing_patterns(model), picks, axis=0)
    return routed


def sample_completion(
    model: SimModel, prompt_hash: int, params: SamplingParams, index: int
) -> Completion:
    """Sample choice `index` of a request whose prompt has hash `prompt_hash`.

    The length is drawn from the seed: a natural stop (ending with `eos_token_id`,
    `finish_reason="stop"`) when it falls within `max_tokens`, else `"length"`. A token of
    `params.stop_token_ids` sampled earlier stops there (`"stop"`, the token kept last).
    Logprobs are float32, as vLLM computes them, so every reply form carries the same
    values.
    """
    rng = np.random.default_rng([params.seed, index, prompt_hash, model.seed])
    max_tokens = params.max_tokens
    natural = int(rng.integers(max(1, max_tokens // 8), max_tokens + max_tokens // 2 + 1))
    stops = natural <= max_tokens
    length = natural if stops else max_tokens

    # Draw among the ids other than EOS, then step over EOS, so only a stop emits it.
    tokens = rng.integers(0, model.vocab_size - 1, size=length)
    tokens[tokens >= model.eos_token_id] += 1
    if stops:
        tokens[-1] = model.eos_token_id
    logprobs = -rng.exponential(scale=0.5 * max(params.temperature, 0.05), size=length)
    mask = _sampling_mask(model, rng, tokens, params)
    # Everything is drawn at full length first, so a stop token only cuts: the same
    # request with or without stop_token_ids agrees on every token both sample.
    if params.stop_token_ids:
        hits = np.flatnonzero(np.isin(tokens, np.asarray(params.stop_token_ids, dtype=np.int64)))
        if hits.size:
            length = int(hits[0]) + 1
            stops = True
            tokens, logprobs, mask = tokens[:length], logprobs[:length], mask[:length]
            mask = mask[:, : int((mask >= 0).sum(axis=1).max())]
    return Completion(
        token_ids=tokens,
        logprobs=logprobs.astype(np.float32),
        finish_reason="stop" if stops else "length",
        sampling_mask=np.ascontiguousarray(mask),
    )


def _sampling_mask(
    model: SimModel,
    rng: np.random.Generator,
    tokens: npt.NDArray[np.int64],
    params: SamplingParams,
) -> npt.NDArray[np.int32]:
    """Per token, the ids the sampler allowed: the sampled one, then distinct others."""
    length = tokens.shape[0]
    widths: npt.NDArray[np.int64]
    if params.temperature == 0:
        widths = np.ones(length, dtype=np.int64)
    else:
        cap = params.top_k if params.top_k > 0 else _UNBOUNDED_MASK_WIDTH
        cap = min(cap, model.vocab_size)
        widths = np.asarray(rng.integers(1, cap + 1, size=length), dtype=np.int64)
        if params.top_p < 1.0:
            widths = np.maximum(1, np.ceil(widths * params.top_p)).astype(np.int64)
    widest = int(widths.max())
    # Positive steps whose running sum stays below vocab_size give distinct ids modulo the
    # vocabulary, all different from the sampled token.
    max_step = max(1, (model.vocab_size - 1) // max(1, widest - 1))
    offsets = np.cumsum(rng.integers(1, max_step + 1, size=(length, widest - 1)), axis=1)
    mask = np.empty((length, widest), dtype=np.int32)
    mask[:, 0] = tokens
    mask[:, 1:] = (tokens[:, None] + offsets) % model.vocab_size
    mask[np.arange(widest)[None, :] >= widths[:, None]] = -1
    return mask


@attrs.frozen
class Generation:
    """One choice as the server computes it: the completion and its routing rows.

    `routed_experts` row `i` is position `routing_start + i` of prompt + completion, up to
    the second-to-last token (the last sampled token is never run forward): `prompt_len +
    len(completion) - 1 - routing_start` rows. None when routing is not captured.
    """

    completion: Completion
    routing_start: int
    routed_experts: npt.NDArray[np.unsignedinteger] | None


def generate(
    model: SimModel,
    prompt: npt.NDArray[np.int64],
    prompt_hashes: UInt64Array,
    params: SamplingParams,
    index: int,
    routing_start: int | None,
) -> Generation:
    """Sample choice `index` for `prompt` and route it from position `routing_start`
    (None: no routing is captured).

    `prompt_hashes` must be `prefix_hashes(prompt)`; `routing_start` below `len(prompt)`.
    """
    completion = sample_completion(model, int(prompt_hashes[-1]), params, index)
    if routing_start is None:
        return Generation(completion=completion, routing_start=0, routed_experts=None)
    if not 0 <= routing_start < prompt.shape[0]:
        raise ValueError(f"routing_start {routing_start} is not a prompt position")
    # The last sampled token is never run forward: it has no routing row.
    sequence = np.concatenate([prompt, completion.token_ids[:-1]])
    hashes = prefix_hashes(sequence)
    return Generation(
        completion=completion,
        routing_start=routing_start,
        routed_experts=route(model, hashes[routing_start:]),
    )
