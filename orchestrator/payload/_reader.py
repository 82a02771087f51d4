"""Read a sample's payload arrays from its segments (trainer side; blocking).

Every segment is validated before any byte is read, so nothing outside `payload_dir` is
ever opened; files are opened relative to the directory and without following symbolic
links. Only the bytes of the requested rows are read, unless digests are verified: then
every digested byte range of the sample is read whole (once, however many segments were
clipped from it) and hashed, also those outside a row window, so that every rank of a
context-parallel group accepts or rejects a sample alike; the rows are sliced from it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import numpy as np
from payload_gc import (
    BadFileName,
    PayloadGCError,
    PayloadRootFiles,
    RootMissing,
    VersionDir,
    is_vanished,
    parse_version,
)

from ._digest import payload_digest
from ._errors import BadSegment, PayloadCorrupt, PayloadMissing
from ._segment import FIELDS, PayloadSegment, stored_dtype
from ._validate import open_version_dir, validate_segment

#: How a file deleted elsewhere after it was opened is described: reading it then fails
#: with a stale handle on NFS (`is_vanished`).
REMOVED_WHILE_OPEN = "removed while it was open"


def read_sample_payload(
    payload_dir: Path,
    segments: Mapping[str, Sequence[PayloadSegment]],
    sample_len: int,
    *,
    rows: range | None = None,
    verify: bool = False,
) -> dict[str, np.ndarray]:
    """Read a sample's stitched segments (field -> segments) into one array per field.

    ``routed_experts`` is ``[n, layers, top_k]``; its segments must cover positions
    ``0 .. sample_len - 1`` exactly once, as `stitch_routing` makes them; a ``-1`` fill
    segment widens the dtype as `stitch_inline_routing` does. ``sampling_mask`` is
    ``int32 [n, W]``, ``W`` the widest segment, ``-1`` where no segment has a row and for
    padding. ``n`` is `sample_len`, or ``len(rows)`` when `rows` (a window of positions
    with step 1, as a context-parallel rank reads) is given; then only those rows' bytes
    are read. Every segment's file must still exist and hold its bytes, even outside the
    window (an ``fstat``, no read). With `verify`, the digest of every segment is checked,
    even outside the window (its digested range is read and hashed): whether a sample
    reads cleanly never depends on `rows`.

    Raises `BadSegment` (before reading anything) for a segment that fails
    `validate_segment`, is filed under another field, lies past the sample or overlaps
    another, for routing that does not cover the sample, and for a symlink or non-regular
    file; `PayloadMissing` naming the file when it is missing or too short;
    `PayloadCorrupt` on a digest mismatch; `ValueError` for a bad `rows` window.
    """
    window = _check_window(rows, sample_len)
    for field, field_segments in segments.items():
        if field not in FIELDS:
            raise BadSegment("field", "", f"unknown field {field!r}")
        for segment in field_segments:
            if segment.field != field:
                raise BadSegment("field", segment.file, f"{segment.field} filed under {field}")
            validate_segment(segment, payload_dir=payload_dir)
    routed = segments.get("routed_experts")
    masks = segments.get("sampling_mask")
    if routed is not None:
        _check_layout(routed, sample_len, exact=True)
    if masks is not None:
        _check_layout(masks, sample_len, exact=False)
    out: dict[str, np.ndarray] = {}
    with _PayloadFiles(payload_dir, verify=verify) as files:
        # Every segment's bytes must exist before anything is allocated or read: the
        # output's size then follows from real files, not from whatever a shape claims,
        # and every rank of a context-parallel group fails alike on a broken sample.
        for field_segments in segments.values():
            for segment in field_segments:
                if not segment.is_fill:
                    files.check_size(segment)
        if verify:
            # Every digest, not only those of the window's segments: otherwise two ranks
            # could disagree about a sample. The ranges the window reads are kept.
            for field_segments in segments.values():
                for segment in field_segments:
                    if segment.digest is not None:
                        files.verify(segment, keep=_overlap(segment, window) is not None)
        if routed is not None:
            out["routed_experts"] = _assemble_routing(files, routed, window)
        if masks is not None:
            out["sampling_mask"] = _assemble_masks(files, masks, window)
    return out


def read_segment(payload_dir: Path, segment: PayloadSegment, *, verify: bool = False) -> np.ndarray:
    """Read one segment's whole array (a fill segment's, widened so its value fits).

    Raises like `read_sample_payload`.
    """
    validate_segment(segment, payload_dir=payload_dir)
    if segment.fill is not None:
        return np.full(segment.shape, segment.fill, dtype=_fill_dtype([segment]))
    with _PayloadFiles(payload_dir, verify=verify) as files:
        return files.read_rows(segment, 0, segment.rows)


class _PayloadFiles:
    """The open files of one read, opened once each, closed on exit."""

    def __init__(self, payload_dir: Path, *, verify: bool) -> None:
        self._payload_dir = payload_dir
        self._verify = verify
        self._root: PayloadRootFiles | None = None
        self._directory: VersionDir | None = None
        self._files: dict[str, tuple[int, int]] = {}  # name -> (fd, size)
        self._verified: dict[tuple[str, int, int], bytearray] = {}
        self._verified_unkept: set[tuple[str, int, int]] = set()

    def __enter__(self) -> _PayloadFiles:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for fd, _ in self._files.values():
            os.close(fd)
        if self._root is not None:
            self._root.close()

    def check_size(self, segment: PayloadSegment) -> None:
        """Raise `PayloadMissing` unless the segment's digested bytes are all in its file."""
        offset, nbytes = segment.digest_range
        _, size = self._open(segment.file)
        if offset + nbytes > size:
            raise PayloadMissing(
                self._payload_dir / segment.file,
                f"file has {size} bytes, a segment needs {offset + nbytes}",
            )

    def read_rows(self, segment: PayloadSegment, first_row: int, rows: int) -> np.ndarray:
        """Rows ``first_row .. first_row + rows - 1`` of a (non-fill) segment, native order."""
        dtype = stored_dtype(segment.dtype)
        start = segment.offset + first_row * segment.row_nbytes
        length = rows * segment.row_nbytes
        if self._verify and segment.digest is not None:
            parent_offset, _ = segment.digest_range
            data = self._verified_range(segment)
            # A copy: the array handed out must be writable and not pin the whole range.
            raw = bytearray(
                memoryview(data)[start - parent_offset : start - parent_offset + length]
            )
        else:
            raw = self._pread(segment.file, start, length)
        array = np.frombuffer(raw, dtype=dtype).reshape((rows, *segment.shape[1:]))
        return array.astype(np.dtype(segment.dtype), copy=False)

    def verify(self, segment: PayloadSegment, *, keep: bool) -> None:
        """Raise `PayloadCorrupt` unless the segment's digested range matches its digest.

        With `keep`, the verified bytes stay for `read_rows`; otherwise only the fact that
        they were verified does (a range outside a row window is hashed, not held).
        """
        offset, nbytes = segment.digest_range
        key = (segment.file, offset, nbytes)
        if key in self._verified or (not keep and key in self._verified_unkept):
            return
        data = self._read_and_check(segment)
        if keep:
            self._verified[key] = data
        else:
            self._verified_unkept.add(key)

    def _verified_range(self, segment: PayloadSegment) -> bytearray:
        offset, nbytes = segment.digest_range
        key = (segment.file, offset, nbytes)
        data = self._verified.get(key)
        if data is None:
            data = self._verified[key] = self._read_and_check(segment)
        return data

    def _read_and_check(self, segment: PayloadSegment) -> bytearray:
        offset, nbytes = segment.digest_range
        data = self._pread(segment.file, offset, nbytes)
        if payload_digest(data) != segment.digest:
            raise PayloadCorrupt(
                self._payload_dir / segment.file,
                f"{segment.field} bytes {offset}..{offset + nbytes}",
            )
        return data

    def _pread(self, name: str, offset: int, length: int) -> bytearray:
        fd, size = self._open(name)
        path = self._payload_dir / name
        if offset + length > size:
            raise PayloadMissing(path, f"file has {size} bytes, a segment needs {offset + length}")
        buffer = bytearray(length)
        view = memoryview(buffer)
        done = 0
        while done < length:
            try:
                got = os.preadv(fd, [view[done:]], offset + done)
            except OSError as error:
                if is_vanished(error):
                    # Deleted by another host while open (NFS: a stale handle).
                    raise PayloadMissing(path, REMOVED_WHILE_OPEN) from None
                raise
            if got == 0:
                # The file shrank since it was opened.
                raise PayloadMissing(path, f"file ends at byte {offset + done}")
            done += got
        return buffer

    def _open(self, name: str) -> tuple[int, int]:
        """Open `name` the way payload_gc does: the payload directory (`<root>/v<k>`)
        relative to its root without following a link and on the root's mount, the file
        by plain name, never a link, never a FIFO or device (refused without blocking)."""
        opened = self._files.get(name)
        if opened is not None:
            return opened
        if self._directory is None:
            self._root = _open_root(self._payload_dir)
            self._directory = open_version_dir(self._root, _version_of(self._payload_dir))
        path = self._payload_dir / name
        try:
            fd = self._directory.open_file(name)
        except BadFileName as error:
            raise BadSegment("not_plain_name", name, str(error)) from None
        except OSError as error:
            if is_vanished(error):
                raise PayloadMissing(path) from None
            if error.errno == errno.ELOOP:
                raise BadSegment("symlink", name, f"{str(path)!r} is a symbolic link") from None
            if error.errno in (errno.EISDIR, errno.EINVAL, errno.ENXIO):
                raise BadSegment(
                    "not_regular_file", name, f"{str(path)!r} is not a regular file"
                ) from None
            raise
        try:
            size = os.fstat(fd).st_size
        except OSError as error:
            os.close(fd)
            if is_vanished(error):
                raise PayloadMissing(path, REMOVED_WHILE_OPEN) from None
            raise
        self._files[name] = (fd, size)
        return fd, size


