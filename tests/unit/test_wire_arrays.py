"""The array forms of a generate reply (orchestrator/wire/arrays.py): every codec round
trips every dtype it allows, bytes are checked against independently built base64, and
every malformed or hostile form is a one-line `WireFormatError`."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest

from orchestrator.wire.arrays import (
    MISSING_LOGPROB,
    ROUTING_DTYPES,
    WireFormatError,
    decode_mask,
    decode_npy,
    decode_packed,
    decode_packed_routing,
    encode_mask_csr,
    encode_mask_lists,
    encode_npy,
    encode_packed,
    mask_from_rows,
    routing_dtype_for,
)

ROUTING = sorted(ROUTING_DTYPES)
#: Every dtype some packed field allows: routing ids, float32 logprobs, int32 CSR parts.
PACKED_DTYPES = sorted({*ROUTING_DTYPES, "float32", "int32"})


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def sample_array(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Values spanning the dtype's range (its extremes included when there is room)."""
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    if np.dtype(dtype).kind == "f":
        values = rng.standard_normal(size).astype(dtype)
    else:
        info = np.iinfo(np.dtype(dtype))
        values = rng.integers(info.min, int(info.max) + 1, size=size, dtype=np.int64).astype(dtype)
        if size >= 2:
            values[0], values[-1] = info.min, info.max
    return values.reshape(shape)


def npy_bytes(array: np.ndarray, *, version: tuple[int, int] | None = None) -> bytes:
    buffer = io.BytesIO()
    if version is None:
        np.save(buffer, array, allow_pickle=False)
    else:
        np.lib.format.write_array(buffer, array, version=version, allow_pickle=False)
    return buffer.getvalue()


def npy_with_header(header: str, data: bytes, version: int = 1) -> bytes:
    """A .npy file with `header` (a dict literal) as written, padded as numpy pads it."""
    prefix = 10 if version == 1 else 12
    text = header + " " * (-(prefix + len(header) + 1) % 64) + "\n"
    size = len(text).to_bytes(2 if version == 1 else 4, "little")
    return b"\x93NUMPY" + bytes((version, 0)) + size + text.encode("latin1") + data


def raises(call: Callable[[], object], *words: str) -> str:
    with pytest.raises(WireFormatError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    return message


# --- packed ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("shape", [(5, 3, 2), (0, 48, 8), (1, 1, 1)])
def test_packed_round_trips_every_dtype(dtype: str, shape: tuple[int, ...]) -> None:
    array = sample_array(dtype, shape)
    obj = encode_packed(array)
    assert obj == {
        "data": b64(array.astype(np.dtype(dtype).newbyteorder("<")).tobytes()),
        "shape": list(shape),
        "dtype": dtype,
    }
    decoded = decode_packed(obj, "x", dtypes=(dtype,), ndim=3)
    assert decoded.dtype == np.dtype(dtype) and decoded.dtype.isnative
    assert decoded.shape == shape
    np.testing.assert_array_equal(decoded, array)
    assert decoded.flags.writeable and decoded.flags.c_contiguous


def test_packed_decodes_independently_built_little_endian_bytes() -> None:
    values = [[1, 256], [65535, 513]]
    raw = b"\x01\x00\x00\x01\xff\xff\x01\x02"  # little-endian uint16
    obj = {"data": b64(raw), "shape": [2, 2], "dtype": "uint16"}
    decoded = decode_packed(obj, "x", dtypes=ROUTING)
    assert decoded.tolist() == values
    # A big-endian array is sent little-endian too.
    big = np.array(values, dtype=">u2")
    assert encode_packed(big)["data"] == b64(raw)


def test_packed_routing_has_its_start_and_packed_arrays_have_none() -> None:
    array = np.arange(8, dtype=np.uint8).reshape(2, 2, 2)
    obj = encode_packed(array, start=7)
    assert obj["start"] == 7
    got, start = decode_packed_routing(obj, "routed_experts", dtypes=ROUTING, ndim=3)
    np.testing.assert_array_equal(got, array)
    assert start == 7
    raises(lambda: decode_packed(obj, "routed_experts", dtypes=ROUTING), "unknown field `start`")
    plain = encode_packed(array)
    raises(
        lambda: decode_packed_routing(plain, "routed_experts", dtypes=ROUTING, ndim=3),
        "routed_experts",
        "missing required field `start`",
    )
    negative = encode_packed(array, start=-1)
    raises(
        lambda: decode_packed_routing(negative, "routed_experts", dtypes=ROUTING, ndim=3), "start"
    )


def test_raw_json_text_decodes_like_the_object() -> None:
    # The reply parser hands the decoders raw JSON (msgspec.Raw), never Python strings.
    array = np.arange(24, dtype=np.uint16).reshape(2, 3, 4)
    obj = encode_packed(array, start=3)
    raw = msgspec.Raw(json.dumps(obj).encode())
    got, start = decode_packed_routing(raw, "routed_experts", dtypes=ROUTING, ndim=3)
    np.testing.assert_array_equal(got, array)
    assert start == 3
    raises(lambda: decode_packed(msgspec.Raw(b"{"), "x", dtypes=ROUTING), "x")


GOOD_PACKED: dict[str, Any] = {"data": b64(bytes(range(8))), "shape": [2, 2, 2], "dtype": "uint8"}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"dtype": "uint32"}, ("dtype",)),
        ({"dtype": "float64"}, ("dtype",)),
        ({"dtype": 8}, ("dtype",)),
        ({"shape": [2, 4]}, ("dimensions",)),
        ({"shape": [2, 2, -2]}, ("shape",)),
        ({"shape": [2, True, 4]}, ("shape",)),
        ({"shape": "2,2,2"}, ("shape",)),
        ({"shape": [3, 2, 2]}, ("8 data bytes", "12")),
        ({"data": "not base64!"}, ("base64",)),
        ({"data": b64(bytes(range(8)))[:-1]}, ("base64",)),  # bad padding
        ({"data": 12}, ("bytes",)),
        ({"extra": 1}, ("unknown field `extra`",)),
    ],
)
def test_malformed_packed_objects_are_refused(change: dict[str, Any], words: tuple[str]) -> None:
    obj = {**GOOD_PACKED, **change}
    raises(lambda: decode_packed(obj, "routed_experts", dtypes=ROUTING, ndim=3), *words)


