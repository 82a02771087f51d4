"""By-handle segments as servers send them, to and from the daemon's `PayloadSegment`.

On the wire (prime-rl's extension) a segment is ``{"field", "file", "offset", "pos",
"rows", "dtype", "shape"}``: ``rows`` rows of one row ``shape`` each, starting at token
position ``pos``, stored at byte ``offset`` of ``file``, the file's absolute path inside the
request's ``payload_dir``. ``digest`` (blake2b-128 hex of the segment's bytes) is this
project's optional extension: verified when present, never required.

Inside the daemon a segment names its file by its bare name in the version directory and
carries the rows in its shape. The conversion is the one place where a server's path is
accepted: only a direct child of the very ``payload_dir`` the request named, spelled
without ``.``, ``..`` or doubled slashes (docs/design.md §9). Whether that child is a link
is checked where the file is opened, by payload_gc's no-follow calls.
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

from payload_gc import is_busy_name, plain_name_problem

from orchestrator.payload import FIELD_NDIM, FIELDS, BadSegment, PayloadSegment, is_digest_hex

__all__ = ["SEGMENT_KEYS", "segment_from_wire", "segment_to_wire"]

#: The keys of a segment on the wire, in prime-rl's field order.
SEGMENT_KEYS = ("field", "file", "offset", "pos", "rows", "dtype", "shape")
_OPTIONAL_KEYS = ("digest",)


def _is_int(value: object) -> bool:
    # JSON booleans parse as Python bools, which are ints: never accept them as numbers.
    return isinstance(value, int) and not isinstance(value, bool)


def segment_to_wire(
    segment: PayloadSegment, payload_dir: Path, *, digest: bool = False
) -> dict[str, Any]:
    """The wire form of one of a server's segments (`segment.file` a bare name)."""
    obj: dict[str, Any] = {
        "field": segment.field,
        "file": str(payload_dir / segment.file),
        "offset": segment.offset,
        "pos": segment.pos,
        "rows": segment.rows,
        "dtype": segment.dtype,
        "shape": list(segment.shape[1:]),
    }
    if digest and segment.digest is not None:
        obj["digest"] = segment.digest
    return obj


def segment_from_wire(obj: object, payload_dir: Path) -> PayloadSegment:
    """Parse and check one segment of a reply to a request that named `payload_dir`.

    Raises `BadSegment`: ``malformed`` (keys, types), ``field``, ``dtype``, ``shape``,
    ``out_of_range`` (a negative offset, pos or row count), ``traversal`` (a file outside
    `payload_dir`), ``not_plain_name``, ``digest`` (not 32 hex digits).
    """
    if not isinstance(obj, dict):
        raise BadSegment("malformed", "", f"expected a JSON object, got {type(obj).__name__}")
    file = obj.get("file")
    shown = file if isinstance(file, str) else ""
    missing = [key for key in SEGMENT_KEYS if key not in obj]
    if missing:
        raise BadSegment("malformed", shown, f"missing key(s) {', '.join(missing)}")
    unknown = sorted(str(key) for key in obj if key not in SEGMENT_KEYS + _OPTIONAL_KEYS)
    if unknown:
        # A key from a newer writer might change what the bytes mean: never half-read.
        raise BadSegment("malformed", shown, f"unknown key(s) {', '.join(unknown)}")
    for key in ("field", "file", "dtype"):
        if not isinstance(obj[key], str):
            raise BadSegment("malformed", shown, f"{key} must be a string")
    for key in ("offset", "pos", "rows"):
        if not _is_int(obj[key]):
            raise BadSegment("malformed", shown, f"{key} must be an integer")
        if obj[key] < 0:
            raise BadSegment("out_of_range", shown, f"negative {key} {obj[key]}")
    field, dtype, row_shape = obj["field"], obj["dtype"], obj["shape"]
    if field not in FIELDS:
        raise BadSegment("field", shown, f"unknown field {field!r}")
    if dtype not in FIELDS[field]:
        raise BadSegment("dtype", shown, f"dtype {dtype!r} not allowed for {field}")
    ndim = FIELD_NDIM[field] - 1
    if (
        not isinstance(row_shape, list)
        or len(row_shape) != ndim
        or not all(_is_int(d) and d >= 1 for d in row_shape)
    ):
        raise BadSegment(
            "shape", shown, f"{field} row shape must be {ndim} positive integers, got {row_shape!r}"
        )
    digest = obj.get("digest")
    if digest is not None and not (isinstance(digest, str) and is_digest_hex(digest)):
        raise BadSegment("digest", shown, "digest must be 32 lowercase hex digits")
    return PayloadSegment(
        field=field,
        file=_name_in(obj["file"], payload_dir),
        offset=obj["offset"],
        pos=obj["pos"],
        shape=(obj["rows"], *row_shape),
        dtype=dtype,
        digest=digest,
    )


def _name_in(file: str, payload_dir: Path) -> str:
    """The bare name of `file` when it is a direct child of `payload_dir`, spelled plainly."""
    directory, name = posixpath.split(file)
    problem = plain_name_problem(name)
    if problem is None and is_busy_name(name):
        # The collector never deletes such a name (a filesystem's own, for a file deleted
        # while open): a payload under it would pin its version directory for good.
        problem = f"{name!r} is named like a file deleted while still open (.nfs*, .fuse_hidden*)"
    if problem is not None:
        raise BadSegment("not_plain_name", file, problem)
    if (
        not file.startswith("/")
        or posixpath.normpath(file) != file
        or directory != str(payload_dir)
    ):
        raise BadSegment(
            "traversal", file, f"not a file directly inside the request's {str(payload_dir)!r}"
        )
    return name
