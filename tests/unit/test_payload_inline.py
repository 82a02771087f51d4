"""encode_inline / decode_inline: same bytes as the file, and every rejection."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orchestrator.payload import BadSegment, decode_inline, encode_inline, write_payload_file


@pytest.mark.parametrize(
    ("field", "array"),
    [
        ("routed_experts", np.arange(24, dtype=np.uint8).reshape(2, 3, 4)),
        ("routed_experts", np.arange(24, dtype=np.uint16).reshape(2, 3, 4) * 1000),
        ("sampling_mask", np.arange(-1, 11, dtype=np.int32).reshape(3, 4)),
        ("sampling_mask", np.zeros((0, 4), np.int32)),
    ],
)
def test_round_trip(field: str, array: np.ndarray) -> None:
    obj = encode_inline(array, 7)
    assert obj["pos"] == 7
    assert obj["shape"] == list(array.shape)
    assert obj["dtype"] == array.dtype.name
    decoded, pos = decode_inline(obj, field=field)
    assert pos == 7
    assert decoded.dtype == array.dtype
    assert np.array_equal(decoded, array)
    decoded[...] = 0  # writable


def test_inline_bytes_equal_file_bytes(tmp_path: Path) -> None:
    array = np.arange(60, dtype=np.uint16).reshape(5, 3, 4) * 997
    [segment] = write_payload_file(tmp_path, {"routed_experts": (array, 0)})
    inline = base64.b64decode(encode_inline(array, 0)["data"])
    assert inline == (tmp_path / segment.file).read_bytes()


def good(**changes: Any) -> dict[str, Any]:
    obj = encode_inline(np.zeros((2, 3), np.int32), 4)
    obj.update(changes)
    return obj


@pytest.mark.parametrize(
    ("obj", "field", "reason"),
    [
        (good(), "logits", "field"),
        ("abc", "sampling_mask", "malformed"),
        ({**good(), "extra": 1}, "sampling_mask", "malformed"),
        ({k: v for k, v in good().items() if k != "pos"}, "sampling_mask", "malformed"),
        (good(pos=True), "sampling_mask", "malformed"),
        (good(pos="4"), "sampling_mask", "malformed"),
        (good(shape=[2, 3.0]), "sampling_mask", "malformed"),
        (good(shape="2,3"), "sampling_mask", "malformed"),
        (good(data=5), "sampling_mask", "malformed"),
        (good(data="!!!!"), "sampling_mask", "malformed"),
        (good(dtype="int64"), "sampling_mask", "dtype"),
        (good(), "routed_experts", "shape"),
        (good(dtype="int64", shape=[2, 1, 3]), "routed_experts", "dtype"),
        (good(shape=[6]), "sampling_mask", "shape"),
        (good(shape=[-2, -3]), "sampling_mask", "shape"),
        (good(shape=[2, 4]), "sampling_mask", "shape"),
        (good(pos=-1), "sampling_mask", "out_of_range"),
    ],
)
def test_rejects(obj: object, field: str, reason: str) -> None:
    with pytest.raises(BadSegment) as info:
        decode_inline(obj, field=field)
    assert info.value.reason == reason
    assert "\n" not in str(info.value)


def test_routing_dtypes_are_the_captured_ones() -> None:
    # A server sends uint8/uint16 (vLLM per model), int16 or int32 (a wide capture buffer):
    # the same dtypes hold a stitched sample's -1 sentinel.
    array = np.full((2, 3, 4), -1, dtype=np.int16)
    decoded, _ = decode_inline(encode_inline(array, 0), field="routed_experts")
    assert decoded.dtype == np.int16
    assert (decoded == -1).all()
    wide, _ = decode_inline(encode_inline(array.astype(np.int32), 0), field="routed_experts")
    assert wide.dtype == np.int32
    with pytest.raises(BadSegment):
        decode_inline(encode_inline(array.astype(np.int64), 0), field="routed_experts")
    with pytest.raises(BadSegment):
        decode_inline(
            encode_inline(np.zeros((1, 2), np.int16), 0), field="sampling_mask", allow_sentinel=True
        )


def test_a_mask_may_be_zero_wide_routing_may_not() -> None:
    # No token of the sample had a kept set: the mask has no columns.
    mask, _ = decode_inline(encode_inline(np.zeros((3, 0), np.int32), 0), field="sampling_mask")
    assert mask.shape == (3, 0)
    with pytest.raises(BadSegment) as info:
        decode_inline(encode_inline(np.zeros((3, 0, 2), np.uint8), 0), field="routed_experts")
    assert info.value.reason == "shape"
