"""The batch file format 2 (docs/protocol.md#batches): `batch.bin`, as pure values.

One binary file per batch, all integers little-endian::

    bytes 0..7     magic b"ROBATCH\\n"
    bytes 8..11    u32 format version, 2
    bytes 12..15   u32 header length H
    bytes 16..16+H the header: a msgpack map (`BatchHeader`)
    zero padding up to D, the first multiple of 64 at or after 16 + H
    the data section: every array at D + offset (offset a multiple of 64), C order,
    little-endian, zero padding between arrays; the file ends where its last array ends.

The header names four columns over all T positions of the batch (`token_ids` int32,
`loss_mask` uint8 0/1, `logprobs` float32, `advantages` float32) and lists the samples in
column order, each with its range of positions (`start`, `length`) and its payload: by
handle (`payload_dir` and segments per field), inline (an array per field in the data
section), or none. Offsets are relative to D, so the header never depends on its own
size.

`encode_batch` plans a file (the header's bytes and where each array goes; the arrays
are not copied), `decode_batch` validates a whole file held in memory and returns views
of its arrays. Decoding is strict: a header that does not match the schema exactly
(unknown keys, wrong types), an array outside the file, misaligned, overlapping another
or of the wrong dtype or shape, samples whose ranges do not tile the columns, a loss mask
other than 0/1, a non-finite number: each is a `BatchError`, one line naming the file
and the place, because a trainer must never half-read a batch. This module does no I/O
(`batch_file` reads and writes files).
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import PurePath
from types import MappingProxyType
from typing import Annotated, Any

import attrs
import msgspec
import numpy as np

from orchestrator.core.rollouts import TrainSample
from orchestrator.payload import FIELD_NDIM, FIELDS, BadSegment, PayloadSegment

#: The file's first 8 bytes.
MAGIC = b"ROBATCH\n"
#: The format version in bytes 8..11; readers refuse any other.
FORMAT_VERSION = 2
#: The header's `format` key.
BATCH_FORMAT = "rollout-orchestrator.batch/2"
#: The file of a batch in its step directory; its presence marks the batch complete.
BATCH_FILE = "batch.bin"
#: The file of format 1 (JSON), read by earlier versions only.
LEGACY_BATCH_FILE = "batch.json"
#: Where the data section and every array in it start: multiples of this.
ALIGNMENT = 64

#: Magic, version and header length: the fixed 16 bytes before the header.
_PREAMBLE = struct.Struct("<8sII")
PREAMBLE_SIZE = _PREAMBLE.size

#: Each column's dtype as numpy spells it (`np.dtype(...).str`).
COLUMN_DTYPES: Mapping[str, str] = MappingProxyType(
    {"token_ids": "<i4", "loss_mask": "|u1", "logprobs": "<f4", "advantages": "<f4"}
)

#: Each payload field's dtypes inline: a server's dtypes, and for routing the widened
#: ones a `-1` sentinel final row needs (uint8 -> int16, uint16 -> int32).
INLINE_DTYPES: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "routed_experts": frozenset({"|u1", "<u2", "<i2", "<i4"}),
        "sampling_mask": frozenset({"<i4"}),
    }
)

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


# The header's types. Instances are never in a reference cycle, so none is tracked by the
# garbage collector (`gc=False`): a batch's header holds thousands of them, and every
# tracked allocation in the writer's thread brings the next full collection, which holds
# the interpreter lock for as long as it takes, nearer.


class ArrayRef(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """Where an array lies in the data section: `offset` bytes after D (a multiple of
    64), its numpy `dtype` string (`"<i4"`, `"|u1"`, ...) and its `shape` (C order)."""

    offset: _NonNegative
    dtype: str
    shape: list[_NonNegative]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


class Columns(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """The four per-position columns, each of shape `[tokens]`."""

    token_ids: ArrayRef
    loss_mask: ArrayRef
    logprobs: ArrayRef
    advantages: ArrayRef


class SegmentForm(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, gc=False):
    """A payload segment in its batch form: the keys and order of `PayloadSegment.to_json`,
    the optional ones only when set. Decoded strictly typed; `segment` checks the rest."""

    field: str
    file: str
    offset: int
    pos: int
    shape: tuple[int, ...]
    dtype: str
    digest: str | None = None
    fill: int | None = None
    digest_offset: int | None = None
    digest_nbytes: int | None = None

    @classmethod
    def of(cls, segment: PayloadSegment) -> SegmentForm:
        return cls(
            field=segment.field,
            file=segment.file,
            offset=segment.offset,
            pos=segment.pos,
            shape=segment.shape,
            dtype=segment.dtype,
            digest=segment.digest,
            fill=segment.fill,
            digest_offset=segment.digest_offset,
            digest_nbytes=segment.digest_nbytes,
        )

    def segment(self) -> PayloadSegment:
        """The segment, after `PayloadSegment.from_json`'s checks. Raises `BadSegment`."""
        obj = {
            key: value for key, value in msgspec.structs.asdict(self).items() if value is not None
        }
        obj["shape"] = list(self.shape)
        return PayloadSegment.from_json(obj)


