"""Per-token data as compact, read-only numpy arrays inside frozen values.

A queued sample of 4,500 tokens held as tuples of Python ints and floats costs about 70
bytes a token; as ``int32`` ids, a ``bool`` loss mask and ``float32`` logprobs it costs 9.
The values that carry them are frozen, so the arrays are made read-only, and compared by
content (attrs' generated ``__eq__`` would compare them element-wise and fail).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import attrs
import numpy as np
import numpy.typing as npt

__all__ = [
    "ARRAY_EQ",
    "TOKEN_DTYPE",
    "arrays_equal",
    "float_array",
    "frozen_array",
    "frozen_arrays",
    "handed_over",
    "mask_array",
    "token_array",
]

#: Token ids: vocabularies fit in int32 (vLLM's own token tensors are int32).
TOKEN_DTYPE = np.dtype(np.int32)


def frozen_array(value: npt.ArrayLike, dtype: npt.DTypeLike) -> np.ndarray:
    """`value` as a 1-D-or-more C-contiguous array of `dtype` that cannot be written.

    Copies only when the dtype or layout differs, or when the array is writable (so no
    caller can change a frozen value through an array it kept): a producer that hands
    over a fresh array read-only (`handed_over`) saves the copy. Raises ValueError when
    `value` does not convert (a float where ints belong, an id that overflows int32).
    """
    if isinstance(value, np.ndarray) and value.dtype == dtype and not value.flags.writeable:
        return value
    source = value if isinstance(value, np.ndarray) else np.asarray(value)
    # An empty sequence has no values to be wrong: numpy gives it float64.
    if source.dtype.kind == "f" and np.dtype(dtype).kind in "iub" and source.size:
        raise ValueError(f"expected integers, got {source.dtype} values")
    if (
        source.dtype.kind in "iu"
        and np.dtype(dtype).kind in "iu"
        and source.size
        and not np.can_cast(source.dtype, dtype)
    ):
        info = np.iinfo(dtype)
        if int(source.min()) < info.min or int(source.max()) > info.max:
            raise ValueError(f"values outside the range of {np.dtype(dtype).name}")
    array = np.array(source, dtype=dtype, order="C", copy=True)
    array.flags.writeable = False
    return array


def handed_over(array: np.ndarray) -> np.ndarray:
    """`array`, a fresh one nobody else holds, made read-only: a frozen value takes it
    without a copy."""
    array.flags.writeable = False
    return array


def frozen_arrays(value: Mapping[str, npt.ArrayLike] | None) -> Mapping[str, np.ndarray] | None:
    """A read-only mapping of read-only arrays (None stays None), each keeping its dtype."""
    if value is None:
        return None
    return MappingProxyType(
        {key: frozen_array(array, np.asarray(array).dtype) for key, array in value.items()}
    )


def arrays_equal(a: object, b: object) -> bool:
    """Equality of arrays, or of mappings of arrays, by dtype, shape and content."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(arrays_equal(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return a is b or a == b


#: The `eq` of an attrs field holding arrays (or a mapping of arrays): by content.
ARRAY_EQ = attrs.cmp_using(eq=arrays_equal)


def token_array(value: npt.ArrayLike) -> np.ndarray:
    """Converter: read-only int32 token ids."""
    return frozen_array(value, TOKEN_DTYPE)


def mask_array(value: npt.ArrayLike) -> np.ndarray:
    """Converter: a read-only bool mask."""
    return frozen_array(value, np.bool_)


def float_array(value: npt.ArrayLike) -> np.ndarray:
    """Converter: read-only float32 values."""
    return frozen_array(value, np.float32)
