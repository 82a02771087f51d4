"""The routing rows two sides of a disaggregated turn both wrote, checked against each other.

Under disaggregated prefill/decode the prefill server computes the prompt's routing and
the decode server recomputes the prompt's last token in its first forward pass, so both
write a row for position ``prompt_len - 1`` (docs/protocol.md § Disaggregated
prefill/decode). The daemon keeps the prefill's row, as the router's inline merge does,
and checks that the decode's row says the same: a model is a function of its token
prefix, so two sides that ran the same weights on the same prompt agree. Reading those
few bytes is the one place the daemon looks inside a payload file; it does so the way
payload_gc opens files (fd-relative, never through a link, never a FIFO or device).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
from payload_gc import BadFileName, VersionDir, is_vanished

from ._errors import BadSegment, PayloadMissing
from ._reader import REMOVED_WHILE_OPEN
from ._segment import PayloadSegment, stored_dtype

__all__ = ["overlap_problem", "overlap_rows", "read_rows"]


def overlap_rows(first: PayloadSegment, second: PayloadSegment) -> range:
    """The positions both segments have a row for (empty when they do not meet)."""
    return range(max(first.pos, second.pos), min(first.pos + first.rows, second.pos + second.rows))


def read_rows(
    directory: VersionDir, segment: PayloadSegment, first_row: int, rows: int
) -> np.ndarray:
    """Rows ``first_row .. first_row + rows - 1`` of a (non-fill) segment whose file is in
    `directory`, in native byte order. Blocking.

    Raises `PayloadMissing` for a missing or short file, `BadSegment` (``symlink``,
    ``not_regular_file``, ``not_plain_name``) for anything that is not a plain regular file.
    """
    if first_row < 0 or rows < 0 or first_row + rows > segment.rows:
        raise ValueError(
            f"rows {first_row}..{first_row + rows} outside the segment's {segment.rows}"
        )
    path = f"{directory.label}/{segment.file}"
    try:
        fd = directory.open_file(segment.file)
    except BadFileName as exc:
        raise BadSegment("not_plain_name", segment.file, str(exc)) from None
    except OSError as exc:
        if is_vanished(exc):
            raise PayloadMissing(Path(path)) from None
        if exc.errno == errno.ELOOP:
            raise BadSegment("symlink", segment.file, f"{path!r} is a symbolic link") from None
        if exc.errno in (errno.EISDIR, errno.EINVAL, errno.ENXIO):
            raise BadSegment(
                "not_regular_file", segment.file, f"{path!r} is not a regular file"
            ) from None
        raise PayloadMissing(Path(path), exc.strerror or str(exc)) from None
    try:
        length = rows * segment.row_nbytes
        offset = segment.offset + first_row * segment.row_nbytes
        data = os.pread(fd, length, offset)
    except OSError as exc:
        if is_vanished(exc):
            raise PayloadMissing(Path(path), REMOVED_WHILE_OPEN) from None
        raise
    finally:
        os.close(fd)
    if len(data) != length:
        raise PayloadMissing(Path(path), f"file ends before byte {offset + length}")
    dtype = stored_dtype(segment.dtype)
    array = np.frombuffer(data, dtype=dtype).reshape((rows, *segment.shape[1:]))
    return array.astype(np.dtype(segment.dtype), copy=False)


def overlap_problem(
    directory: VersionDir, prefill: PayloadSegment, decode: PayloadSegment
) -> str | None:
    """What is wrong with the rows both sides wrote, or None when they agree (or do not
    overlap). Values are compared, not bytes: a side may have written ``uint8`` where the
    other wrote ``uint16``. Blocking: reads the overlapping rows of both files.

    Raises like `read_rows` when a file cannot be read.
    """
    both = overlap_rows(prefill, decode)
    if not both:
        return None
    if prefill.shape[1:] != decode.shape[1:]:
        return (
            f"prefill and decode routing rows differ in shape: {list(prefill.shape[1:])} "
            f"and {list(decode.shape[1:])}"
        )
    ours = read_rows(directory, prefill, both.start - prefill.pos, len(both))
    theirs = read_rows(directory, decode, both.start - decode.pos, len(both))
    differs = np.flatnonzero(
        (ours.astype(np.int64) != theirs.astype(np.int64)).reshape(len(both), -1).any(axis=1)
    )
    if not differs.size:
        return None
    position = both.start + int(differs[0])
    return (
        f"prefill and decode disagree on the routing of position {position}, which both "
        f"computed ({differs.size} of {len(both)} shared rows differ; files "
        f"{prefill.file!r} and {decode.file!r}): did the sides run different weights?"
    )