#: A sample's temperature when its header names none.
DEFAULT_SAMPLE_TEMPERATURE = 1.0


class SampleHeader(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, gc=False):
    """One sample in the header: positions `start .. start + length - 1` of the columns.

    `payload` maps each field to its segments in their batch form; `inline` maps each
    field to its array. `env` names the environment the sample's prompt came from and
    `temperature` the temperature it was sampled at (absent: "" and 1.0, which files
    written before them hold).
    """

    group_id: str
    rollout_id: str
    start_version: _NonNegative
    dispatch_version: _NonNegative
    reward: float
    advantage: float
    start: _NonNegative
    length: Annotated[int, msgspec.Meta(ge=1)]
    server: str | None = None
    payload_dir: str | None = None
    payload: dict[str, list[SegmentForm]] | None = None
    inline: dict[str, ArrayRef] | None = None
    env: str = ""
    temperature: Annotated[float, msgspec.Meta(ge=0)] = DEFAULT_SAMPLE_TEMPERATURE


class BatchHeader(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """The header: format, step, creation time, total positions, columns, samples."""

    format: str
    step: Annotated[int, msgspec.Meta(ge=1)]
    created_at: float
    tokens: _NonNegative
    columns: Columns
    samples: list[SampleHeader]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(BatchHeader)


class BatchError(Exception):
    """A batch that cannot be trusted: unreadable, malformed, or inconsistent.

    The message is one line naming the file (and the place in it) and the problem.
    """


class _Malformed(Exception):
    """A problem at a place inside the file; turned into `BatchError` at the edge."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}" if where else problem)


def align(n: int) -> int:
    """`n` rounded up to a multiple of `ALIGNMENT`."""
    return -(-n // ALIGNMENT) * ALIGNMENT


# -- writing ---------------------------------------------------------------------------


@attrs.frozen(eq=False)
class BatchLayout:
    """A batch file, planned: write `prefix`, then each of `arrays` at `D + offsets[i]`
    (zeros in between), for `size` bytes in all.

    `prefix` is the preamble, the header and the padding up to D (`data_start`);
    `arrays` are flat uint8 views of the arrays' bytes, in increasing offset order: the
    samples' own memory, not copies (except the advantages, computed here, and any array
    not already little-endian and C-contiguous).
    """

    prefix: bytes
    data_start: int
    offsets: list[int]
    arrays: list[np.ndarray]
    size: int


def encode_batch(step: int, samples: Sequence[TrainSample], *, created_at: float) -> BatchLayout:
    """Plan the `batch.bin` of batch `step` holding `samples`.

    Raises ValueError for a step < 1, a non-finite `created_at`, reward or advantage, or
    an inline array of a dtype or shape the format does not allow.
    """
    if step < 1:
        raise ValueError(f"batches count from 1, got step {step}")
    if not math.isfinite(created_at):
        raise ValueError(f"created_at must be finite, got {created_at}")
    for index, sample in enumerate(samples):
        for name in ("reward", "advantage"):
            value = getattr(sample, name)
            if not math.isfinite(value):
                raise ValueError(f"samples[{index}]: {name} must be finite, got {value}")
    planner = _Planner()
    lengths = [len(sample.token_ids) for sample in samples]
    tokens = sum(lengths)
    columns = Columns(
        token_ids=planner.column([s.token_ids for s in samples], "<i4", tokens),
        loss_mask=planner.column([_mask_bytes(s.loss_mask) for s in samples], "|u1", tokens),
        logprobs=planner.column([s.logprobs for s in samples], "<f4", tokens),
        advantages=planner.column([_advantages(s) for s in samples], "<f4", tokens),
    )
    headers = []
    start = 0
    for index, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
        try:
            headers.append(_sample_header(sample, start, planner))
        except ValueError as exc:
            raise ValueError(f"samples[{index}]: {exc}") from None
        start += length
    header = _ENCODER.encode(
        BatchHeader(
            format=BATCH_FORMAT,
            step=step,
            created_at=created_at,
            tokens=tokens,
            columns=columns,
            samples=headers,
        )
    )
    data_start = align(PREAMBLE_SIZE + len(header))
    prefix = b"".join(
        (
            _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header)),
            header,
            bytes(data_start - PREAMBLE_SIZE - len(header)),
        )
    )
    return BatchLayout(
        prefix=prefix,
        data_start=data_start,
        offsets=planner.offsets,
        arrays=planner.arrays,
        size=data_start + planner.end,
    )


class _Planner:
    """Places arrays in the data section, each at the next multiple of 64."""

    def __init__(self) -> None:
        # Two lists rather than a list of pairs: no tuple to track per array.
        self.offsets: list[int] = []
        self.arrays: list[np.ndarray] = []
        self.end = 0

    def column(self, pieces: Iterable[np.ndarray], dtype: str, tokens: int) -> ArrayRef:
        """Place `pieces` back to back as one `[tokens]` column of `dtype`."""
        offset = cursor = align(self.end)
        for piece in pieces:
            flat = _stored_bytes(piece, dtype)
            self.offsets.append(cursor)
            self.arrays.append(flat)
            cursor += flat.size
        self.end = cursor
        return ArrayRef(offset=offset, dtype=dtype, shape=[tokens])

    def array(self, array: np.ndarray, dtype: str) -> ArrayRef:
        offset = align(self.end)
        flat = _stored_bytes(array, dtype)
        self.offsets.append(offset)
        self.arrays.append(flat)
        self.end = offset + flat.size
        return ArrayRef(offset=offset, dtype=dtype, shape=list(array.shape))


def _stored_bytes(array: np.ndarray, dtype: str) -> np.ndarray:
    """The array's bytes as stored (C order, `dtype`): a flat uint8 view, copied only
    when the array is not already so."""
    stored = np.ascontiguousarray(array, dtype=np.dtype(dtype))
    return stored.reshape(-1).view(np.uint8)


def _mask_bytes(mask: np.ndarray) -> np.ndarray:
    # A bool is one byte, 0 or 1: the column's uint8 values, without a copy.
    return np.ascontiguousarray(mask, dtype=np.bool_).view(np.uint8)


def _advantages(sample: TrainSample) -> np.ndarray:
    """The sample's advantage on its loss positions, 0 elsewhere (float32)."""
    return np.where(sample.loss_mask, np.float32(sample.advantage), np.float32(0.0))


