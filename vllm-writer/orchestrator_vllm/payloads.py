"""A generate reply's arrays, taken off its choices, and the segments that describe them.

vLLM replies with `routed_experts` as base64 of a `.npy` array `[rows, layers, top_k]`
whose rows end at the last forwarded token (position prompt + completion - 2), and, on
builds that capture them, `sampling_mask` as one list of kept token ids per completion
token. By handle, prime-rl's server writes instead, per choice, one file holding:

- the routing rows, narrowed to `uint8` when every id fits, else `uint16`, from position
  `prompt + completion - 1 - rows`;
- then the mask, `int32 [completion tokens, widest]` padded with -1, from position
  `prompt`;

and replies with one segment per field: `{field, file, offset, pos, rows, dtype, shape}`,
`file` the absolute path, `shape` the shape of one row. Pure: no I/O.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


class ReplyProblem(ValueError):
    """A choice whose arrays cannot be read (one line)."""


@dataclasses.dataclass(frozen=True)
class FieldArray:
    """One field of one choice, ready to write: its C-ordered little-endian array and the
    position of its first row."""

    field: str
    array: np.ndarray
    pos: int

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


def routing_array(encoded: str, *, prompt_len: int, completion_len: int) -> FieldArray:
    """The routing rows of a choice's `routed_experts` (base64 `.npy`), narrowed."""
    try:
        raw = base64.b64decode(encoded, validate=True)
        rows = np.load(io.BytesIO(raw), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as exc:
        raise ReplyProblem(f"routed_experts is not a base64 .npy array: {exc}") from None
    if rows.ndim != 3 or rows.dtype.kind not in "iu":
        raise ReplyProblem(
            f"routed_experts must be an integer [rows, layers, top_k] array, "
            f"got {rows.dtype} {list(rows.shape)}"
        )
    pos = prompt_len + completion_len - 1 - rows.shape[0]
    if pos < 0:
        raise ReplyProblem(
            f"routed_experts has {rows.shape[0]} rows, more than the "
            f"{prompt_len + completion_len - 1} forwarded tokens"
        )
    return FieldArray("routed_experts", narrowed(rows), pos)


def narrowed(ids: np.ndarray) -> np.ndarray:
    """`ids` in the narrowest dtype prime-rl uses for them: `uint8` when every id is in
    0..255, else `uint16` (0..65535), else `int32`; little-endian, C order."""
    dtype: np.dtype[Any]
    if ids.size == 0 or (int(ids.min()) >= 0 and int(ids.max()) <= 0xFF):
        dtype = np.dtype("<u1")
    elif int(ids.min()) >= 0 and int(ids.max()) <= 0xFFFF:
        dtype = np.dtype("<u2")
    else:
        dtype = np.dtype("<i4")
    return np.ascontiguousarray(ids, dtype=dtype)


def mask_array(kept: Sequence[Sequence[int]], *, prompt_len: int) -> FieldArray | None:
    """The mask rows of a choice's `sampling_mask` (one list per completion token), or
    None when no token has kept ids."""
    if not isinstance(kept, list) or not all(isinstance(row, list) for row in kept):
        raise ReplyProblem("sampling_mask must be one list of token ids per completion token")
    widest = max((len(row) for row in kept), default=0)
    if widest == 0:
        return None
    rows = np.full((len(kept), widest), -1, dtype="<i4")
    for i, row in enumerate(kept):
        if row:
            rows[i, : len(row)] = row
    return FieldArray("sampling_mask", rows, prompt_len)


def choice_arrays(choice: Mapping[str, Any], prompt_len: int) -> list[FieldArray]:
    """The fields to write for one choice, routing first; empty when it captured none."""
    tokens = choice.get("token_ids")
    if not isinstance(tokens, list):
        raise ReplyProblem("a choice without token_ids")
    arrays = []
    routing = choice.get("routed_experts")
    if routing is not None:
        if not isinstance(routing, str):
            raise ReplyProblem("routed_experts is not a base64 string")
        arrays.append(routing_array(routing, prompt_len=prompt_len, completion_len=len(tokens)))
    kept = choice.get("sampling_mask")
    if kept is not None:
        mask = mask_array(kept, prompt_len=prompt_len)
        if mask is not None:
            arrays.append(mask)
    return arrays


def segments(path: str, arrays: Sequence[FieldArray]) -> list[dict[str, Any]]:
    """The wire segments of `arrays` written back to back into the file at `path`."""
    out = []
    offset = 0
    for item in arrays:
        out.append(
            {
                "field": item.field,
                "file": path,
                "offset": offset,
                "pos": item.pos,
                "rows": int(item.array.shape[0]),
                "dtype": item.array.dtype.name,
                "shape": [int(n) for n in item.array.shape[1:]],
            }
        )
        offset += item.nbytes
    return out
