"""Compact routed expert ids to the narrowest dtype the model's expert count allows."""

from __future__ import annotations

import numpy as np

_MAX_EXPERTS = 1 << 16


def compact_routed_experts(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Return `ids` as ``uint8`` when ``num_experts <= 256``, else as ``uint16``.

    Raises `ValueError` when `ids` is not an integer array, when `num_experts` is not in
    ``1 .. 65536``, or when an id is negative or ``>= num_experts``.
    """
    if not 1 <= num_experts <= _MAX_EXPERTS:
        raise ValueError(f"num_experts must be in 1..{_MAX_EXPERTS}, got {num_experts}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"routed expert ids must be integers, got dtype {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ValueError(
            f"routed expert ids must be in 0..{num_experts - 1}, "
            f"got {int(ids.min())}..{int(ids.max())}"
        )
    dtype = np.uint8 if num_experts <= 256 else np.uint16
    return ids.astype(dtype, copy=False)
