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

Decoders take a value either as raw JSON text (`msgspec.Raw`, what the reply parser
hands them without building Python strings for megabytes of base64) or as an already
decoded Python object, check it against msgspec types (base64 is decoded in C by msgspec:
five times faster than `base64.b64decode`, which matters at 2 MB of routing a reply), and
raise `WireFormatError` with one line naming the field. Encoders are what the local fleet
sends, so the daemon's tests read exactly what it writes. Masks come out as
``int32 [tokens, widest]`` padded with ``-1``, the form the payload files hold.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Collection
from typing import Any

import msgspec
import numpy as np

__all__ = [
    "MISSING_LOGPROB",
    "ROUTING_DTYPES",
    "WireFormatError",
    "decode_mask",
    "decode_npy",
    "decode_packed",
    "decode_packed_routing",
    "encode_mask_csr",
    "encode_mask_lists",
    "encode_npy",
    "encode_packed",
    "mask_from_rows",
    "routing_dtype_for",
    "typed",
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


class Packed(msgspec.Struct, forbid_unknown_fields=True):
    """prime-rl's packed array: base64 of the raw little-endian bytes, shape, dtype."""

    data: bytes
    shape: list[int]
    dtype: str


class PackedRouting(msgspec.Struct, forbid_unknown_fields=True):
    """prime-rl's inline routing: a packed array whose first row is position `start`."""

    data: bytes
    shape: list[int]
    start: int
    dtype: str


class CSRMask(msgspec.Struct, forbid_unknown_fields=True):
    """prime-rl's sampling mask: concatenated kept ids, and a count per completion token;
    each part packed, or bare base64 of int32s."""

    ids: Packed | bytes
    counts: Packed | bytes


def typed(value: object, kind: Any, what: str) -> Any:
    """`value` (raw JSON text as `msgspec.Raw`, or a decoded object) as `kind` (a type
    msgspec understands; the caller annotates what it gets)."""
    try:
        if isinstance(value, msgspec.Raw):
            return msgspec.json.decode(value, type=kind)
        return msgspec.convert(value, kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise WireFormatError(f"{what}: {' '.join(str(exc).split())}") from None


def _shape(value: list[int], what: str, ndim: int | None) -> tuple[int, ...]:
    if any(d < 0 for d in value):
        raise WireFormatError(f"{what}.shape {value} has a negative dimension")
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


def _packed_array(
    packed: Packed | PackedRouting, what: str, dtypes: Collection[str], ndim: int | None
) -> np.ndarray:
    if packed.dtype not in dtypes:
        raise WireFormatError(f"{what}.dtype {packed.dtype!r} is not one of {sorted(dtypes)}")
    shape = _shape(packed.shape, what, ndim)
    return _from_bytes(packed.data, np.dtype(packed.dtype).newbyteorder("<"), shape, what)


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
    value: object, what: str, *, dtypes: Collection[str], ndim: int | None = None
) -> np.ndarray:
    """The array of a packed object with exactly the keys data, shape, dtype; its dtype
    one of `dtypes`."""
    return _packed_array(typed(value, Packed, what), what, dtypes, ndim)


def decode_packed_routing(
    value: object, what: str, *, dtypes: Collection[str], ndim: int
) -> tuple[np.ndarray, int]:
    """prime-rl's inline routing: the ids and the position of their first row."""
    packed: PackedRouting = typed(value, PackedRouting, what)
    if packed.start < 0:
        raise WireFormatError(f"{what}.start must not be negative, got {packed.start}")
    return _packed_array(packed, what, dtypes, ndim), packed.start


def encode_npy(array: np.ndarray) -> str:
    """Base64 of the ``.npy`` file of `array` (upstream vLLM's routed_experts)."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return base64.b64encode(buffer.getbuffer()).decode("ascii")


def decode_npy(value: object, what: str, *, dtypes: Collection[str], ndim: int) -> np.ndarray:
    """The array of a base64 ``.npy`` file: format 1.0 to 3.0, no pickled objects, a
    dtype in `dtypes`, `ndim` dimensions, exactly the bytes its header promises."""
    raw: bytes = typed(value, bytes, what)
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


def _csr_part(value: Packed | bytes, what: str) -> np.ndarray:
    if isinstance(value, bytes):
        if len(value) % 4:
            raise WireFormatError(f"{what}: {len(value)} bytes is not a whole number of int32")
        return np.frombuffer(value, dtype="<i4").astype(np.int32)
    return _packed_array(value, what, ("int32",), 1)


def decode_mask(value: object, what: str, *, tokens: int) -> np.ndarray:
    """A sampling mask in either real form (prime-rl's CSR object, upstream's lists) for
    `tokens` completion tokens -> ``int32 [tokens, widest]``."""
    mask: CSRMask | list[list[int]] = typed(value, CSRMask | list[list[int]], what)
    if isinstance(mask, CSRMask):
        return _csr_mask(mask, what, tokens)
    return _lists_mask(mask, what, tokens)


def _csr_mask(mask: CSRMask, what: str, tokens: int) -> np.ndarray:
    ids = _csr_part(mask.ids, f"{what}.ids")
    counts = _csr_part(mask.counts, f"{what}.counts")
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


def _lists_mask(rows: list[list[int]], what: str, tokens: int) -> np.ndarray:
    if len(rows) != tokens:
        raise WireFormatError(f"{what}: {len(rows)} rows for {tokens} completion tokens")
    counts = np.fromiter((len(row) for row in rows), dtype=np.int64, count=tokens)
    flat = np.fromiter((t for row in rows for t in row), dtype=np.int64, count=int(counts.sum()))
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= 2**31):
        raise WireFormatError(f"{what} must hold non-negative int32 token ids")
    return mask_from_rows(counts, flat.astype(np.int32))


def encode_mask_lists(mask: np.ndarray) -> list[list[int]]:
    """Upstream vLLM's mask form of a ``-1`` padded mask."""
    return [[int(t) for t in row if t >= 0] for row in mask]


def routing_dtype_for(ids: np.ndarray) -> np.dtype[Any]:
    """prime-rl's per-reply choice: uint8 when every id fits, else uint16."""
    return np.dtype(np.uint8 if not ids.size or int(ids.max()) <= 255 else np.uint16)