def _version_of(payload_dir: Path) -> int:
    version = parse_version(payload_dir.name)
    if version is None:
        raise BadSegment(
            "wrong_version_dir", "", f"{str(payload_dir)!r} is not a v<k> version directory"
        )
    return version


def _open_root(payload_dir: Path) -> PayloadRootFiles:
    try:
        return PayloadRootFiles(payload_dir.parent)
    except RootMissing:
        raise PayloadMissing(payload_dir, "no such directory") from None
    except PayloadGCError as error:
        raise BadSegment("symlink", "", str(error)) from None


def _check_window(rows: range | None, sample_len: int) -> range:
    if sample_len < 0:
        raise ValueError(f"sample_len must not be negative, got {sample_len}")
    if rows is None:
        return range(sample_len)
    if rows.step != 1 or not 0 <= rows.start <= rows.stop <= sample_len:
        raise ValueError(f"rows must be a range with step 1 inside 0..{sample_len}, got {rows}")
    return rows


def _check_layout(segments: Sequence[PayloadSegment], sample_len: int, *, exact: bool) -> None:
    """Segments lie inside the sample without overlap; with `exact`, cover it whole.

    Routing segments share a row shape (their dtypes may differ: turns of one rollout
    are promoted to the widest); masks may have any width.
    """
    if not segments:
        if exact and sample_len:
            raise BadSegment("coverage", "", f"no segments cover the {sample_len} positions")
        return
    first = segments[0]
    covered = 0
    for segment in sorted(segments, key=lambda s: s.pos):
        if segment.field == "routed_experts" and segment.shape[1:] != first.shape[1:]:
            raise BadSegment(
                "shape",
                segment.file,
                f"row shape {list(segment.shape[1:])} != {list(first.shape[1:])}",
            )
        if segment.pos < covered or (exact and segment.pos > covered):
            raise BadSegment(
                "coverage", segment.file, f"{segment.field} rows at {segment.pos} after {covered}"
            )
        covered = segment.pos + segment.rows
        if covered > sample_len:
            raise BadSegment(
                "out_of_range",
                segment.file,
                f"rows end at {covered}, past the sample's {sample_len}",
            )
    if exact and covered != sample_len:
        raise BadSegment("coverage", "", f"routing covers {covered} of {sample_len} positions")


