"""validate_segment, and the on-disk checks the daemon runs on a turn's files (open the
version directory, each file's size, each segment within it): every rejection
docs/design.md §4 asks for."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import pytest
from payload_gc import PayloadRootFiles

from orchestrator.payload import (
    BadSegment,
    PayloadMissing,
    PayloadSegment,
    check_segment,
    check_within,
    open_version_dir,
    regular_file_size,
    validate_segment,
    version_dir,
)

DIGEST = "0123456789abcdef0123456789abcdef"
ROUTED = PayloadSegment("routed_experts", "a.bin", 0, 0, (4, 3, 2), "uint8", DIGEST)
MASK = PayloadSegment("sampling_mask", "a.bin", 24, 10, (2, 5), "int32", DIGEST)


def test_version_dir() -> None:
    assert version_dir(Path("/r"), 7) == Path("/r/v7")


def test_valid_segments_return_their_path(tmp_path: Path) -> None:
    assert validate_segment(ROUTED, payload_dir=tmp_path) == tmp_path / "a.bin"
    assert validate_segment(MASK, payload_dir=tmp_path, file_size=64) == tmp_path / "a.bin"
    fill = attrs.evolve(ROUTED, file="", digest=None, fill=-1, shape=(1, 3, 2))
    assert validate_segment(fill, payload_dir=tmp_path) == tmp_path


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("../x.bin", "traversal"),
        ("/abs", "not_plain_name"),
        ("/abs/../../etc/passwd", "traversal"),
        ("a/b", "not_plain_name"),
        ("a\\b", "not_plain_name"),
        ("..\\x.bin", "traversal"),
        ("", "not_plain_name"),
        (".", "traversal"),
        ("..", "traversal"),
        ("a\0.bin", "not_plain_name"),
    ],
)
def test_rejects_names(tmp_path: Path, name: str, reason: str) -> None:
    with pytest.raises(BadSegment) as info:
        validate_segment(attrs.evolve(ROUTED, file=name), payload_dir=tmp_path)
    assert info.value.reason == reason
    assert repr(name) in str(info.value)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"dtype": "int64"}, "dtype"),
        ({"dtype": "float32"}, "dtype"),
        ({"field": "sampling_mask"}, "dtype"),
        ({"field": "logits"}, "field"),
        ({"shape": (4, 3)}, "shape"),
        ({"shape": (4, 3, 2, 1)}, "shape"),
        ({"shape": (4, -3, 2)}, "shape"),
        ({"offset": -1}, "out_of_range"),
        ({"pos": -1}, "out_of_range"),
        ({"digest": "xyz"}, "digest"),
        ({"digest": DIGEST.upper()}, "digest"),
        ({"digest_offset": 0}, "malformed"),
        ({"offset": 8, "digest_offset": 10, "digest_nbytes": 100}, "out_of_range"),
        ({"offset": 8, "digest_offset": 0, "digest_nbytes": 20}, "out_of_range"),
        ({"fill": -1}, "malformed"),
        ({"shape": (1, 1 << 12, 1 << 11)}, "shape"),
        ({"fill": -1, "file": "", "digest": "", "shape": (1, 1 << 20, 8)}, "shape"),
        (
            {
                "fill": -1,
                "file": "",
                "digest": "",
                "field": "sampling_mask",
                "dtype": "int32",
                "shape": (1, 4),
            },
            "malformed",
        ),
    ],
)
def test_rejects_fields(tmp_path: Path, changes: dict[str, Any], reason: str) -> None:
    with pytest.raises(BadSegment) as info:
        validate_segment(attrs.evolve(ROUTED, **changes), payload_dir=tmp_path)
    assert info.value.reason == reason


def test_mask_shape_must_be_2d(tmp_path: Path) -> None:
    with pytest.raises(BadSegment, match="shape"):
        validate_segment(attrs.evolve(MASK, shape=(2, 5, 1)), payload_dir=tmp_path)


def test_rejects_bytes_past_file_size(tmp_path: Path) -> None:
    # MASK ends at 24 + 2 * 5 * 4 = 64.
    validate_segment(MASK, payload_dir=tmp_path, file_size=64)
    with pytest.raises(BadSegment) as info:
        validate_segment(MASK, payload_dir=tmp_path, file_size=63)
    assert info.value.reason == "out_of_range"
    # A clipped segment must fit its whole digested range, not only its own rows.
    clipped = attrs.evolve(MASK, shape=(1, 5), digest_offset=24, digest_nbytes=40)
    with pytest.raises(BadSegment, match="past the file"):
        validate_segment(clipped, payload_dir=tmp_path, file_size=60)


def make_version_dir(root: Path, version: int, size: int) -> Path:
    payload_dir = version_dir(root, version)
    payload_dir.mkdir()
    (payload_dir / "a.bin").write_bytes(bytes(size))
    return payload_dir


def validate_segments(
    segments: list[PayloadSegment], *, root: Path, version: int, check_files: bool
) -> None:
    """A turn's segments checked as the daemon checks them (`check_segment` on the record;
    then, with `check_files`, `v<version>` opened once and each file's size, no link
    followed, as orchestrator.daemon.inference.client.check_turn_files does)."""
    for segment in segments:
        check_segment(segment)
    if not check_files:
        return
    with PayloadRootFiles(root) as files:
        directory = open_version_dir(files, version)
        for segment in segments:
            check_within(segment, regular_file_size(directory, segment.file))


def test_validate_segments_checks_files(tmp_path: Path) -> None:
    make_version_dir(tmp_path, 3, 64)
    validate_segments([ROUTED, MASK], root=tmp_path, version=3, check_files=True)
    with pytest.raises(BadSegment, match="past the file"):
        validate_segments(
            [attrs.evolve(MASK, offset=32)], root=tmp_path, version=3, check_files=True
        )
    # Without file checks nothing is read, so a missing version dir is not an error.
    validate_segments([ROUTED], root=tmp_path, version=9, check_files=False)


def test_validate_segments_rejects_bad_names_before_io(tmp_path: Path) -> None:
    make_version_dir(tmp_path, 3, 64)
    with pytest.raises(BadSegment) as info:
        validate_segments(
            [ROUTED, attrs.evolve(MASK, file="../v3/a.bin")],
            root=tmp_path,
            version=3,
            check_files=True,
        )
    assert info.value.reason == "traversal"


def test_missing_file_and_dir(tmp_path: Path) -> None:
    with pytest.raises(PayloadMissing) as info:
        validate_segments([ROUTED], root=tmp_path, version=3, check_files=True)
    assert str(tmp_path / "v3") in str(info.value)
    make_version_dir(tmp_path, 3, 64)
    with pytest.raises(PayloadMissing) as info:
        validate_segments(
            [attrs.evolve(ROUTED, file="b.bin")], root=tmp_path, version=3, check_files=True
        )
    assert str(tmp_path / "v3" / "b.bin") in str(info.value)


def test_symlinked_file_is_rejected_even_inside(tmp_path: Path) -> None:
    payload_dir = make_version_dir(tmp_path, 3, 64)
    (payload_dir / "link.bin").symlink_to(payload_dir / "a.bin")
    with pytest.raises(BadSegment) as info:
        validate_segments(
            [attrs.evolve(ROUTED, file="link.bin")], root=tmp_path, version=3, check_files=True
        )
    assert info.value.reason == "symlink"
    assert "link.bin" in str(info.value)


def test_symlinked_version_dir_is_rejected(tmp_path: Path) -> None:
    make_version_dir(tmp_path, 2, 64)
    (tmp_path / "v3").symlink_to(tmp_path / "v2")
    with pytest.raises(BadSegment) as info:
        validate_segments([ROUTED], root=tmp_path, version=3, check_files=True)
    assert info.value.reason == "symlink"


def test_not_regular_file(tmp_path: Path) -> None:
    payload_dir = make_version_dir(tmp_path, 3, 64)
    (payload_dir / "d.bin").mkdir()
    os.mkfifo(payload_dir / "f.bin")
    for name in ("d.bin", "f.bin"):
        with pytest.raises(BadSegment) as info:
            validate_segments(
                [attrs.evolve(ROUTED, file=name)], root=tmp_path, version=3, check_files=True
            )
        assert info.value.reason == "not_regular_file"
