"""Writing and mapping one `batch.bin` (the format is `format`'s; docs/protocol.md#batches).

The writer never builds the file in memory: it plans where every array goes, then hands
the arrays' own buffers to `os.writev`, a few hundred at a time (`durable.write_new_file`).
The interpreter lock is released during each system call, so a daemon publishing a batch
from a worker thread keeps its event loop running; the longest stretch the writer holds
the lock is one sample's advantages or the header's encoding, milliseconds for the
largest batches.

The reader maps the file copy-on-write: every array it hands out is a view of the
mapping, writable (a write stays private to the process, the file never changes), and
no byte is copied until it is touched. Both block: call them from a worker thread in
async code.
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from orchestrator.core.rollouts import TrainSample
from orchestrator.handoff.durable import write_new_file
from orchestrator.handoff.native.format import (
    BatchError,
    BatchFile,
    BatchLayout,
    decode_batch,
    encode_batch,
)

# Padding between arrays is shorter than the alignment: slices of one block of zeros.
_ZEROS = np.zeros(64, dtype=np.uint8)


def write_batch_file(
    path: Path,
    step: int,
    samples: Sequence[TrainSample],
    *,
    created_at: float,
    fsync: bool = True,
) -> int:
    """Create `path` (it must not exist) holding batch `step`; return its size in bytes.

    The file is fsynced before it is closed unless `fsync` is false. Blocking.

    Raises ValueError when the batch cannot be encoded (see `encode_batch`; nothing is
    created then), FileExistsError when `path` exists, OSError when writing fails (the
    partial file is left for the caller to remove).
    """
    layout = encode_batch(step, samples, created_at=created_at)
    write_layout(path, layout, fsync=fsync)
    return layout.size


def write_layout(path: Path, layout: BatchLayout, *, fsync: bool = True) -> None:
    """Create `path` (it must not exist) with the file `layout` plans (`encode_batch`).

    Raises like `write_batch_file`.
    """
    # Plain uint8 arrays, not memoryviews: the garbage collector does not track them.
    buffers = [np.frombuffer(layout.prefix, dtype=np.uint8)]
    position = 0
    for offset, array in zip(layout.offsets, layout.arrays, strict=True):
        if offset > position:
            buffers.append(_ZEROS[: offset - position])
        if array.size:
            buffers.append(array)
        position = offset + array.size
    if layout.data_start + position != layout.size:
        buffers.append(_ZEROS[: layout.size - layout.data_start - position])
    write_new_file(path, buffers, fsync=fsync)


def read_batch_file(path: Path) -> BatchFile:
    """Map the `batch.bin` at `path` and validate it whole; the arrays are views of the
    mapping (copy-on-write: writable, and the file never changes). Blocking.

    The file must not be rewritten or truncated while its arrays are in use (a shipped
    batch never is): a page past a new end would fault. Payload files are not read.

    Raises `BatchError` (one line naming the file) when it cannot be opened or read, or
    is not a valid batch file of format 2.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise BatchError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise BatchError(f"{path}: cannot read: not a regular file")
        size = status.st_size
        if size == 0:
            # mmap refuses an empty file; the format refuses it anyway.
            data = np.zeros(0, dtype=np.uint8)
        else:
            mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
            data = np.frombuffer(mapping, dtype=np.uint8)
    except (OSError, ValueError) as exc:
        message = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise BatchError(f"{path}: cannot read: {message}") from None
    finally:
        os.close(fd)
    return decode_batch(data, source=str(path))