def _fill_dtype(segments: Sequence[PayloadSegment]) -> np.dtype[np.generic]:
    """The dtype of the assembled array: every segment's values, and every fill value."""
    dtype: np.dtype[np.generic] = np.result_type(*(np.dtype(s.dtype) for s in segments))
    for segment in segments:
        if segment.fill is not None:
            dtype = np.promote_types(dtype, np.min_scalar_type(segment.fill))
    return dtype


def _overlap(segment: PayloadSegment, window: range) -> tuple[int, int] | None:
    lo = max(segment.pos, window.start)
    hi = min(segment.pos + segment.rows, window.stop)
    return (lo, hi) if lo < hi else None


def _assemble_routing(
    files: _PayloadFiles, segments: Sequence[PayloadSegment], window: range
) -> np.ndarray:
    if not segments:
        return np.empty((0, 0, 0), dtype=np.uint8)
    out = np.empty((len(window), *segments[0].shape[1:]), dtype=_fill_dtype(segments))
    _place(files, segments, window, out)
    return out


def _assemble_masks(
    files: _PayloadFiles, segments: Sequence[PayloadSegment], window: range
) -> np.ndarray:
    width = max((s.shape[1] for s in segments), default=0)
    out = np.full((len(window), width), -1, dtype=np.int32)
    _place(files, segments, window, out)
    return out


def _place(
    files: _PayloadFiles, segments: Sequence[PayloadSegment], window: range, out: np.ndarray
) -> None:
    """Copy each segment's rows inside `window` into `out` (row 0 = ``window.start``)."""
    for segment in segments:
        rows = _overlap(segment, window)
        if rows is None:
            continue
        lo, hi = rows
        target = out[lo - window.start : hi - window.start, ..., : segment.shape[-1]]
        if segment.fill is not None:
            target[...] = segment.fill
        else:
            target[...] = files.read_rows(segment, lo - segment.pos, hi - lo)