def test_a_packed_object_must_be_an_object_with_all_keys() -> None:
    raises(lambda: decode_packed("AAAA", "x", dtypes=ROUTING), "object")
    raises(lambda: decode_packed(None, "x", dtypes=ROUTING), "object")
    partial = {k: v for k, v in GOOD_PACKED.items() if k != "shape"}
    raises(lambda: decode_packed(partial, "x", dtypes=ROUTING), "missing required field `shape`")


# --- npy ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ROUTING)
def test_npy_round_trips_every_routing_dtype(dtype: str) -> None:
    array = sample_array(dtype, (7, 3, 2), seed=1)
    text = encode_npy(array)
    assert base64.b64decode(text) == npy_bytes(array)
    decoded = decode_npy(text, "routed_experts", dtypes=ROUTING, ndim=3)
    assert decoded.dtype == np.dtype(dtype) and decoded.shape == (7, 3, 2)
    np.testing.assert_array_equal(decoded, array)


@pytest.mark.parametrize("dtype", [">u2", ">i2", ">i4"])
def test_big_endian_npy_is_read_in_native_order(dtype: str) -> None:
    array = np.array([[[1, 300]], [[4000, 77]]], dtype=dtype)
    decoded = decode_npy(b64(npy_bytes(array)), "r", dtypes=ROUTING, ndim=3)
    assert decoded.dtype.isnative and decoded.dtype.name == np.dtype(dtype).name
    assert decoded.tolist() == [[[1, 300]], [[4000, 77]]]


def test_fortran_order_npy_is_read_in_logical_order() -> None:
    array = np.asfortranarray(np.arange(2 * 3 * 4, dtype=np.uint16).reshape(2, 3, 4))
    raw = npy_bytes(array)
    assert b"'fortran_order': True" in raw
    decoded = decode_npy(b64(raw), "r", dtypes=ROUTING, ndim=3)
    assert decoded.flags.c_contiguous
    np.testing.assert_array_equal(decoded, np.arange(24).reshape(2, 3, 4))


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_npy_format_versions_one_to_three_are_read(version: tuple[int, int]) -> None:
    array = np.arange(12, dtype=np.uint8).reshape(3, 2, 2)
    raw = npy_bytes(array, version=version)
    assert raw[6:8] == bytes(version)
    np.testing.assert_array_equal(decode_npy(b64(raw), "r", dtypes=ROUTING, ndim=3), array)


def test_pickled_object_npy_is_refused_unread() -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.array([[[{"x": 1}]]], dtype=object), allow_pickle=True)
    raises(lambda: decode_npy(b64(buffer.getvalue()), "r", dtypes=ROUTING, ndim=3), "dtype")


@pytest.mark.parametrize("dtype", ["float32", "uint32", "int64", "bool", "int8"])
def test_npy_of_a_dtype_routing_never_has_is_refused(dtype: str) -> None:
    raw = npy_bytes(np.zeros((2, 1, 1), dtype=dtype))
    raises(lambda: decode_npy(b64(raw), "r", dtypes=ROUTING, ndim=3), "dtype")


