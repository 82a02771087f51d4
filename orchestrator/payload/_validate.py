"""Checks a segment must pass before anything it points at is trusted or read
(docs/design.md §4)."""

from __future__ import annotations

import math
import stat
from pathlib import Path

from payload_gc import (
    BadFileName,
    PayloadGCError,
    PayloadRootFiles,
    VersionDir,
    VersionDirMissing,
    VersionDirRefused,
    plain_name_problem,
    version_name,
)

from ._digest import is_digest_hex
from ._errors import BadSegment, PayloadMissing
from ._segment import FIELD_NDIM, FIELDS, PayloadSegment

#: An upper bound on the elements of one row (layers x top_k, or a mask's width), far
#: above any real model (a whole vocabulary fits), so that a fill segment's claimed shape
#: cannot make a reader allocate without bound.
MAX_ROW_ELEMENTS = 1 << 22


def version_dir(root: Path, version: int) -> Path:
    """The directory payloads of policy version `version` are written into: ``root/v<k>``."""
    return root / f"v{version}"


def validate_segment(
    segment: PayloadSegment, *, payload_dir: Path, file_size: int | None = None
) -> Path:
    """Check one segment against docs/design.md §4 (`check_segment`) and return the path of its
    file, or `payload_dir` itself for a fill segment."""
    check_segment(segment, file_size=file_size)
    return payload_dir if segment.is_fill else payload_dir / segment.file


def check_segment(segment: PayloadSegment, *, file_size: int | None = None) -> None:
    """Check one segment against docs/design.md §4.

    Checks, without touching the filesystem, what `check_segment_layout` checks, and that
    the file is a plain name (not empty, no ``/`` or ``\\``, not ``.`` or ``..``, not
    absolute, no NUL), so its path stays inside the payload directory. When `file_size`
    is given, the bytes (and the digested range) must end within it.

    Raises `BadSegment` (reasons ``field``, ``dtype``, ``shape``, ``not_plain_name``,
    ``traversal``, ``out_of_range``, ``digest``, ``malformed``).
    """
    check_segment_layout(segment)
    if segment.is_fill:
        return
    _check_plain_name(segment.file)
    if file_size is not None:
        check_within(segment, file_size)


def check_segment_layout(segment: PayloadSegment) -> None:
    """Check everything about one segment but its file's name, without touching the
    filesystem: what its bytes are and where they lie.

    The dtype is allowed for the field; the shape has the field's number of dimensions,
    no row dimension below one and at most `MAX_ROW_ELEMENTS` elements in a row; offset,
    pos and the row count are not negative; a digest, when there is one, is 32 lowercase
    hex digits and its byte range contains the segment's bytes. A fill segment
    (``routed_experts`` only) has no file, offset or digest. `segment.file` is only shown
    in errors, so a caller that reads a file's name in another form (a server's absolute
    path, ``orchestrator.wire.segments``) checks that form itself.

    Raises `BadSegment` (reasons ``field``, ``dtype``, ``shape``, ``out_of_range``,
    ``digest``, ``malformed``).
    """
    name = segment.file
    allowed = FIELDS.get(segment.field)
    if allowed is None:
        raise BadSegment("field", name, f"unknown field {segment.field!r}")
    if segment.dtype not in allowed:
        raise BadSegment(
            "dtype", name, f"dtype {segment.dtype!r} not allowed for field {segment.field!r}"
        )
    ndim = FIELD_NDIM[segment.field]
    if len(segment.shape) != ndim or any(d < 0 for d in segment.shape[1:]):
        raise BadSegment(
            "shape",
            name,
            f"shape {list(segment.shape)} of {segment.field!r} must have {ndim} "
            "non-negative dimensions",
        )
    if 0 in segment.shape[1:]:
        raise BadSegment("shape", name, f"shape {list(segment.shape)} has a row of size zero")
    if math.prod(segment.shape[1:]) > MAX_ROW_ELEMENTS:
        raise BadSegment(
            "shape", name, f"rows of {math.prod(segment.shape[1:])} elements are implausible"
        )
    for key, value in (("offset", segment.offset), ("pos", segment.pos), ("rows", segment.rows)):
        if value < 0:
            raise BadSegment("out_of_range", name, f"negative {key} {value}")
    if segment.is_fill:
        if segment.field != "routed_experts":
            raise BadSegment("malformed", name, "only routed_experts has fill segments")
        if (
            name
            or segment.offset
            or segment.digest is not None
            or segment.digest_offset is not None
        ):
            raise BadSegment("malformed", name, "a fill segment has no file, offset or digest")
        return
    # isinstance too: a server's JSON may hold anything where the digest goes.
    if segment.digest is not None and not (
        isinstance(segment.digest, str) and is_digest_hex(segment.digest)
    ):
        raise BadSegment("digest", name, "digest must be 32 lowercase hex digits")
    if (segment.digest_offset is None) != (segment.digest_nbytes is None):
        raise BadSegment("malformed", name, "digest_offset and digest_nbytes go together")
    if segment.digest is None and segment.digest_offset is not None:
        raise BadSegment("malformed", name, "a digested range without a digest")
    digest_offset, digest_nbytes = segment.digest_range
    if not (
        0 <= digest_offset <= segment.offset
        and segment.offset + segment.nbytes <= digest_offset + digest_nbytes
    ):
        raise BadSegment(
            "out_of_range", name, "the digested byte range does not contain the segment"
        )


