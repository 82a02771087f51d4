"""The reader: round trips, row windows, digests, and missing, short or hostile files."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import numpy as np
import pytest

from orchestrator.payload import (
    BadSegment,
    FinalTokenRoute,
    PayloadCorrupt,
    PayloadMissing,
    PayloadSegment,
    read_sample_payload,
    read_segment,
    stitch_masks,
    stitch_routing,
    write_payload_file,
)


@pytest.fixture
def payload_dir(tmp_path: Path) -> Path:
    """The payload directory of these tests: `v1` of a payload root, as batches name it
    (the reader opens it relative to its root, the way payload_gc does)."""
    directory = tmp_path / "root" / "v1"
    directory.mkdir(parents=True)
    return directory


def write_turn(
    payload_dir: Path, dtype: str = "uint8", *, rows: int = 9, pos: int = 0, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, list[PayloadSegment]]:
    rng = np.random.default_rng(seed)
    high = 256 if dtype == "uint8" else 4096
    routing = rng.integers(0, high, size=(rows, 4, 3)).astype(dtype)
    mask = rng.integers(-1, 50_000, size=(4, 6)).astype(np.int32)
    segments = write_payload_file(
        payload_dir, {"routed_experts": (routing, pos), "sampling_mask": (mask, rows - 3)}
    )
    return routing, mask, segments


@pytest.mark.parametrize("dtype", ["uint8", "uint16"])
@pytest.mark.parametrize("verify", [False, True])
def test_round_trip_is_bitwise(payload_dir: Path, dtype: str, verify: bool) -> None:
    routing, mask, (routed_seg, mask_seg) = write_turn(payload_dir, dtype)
    assert np.array_equal(read_segment(payload_dir, routed_seg, verify=verify), routing)
    read_mask = read_segment(payload_dir, mask_seg, verify=verify)
    assert read_mask.dtype == np.int32
    assert np.array_equal(read_mask, mask)
    # The turn's tokens are positions 0..9: routing rows 0..8, mask rows (completion) 6..9.
    routed_only = read_sample_payload(payload_dir, {"routed_experts": [routed_seg]}, 9)
    assert routed_only["routed_experts"].tobytes() == routing.tobytes()
    stitched = stitch_routing([routed_seg], 10, "repeat")
    assert stitched is not None
    out = read_sample_payload(
        payload_dir,
        {"routed_experts": stitched, "sampling_mask": [mask_seg]},
        10,
        verify=verify,
    )
    assert out["routed_experts"].dtype == np.dtype(dtype)
    assert out["routed_experts"][:9].tobytes() == routing.tobytes()
    assert np.array_equal(out["routed_experts"][9], routing[8])
    assert out["sampling_mask"].shape == (10, 6)
    assert (out["sampling_mask"][:6] == -1).all()
    assert np.array_equal(out["sampling_mask"][6:], mask)


def test_read_segment_is_writable_and_fill(payload_dir: Path) -> None:
    _, _, (routed_seg, _) = write_turn(payload_dir)
    read_segment(payload_dir, routed_seg, verify=True)[0, 0, 0] = 1
    fill = PayloadSegment("routed_experts", "", 0, 3, (2, 4, 3), "uint8", fill=-1)
    filled = read_segment(payload_dir, fill)
    assert filled.dtype == np.int16
    assert (filled == -1).all()


@pytest.mark.parametrize("route", ["repeat", "sentinel"])
def test_row_windows_equal_the_full_read(payload_dir: Path, route: FinalTokenRoute) -> None:
    _, _, (r0, m0) = write_turn(payload_dir, rows=9, seed=1)
    _, _, (r1, m1) = write_turn(payload_dir, rows=12, pos=5, seed=2)
    routed = stitch_routing([r0, r1], 15, route)
    assert routed is not None
    segments = {"routed_experts": routed, "sampling_mask": stitch_masks([m0, m1], 15)}
    full = read_sample_payload(payload_dir, segments, 15, verify=True)
    for window in (range(0, 15), range(0, 7), range(7, 15), range(8, 10), range(14, 15)):
        for verify in (False, True):
            part = read_sample_payload(payload_dir, segments, 15, rows=window, verify=verify)
            for field in ("routed_experts", "sampling_mask"):
                assert part[field].dtype == full[field].dtype
                assert np.array_equal(part[field], full[field][window.start : window.stop])
    empty = read_sample_payload(payload_dir, segments, 15, rows=range(3, 3))
    assert empty["routed_experts"].shape == (0, 4, 3)


def test_window_reads_only_its_rows(payload_dir: Path) -> None:
    routing, _, (routed_seg, _) = write_turn(payload_dir, rows=9)
    # Zero the bytes of rows 0..5 on disk: a read of rows 6..8 must not need them.
    path = payload_dir / routed_seg.file
    raw = bytearray(path.read_bytes())
    raw[: 6 * routed_seg.row_nbytes] = bytes(6 * routed_seg.row_nbytes)
    path.write_bytes(bytes(raw))
    out = read_sample_payload(payload_dir, {"routed_experts": [routed_seg]}, 9, rows=range(6, 9))
    assert np.array_equal(out["routed_experts"], routing[6:9])


def flip_byte(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_digest_mismatch_is_detected(payload_dir: Path) -> None:
    _, _, (_, mask_seg) = write_turn(payload_dir)
    flip_byte(payload_dir / mask_seg.file, mask_seg.offset + 5)
    segments = {"sampling_mask": [mask_seg]}
    read_sample_payload(payload_dir, segments, 10)  # not verified: read as is
    with pytest.raises(PayloadCorrupt) as info:
        read_sample_payload(payload_dir, segments, 10, verify=True)
    assert mask_seg.file in str(info.value)
    assert "sampling_mask" in str(info.value)
    with pytest.raises(PayloadCorrupt):
        read_segment(payload_dir, mask_seg, verify=True)


def test_verify_covers_the_parents_bytes_outside_the_clip(payload_dir: Path) -> None:
    _, _, (routed_seg, _) = write_turn(payload_dir, rows=9)
    stitched = stitch_routing([routed_seg], 4, "repeat")
    assert stitched is not None
    # Row 8 is outside the sample, but inside the digested range of its parent.
    flip_byte(payload_dir / routed_seg.file, 8 * routed_seg.row_nbytes)
    read_sample_payload(payload_dir, {"routed_experts": stitched}, 4)
    with pytest.raises(PayloadCorrupt):
        read_sample_payload(payload_dir, {"routed_experts": stitched}, 4, verify=True)


def test_missing_file_names_the_file(payload_dir: Path) -> None:
    _, _, (routed_seg, _) = write_turn(payload_dir)
    (payload_dir / routed_seg.file).unlink()
    with pytest.raises(PayloadMissing) as info:
        read_sample_payload(payload_dir, {"routed_experts": [routed_seg]}, 9)
    assert str(payload_dir / routed_seg.file) in str(info.value)
    with pytest.raises(PayloadMissing) as info:
        read_segment(payload_dir / "v9", routed_seg)
    assert str(payload_dir / "v9") in str(info.value)


@pytest.mark.parametrize("verify", [False, True])
def test_short_file_is_missing(payload_dir: Path, verify: bool) -> None:
    _, _, (routed_seg, mask_seg) = write_turn(payload_dir)
    path = payload_dir / mask_seg.file
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(PayloadMissing) as info:
        read_segment(payload_dir, mask_seg, verify=verify)
    assert mask_seg.file in str(info.value)
    assert np.array_equal(read_segment(payload_dir, routed_seg).shape, (9, 4, 3))


def test_a_fifo_swapped_in_is_refused_without_blocking(payload_dir: Path) -> None:
    # Replaced after the daemon checked it: opening a FIFO for reading would wait forever
    # for a writer.
    _, _, (routed_seg, _) = write_turn(payload_dir)
    (payload_dir / routed_seg.file).unlink()
    os.mkfifo(payload_dir / routed_seg.file)
    with pytest.raises(BadSegment) as info:
        read_segment(payload_dir, routed_seg)
    assert info.value.reason == "not_regular_file"


def test_a_linked_version_dir_is_refused(payload_dir: Path) -> None:
    _, _, (routed_seg, _) = write_turn(payload_dir)
    link = payload_dir.with_name("v5")
    link.symlink_to(payload_dir, target_is_directory=True)
    with pytest.raises(BadSegment) as info:
        read_segment(link, routed_seg)
    assert info.value.reason == "symlink"


def test_symlinked_file_is_refused(payload_dir: Path) -> None:
    _, _, (routed_seg, _) = write_turn(payload_dir)
    (payload_dir / "link.bin").symlink_to(payload_dir / routed_seg.file)
    with pytest.raises(BadSegment) as info:
        read_segment(payload_dir, attrs.evolve(routed_seg, file="link.bin"))
    assert info.value.reason == "symlink"


def test_segments_are_validated_before_any_read(payload_dir: Path) -> None:
    written = payload_dir
    payload_dir = written.with_name("v7")
    _, _, (routed_seg, _) = write_turn(written)
    payload_dir.mkdir()
    # The file exists in the sibling v1; the reader must refuse the name, not read it.
    escaping = attrs.evolve(routed_seg, file=f"../{written.name}/{routed_seg.file}")
    with pytest.raises(BadSegment) as info:
        read_sample_payload(payload_dir, {"routed_experts": [escaping]}, 9)
    assert info.value.reason == "traversal"
    with pytest.raises(BadSegment) as info:
        read_segment(payload_dir, attrs.evolve(routed_seg, file=str(written / routed_seg.file)))
    assert info.value.reason == "not_plain_name"


def test_layout_errors(payload_dir: Path) -> None:
    _, _, (routed_seg, mask_seg) = write_turn(payload_dir)
    cases: list[tuple[dict[str, list[PayloadSegment]], int, str]] = [
        ({"routed_experts": [routed_seg]}, 10, "coverage"),  # position 9 has no row
        ({"routed_experts": [routed_seg]}, 8, "out_of_range"),
        ({"routed_experts": [attrs.evolve(routed_seg, pos=1)]}, 10, "coverage"),
        ({"routed_experts": []}, 3, "coverage"),
        ({"routed_experts": [routed_seg, routed_seg]}, 18, "coverage"),
        ({"sampling_mask": [mask_seg, mask_seg]}, 10, "coverage"),
        ({"sampling_mask": [mask_seg]}, 9, "out_of_range"),
        ({"routed_experts": [mask_seg]}, 9, "field"),
        ({"logits": [mask_seg]}, 9, "field"),
        (
            {"routed_experts": [routed_seg, attrs.evolve(routed_seg, pos=9, shape=(9, 3, 4))]},
            18,
            "shape",
        ),
    ]
    for segments, sample_len, reason in cases:
        with pytest.raises(BadSegment) as info:
            read_sample_payload(payload_dir, segments, sample_len)
        assert info.value.reason == reason, segments


def test_bad_windows(payload_dir: Path) -> None:
    for rows in (range(0, 10), range(-1, 3), range(0, 9, 2), range(5, 2)):
        with pytest.raises(ValueError, match="rows"):
            read_sample_payload(payload_dir, {}, 9, rows=rows)


def test_sizes_are_checked_before_allocating(payload_dir: Path) -> None:
    _, _, (routed_seg, mask_seg) = write_turn(payload_dir)
    # A width no file backs: refused before an [L, W] array is allocated.
    wide = attrs.evolve(mask_seg, shape=(1, 1 << 21))
    with pytest.raises(PayloadMissing, match="bytes"):
        read_sample_payload(payload_dir, {"sampling_mask": [wide]}, 10, rows=range(0, 1))
    # A file outside the window still has to be there.
    stitched = stitch_routing([routed_seg], 10, "repeat")
    assert stitched is not None
    other = payload_dir.with_name("v2")
    other.mkdir()
    (other / routed_seg.file).write_bytes((payload_dir / routed_seg.file).read_bytes()[:20])
    with pytest.raises(PayloadMissing):
        read_sample_payload(other, {"routed_experts": stitched}, 10, rows=range(0, 1))


def test_routing_turns_of_different_dtypes_are_promoted(payload_dir: Path) -> None:
    # A server narrows each reply's routing to uint8 when its ids fit (prime-rl does): the
    # turns of one rollout may differ, and the sample is read in the widest dtype.
    narrow, _, (first, _) = write_turn(payload_dir, "uint8", rows=9)
    wide, _, (second, _) = write_turn(payload_dir, "uint16", rows=9, pos=9, seed=1)
    stitched = stitch_routing([first, second], 19, "repeat")
    assert stitched is not None
    out = read_sample_payload(payload_dir, {"routed_experts": stitched}, 19)["routed_experts"]
    assert out.dtype == np.uint16
    assert (out[:9] == narrow).all()
    assert (out[9:18] == wide).all()
    assert (out[18] == wide[-1]).all()


def test_segments_without_digest_read_and_verify_nothing(payload_dir: Path) -> None:
    routing, _, (routed_seg, _) = write_turn(payload_dir)
    bare = attrs.evolve(routed_seg, digest=None)
    stitched = stitch_routing([bare], 10, "repeat")
    assert stitched is not None
    assert all(s.digest is None and s.digest_offset is None for s in stitched)
    out = read_sample_payload(payload_dir, {"routed_experts": stitched}, 10, verify=True)
    assert (out["routed_experts"][:9] == routing).all()