def test_npy_of_the_wrong_rank_is_refused() -> None:
    raw = npy_bytes(np.zeros((2, 3), dtype=np.uint8))
    raises(lambda: decode_npy(b64(raw), "r", dtypes=ROUTING, ndim=3), "dimensions")


def test_npy_with_missing_or_extra_bytes_is_refused() -> None:
    raw = npy_bytes(np.arange(8, dtype=np.uint8).reshape(2, 2, 2))
    raises(lambda: decode_npy(b64(raw[:-1]), "r", dtypes=ROUTING, ndim=3), "7 data bytes")
    raises(lambda: decode_npy(b64(raw + b"\0"), "r", dtypes=ROUTING, ndim=3), "9 data bytes")
    # A header that promises far more than is sent is not trusted (nothing is allocated).
    huge = npy_with_header(
        "{'descr': '|u1', 'fortran_order': False, 'shape': (1000000000000, 48, 8), }", raw[-8:]
    )
    raises(lambda: decode_npy(b64(huge), "r", dtypes=ROUTING, ndim=3), "8 data bytes")


def test_a_hand_built_npy_header_is_read() -> None:
    raw = npy_with_header(
        "{'descr': '<u2', 'fortran_order': False, 'shape': (1, 1, 2), }", b"\x01\x00\x00\x01"
    )
    assert decode_npy(b64(raw), "r", dtypes=ROUTING, ndim=3).tolist() == [[[1, 256]]]


def test_npy_with_a_bad_header_is_refused() -> None:
    raw = npy_bytes(np.zeros((1, 1, 1), dtype=np.uint8))
    raises(lambda: decode_npy(b64(b"\x93NUMPX" + raw[6:]), "r", dtypes=ROUTING, ndim=3), "npy")
    raises(lambda: decode_npy(b64(raw[:5]), "r", dtypes=ROUTING, ndim=3), "npy")
    raises(lambda: decode_npy(b64(raw[:6] + b"\x07\x00" + raw[8:]), "r", dtypes=ROUTING, ndim=3))
    # A header that is not a Python literal dict.
    broken = raw.replace(b"'descr'", b"'descr' +")
    raises(lambda: decode_npy(b64(broken), "r", dtypes=ROUTING, ndim=3), "npy")


OVERSIZED_HEADER = npy_with_header(
    "{'descr': '|u1', 'fortran_order': False, 'shape': (1, 1, 1), }" + " " * 5000, b"\0", 2
)


def test_npy_with_an_oversized_header_is_refused() -> None:
    with pytest.raises(WireFormatError, match=r"routed_experts is not a \.npy array"):
        decode_npy(b64(OVERSIZED_HEADER), "routed_experts", dtypes=ROUTING, ndim=3)


def test_npy_header_errors_are_one_line() -> None:
    raises(lambda: decode_npy(b64(OVERSIZED_HEADER), "routed_experts", dtypes=ROUTING, ndim=3))


def test_npy_must_be_a_base64_string() -> None:
    raises(lambda: decode_npy("@@@", "r", dtypes=ROUTING, ndim=3), "base64")
    raises(lambda: decode_npy({"data": ""}, "r", dtypes=ROUTING, ndim=3), "bytes")
    raises(lambda: decode_npy(msgspec.Raw(b"12"), "r", dtypes=ROUTING, ndim=3), "bytes")


# --- CSR masks ------------------------------------------------------------------------

#: Three completion tokens: kept sets {5, 9}, {} and {7}.
MASK = np.array([[5, 9], [-1, -1], [7, -1]], dtype=np.int32)
IDS, COUNTS = [5, 9, 7], [2, 0, 1]


def packed_i32(values: list[int]) -> dict[str, Any]:
    raw = np.array(values, dtype="<i4").tobytes()
    return {"data": b64(raw), "shape": [len(values)], "dtype": "int32"}


def bare_i32(values: list[int]) -> str:
    return b64(np.array(values, dtype="<i4").tobytes())


@pytest.mark.parametrize("form", [packed_i32, bare_i32])
def test_csr_masks_decode_from_packed_and_bare_parts(form: Callable[[list[int]], Any]) -> None:
    obj = {"ids": form(IDS), "counts": form(COUNTS)}
    mask = decode_mask(obj, "sampling_mask", tokens=3)
    assert mask.dtype == np.int32
    np.testing.assert_array_equal(mask, MASK)


def test_csr_parts_may_mix_forms() -> None:
    obj = {"ids": bare_i32(IDS), "counts": packed_i32(COUNTS)}
    np.testing.assert_array_equal(decode_mask(obj, "m", tokens=3), MASK)


