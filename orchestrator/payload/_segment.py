"""Payload segments: small records that point at an array's bytes inside a payload file.

A segment is the by-handle form of one array (docs/design.md §4): the server writes the bytes into
``<payload_dir>/<file>`` and returns ``{"field", "file", "offset", "pos", "shape", "dtype",
"digest"}``. Row ``i`` of the array belongs to token position ``pos + i``.

Two optional extensions come from stitching (see ``_stitch.py``):

* a **fill segment** has no bytes (``file == ""``, ``offset == 0``, ``digest == ""``):
  every element is ``fill`` (``-1``, "let the trainer's router pick");
* a **clipped segment** covers part of the bytes its parent segment was digested over.
  It keeps the parent's ``digest`` and names the parent's byte range in ``digest_offset``
  and ``digest_nbytes``; a verified read hashes that whole range and then slices it.

Bytes are stored in C order, little-endian.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs
import numpy as np

from ._errors import BadSegment

#: Each payload field and the dtypes its arrays may have. Routed expert ids are compact
#: (``uint8`` for at most 256 experts, else ``uint16``); masks are ``int32`` token ids.
FIELDS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "routed_experts": frozenset({"uint8", "uint16"}),
        "sampling_mask": frozenset({"int32"}),
    }
)

#: The number of dimensions of each field's arrays: ``[rows, layers, top_k]`` and
#: ``[rows, widest_row]``.
FIELD_NDIM: Mapping[str, int] = MappingProxyType({"routed_experts": 3, "sampling_mask": 2})

_ALL_DTYPES = frozenset().union(*FIELDS.values())
_ITEMSIZE: Mapping[str, int] = MappingProxyType({d: np.dtype(d).itemsize for d in _ALL_DTYPES})
_REQUIRED_KEYS = ("field", "file", "offset", "pos", "shape", "dtype", "digest")
_OPTIONAL_KEYS = ("fill", "digest_offset", "digest_nbytes")


def _to_shape(value: Any) -> tuple[int, ...]:
    return tuple(value)


@attrs.frozen
class PayloadSegment:
    """One array's place in a payload file (or, for a fill segment, its constant value).

    Build one from the wire with `from_json`; check it with `validate_segment` before
    reading anything it points at.
    """

    field: str
    file: str
    offset: int
    pos: int
    shape: tuple[int, ...] = attrs.field(converter=_to_shape)
    dtype: str
    digest: str
    fill: int | None = None
    digest_offset: int | None = None
    digest_nbytes: int | None = None

    @property
    def rows(self) -> int:
        """The number of rows (token positions) the segment covers."""
        return self.shape[0]

    @property
    def row_nbytes(self) -> int:
        """The size in bytes of one row."""
        itemsize = _ITEMSIZE.get(self.dtype) or np.dtype(self.dtype).itemsize
        return math.prod(self.shape[1:]) * itemsize

    @property
    def nbytes(self) -> int:
        """The size in bytes of the whole array (0 bytes are stored for a fill segment)."""
        return self.rows * self.row_nbytes

    @property
    def is_fill(self) -> bool:
        """Whether this is a fill segment, which stores no bytes."""
        return self.fill is not None

    @property
    def digest_range(self) -> tuple[int, int]:
        """The ``(offset, nbytes)`` of the bytes `digest` was computed over.

        That is the segment's own bytes, unless it was clipped out of a larger parent.
        """
        if self.digest_offset is not None and self.digest_nbytes is not None:
            return self.digest_offset, self.digest_nbytes
        return self.offset, self.nbytes

    def to_json(self) -> dict[str, Any]:
        """The wire form of docs/design.md §4; the optional keys appear only when set."""
        obj: dict[str, Any] = {
            "field": self.field,
            "file": self.file,
            "offset": self.offset,
            "pos": self.pos,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "digest": self.digest,
        }
        for key in _OPTIONAL_KEYS:
            value = getattr(self, key)
            if value is not None:
                obj[key] = value
        return obj

    @classmethod
    def from_reply(cls, obj: object) -> PayloadSegment:
        """Parse a segment as an inference server sends it: exactly the wire keys.

        The stitched forms (``fill``, ``digest_offset``, ``digest_nbytes``) are built
        inside the daemon only; a server that sends them is refused, so no reply can make
        the daemon take a fill segment's empty file name for a file. Raises like
        `from_json`.
        """
        if isinstance(obj, dict):
            internal = sorted(key for key in _OPTIONAL_KEYS if key in obj)
            if internal:
                file = obj.get("file")
                raise BadSegment(
                    "malformed",
                    file if isinstance(file, str) else "",
                    f"key(s) {', '.join(internal)} are the daemon's own, never a server's",
                )
        return cls.from_json(obj)

    @classmethod
    def from_json(cls, obj: object) -> PayloadSegment:
        """Parse the wire form, checking keys and types (not paths or sizes).

        Unknown keys are rejected: a segment from a newer writer must not be half-read.
        Raises `BadSegment` with reason ``malformed``, ``field`` or ``dtype``.
        """
        if not isinstance(obj, dict):
            raise BadSegment("malformed", "", f"expected a JSON object, got {type(obj).__name__}")
        file = obj.get("file")
        name = file if isinstance(file, str) else ""
        missing = [key for key in _REQUIRED_KEYS if key not in obj]
        if missing:
            raise BadSegment("malformed", name, f"missing key(s) {', '.join(missing)}")
        unknown = sorted(str(key) for key in obj if key not in _REQUIRED_KEYS + _OPTIONAL_KEYS)
        if unknown:
            raise BadSegment("malformed", name, f"unknown key(s) {', '.join(unknown)}")
        for key in ("field", "file", "dtype", "digest"):
            if not isinstance(obj[key], str):
                raise BadSegment("malformed", name, f"{key} must be a string")
        for key in ("offset", "pos"):
            if not is_json_int(obj[key]):
                raise BadSegment("malformed", name, f"{key} must be an integer")
        for key in _OPTIONAL_KEYS:
            if obj.get(key) is not None and not is_json_int(obj[key]):
                raise BadSegment("malformed", name, f"{key} must be an integer")
        shape = obj["shape"]
        if not isinstance(shape, list) or not shape or not all(is_json_int(d) for d in shape):
            raise BadSegment("malformed", name, "shape must be a non-empty list of integers")
        if obj["field"] not in FIELDS:
            raise BadSegment("field", name, f"unknown field {obj['field']!r}")
        if obj["dtype"] not in _ALL_DTYPES:
            raise BadSegment("dtype", name, f"unknown dtype {obj['dtype']!r}")
        return cls(
            field=obj["field"],
            file=obj["file"],
            offset=obj["offset"],
            pos=obj["pos"],
            shape=tuple(shape),
            dtype=obj["dtype"],
            digest=obj["digest"],
            fill=obj.get("fill"),
            digest_offset=obj.get("digest_offset"),
            digest_nbytes=obj.get("digest_nbytes"),
        )


def stored_dtype(name: str) -> np.dtype[np.generic]:
    """The numpy dtype named `name` with the little-endian byte order payload bytes use."""
    return np.dtype(name).newbyteorder("<")


def stored_bytes(array: np.ndarray) -> memoryview:
    """The array's bytes as stored in payloads (C order, little-endian); no copy if already so."""
    data = np.ascontiguousarray(array, dtype=stored_dtype(array.dtype.name))
    # A flat uint8 view: memoryview.cast refuses shapes with a zero dimension.
    return data.reshape(-1).view(np.uint8).data


def is_json_int(value: object) -> bool:
    """Whether a parsed JSON value is an integer (booleans are not)."""
    # JSON booleans parse as Python bools, which are ints: never accept them as numbers.
    return isinstance(value, int) and not isinstance(value, bool)
