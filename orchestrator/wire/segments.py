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

import msgspec
from payload_gc import is_busy_name, plain_name_problem

from orchestrator.payload import (
    BadSegment,
    PayloadSegment,
    check_json_types,
    check_segment_layout,
    is_json_int,
    segment_object,
)

__all__ = ["SEGMENT_KEYS", "decode_segments", "segment_from_wire", "segment_to_wire"]

#: The keys of a segment on the wire, in prime-rl's field order.
SEGMENT_KEYS = ("field", "file", "offset", "pos", "rows", "dtype", "shape")
_OPTIONAL_KEYS = ("digest",)


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


class _TypedSegment(msgspec.Struct, forbid_unknown_fields=True):
    """A segment whose keys and types msgspec checked while decoding (in C): what
    `segment_object` and `check_json_types` accept, and nothing they refuse."""

    field: str
    file: str
    offset: int
    pos: int
    rows: int
    dtype: str
    shape: list[int]
    digest: str | None = None


_TYPED_SEGMENTS = msgspec.json.Decoder(list[_TypedSegment])


def decode_segments(payload: bytes) -> object:
    """A reply's ``payload`` JSON: a list of typed segments when every item has a
    segment's keys and types (the servers' case, about half the cost of checking the
    decoded objects in Python), else the plain JSON value, for `segment_from_wire` to
    say what is wrong with it item by item."""
    try:
        return _TYPED_SEGMENTS.decode(payload)
    except msgspec.ValidationError:
        return msgspec.json.decode(payload)


def segment_from_wire(obj: object, payload_dir: Path) -> PayloadSegment:
    """Parse and check one segment of a reply to a request that named `payload_dir`
    (an item of what `decode_segments` gives, or any decoded JSON value).

    The keys and their types are checked the way every segment's JSON form is, the
    layout the way every segment's is (`check_segment_layout`); only the file's path is
    the wire's own.

    Raises `BadSegment`: ``malformed`` (keys, types), ``field``, ``dtype``, ``shape``,
    ``out_of_range`` (a negative offset, pos or row count), ``traversal`` (a file outside
    `payload_dir`), ``not_plain_name``, ``digest`` (not 32 hex digits).
    """
    # Until its path is checked, the segment names its file as sent, so do its errors.
    if isinstance(obj, _TypedSegment):
        segment = PayloadSegment(
            field=obj.field,
            file=obj.file,
            offset=obj.offset,
            pos=obj.pos,
            shape=(obj.rows, *obj.shape),
            dtype=obj.dtype,
            digest=obj.digest,
        )
    else:
        segment = _checked_segment(obj)
    check_segment_layout(segment)
    # Built again rather than `attrs.evolve`d: evolve looks every field up by name, and
    # this runs for every segment of every reply on the event loop.
    return PayloadSegment(
        field=segment.field,
        file=_name_in(segment.file, payload_dir),
        offset=segment.offset,
        pos=segment.pos,
        shape=segment.shape,
        dtype=segment.dtype,
        digest=segment.digest,
    )


def _checked_segment(obj: object) -> PayloadSegment:
    """`obj` as a segment once its keys and types are checked in Python (every refusal
    named). Raises `BadSegment` (``malformed``, ``shape``)."""
    obj, shown = segment_object(obj, required=SEGMENT_KEYS, optional=_OPTIONAL_KEYS)
    check_json_types(obj, shown, strings=("field", "file", "dtype"), ints=("offset", "pos", "rows"))
    row_shape = obj["shape"]
    if not isinstance(row_shape, list) or not all(is_json_int(d) for d in row_shape):
        raise BadSegment(
            "shape", shown, f"the row shape must be a list of integers, got {row_shape!r}"
        )
    return PayloadSegment(
        field=obj["field"],
        file=obj["file"],
        offset=obj["offset"],
        pos=obj["pos"],
        shape=(obj["rows"], *row_shape),
        dtype=obj["dtype"],
        digest=obj.get("digest"),
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