def test_csr_round_trips_and_an_empty_mask_is_null() -> None:
    obj = encode_mask_csr(MASK)
    assert obj == {"ids": packed_i32(IDS), "counts": packed_i32(COUNTS)}
    np.testing.assert_array_equal(decode_mask(obj, "m", tokens=3), MASK)
    assert encode_mask_csr(np.full((3, 2), -1, dtype=np.int32)) is None


def test_a_csr_mask_with_no_kept_ids_has_width_zero() -> None:
    obj = {"ids": bare_i32([]), "counts": bare_i32([0, 0])}
    assert decode_mask(obj, "m", tokens=2).shape == (2, 0)


@pytest.mark.parametrize(
    ("ids", "counts", "words"),
    [
        (IDS, [2, 0], ("2 counts for 3",)),  # a count per completion token
        (IDS, [2, 0, 1, 0], ("4 counts for 3",)),
        (IDS, [2, 0, 2], ("add up to 4", "3")),
        (IDS, [1, 0, 1], ("add up to 2",)),
        (IDS, [4, -2, 1], ("negative count",)),
        ([5, -9, 7], COUNTS, ("negative token id",)),
    ],
)
def test_inconsistent_csr_masks_are_refused(
    ids: list[int], counts: list[int], words: tuple[str]
) -> None:
    obj = {"ids": bare_i32(ids), "counts": bare_i32(counts)}
    raises(lambda: decode_mask(obj, "sampling_mask", tokens=3), "sampling_mask", *words)


@pytest.mark.parametrize(
    "obj",
    [
        {"ids": bare_i32(IDS)},
        {"ids": bare_i32(IDS), "counts": bare_i32(COUNTS), "width": 2},
        [IDS, COUNTS],
        None,
        {"ids": b64(b"\x05\x00\x00"), "counts": bare_i32(COUNTS)},  # not whole int32s
        {"ids": "***", "counts": bare_i32(COUNTS)},
        {"ids": IDS, "counts": COUNTS},
        {
            "ids": {**packed_i32(IDS), "dtype": "int64"},
            "counts": packed_i32(COUNTS),
        },
        {"ids": {**packed_i32(IDS), "shape": [3, 1]}, "counts": packed_i32(COUNTS)},
    ],
)
def test_malformed_csr_masks_are_refused(obj: object) -> None:
    raises(lambda: decode_mask(obj, "sampling_mask", tokens=3), "sampling_mask")


def test_mask_from_rows_pads_with_minus_one() -> None:
    got = mask_from_rows(np.array([0, 3, 1]), np.array([4, 5, 6, 7], dtype=np.int32))
    assert got.tolist() == [[-1, -1, -1], [4, 5, 6], [7, -1, -1]]
    assert mask_from_rows(np.zeros(0, dtype=np.int64), np.zeros(0, np.int32)).shape == (0, 0)


# --- list masks (upstream vLLM) -------------------------------------------------------


def test_list_masks_decode_and_round_trip() -> None:
    mask = decode_mask([[5, 9], [], [7]], "sampling_mask", tokens=3)
    assert mask.dtype == np.int32
    np.testing.assert_array_equal(mask, MASK)
    assert encode_mask_lists(MASK) == [[5, 9], [], [7]]
    assert decode_mask([[], []], "m", tokens=2).shape == (2, 0)
    assert decode_mask([[2**31 - 1]], "m", tokens=1).tolist() == [[2**31 - 1]]


@pytest.mark.parametrize(
    "value",
    [
        [[5, True], [], [7]],  # a bool is not a token id
        [[5, 9], [False], [7]],
        [[5, -9], [], [7]],
        [[5, 9], [], [2**31]],
        [[5, 9.0], [], [7]],
        [[5, "9"], [], [7]],
        [[5, 9], None, [7]],
        [[5, 9], [7]],  # one list per completion token
        [[5, 9], [], [7], []],
        {"0": [5]},
        "5,9",
    ],
)
def test_malformed_list_masks_are_refused(value: object) -> None:
    raises(lambda: decode_mask(value, "sampling_mask", tokens=3), "sampling_mask")


# --- dtype choice ---------------------------------------------------------------------


def test_routing_dtype_is_the_narrowest_that_holds_every_id() -> None:
    assert routing_dtype_for(np.array([0, 255])) == np.uint8
    assert routing_dtype_for(np.array([0, 256])) == np.uint16
    assert routing_dtype_for(np.zeros(0, dtype=np.int64)) == np.uint8
    assert MISSING_LOGPROB == -9999.0