def _sample_header(sample: TrainSample, start: int, planner: _Planner) -> SampleHeader:
    payload = None
    if sample.payload:
        payload = {
            field: [SegmentForm.of(segment) for segment in segments]
            for field, segments in sample.payload.items()
        }
    inline = None
    if sample.inline is not None:
        inline = {}
        for field, array in sample.inline.items():
            dtype = array.dtype.newbyteorder("<").str
            if dtype not in INLINE_DTYPES[field]:
                raise ValueError(f"inline {field} has dtype {array.dtype}, not one of the format's")
            if array.ndim != FIELD_NDIM[field]:
                raise ValueError(
                    f"inline {field} has {array.ndim} dimensions, expected {FIELD_NDIM[field]}"
                )
            if field == "routed_experts" and 0 in array.shape[1:]:
                raise ValueError(f"inline {field} has shape {list(array.shape)}: empty rows")
            inline[field] = planner.array(array, dtype)
    # Only what differs from the defaults: msgspec leaves a default out of the header
    # only when it is the very default object, which an equal float is not.
    named: dict[str, Any] = {}
    if sample.env:
        named["env"] = sample.env
    if sample.temperature != DEFAULT_SAMPLE_TEMPERATURE:
        named["temperature"] = sample.temperature
    return SampleHeader(
        group_id=sample.group_id,
        rollout_id=sample.rollout_id,
        start_version=sample.start_version,
        dispatch_version=sample.dispatch_version,
        reward=sample.reward,
        advantage=sample.advantage,
        start=start,
        length=len(sample.token_ids),
        server=sample.server,
        payload_dir=sample.payload_dir,
        payload=payload,
        inline=inline,
        **named,
    )


# -- reading ---------------------------------------------------------------------------


def _frozen_map(value: Mapping[str, np.ndarray] | None) -> Mapping[str, np.ndarray] | None:
    return None if value is None else MappingProxyType(dict(value))


