"""Payload segments: small records that point at an array's bytes inside a payload file.

A segment is the by-handle form of one array (docs/design.md §4): a server writes the bytes
into ``<payload_dir>/<file>`` and returns a segment for them (its wire form is read in
``orchestrator.wire``). Inside the daemon and in a batch, a segment names its file by its
bare name in the version directory, and its ``shape`` starts with its row count: row ``i``
of the array belongs to token position ``pos + i``. ``digest`` (blake2b-128 of the bytes)
is optional: a server may send one, and then every read verifies it.

Two optional extensions come from stitching (see ``_stitch.py``):

* a **fill segment** has no bytes (``file == ""``, ``offset == 0``, no ``digest``):
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
from ._json import check_json_types, is_json_int, segment_object

#: Each payload field and the dtypes its arrays may have. Routed expert ids come as the
#: server captured them (``uint8`` for at most 256 experts, else ``uint16``; ``int16`` or
#: ``int32`` from a wide capture buffer); masks are ``int32`` token ids.
FIELDS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "routed_experts": frozenset({"uint8", "uint16", "int16", "int32"}),
        "sampling_mask": frozenset({"int32"}),
    }
)

#: The number of dimensions of each field's arrays: ``[rows, layers, top_k]`` and
#: ``[rows, widest_row]``.
FIELD_NDIM: Mapping[str, int] = MappingProxyType({"routed_experts": 3, "sampling_mask": 2})

_ALL_DTYPES = frozenset().union(*FIELDS.values())
_ITEMSIZE: Mapping[str, int] = MappingProxyType({d: np.dtype(d).itemsize for d in _ALL_DTYPES})
_REQUIRED_KEYS = ("field", "file", "offset", "pos", "shape", "dtype")
_OPTIONAL_KEYS = ("digest", "fill", "digest_offset", "digest_nbytes")


def _to_shape(value: Any) -> tuple[int, ...]:
    return tuple(value)


@attrs.frozen
class PayloadSegment:
    """One array's place in a payload file (or, for a fill segment, its constant value).

    Build one from a batch with `from_json` (a server's reply is read by
    ``orchestrator.wire``); check it with `validate_segment` before reading anything it
    points at.
    """

    field: str
    file: str
    offset: int
    pos: int
    shape: tuple[int, ...] = attrs.field(converter=_to_shape)
    dtype: str
    digest: str | None = None
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
        """The batch form (docs/protocol.md); the optional keys appear only when set."""
        obj: dict[str, Any] = {
            "field": self.field,
            "file": self.file,
            "offset": self.offset,
            "pos": self.pos,
            "shape": list(self.shape),
            "dtype": self.dtype,
        }
        for key in _OPTIONAL_KEYS:
            value = getattr(self, key)
            if value is not None:
                obj[key] = value
        return obj

    @classmethod
    def from_json(cls, obj: object) -> PayloadSegment:
        """Parse the batch form, checking keys and types (not paths or sizes).

        Unknown keys are rejected: a segment from a newer writer must not be half-read.
        Raises `BadSegment` with reason ``malformed``, ``field`` or ``dtype``.
        """
        obj, name = segment_object(obj, required=_REQUIRED_KEYS, optional=_OPTIONAL_KEYS)
        check_json_types(
            obj,
            name,
            strings=("field", "file", "dtype", "digest"),
            ints=("offset", "pos", "fill", "digest_offset", "digest_nbytes"),
            nullable=_OPTIONAL_KEYS,
        )
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
            digest=obj.get("digest"),
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
