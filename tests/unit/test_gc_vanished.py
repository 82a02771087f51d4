"""The payload readers on a file that vanished (`is_vanished`: `ENOENT`, or on NFS and
FUSE mounts `ESTALE`, "Stale file handle"): missing, never a crash. payload_gc's own side
of it (the collection, file removal, the lock) is payload-gc/tests/unit/test_vanished.py.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from payload_gc import PayloadRootFiles

from orchestrator.payload import (
    PayloadMissing,
    PayloadSegment,
    read_rows,
    read_segment,
    write_payload_file,
)

REAL_OPEN = os.open


def _stale() -> OSError:
    return OSError(errno.ESTALE, os.strerror(errno.ESTALE))


@pytest.fixture
def segment(tmp_path: Path) -> tuple[Path, PayloadSegment]:
    directory = tmp_path / "root" / "v1"
    directory.mkdir(parents=True)
    routing = np.arange(4 * 2 * 3, dtype=np.uint8).reshape(4, 2, 3)
    (written,) = write_payload_file(directory, {"routed_experts": (routing, 0)})
    return directory, written


def test_the_reader_says_missing_for_a_file_that_vanished(
    segment: tuple[Path, PayloadSegment], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, written = segment

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if path == written.file:
            raise _stale()
        return REAL_OPEN(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    with pytest.raises(PayloadMissing) as missing:
        read_segment(directory, written)
    assert missing.value.detail == "no such file"
    with PayloadRootFiles(directory.parent) as files, pytest.raises(PayloadMissing) as missing:
        read_rows(files.version(1), written, 0, 1)
    assert missing.value.detail == "no such file"


def test_the_reader_says_missing_for_a_file_deleted_elsewhere_while_open(
    segment: tuple[Path, PayloadSegment], monkeypatch: pytest.MonkeyPatch
) -> None:
    # NFS: another host deleted the file after it was opened here; reading the open
    # descriptor then fails with a stale handle.
    directory, written = segment

    def stale(*args: Any, **kwargs: Any) -> Any:
        raise _stale()

    monkeypatch.setattr(os, "preadv", stale)
    monkeypatch.setattr(os, "pread", stale)
    with pytest.raises(PayloadMissing, match="removed while it was open"):
        read_segment(directory, written)
    with PayloadRootFiles(directory.parent) as files:
        version = files.version(1)
        with pytest.raises(PayloadMissing, match="removed while it was open"):
            read_rows(version, written, 0, 1)