def _segments(
    value: Mapping[str, Sequence[PayloadSegment]],
) -> Mapping[str, tuple[PayloadSegment, ...]]:
    return MappingProxyType({field: tuple(segments) for field, segments in value.items()})


@attrs.frozen(eq=False)
class BatchSample:
    """One sample of a decoded batch file: its values, and views of its arrays.

    `token_ids` (int32), `loss_mask` (bool), `logprobs` and `advantages` (float32) are
    positions `start .. start + length - 1` of the columns; `inline` the sample's inline
    arrays (one row per position), None when it has none. All are views of the file's
    memory (writable when that memory is). `payload` holds the by-handle segments per
    field (all in `payload_dir`), empty when there are none.
    """

    index: int
    group_id: str
    rollout_id: str
    server: str | None
    start_version: int
    dispatch_version: int
    reward: float
    advantage: float
    start: int
    length: int
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    advantages: np.ndarray
    payload_dir: str | None = None
    payload: Mapping[str, tuple[PayloadSegment, ...]] = attrs.field(
        factory=dict, converter=_segments
    )
    inline: Mapping[str, np.ndarray] | None = attrs.field(default=None, converter=_frozen_map)
    env: str = ""
    temperature: float = 1.0

    def train_sample(self) -> TrainSample:
        """The `TrainSample` this sample was written from (its arrays copied)."""
        return TrainSample(
            group_id=self.group_id,
            rollout_id=self.rollout_id,
            start_version=self.start_version,
            dispatch_version=self.dispatch_version,
            reward=self.reward,
            advantage=self.advantage,
            token_ids=self.token_ids,
            loss_mask=self.loss_mask,
            logprobs=self.logprobs,
            payload=self.payload,
            payload_dir=self.payload_dir,
            inline=self.inline,
            server=self.server,
            env=self.env,
            temperature=self.temperature,
        )


def _sample_tuple(value: Iterable[BatchSample]) -> tuple[BatchSample, ...]:
    return tuple(value)


@attrs.frozen(eq=False)
class BatchFile:
    """A decoded, validated `batch.bin`: the step, when it was written, the columns (views
    of the whole file's `[tokens]` arrays) and the samples."""

    step: int
    created_at: float
    tokens: int
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    advantages: np.ndarray
    samples: tuple[BatchSample, ...] = attrs.field(converter=_sample_tuple)


def decode_batch(data: np.ndarray, *, source: str) -> BatchFile:
    """Validate the bytes of a whole `batch.bin` (a 1-D uint8 array) and decode it.

    Every array handed out is a view of `data` (writable when `data` is) in native byte
    order: a copy only on a big-endian machine. `source` (the file) starts every error
    message.

    Raises `BatchError` for anything the format does not allow (see the module's
    docstring).
    """
    try:
        return _decode(data)
    except _Malformed as exc:
        raise BatchError(f"{source}: {exc}") from None


