"""The inline form of a payload array: its bytes in base64 inside the JSON response.

The bytes are exactly what the by-handle file would hold (C order, little-endian), so an
inline array and a by-handle read of the same array are bitwise equal.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

import numpy as np

from ._errors import BadSegment
from ._json import is_json_int
from ._segment import FIELD_NDIM, FIELDS, stored_bytes, stored_dtype
from ._stitch import sentinel_dtype

_KEYS = frozenset({"data", "pos", "shape", "dtype"})


def encode_inline(array: np.ndarray, pos: int) -> dict[str, Any]:
    """Return ``{"data": <base64 of the C-order bytes>, "pos", "shape", "dtype"}``."""
    return {
        "data": base64.b64encode(stored_bytes(array)).decode("ascii"),
        "pos": pos,
        "shape": list(array.shape),
        "dtype": array.dtype.name,
    }


def decode_inline(
    obj: object, *, field: str, allow_sentinel: bool = False
) -> tuple[np.ndarray, int]:
    """Decode an inline array of `field`; return ``(array, pos)`` with a writable array.

    Checks the keys and their types, that the dtype is allowed for the field, that the
    shape has the field's number of non-negative dimensions, that pos is not negative and
    that the data holds exactly the shape's bytes. With `allow_sentinel` (a *sample's*
    routing stitched with ``"sentinel"``), the widened routing dtypes (``int16``,
    ``int32``) are allowed too; a server's turn never uses them.

    Raises `BadSegment` (reasons ``malformed``, ``field``, ``dtype``, ``shape``,
    ``out_of_range``); its file is ``""``.
    """
    allowed = FIELDS.get(field)
    if allowed is None:
        raise BadSegment("field", "", f"unknown field {field!r}")
    if allow_sentinel and field == "routed_experts":
        allowed = allowed | {sentinel_dtype(np.dtype(name)).name for name in allowed}
    if not isinstance(obj, dict):
        raise BadSegment("malformed", "", f"inline {field} must be a JSON object")
    if set(obj) != _KEYS:
        raise BadSegment("malformed", "", f"inline {field} must have exactly keys {sorted(_KEYS)}")
    data, pos, shape, dtype = obj["data"], obj["pos"], obj["shape"], obj["dtype"]
    if not isinstance(data, str) or not isinstance(dtype, str):
        raise BadSegment("malformed", "", f"inline {field}: data and dtype must be strings")
    if not is_json_int(pos):
        raise BadSegment("malformed", "", f"inline {field}: pos must be an integer")
    if not isinstance(shape, list) or not all(is_json_int(d) for d in shape):
        raise BadSegment("malformed", "", f"inline {field}: shape must be a list of integers")
    if dtype not in allowed:
        raise BadSegment("dtype", "", f"dtype {dtype!r} not allowed for field {field!r}")
    if len(shape) != FIELD_NDIM[field] or any(d < 0 for d in shape):
        raise BadSegment(
            "shape",
            "",
            f"shape {shape} of {field!r} must have {FIELD_NDIM[field]} non-negative dimensions",
        )
    if field == "routed_experts" and 0 in shape[1:]:
        # A mask may be zero wide: no token of the sample had a kept set.
        raise BadSegment("shape", "", f"inline {field}: shape {shape} has a row of size zero")
    if pos < 0:
        raise BadSegment("out_of_range", "", f"inline {field}: negative pos {pos}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadSegment("malformed", "", f"inline {field}: data is not base64") from None
    stored = stored_dtype(dtype)
    expected = math.prod(shape) * stored.itemsize
    if len(raw) != expected:
        raise BadSegment(
            "shape", "", f"inline {field}: {len(raw)} data bytes, shape needs {expected}"
        )
    # bytearray: the array owns writable memory; astype gives native byte order.
    array = np.frombuffer(bytearray(raw), dtype=stored).reshape(shape)
    return array.astype(np.dtype(dtype), copy=False), pos
