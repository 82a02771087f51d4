"""Write one choice's payload arrays into one new file and describe them as segments."""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import trio

from ._digest import payload_digest
from ._segment import FIELD_NDIM, FIELDS, PayloadSegment, stored_bytes


def write_payload_file(
    payload_dir: Path, arrays: Mapping[str, tuple[np.ndarray, int]], *, fsync: bool = False
) -> list[PayloadSegment]:
    """Write `arrays` (field -> (array, pos)) into one new ``<uuid4 hex>.bin`` file.

    Creates `payload_dir` (and its parents) if missing. The fields are written back to back
    in mapping order, each in C order and little-endian; the file is closed (after an
    ``fsync`` when asked) before this returns, so a reader on another host sees it whole
    (NFS close-to-open). Returns one segment per field, each with its bytes' digest.
    Blocks: call `write_payload` from an event loop.

    Raises `ValueError` for an unknown field, a dtype not allowed for it, a wrong number
    of dimensions or a negative pos (before anything is written), and `OSError` as is. A
    partly written file is removed before the error propagates.
    """
    prepared = [_prepare(field, array, pos) for field, (array, pos) in arrays.items()]
    payload_dir.mkdir(parents=True, exist_ok=True)
    name = f"{uuid.uuid4().hex}.bin"
    path = payload_dir / name
    segments: list[PayloadSegment] = []
    # O_EXCL: a uuid4 collision must fail loudly rather than overwrite another choice's file.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        offset = 0
        for field, array, pos in prepared:
            view = stored_bytes(array)
            _write_all(fd, view)
            segments.append(
                PayloadSegment(
                    field=field,
                    file=name,
                    offset=offset,
                    pos=pos,
                    shape=array.shape,
                    dtype=array.dtype.name,
                    digest=payload_digest(view),
                )
            )
            offset += view.nbytes
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return segments


async def write_payload(
    payload_dir: Path,
    arrays: Mapping[str, tuple[np.ndarray, int]],
    *,
    fsync: bool = False,
    limiter: trio.CapacityLimiter | None = None,
) -> list[PayloadSegment]:
    """`write_payload_file` in a worker thread (bounded by `limiter` when given)."""
    return await trio.to_thread.run_sync(
        functools.partial(write_payload_file, payload_dir, arrays, fsync=fsync),
        limiter=limiter,
    )


def _prepare(field: str, array: np.ndarray, pos: int) -> tuple[str, np.ndarray, int]:
    allowed = FIELDS.get(field)
    if allowed is None:
        raise ValueError(f"unknown payload field {field!r}")
    if array.dtype.name not in allowed:
        raise ValueError(f"{field} must have dtype in {sorted(allowed)}, got {array.dtype.name}")
    if array.ndim != FIELD_NDIM[field]:
        raise ValueError(f"{field} must have {FIELD_NDIM[field]} dimensions, got {array.ndim}")
    if pos < 0:
        raise ValueError(f"{field} pos must not be negative, got {pos}")
    return field, array, pos


def _write_all(fd: int, view: memoryview) -> None:
    # os.write may write less than asked (signals, some filesystems): loop until done.
    while view:
        written = os.write(fd, view)
        view = view[written:]
