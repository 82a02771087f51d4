"""prime-rl's rank file: a msgpack list of `MicroBatch`, written from arrays, read back.

prime-rl (`src/prime_rl/transports/rollouts/types.py`) declares `MicroBatch`,
`RoutedExperts` as msgspec structs with ``array_like=True``: each is a msgpack array of
its fields in declaration order, trailing defaults left out. Its trainer decodes
``list[MicroBatch]`` from ``rollouts/step_N/rank_R.bin``.

Writing goes around Python objects: a micro batch of 50,000 tokens would be half a
million Python ints and floats for msgspec to walk. Each per-token list is encoded by
numpy in one pass instead, every element in a fixed-width msgpack form (``uint 32`` for
ids, ``float 32`` for reals, ``true``/``false``), which any msgpack decoder reads as
the same values; every field of `MicroBatch` is written, the unset ones nil, as msgspec
writes an array-like struct. The result is a list of buffers for `os.writev`. The structs below
follow prime-rl's field order, and decoding with them (what the local trainer does) is
the check that the hand-made bytes are what msgspec means by those types.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import msgspec
import numpy as np

from orchestrator.handoff.primerl.micro_batches import MicroBatchArrays

__all__ = ["MicroBatch", "RoutedExperts", "decode_rank_file", "encode_rank_file"]


class RoutedExperts(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """prime-rl's `RoutedExperts`: raw bytes, ``[tokens, layers, top_k]``, dtype."""

    data: bytes
    shape: list[int]
    dtype: str


class MicroBatch(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """prime-rl's `MicroBatch`, in its field order (the fields this project never sets
    are kept so that positions match)."""

    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]
    sequence_lengths: list[int]
    temperatures: list[float]
    env_names: list[str]
    seq_lens: list[int]
    ref_logprobs: list[float] | None = None
    routed_experts: RoutedExperts | None = None
    mm_kwargs: dict[str, object] | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None


_DECODER = msgspec.msgpack.Decoder(list[MicroBatch])
_MICRO_BATCH_FIELDS = len(MicroBatch.__struct_fields__)
_NIL = b"\xc0"


def decode_rank_file(data: bytes) -> list[MicroBatch]:
    """Decode one rank file as prime-rl's trainer does. Raises msgspec errors."""
    return _DECODER.decode(data)


def _array_header(length: int) -> bytes:
    if length < 16:
        return bytes((0x90 | length,))
    if length < 1 << 16:
        return b"\xdc" + struct.pack(">H", length)
    return b"\xdd" + struct.pack(">I", length)


def _fixed(values: np.ndarray, marker: int, wire: str) -> np.ndarray:
    """Each value as ``marker`` then its 4 big-endian bytes (`wire`: ``>u4`` or ``>f4``)."""
    out = np.empty((len(values), 5), dtype=np.uint8)
    out[:, 0] = marker
    out[:, 1:] = values.astype(wire).view(np.uint8).reshape(-1, 4)
    return out.reshape(-1)


def _uints(values: np.ndarray) -> list[bytes | np.ndarray]:
    if values.size and int(values.min()) < 0:
        raise ValueError("ids and positions must not be negative")
    return [_array_header(len(values)), _fixed(values, 0xCE, ">u4")]


def _floats(values: np.ndarray) -> list[bytes | np.ndarray]:
    return [_array_header(len(values)), _fixed(values, 0xCA, ">f4")]


def _bools(values: np.ndarray) -> list[bytes | np.ndarray]:
    return [_array_header(len(values)), np.where(values, 0xC3, 0xC2).astype(np.uint8)]


def _names(runs: Sequence[tuple[str, int]]) -> list[bytes | np.ndarray]:
    total = sum(count for _, count in runs)
    parts: list[bytes | np.ndarray] = [_array_header(total)]
    for name, count in runs:
        parts.append(msgspec.msgpack.encode(name) * count)
    return parts


def _routed(routed: np.ndarray) -> list[bytes | np.ndarray]:
    data = np.ascontiguousarray(routed, dtype=routed.dtype.newbyteorder("<"))
    raw = data.reshape(-1).view(np.uint8)
    return [
        b"\x93\xc6" + struct.pack(">I", raw.nbytes),
        raw,
        msgspec.msgpack.encode(list(routed.shape)),
        msgspec.msgpack.encode(routed.dtype.name),
    ]


def encode_micro_batch(batch: MicroBatchArrays) -> list[bytes | np.ndarray]:
    """One micro batch as prime-rl's `MicroBatch` in msgpack, as buffers in order."""
    # All of prime-rl's fields, the unset ones nil, as msgspec writes an array-like struct.
    parts: list[bytes | np.ndarray] = [_array_header(_MICRO_BATCH_FIELDS)]
    parts += _uints(batch.input_ids)
    parts += _bools(batch.loss_mask)
    parts += _floats(batch.advantages)
    parts += _floats(batch.inference_logprobs)
    parts += _uints(batch.position_ids)
    parts.append(msgspec.msgpack.encode(list(batch.sequence_lengths)))
    parts += _floats(batch.temperatures)
    parts += _names(batch.env_names)
    parts.append(msgspec.msgpack.encode(list(batch.seq_lens)))
    parts.append(_NIL)  # ref_logprobs
    if batch.routed_experts is not None:
        parts += _routed(batch.routed_experts)
    else:
        parts.append(_NIL)
    # mm_kwargs, mm_token_type_ids, rl_weights, ce_weights, ref_kl_weights
    parts.append(_NIL * (_MICRO_BATCH_FIELDS - 11))
    return parts


def encode_rank_file(micro_batches: Sequence[MicroBatchArrays]) -> list[bytes | np.ndarray]:
    """A rank's file, ``list[MicroBatch]`` in msgpack, as buffers for `os.writev`."""
    parts: list[bytes | np.ndarray] = [_array_header(len(micro_batches))]
    for batch in micro_batches:
        parts += encode_micro_batch(batch)
    return parts
