"""The array forms real servers put in a generate reply, both ways (docs/protocol.md).

A reply carries per-token arrays in one of the forms its server family uses:

- **packed** (prime-rl's extension): ``{"data": <base64 of the raw little-endian bytes>,
  "shape": [...], "dtype": "<numpy name>"}``; routing adds ``"start"``, the position of
  its first row;
- **npy** (upstream vLLM's ``routed_experts``): base64 of a whole ``.npy`` file, read
  without pickle, its header checked before any byte is trusted;
- **CSR** (prime-rl's ``sampling_mask``): ``{"ids": ..., "counts": ...}``, int32 each, as a
  packed object or as bare base64; ``counts[i]`` kept ids for completion token ``i``;
- **lists** (upstream vLLM's ``sampling_mask``): one list of token ids per completion
  token.

Decoders raise `WireFormatError` with one line naming the field; encoders are what the
local fleet sends, so the daemon's tests read exactly what it writes. Masks come out as
``int32 [tokens, widest]`` padded with ``-1``, the form the payload files hold.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

__all__ = [
    "MISSING_LOGPROB",
    "ROUTING_DTYPES",
    "WireFormatError",
    "decode_mask_csr",
    "decode_mask_lists",
    "decode_npy",
    "decode_packed",
    "encode_mask_csr",
    "encode_mask_lists",
    "encode_npy",
    "encode_packed",
    "mask_from_rows",
    "routing_dtype_for",
]

#: What prime-rl's server writes for a logprob it does not have (vLLM clamps ``-inf`` to it).
MISSING_LOGPROB = -9999.0

#: The dtypes a server may send routed expert ids in: vLLM's per-model capture dtype
#: (uint8 up to 256 experts, else uint16; int32 from a wide capture buffer) and prime-rl's
#: int16 passthrough. prime-rl narrows per reply, so two turns of a rollout may differ.
ROUTING_DTYPES: frozenset[str] = frozenset({"uint8", "uint16", "int16", "int32"})

_PACKED_KEYS = frozenset({"data", "shape", "dtype"})
# A .npy header is a few hundred bytes; a longer one is not a routing array.
_MAX_NPY_HEADER = 4096


class WireFormatError(ValueError):
    """A reply value that is not in the form its key promises: one line."""


def _b64(text: object, what: str) -> bytes:
    if not isinstance(text, str):
        raise WireFormatError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise WireFormatError(f"{what} is not base64") from None


def _shape(value: object, what: str, ndim: int | None) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        raise WireFormatError(f"{what}.shape must be a list of non-negative integers")
    if ndim is not None and len(value) != ndim:
        raise WireFormatError(f"{what}.shape {value} must have {ndim} dimensions")
    return tuple(value)


def _from_bytes(
    raw: bytes | memoryview, dtype: np.dtype[Any], shape: tuple[int, ...], what: str
) -> np.ndarray:
    expected = math.prod(shape) * dtype.itemsize
    if len(raw) != expected:
        raise WireFormatError(
            f"{what}: {len(raw)} data bytes, shape {list(shape)} needs {expected}"
        )
    # bytearray: the array owns writable memory; astype gives native byte order.
    array = np.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
    return array.astype(dtype.newbyteorder("="), copy=False)


def encode_packed(array: np.ndarray, **extra: object) -> dict[str, Any]:
    """``{"data", "shape", "dtype"}`` (plus `extra`, e.g. routing's ``start``)."""
    stored = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return {
        "data": base64.b64encode(stored.reshape(-1).view(np.uint8).data).decode("ascii"),
        "shape": list(array.shape),
        **extra,
        "dtype": array.dtype.name,
    }


def decode_packed(
    obj: object,
    what: str,
    *,
    dtypes: Collection[str],
    ndim: int | None = None,
    extra_keys: Collection[str] = (),
) -> np.ndarray:
    """The array of a packed object with exactly the keys data, shape, dtype (and
    `extra_keys`, read by the caller); its dtype one of `dtypes`."""
    if not isinstance(obj, dict):
        raise WireFormatError(f"{what} must be an object")
    keys = _PACKED_KEYS | set(extra_keys)
    if set(obj) != keys:
        raise WireFormatError(f"{what} must have exactly the keys {sorted(keys)}")
    dtype = obj["dtype"]
    if not isinstance(dtype, str) or dtype not in dtypes:
        raise WireFormatError(f"{what}.dtype {dtype!r} is not one of {sorted(dtypes)}")
    shape = _shape(obj["shape"], what, ndim)
    raw = _b64(obj["data"], f"{what}.data")
    return _from_bytes(raw, np.dtype(dtype).newbyteorder("<"), shape, what)


def encode_npy(array: np.ndarray) -> str:
    """Base64 of the ``.npy`` file of `array` (upstream vLLM's routed_experts)."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return base64.b64encode(buffer.getbuffer()).decode("ascii")


def decode_npy(text: object, what: str, *, dtypes: Collection[str], ndim: int) -> np.ndarray:
    """The array of a base64 ``.npy`` file: format 1.0 to 3.0, no pickled objects, a
    dtype in `dtypes`, `ndim` dimensions, exactly the bytes its header promises."""
    raw = _b64(text, what)
    stream = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            header = np.lib.format.read_array_header_1_0(stream, max_header_size=_MAX_NPY_HEADER)
        elif version in ((2, 0), (3, 0)):
            header = np.lib.format.read_array_header_2_0(stream, max_header_size=_MAX_NPY_HEADER)
        else:
            raise WireFormatError(f"{what}: .npy format {version} is not supported")
    except (ValueError, SyntaxError, TypeError, OverflowError) as exc:
        if isinstance(exc, WireFormatError):
            raise
        reason = " ".join(str(exc).split())[:80]
        raise WireFormatError(f"{what} is not a .npy array ({reason})") from None
    shape, fortran_order, dtype = header
    if dtype.hasobject or dtype.name not in dtypes:
        raise WireFormatError(f"{what}: .npy dtype {dtype.str!r} is not one of {sorted(dtypes)}")
    if len(shape) != ndim:
        raise WireFormatError(f"{what}: .npy shape {list(shape)} must have {ndim} dimensions")
    data = memoryview(raw)[stream.tell() :]
    if fortran_order:
        array = _from_bytes(data, dtype, tuple(reversed(shape)), what).T
        return np.ascontiguousarray(array)
    return _from_bytes(data, dtype, tuple(shape), what)


def mask_from_rows(counts: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``int32 [len(counts), max(counts)]``: row ``i`` holds the next ``counts[i]`` ids,
    then ``-1``. The caller has checked that the counts add up to ``len(ids)``."""
    tokens = len(counts)
    width = int(counts.max()) if tokens else 0
    out = np.full((tokens, width), -1, dtype=np.int32)
    if ids.size:
        rows = np.repeat(np.arange(tokens), counts)
        starts = np.cumsum(counts) - counts
        cols = np.arange(ids.size) - np.repeat(starts, counts)
        out[rows, cols] = ids
    return out


def _csr_part(value: object, what: str) -> np.ndarray:
    if isinstance(value, str):
        raw = _b64(value, what)
        if len(raw) % 4:
            raise WireFormatError(f"{what}: {len(raw)} bytes is not a whole number of int32")
        return np.frombuffer(raw, dtype="<i4").astype(np.int32)
    return decode_packed(value, what, dtypes=("int32",), ndim=1)


def decode_mask_csr(obj: object, what: str, *, tokens: int) -> np.ndarray:
    """A CSR sampling mask for `tokens` completion tokens -> ``int32 [tokens, widest]``."""
    if not isinstance(obj, dict) or set(obj) != {"ids", "counts"}:
        raise WireFormatError(f"{what} must be an object with exactly the keys ids, counts")
    ids = _csr_part(obj["ids"], f"{what}.ids")
    counts = _csr_part(obj["counts"], f"{what}.counts")
    if len(counts) != tokens:
        raise WireFormatError(f"{what}: {len(counts)} counts for {tokens} completion tokens")
    if counts.size and int(counts.min()) < 0:
        raise WireFormatError(f"{what}: negative count")
    if int(counts.sum(dtype=np.int64)) != ids.size:
        raise WireFormatError(f"{what}: counts add up to {int(counts.sum())}, ids has {ids.size}")
    if ids.size and int(ids.min()) < 0:
        raise WireFormatError(f"{what}: negative token id")
    return mask_from_rows(counts, ids)


def encode_mask_csr(mask: np.ndarray) -> dict[str, Any] | None:
    """The CSR form of a ``-1`` padded mask, or None when no token has a kept id (what
    prime-rl's server sends then)."""
    kept = mask >= 0
    counts = kept.sum(axis=1, dtype=np.int32)
    if not counts.any():
        return None
    ids = mask[kept].astype(np.int32)
    return {"ids": encode_packed(ids), "counts": encode_packed(counts)}


def decode_mask_lists(value: object, what: str, *, tokens: int) -> np.ndarray:
    """Upstream vLLM's mask, one list of ids per completion token -> ``int32 [tokens,
    widest]``."""
    if not isinstance(value, list) or len(value) != tokens:
        raise WireFormatError(f"{what} must be a list of {tokens} lists (one per completion token)")
    rows: list[Sequence[int]] = []
    for row in value:
        if not isinstance(row, list) or not all(
            type(token) is int and 0 <= token < 2**31 for token in row
        ):
            raise WireFormatError(f"{what} must hold lists of non-negative int32 token ids")
        rows.append(row)
    counts = np.fromiter((len(row) for row in rows), dtype=np.int64, count=tokens)
    flat = np.fromiter((t for row in rows for t in row), dtype=np.int32, count=int(counts.sum()))
    return mask_from_rows(counts, flat)


def encode_mask_lists(mask: np.ndarray) -> list[list[int]]:
    """Upstream vLLM's mask form of a ``-1`` padded mask."""
    return [[int(t) for t in row if t >= 0] for row in mask]


def routing_dtype_for(ids: np.ndarray) -> np.dtype[Any]:
    """prime-rl's per-reply choice: uint8 when every id fits, else uint16."""
    return np.dtype(np.uint8 if not ids.size or int(ids.max()) <= 255 else np.uint16)
