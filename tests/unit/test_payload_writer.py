"""write_payload_file / write_payload: one file per call, segments with digests."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import trio

from orchestrator.payload import PayloadSegment, write_payload, write_payload_file


def arrays(dtype: str = "uint8") -> dict[str, tuple[np.ndarray, int]]:
    rng = np.random.default_rng(0)
    routed = rng.integers(0, 200, size=(6, 4, 2)).astype(dtype)
    mask = rng.integers(-1, 1000, size=(3, 5)).astype(np.int32)
    return {"routed_experts": (routed, 2), "sampling_mask": (mask, 5)}


@pytest.mark.parametrize("dtype", ["uint8", "uint16"])
def test_writes_fields_back_to_back(tmp_path: Path, dtype: str) -> None:
    payload_dir = tmp_path / "root" / "v0"
    data = arrays(dtype)
    segments = write_payload_file(payload_dir, data, fsync=True)
    [file] = list(payload_dir.iterdir())
    assert file.name.endswith(".bin")
    assert len(file.name) == 32 + 4
    routed, mask = data["routed_experts"][0], data["sampling_mask"][0]
    raw = file.read_bytes()
    assert len(raw) == routed.nbytes + mask.nbytes
    assert segments == [
        PayloadSegment(
            "routed_experts",
            file.name,
            0,
            2,
            (6, 4, 2),
            dtype,
            hashlib.blake2b(raw[: routed.nbytes], digest_size=16).hexdigest(),
        ),
        PayloadSegment(
            "sampling_mask",
            file.name,
            routed.nbytes,
            5,
            (3, 5),
            "int32",
            hashlib.blake2b(raw[routed.nbytes :], digest_size=16).hexdigest(),
        ),
    ]
    stored = np.frombuffer(raw[: routed.nbytes], dtype=np.dtype(dtype).newbyteorder("<"))
    assert np.array_equal(stored.reshape(routed.shape), routed)
    stored_mask = np.frombuffer(raw[routed.nbytes :], dtype="<i4").reshape(mask.shape)
    assert np.array_equal(stored_mask, mask)


def test_non_contiguous_and_big_endian_input(tmp_path: Path) -> None:
    mask = np.arange(24, dtype=">i4").reshape(4, 6)[:, ::2]
    [segment] = write_payload_file(tmp_path, {"sampling_mask": (mask, 0)})
    raw = (tmp_path / segment.file).read_bytes()
    assert np.array_equal(np.frombuffer(raw, "<i4").reshape(4, 3), mask)


def test_each_call_writes_a_new_file(tmp_path: Path) -> None:
    first = write_payload_file(tmp_path, arrays())
    second = write_payload_file(tmp_path, arrays())
    assert first[0].file != second[0].file
    assert len(list(tmp_path.iterdir())) == 2


def test_empty_arrays(tmp_path: Path) -> None:
    segments = write_payload_file(tmp_path, {"routed_experts": (np.zeros((0, 4, 2), np.uint8), 0)})
    assert segments[0].shape == (0, 4, 2)
    assert (tmp_path / segments[0].file).stat().st_size == 0


@pytest.mark.parametrize(
    ("field", "array", "pos", "words"),
    [
        ("logits", np.zeros((1, 2, 2), np.uint8), 0, "unknown payload field"),
        ("routed_experts", np.zeros((1, 2, 2), np.int64), 0, "dtype"),
        ("routed_experts", np.zeros((1, 2), np.uint8), 0, "dimensions"),
        ("sampling_mask", np.zeros((1, 2), np.int64), 0, "dtype"),
        ("sampling_mask", np.zeros((1, 2), np.int32), -1, "pos"),
    ],
)
def test_rejects_bad_arrays_before_writing(
    tmp_path: Path, field: str, array: np.ndarray, pos: int, words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        write_payload_file(tmp_path / "v0", {field: (array, pos)})
    assert not (tmp_path / "v0").exists()


def test_os_error_propagates(tmp_path: Path) -> None:
    blocker = tmp_path / "v0"
    blocker.write_bytes(b"")
    with pytest.raises(OSError):
        write_payload_file(blocker, arrays())


async def test_write_payload_in_thread(tmp_path: Path) -> None:
    limiter = trio.CapacityLimiter(1)
    segments = await write_payload(tmp_path, arrays(), limiter=limiter)
    assert [s.field for s in segments] == ["routed_experts", "sampling_mask"]
    assert (tmp_path / segments[0].file).is_file()