def _decode(data: np.ndarray) -> BatchFile:
    if data.dtype != np.uint8 or data.ndim != 1:
        raise TypeError("decode_batch takes a 1-D uint8 array")
    size = data.size
    if size < PREAMBLE_SIZE:
        raise _Malformed("", f"{size} bytes, too short for a batch file")
    magic, version, header_len = _PREAMBLE.unpack_from(data[:PREAMBLE_SIZE].tobytes())
    if magic != MAGIC:
        raise _Malformed("", f"not a batch file: magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise _Malformed(
            "", f"batch format version {version}; this version reads format {FORMAT_VERSION}"
        )
    if PREAMBLE_SIZE + header_len > size:
        raise _Malformed(
            "", f"the header ({header_len} bytes) runs past the end of the file ({size} bytes)"
        )
    try:
        header = _DECODER.decode(data[PREAMBLE_SIZE : PREAMBLE_SIZE + header_len].data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _Malformed("header", str(exc)) from None
    if header.format != BATCH_FORMAT:
        raise _Malformed("format", f"unknown format {header.format!r} (expected {BATCH_FORMAT!r})")
    if not math.isfinite(header.created_at):
        raise _Malformed("created_at", "expected a finite number")
    sections = _Sections(data, align(PREAMBLE_SIZE + header_len))
    tokens = header.tokens
    columns = {
        name: sections.array(getattr(header.columns, name), f"columns.{name}", {dtype}, [tokens])
        for name, dtype in COLUMN_DTYPES.items()
    }
    starts = _check_samples(header.samples, tokens)
    payloads = [
        _payload(sample, f"samples[{index}]") for index, sample in enumerate(header.samples)
    ]
    inline = [
        _inline_arrays(sample, f"samples[{index}]", sections)
        for index, sample in enumerate(header.samples)
    ]
    sections.check_placement()
    token_ids = columns["token_ids"]
    loss_bytes = columns["loss_mask"]
    logprobs = columns["logprobs"]
    advantages = columns["advantages"]
    _check_columns(header.samples, starts, loss_bytes, logprobs, advantages)
    loss_mask = loss_bytes.view(np.bool_)
    samples = []
    for index, (sample, payload, arrays) in enumerate(
        zip(header.samples, payloads, inline, strict=True)
    ):
        span = slice(sample.start, sample.start + sample.length)
        samples.append(
            BatchSample(
                index=index,
                group_id=sample.group_id,
                rollout_id=sample.rollout_id,
                server=sample.server,
                start_version=sample.start_version,
                dispatch_version=sample.dispatch_version,
                reward=sample.reward,
                advantage=sample.advantage,
                start=sample.start,
                length=sample.length,
                token_ids=token_ids[span],
                loss_mask=loss_mask[span],
                logprobs=logprobs[span],
                advantages=advantages[span],
                payload_dir=sample.payload_dir,
                payload=payload,
                inline=arrays,
                env=sample.env,
                temperature=sample.temperature,
            )
        )
    return BatchFile(
        step=header.step,
        created_at=header.created_at,
        tokens=tokens,
        token_ids=token_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        advantages=advantages,
        samples=samples,
    )


class _Sections:
    """The arrays of the data section, checked one by one and then all together."""

    def __init__(self, data: np.ndarray, data_start: int) -> None:
        self.data = data
        self.data_start = data_start
        self.placed: list[tuple[int, int, str]] = []  # (offset, nbytes, where)

    def array(
        self, ref: ArrayRef, where: str, dtypes: Iterable[str], shape: Sequence[int] | None = None
    ) -> np.ndarray:
        """The array `ref` names, after checking its dtype, shape and place."""
        allowed = sorted(dtypes)
        if ref.dtype not in allowed:
            expected = " or ".join(repr(d) for d in allowed)
            raise _Malformed(where, f"dtype {ref.dtype!r}, expected {expected}")
        if shape is not None and list(ref.shape) != list(shape):
            raise _Malformed(where, f"shape {list(ref.shape)}, expected {list(shape)}")
        if ref.offset % ALIGNMENT:
            raise _Malformed(where, f"offset {ref.offset} is not a multiple of {ALIGNMENT}")
        nbytes = ref.nbytes
        begin = self.data_start + ref.offset
        if begin + nbytes > self.data.size:
            raise _Malformed(
                where,
                f"bytes {begin}..{begin + nbytes} lie past the end of the file "
                f"({self.data.size} bytes)",
            )
        self.placed.append((ref.offset, nbytes, where))
        dtype = np.dtype(ref.dtype)
        array = self.data[begin : begin + nbytes].view(dtype).reshape(ref.shape)
        # Native byte order: a no-op view on little-endian machines.
        return array.astype(dtype.newbyteorder("="), copy=False)

    def check_placement(self) -> None:
        """No two arrays overlap, and the file ends where the last one ends."""
        end, last = 0, ""
        for offset, nbytes, where in sorted(self.placed):
            if nbytes and offset < end:
                raise _Malformed(where, f"overlaps {last}")
            if offset + nbytes >= end:
                end, last = offset + nbytes, where
        expected = self.data_start + end
        if self.data.size != expected:
            raise _Malformed(
                "", f"the file has {self.data.size} bytes, its last array ends at byte {expected}"
            )


def _check_samples(samples: Sequence[SampleHeader], tokens: int) -> np.ndarray:
    """The samples' numbers are sound and their ranges tile `0 .. tokens - 1` in order;
    return their starts."""
    position = 0
    for index, sample in enumerate(samples):
        for name in ("reward", "advantage"):
            if not math.isfinite(getattr(sample, name)):
                raise _Malformed(f"samples[{index}].{name}", "expected a finite number")
        if sample.dispatch_version < sample.start_version:
            raise _Malformed(
                f"samples[{index}]",
                f"dispatch_version {sample.dispatch_version} is below start_version "
                f"{sample.start_version}",
            )
        if sample.start != position:
            raise _Malformed(
                f"samples[{index}].start",
                f"{sample.start}, expected {position} (the sum of the earlier lengths)",
            )
        position += sample.length
        if position > tokens:
            raise _Malformed(
                f"samples[{index}].length",
                f"positions {sample.start}..{position} lie past the {tokens} tokens",
            )
    if position != tokens:
        raise _Malformed("tokens", f"{tokens}, but the samples' lengths add up to {position}")
    return np.array([sample.start for sample in samples], dtype=np.int64)


def _check_columns(
    samples: Sequence[SampleHeader],
    starts: np.ndarray,
    loss_mask: np.ndarray,
    logprobs: np.ndarray,
    advantages: np.ndarray,
) -> None:
    """Loss mask 0/1, logprobs finite, advantages the sample's on loss positions and 0
    elsewhere; a failure names the sample and position."""

    def fail(bad: np.ndarray, column: str, problem: str) -> None:
        position = int(np.flatnonzero(bad)[0])
        index = int(np.searchsorted(starts, position, side="right")) - 1
        offset = position - samples[index].start
        raise _Malformed(f"samples[{index}].{column}[{offset}]", problem)

    bad = loss_mask > 1
    if bad.any():
        fail(bad, "loss_mask", "a value other than 0 and 1")
    bad = ~np.isfinite(logprobs)
    if bad.any():
        fail(bad, "logprobs", "not a finite number")
    per_sample = np.array([sample.advantage for sample in samples], dtype=np.float32)
    lengths = np.array([sample.length for sample in samples], dtype=np.int64)
    expected = np.repeat(per_sample, lengths)
    expected[loss_mask == 0] = 0
    bad = advantages != expected
    if bad.any():
        fail(bad, "advantages", "differs from the sample's advantage (0 off the loss mask)")


def _payload(sample: SampleHeader, where: str) -> dict[str, list[PayloadSegment]]:
    """The sample's by-handle segments, after checking the payload's form."""
    if sample.payload is not None and sample.inline is not None:
        raise _Malformed(where, "a sample carries its payload by handle or inline, not both")
    if (sample.payload is None) != (sample.payload_dir is None) or sample.payload == {}:
        raise _Malformed(where, "payload_dir and a non-empty payload come together")
    if sample.payload_dir is None or sample.payload is None:
        return {}
    payload_dir = sample.payload_dir
    if not os.path.isabs(payload_dir):
        raise _Malformed(f"{where}.payload_dir", f"{payload_dir!r} is not an absolute path")
    # Every turn of a rollout writes into <root>/v<k>, k its dispatch version (docs/design.md
    # §3): a sample pointing elsewhere would escape the collector's bound.
    if PurePath(payload_dir).name != f"v{sample.dispatch_version}":
        raise _Malformed(
            f"{where}.payload_dir",
            f"{payload_dir!r} is not v{sample.dispatch_version}, the sample's dispatch version",
        )
    payload: dict[str, list[PayloadSegment]] = {}
    for field, raw_segments in sample.payload.items():
        if field not in FIELDS:
            raise _Malformed(f"{where}.payload", f"unknown field {field!r}")
        if not raw_segments:
            raise _Malformed(f"{where}.payload.{field}", "no segments")
        segments = payload[field] = []
        for index, form in enumerate(raw_segments):
            try:
                segment = form.segment()
            except BadSegment as exc:
                raise _Malformed(f"{where}.payload.{field}[{index}]", str(exc)) from None
            if segment.field != field:
                raise _Malformed(
                    f"{where}.payload.{field}[{index}]", f"a segment of field {segment.field!r}"
                )
            segments.append(segment)
    return payload


def _inline_arrays(
    sample: SampleHeader, where: str, sections: _Sections
) -> dict[str, np.ndarray] | None:
    if sample.inline is None:
        return None
    arrays = {}
    for field, ref in sample.inline.items():
        place = f"{where}.inline.{field}"
        if field not in FIELDS:
            raise _Malformed(f"{where}.inline", f"unknown field {field!r}")
        if len(ref.shape) != FIELD_NDIM[field]:
            raise _Malformed(
                place, f"shape {list(ref.shape)}, expected {FIELD_NDIM[field]} dimensions"
            )
        if ref.shape[0] != sample.length:
            raise _Malformed(
                place, f"shape {list(ref.shape)}: {ref.shape[0]} rows, expected {sample.length}"
            )
        if field == "routed_experts" and 0 in ref.shape[1:]:
            # A mask may be zero wide (no position had a kept set); routing rows may not.
            raise _Malformed(place, f"shape {list(ref.shape)} has a row of size zero")
        arrays[field] = sections.array(ref, place, INLINE_DTYPES[field])
    return arrays