def check_within(segment: PayloadSegment, file_size: int) -> None:
    """Raise `BadSegment` (``out_of_range``) unless the segment's (digested) bytes end
    within a file of `file_size` bytes."""
    digest_offset, digest_nbytes = segment.digest_range
    end = digest_offset + digest_nbytes
    if end > file_size:
        raise BadSegment(
            "out_of_range",
            segment.file,
            f"bytes end at {end}, past the file's {file_size} bytes",
        )


def open_version_dir(files: PayloadRootFiles, version: int) -> VersionDir:
    """`v<version>` of the open root, with payload_gc's refusals as payload errors.

    Raises `PayloadMissing` or `BadSegment` (``symlink``, ``mount_point``,
    ``not_regular_file``)."""
    try:
        return files.version(version)
    except VersionDirMissing:
        raise PayloadMissing(Path(files.root, version_name(version)), "no such directory") from None
    except VersionDirRefused as exc:
        reason = {"symlink": "symlink", "mount_point": "mount_point"}.get(
            exc.kind, "not_regular_file"
        )
        raise BadSegment(reason, "", str(exc)) from None
    except PayloadGCError as exc:
        raise PayloadMissing(Path(files.root, version_name(version)), str(exc)) from None


def regular_file_size(directory: VersionDir, name: str) -> int:
    """The size of regular file `name` in `directory`, looked at without following a link.

    Raises `PayloadMissing`, or `BadSegment` (``symlink``, ``not_regular_file``,
    ``not_plain_name``)."""
    path = f"{directory.label}/{name}"
    try:
        st = directory.lstat(name)
    except FileNotFoundError:
        raise PayloadMissing(Path(path)) from None
    except BadFileName as exc:
        raise BadSegment("not_plain_name", name, str(exc)) from None
    except OSError as exc:
        raise PayloadMissing(Path(path), exc.strerror or str(exc)) from None
    if stat.S_ISLNK(st.st_mode):
        raise BadSegment("symlink", name, f"{path!r} is a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise BadSegment("not_regular_file", name, f"{path!r} is not a regular file")
    return st.st_size


def _check_plain_name(name: str) -> None:
    # One rule for what a plain name is, payload_gc's; only the reason is ours.
    problem = plain_name_problem(name)
    if problem is None:
        return
    climbs = name in {".", ".."} or ".." in name.replace("\\", "/").split("/")
    raise BadSegment("traversal" if climbs else "not_plain_name", name, problem)
