"""compact_routed_experts: the narrowest dtype, and ids out of range rejected."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.payload import compact_routed_experts


def test_uint8_up_to_256_experts() -> None:
    ids = np.array([[[0, 255]]], dtype=np.int64)
    out = compact_routed_experts(ids, 256)
    assert out.dtype == np.uint8
    assert np.array_equal(out, ids)


def test_uint16_above_256_experts() -> None:
    ids = np.array([[[0, 256, 1023]]], dtype=np.int32)
    out = compact_routed_experts(ids, 1024)
    assert out.dtype == np.uint16
    assert np.array_equal(out, ids)


def test_empty_array() -> None:
    assert compact_routed_experts(np.zeros((0, 4, 2), np.int64), 8).shape == (0, 4, 2)


@pytest.mark.parametrize(
    ("ids", "num_experts", "words"),
    [
        (np.array([-1, 0]), 8, "0..7"),
        (np.array([8]), 8, "0..7"),
        (np.array([0]), 0, "num_experts"),
        (np.array([0]), 65537, "num_experts"),
        (np.array([0.0]), 8, "integers"),
    ],
)
def test_rejects(ids: np.ndarray, num_experts: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        compact_routed_experts(ids, num_experts)
