"""The batch.bin format: TrainSample values, the layout written, and strict decoding."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import msgspec
import numpy as np
import pytest
from sample_kit import train_sample

from orchestrator.handoff import (
    BATCH_FORMAT,
    FORMAT_VERSION,
    BatchError,
    BatchFile,
    BatchLayout,
    TrainSample,
    decode_batch,
    encode_batch,
    read_batch_file,
    write_batch_file,
)
from orchestrator.payload import PayloadSegment

SOURCE = "/runs/a/batches/step_000007/batch.bin"

SEGMENT = PayloadSegment(
    field="routed_experts",
    file="0123abcd.bin",
    offset=0,
    pos=0,
    shape=(4, 2, 2),
    dtype="uint8",
    digest="0" * 32,
)
CLIPPED = PayloadSegment(
    field="routed_experts",
    file="0123abcd.bin",
    offset=12,
    pos=3,
    shape=(1, 2, 2),
    dtype="uint8",
    digest="0" * 32,
    digest_offset=0,
    digest_nbytes=16,
)


def make_sample(**changes: Any) -> TrainSample:
    """The sample whose bytes the layout tests spell out; `changes` replace its fields."""
    fields: dict[str, Any] = {
        "group_id": "g1",
        "rollout_id": "r1",
        "start_version": 2,
        "token_ids": (5, 6, 7, 8),
        "logprobs": (0.0, 0.0, -0.25, -1.5),
    }
    return train_sample(prompt=2, version=3, **{**fields, **changes})


def by_handle_sample(**changes: Any) -> TrainSample:
    segments = [attrs.evolve(SEGMENT, shape=(3, 2, 2)), CLIPPED]
    return make_sample(
        payload_dir="/shared/run/payloads/v3", payload={"routed_experts": segments}, **changes
    )


def inline_sample(**changes: Any) -> TrainSample:
    rng = np.random.default_rng(0)
    routing = rng.integers(0, 300, size=(4, 3, 2)).astype(np.uint16)
    masks = np.full((4, 3), -1, dtype=np.int32)
    masks[2:, :2] = [[11, 12], [13, 14]]
    return make_sample(inline={"routed_experts": routing, "sampling_mask": masks}, **changes)


def three_forms() -> list[TrainSample]:
    return [make_sample(), by_handle_sample(rollout_id="r2"), inline_sample(rollout_id="r3")]


# -- helpers: the file in memory, taken apart and put back together --------------------


def file_bytes(layout: BatchLayout) -> bytearray:
    """The bytes `write_batch_file` would write for `layout`."""
    data = bytearray(layout.size)
    data[: len(layout.prefix)] = layout.prefix
    for offset, array in zip(layout.offsets, layout.arrays, strict=True):
        start = layout.data_start + offset
        data[start : start + array.size] = array.tobytes()
    return data


def encode(samples: list[TrainSample], step: int = 7) -> bytearray:
    return file_bytes(encode_batch(step, samples, created_at=1234.5))


def decode(data: bytes | bytearray, source: str = SOURCE) -> BatchFile:
    return decode_batch(np.frombuffer(bytearray(data), dtype=np.uint8), source=source)


def split(data: bytes | bytearray) -> tuple[dict[str, Any], bytes]:
    """The header as plain objects, and the data section."""
    _, _, length = struct.unpack_from("<8sII", data)
    header = msgspec.msgpack.decode(bytes(data[16 : 16 + length]))
    start = -(-(16 + length) // 64) * 64
    return header, bytes(data[start:])


def assemble(
    header: object, section: bytes, *, magic: bytes = b"ROBATCH\n", version: int = 2
) -> bytearray:
    """A file from a header object and a data section (offsets are relative to it, so
    they stay valid whatever the header's new length)."""
    encoded = msgspec.msgpack.encode(header)
    start = -(-(16 + len(encoded)) // 64) * 64
    prefix = struct.pack("<8sII", magic, version, len(encoded)) + encoded
    return bytearray(prefix + bytes(start - len(prefix)) + section)


def edited(
    edit: Callable[[dict[str, Any]], object], samples: list[TrainSample] | None = None
) -> bytearray:
    """A good file whose header `edit` changed (in place)."""
    header, section = split(encode(samples or three_forms()))
    edit(header)
    return assemble(header, section)


# -- TrainSample -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"token_ids": np.zeros(0, np.int32)}, "token_ids is empty"),
        ({"loss_mask": (0, 1, 1)}, "differ in length"),
        ({"logprobs": (0.0,)}, "differ in length"),
        ({"logprobs": (0.0, math.nan, 0.0, 0.0)}, "not finite"),
        ({"start_version": -1}, "start_version <= dispatch_version"),
        ({"start_version": 4}, "start_version <= dispatch_version"),
        ({"payload_dir": "/x/v3"}, "come together"),
        ({"payload": {"routed_experts": [SEGMENT]}}, "come together"),
        ({"payload_dir": "rel/v3", "payload": {"routed_experts": [SEGMENT]}}, "absolute"),
        ({"payload_dir": "/x/v3", "payload": {"routed_experts": []}}, "no segments"),
        ({"payload_dir": "/x/v3", "payload": {"sampling_mask": [SEGMENT]}}, "another field"),
        ({"payload_dir": "/x/v3", "payload": {"logits": [SEGMENT]}}, "unknown payload field"),
        ({"inline": {"logits": np.zeros((4, 1))}}, "unknown inline field"),
        ({"inline": {"sampling_mask": np.zeros((3, 1), np.int32)}}, "needs 4 rows"),
        (
            {
                "payload_dir": "/x/v3",
                "payload": {"routed_experts": [SEGMENT]},
                "inline": {"sampling_mask": np.zeros((4, 1), np.int32)},
            },
            "not both",
        ),
    ],
)
def test_inconsistent_samples_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_sample(**changes)


def test_train_sample_is_frozen_and_its_arrays_read_only() -> None:
    sample = make_sample()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        sample.reward = 2.0  # type: ignore[misc]
    assert attrs.evolve(sample, reward=2.0).reward == 2.0
    with pytest.raises(ValueError, match="read-only"):
        sample.token_ids[0] = 1


def test_numpy_values_are_normalised_to_the_documented_dtypes() -> None:
    sample = make_sample(
        token_ids=np.arange(5, 9, dtype=np.int64),
        loss_mask=np.array([False, False, True, True]),
        logprobs=np.array([0.0, 0.0, -0.25, -1.5], dtype=np.float64),
    )
    assert sample == make_sample()
    assert (sample.token_ids.dtype, sample.loss_mask.dtype, sample.logprobs.dtype) == (
        np.int32,
        np.bool_,
        np.float32,
    )
    with pytest.raises(ValueError, match="expected integers"):
        make_sample(token_ids=(5.0, 6, 7, 8))


# -- the layout ------------------------------------------------------------------------


def test_the_preamble_header_and_data_section_are_where_the_format_says() -> None:
    samples = three_forms()
    data = encode(samples)
    assert data[:8] == b"ROBATCH\n"
    magic, version, length = struct.unpack_from("<8sII", data)
    assert (magic, version) == (b"ROBATCH\n", FORMAT_VERSION) and FORMAT_VERSION == 2
    header, section = split(data)
    start = len(data) - len(section)
    assert start % 64 == 0 and 16 + length <= start < 16 + length + 64
    assert data[16 + length : start] == bytes(start - 16 - length)
    assert set(header) == {"format", "step", "created_at", "tokens", "columns", "samples"}
    assert header["format"] == BATCH_FORMAT == "rollout-orchestrator.batch/2"
    assert (header["step"], header["created_at"], header["tokens"]) == (7, 1234.5, 12)
    columns = header["columns"]
    assert {name: (ref["dtype"], ref["shape"]) for name, ref in columns.items()} == {
        "token_ids": ("<i4", [12]),
        "loss_mask": ("|u1", [12]),
        "logprobs": ("<f4", [12]),
        "advantages": ("<f4", [12]),
    }

    def column(name: str, dtype: str) -> np.ndarray:
        ref = columns[name]
        assert ref["offset"] % 64 == 0
        return np.frombuffer(section, dtype=dtype, count=12, offset=ref["offset"])

    np.testing.assert_array_equal(column("token_ids", "<i4"), [5, 6, 7, 8] * 3)
    np.testing.assert_array_equal(column("loss_mask", "u1"), [0, 0, 1, 1] * 3)
    np.testing.assert_array_equal(column("logprobs", "<f4"), [0, 0, -0.25, -1.5] * 3)
    np.testing.assert_array_equal(column("advantages", "<f4"), [0, 0, 0.5, 0.5] * 3)
    # Samples in column order, each with its range of positions.
    assert [(s["start"], s["length"]) for s in header["samples"]] == [(0, 4), (4, 4), (8, 4)]
    base = {
        "group_id",
        "rollout_id",
        "start_version",
        "dispatch_version",
        "reward",
        "advantage",
        "start",
        "length",
    }
    bare, handle, inlined = header["samples"]
    assert set(bare) == base
    assert set(handle) == base | {"payload_dir", "payload"}
    assert handle["payload"] == {
        "routed_experts": [s.to_json() for s in samples[1].payload["routed_experts"]]
    }
    assert set(inlined) == base | {"inline"}
    routing, masks = inlined["inline"]["routed_experts"], inlined["inline"]["sampling_mask"]
    assert (routing["dtype"], routing["shape"]) == ("<u2", [4, 3, 2])
    assert (masks["dtype"], masks["shape"]) == ("<i4", [4, 3])
    stored = np.frombuffer(section, dtype="<u2", count=24, offset=routing["offset"])
    assert stored.tobytes() == samples[2].inline["routed_experts"].tobytes()  # type: ignore[index]
    # The file ends where its last array ends.
    ends = [ref["offset"] + 4 * 12 for ref in columns.values()] + [masks["offset"] + 48]
    assert len(section) == max(ends)


def test_the_write_round_trip_is_bitwise_in_all_three_payload_forms(tmp_path: Path) -> None:
    samples = [
        attrs.evolve(s, server=f"http://10.0.0.{i}:8000") for i, s in enumerate(three_forms())
    ]
    samples.append(inline_sample(rollout_id="r4", advantage=-2.0))
    path = tmp_path / "batch.bin"
    size = write_batch_file(path, 3, samples, created_at=99.5, fsync=False)
    assert path.stat().st_size == size
    assert path.read_bytes() == file_bytes(encode_batch(3, samples, created_at=99.5))
    batch = read_batch_file(path)
    assert (batch.step, batch.created_at, batch.tokens) == (3, 99.5, 16)
    assert [s.train_sample() for s in batch.samples] == samples
    for got, want in zip(batch.samples, samples, strict=True):
        assert got.token_ids.dtype == np.int32 and got.loss_mask.dtype == np.bool_
        assert got.logprobs.tobytes() == want.logprobs.tobytes()
        expected = np.where(want.loss_mask, np.float32(want.advantage), np.float32(0))
        assert got.advantages.tobytes() == expected.tobytes()
        for field, array in (want.inline or {}).items():
            assert got.inline is not None
            assert got.inline[field].dtype == array.dtype
            assert got.inline[field].tobytes() == array.tobytes()
    assert batch.samples[1].payload == samples[1].payload


def test_decoded_arrays_are_writable_views_of_the_file() -> None:
    data = np.frombuffer(encode(three_forms()), dtype=np.uint8)
    batch = decode_batch(data, source="b")
    for sample in batch.samples:
        arrays = [sample.token_ids, sample.loss_mask, sample.logprobs, sample.advantages]
        arrays += list((sample.inline or {}).values())
        for array in arrays:
            assert np.shares_memory(array, data)
            assert array.flags.writeable and array.flags.c_contiguous
    assert np.shares_memory(batch.token_ids, batch.samples[0].token_ids)


def test_read_batch_file_maps_copy_on_write(tmp_path: Path) -> None:
    path = tmp_path / "batch.bin"
    write_batch_file(path, 1, three_forms(), created_at=0.0, fsync=False)
    before = path.read_bytes()
    batch = read_batch_file(path)
    batch.samples[0].token_ids[:] = -7
    assert batch.samples[0].token_ids.tolist() == [-7] * 4
    assert path.read_bytes() == before
    assert read_batch_file(path).samples[0].token_ids.tolist() == [5, 6, 7, 8]


def test_an_empty_batch_round_trips() -> None:
    batch = decode(encode([], step=2))
    assert (batch.step, batch.tokens, batch.samples) == (2, 0, ())
    assert batch.token_ids.shape == (0,)


def test_a_zero_wide_mask_round_trips() -> None:
    sample = make_sample(inline={"sampling_mask": np.zeros((4, 0), np.int32)})
    got, _ = decode(encode([sample, make_sample()])).samples
    assert got.inline is not None and got.inline["sampling_mask"].shape == (4, 0)
    assert got.train_sample() == sample


def test_the_server_key_is_optional_and_round_trips() -> None:
    server = "http://10.0.0.7:8000"
    samples = [make_sample(server=server), make_sample()]
    header, _ = split(encode(samples))
    assert header["samples"][0]["server"] == server
    assert "server" not in header["samples"][1]
    assert [s.server for s in decode(encode(samples)).samples] == [server, None]


def test_big_endian_inline_arrays_are_stored_little_endian() -> None:
    routing = np.arange(24, dtype=">u2").reshape(4, 3, 2)
    sample = make_sample(inline={"routed_experts": routing})
    header, section = split(encode([sample]))
    ref = header["samples"][0]["inline"]["routed_experts"]
    assert ref["dtype"] == "<u2"
    stored = np.frombuffer(section, dtype="<u2", count=24, offset=ref["offset"])
    np.testing.assert_array_equal(stored, np.arange(24))


@pytest.mark.parametrize(
    ("step", "samples", "message"),
    [
        (0, [], "count from 1"),
        (1, [make_sample(reward=math.nan)], r"samples\[0\]: reward must be finite"),
        (1, [make_sample(), make_sample(advantage=math.inf)], r"samples\[1\]: advantage"),
        (1, [make_sample(inline={"routed_experts": np.zeros((4, 1, 1), np.int64)})], "dtype"),
        (1, [make_sample(inline={"sampling_mask": np.zeros((4, 1, 1), np.int32)})], "dimensions"),
        (1, [make_sample(inline={"routed_experts": np.zeros((4, 0, 2), np.uint8)})], "empty"),
    ],
)
def test_encode_refuses_what_no_reader_accepts(
    step: int, samples: list[TrainSample], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        encode_batch(step, samples, created_at=0.0)


def test_encode_refuses_a_non_finite_time() -> None:
    with pytest.raises(ValueError, match="created_at must be finite"):
        encode_batch(1, [], created_at=math.nan)


# -- strict decoding -------------------------------------------------------------------


def _set(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    """An edit setting (or, for `_DELETE`, deleting) the key at a dotted path."""

    def edit(header: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = header
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        key: Any = int(last) if last.isdigit() else last
        if value is _DELETE:
            del node[key]
        else:
            node[key] = value

    return edit


_DELETE = object()


def _raw(data: bytes | bytearray) -> Callable[[], bytearray]:
    return lambda: bytearray(data)


def _good() -> bytearray:
    return encode(three_forms())


def _patched(position: int | Callable[[bytearray], int], value: bytes) -> Callable[[], bytearray]:
    def make() -> bytearray:
        data = _good()
        at = position(data) if callable(position) else position
        data[at : at + len(value)] = value
        return data

    return make


def _data_start(data: bytearray) -> int:
    (length,) = struct.unpack_from("<I", data, 12)
    return -(-(16 + length) // 64) * 64


def _column_at(name: str, index: int) -> Callable[[bytearray], int]:
    def position(data: bytearray) -> int:
        header, _ = split(data)
        ref = header["columns"][name]
        return _data_start(data) + ref["offset"] + index * np.dtype(ref["dtype"]).itemsize

    return position


def _edit(edit: Callable[[dict[str, Any]], object]) -> Callable[[], bytearray]:
    return lambda: edited(edit)


def _both_payloads(header: dict[str, Any]) -> None:
    header["samples"][1]["inline"] = header["samples"][2]["inline"]


def _overlap(header: dict[str, Any]) -> None:
    columns = header["columns"]
    columns["logprobs"]["offset"] = columns["token_ids"]["offset"]


MALFORMED: list[tuple[Callable[[], bytearray], str]] = [
    # The preamble.
    (_raw(b""), "0 bytes, too short for a batch file"),
    (_raw(b"ROBATCH\n\x02\x00"), "too short"),
    (_raw(b'{"format": "rollout-orchestrator.batch/1", "step": 1}'), "not a batch file: magic"),
    (lambda: assemble(split(_good())[0], split(_good())[1], version=1), "batch format version 1"),
    (_patched(8, struct.pack("<I", 3)), "this version reads format 2"),
    (_patched(12, struct.pack("<I", 1 << 30)), "runs past the end of the file"),
    # The header's msgpack and schema.
    (lambda: assemble(None, b""), "header: Expected `object`, got `None`"),
    (_patched(16, b"\xc1"), "header: MessagePack data is malformed"),
    (
        lambda: bytearray(struct.pack("<8sII", b"ROBATCH\n", 2, 1) + b"\x80" + bytes(47)),
        "header: Object missing required field `format`",
    ),
    (_edit(_set("extra", 1)), "header: Object contains unknown field `extra`"),
    (_edit(_set("format", "rollout-orchestrator.batch/1")), "format: unknown format"),
    (_edit(_set("step", "7")), "Expected `int`, got `str` - at `$.step`"),
    (_edit(_set("step", True)), "Expected `int`, got `bool` - at `$.step`"),
    (_edit(_set("step", 7.0)), "Expected `int`, got `float` - at `$.step`"),
    (_edit(_set("step", 0)), "Expected `int` >= 1 - at `$.step`"),
    (_edit(_set("created_at", None)), "at `$.created_at`"),
    (_edit(_set("created_at", math.nan)), "created_at: expected a finite number"),
    (_edit(_set("tokens", _DELETE)), "missing required field `tokens`"),
    (_edit(_set("samples", {})), "Expected `array`, got `object` - at `$.samples`"),
    (_edit(_set("samples.0", 3)), "at `$.samples[0]`"),
    (
        _edit(_set("samples.0.group_id", 1)),
        "Expected `str`, got `int` - at `$.samples[0].group_id`",
    ),
    (_edit(_set("samples.1.weight", 1)), "unknown field `weight` - at `$.samples[1]`"),
    (
        _edit(_set("samples.0.start_version", -1)),
        "Expected `int` >= 0 - at `$.samples[0].start_version`",
    ),
    (_edit(_set("samples.0.start_version", False)), "got `bool` - at `$.samples[0].start_version`"),
    (_edit(_set("samples.0.dispatch_version", 1)), "samples[0]: dispatch_version 1 is below"),
    (
        _edit(_set("samples.0.reward", "1")),
        "Expected `float`, got `str` - at `$.samples[0].reward`",
    ),
    (_edit(_set("samples.2.reward", math.inf)), "samples[2].reward: expected a finite number"),
    (_edit(_set("samples.0.advantage", math.nan)), "samples[0].advantage: expected a finite"),
    (_edit(_set("samples.0.server", 7)), "got `int` - at `$.samples[0].server`"),
    (_edit(_set("samples.0.length", 0)), "Expected `int` >= 1 - at `$.samples[0].length`"),
    (
        _edit(_set("columns.token_ids.nbytes", 48)),
        "unknown field `nbytes` - at `$.columns.token_ids`",
    ),
    (_edit(_set("columns.advantages", _DELETE)), "missing required field `advantages`"),
    (_edit(_set("columns.token_ids.shape", [12.0])), "at `$.columns.token_ids.shape[0]`"),
    # Array references.
    (
        _edit(_set("columns.token_ids.dtype", "<i8")),
        "columns.token_ids: dtype '<i8', expected '<i4'",
    ),
    (
        _edit(_set("columns.loss_mask.dtype", "|b1")),
        "columns.loss_mask: dtype '|b1', expected '|u1'",
    ),
    (_edit(_set("columns.logprobs.dtype", ">f4")), "columns.logprobs: dtype '>f4'"),
    (_edit(_set("columns.logprobs.shape", [11])), "columns.logprobs: shape [11], expected [12]"),
    (_edit(_set("columns.token_ids.shape", [3, 4])), "columns.token_ids: shape [3, 4]"),
    (
        _edit(_set("columns.advantages.offset", 4)),
        "columns.advantages: offset 4 is not a multiple of 64",
    ),
    (_edit(_set("columns.advantages.offset", 1 << 20)), "columns.advantages: bytes"),
    (_edit(_overlap), "overlaps columns."),
    (
        _edit(_set("samples.2.inline.routed_experts.dtype", "<u4")),
        "samples[2].inline.routed_experts: dtype '<u4'",
    ),
    (_edit(_set("samples.2.inline.sampling_mask.dtype", "<u2")), "expected '<i4'"),
    (_edit(_set("samples.2.inline.sampling_mask.shape", [4])), "expected 2 dimensions"),
    (_edit(_set("samples.2.inline.sampling_mask.shape", [3, 4])), "3 rows, expected 4"),
    (_edit(_set("samples.2.inline.routed_experts.shape", [4, 0, 2])), "has a row of size zero"),
    (_edit(_set("samples.2.inline.sampling_mask.offset", 1 << 20)), "lie past the end of the file"),
    (
        _edit(_set("samples.2.inline.logits", {"offset": 0, "dtype": "<f4", "shape": [4]})),
        "samples[2].inline: unknown field 'logits'",
    ),
    (lambda: _good() + bytes(64), "the file has"),
    (lambda: _good()[:-1], "lie past the end of the file"),
    # Sample ranges.
    (_edit(_set("samples.1.start", 5)), "samples[1].start: 5, expected 4"),
    (
        _edit(_set("samples.2.length", 5)),
        "samples[2].length: positions 8..13 lie past the 12 tokens",
    ),
    (_edit(_set("tokens", 13)), "columns.token_ids: shape [12], expected [13]"),
    # Payload forms.
    (
        _edit(_set("samples.1.payload_dir", _DELETE)),
        "samples[1]: payload_dir and a non-empty payload",
    ),
    (_edit(_set("samples.1.payload", {})), "samples[1]: payload_dir and a non-empty payload"),
    (
        _edit(_set("samples.0.payload", {})),
        "samples[0]: payload_dir and a non-empty payload",
    ),
    (
        _edit(_set("samples.0.payload_dir", "/x/v3")),
        "samples[0]: payload_dir and a non-empty payload",
    ),
    (
        _edit(_set("samples.1.payload_dir", "x/v3")),
        "samples[1].payload_dir: 'x/v3' is not an absolute path",
    ),
    (
        _edit(_set("samples.1.payload_dir", "/x/v2")),
        "'/x/v2' is not v3, the sample's dispatch version",
    ),
    (_edit(_set("samples.1.payload.logits", [])), "samples[1].payload: unknown field 'logits'"),
    (
        _edit(_set("samples.1.payload.routed_experts", [])),
        "samples[1].payload.routed_experts: no segments",
    ),
    (
        _edit(_set("samples.1.payload.routed_experts.0.offset", "0")),
        "Expected `int`, got `str` - at `$.samples[1].payload[...][0].offset`",
    ),
    (
        _edit(_set("samples.1.payload.routed_experts.0.fill", True)),
        "Expected `int | null`, got `bool` - at `$.samples[1].payload[...][0].fill`",
    ),
    (
        _edit(_set("samples.1.payload.routed_experts.0.shape", [])),
        "payload.routed_experts[0]: bad payload segment: malformed: shape must be a non-empty",
    ),
    (
        _edit(_set("samples.1.payload.routed_experts.0.dtype", "float16")),
        "payload.routed_experts[0]: bad payload segment: dtype: unknown dtype 'float16'",
    ),
    (
        _edit(_set("samples.1.payload.routed_experts.1.weird", 1)),
        "Object contains unknown field `weird` - at `$.samples[1].payload[...][1]`",
    ),
    (
        _edit(_set("samples.1.payload.routed_experts.0.field", "sampling_mask")),
        "a segment of field 'sampling_mask'",
    ),
    (
        _edit(_set("samples.1.payload.routed_experts", {})),
        "Expected `array`, got `object` - at `$.samples[1].payload[...]`",
    ),
    (
        _edit(_both_payloads),
        "samples[1]: a sample carries its payload by handle or inline, not both",
    ),
    # Column contents.
    (
        _patched(_column_at("loss_mask", 5), b"\x02"),
        "samples[1].loss_mask[1]: a value other than 0 and 1",
    ),
    (
        _patched(_column_at("logprobs", 9), struct.pack("<f", math.nan)),
        "samples[2].logprobs[1]: not a finite number",
    ),
    (_patched(_column_at("logprobs", 0), struct.pack("<f", -math.inf)), "samples[0].logprobs[0]"),
    (
        _patched(_column_at("advantages", 11), struct.pack("<f", 0.25)),
        "samples[2].advantages[3]: differs",
    ),
    (
        _patched(_column_at("advantages", 0), struct.pack("<f", 0.5)),
        "samples[0].advantages[0]: differs",
    ),
    (_edit(_set("samples.1.advantage", 0.75)), "samples[1].advantages[2]: differs"),
]


@pytest.mark.parametrize("case", range(len(MALFORMED)))
def test_malformed_batches_raise_one_line_naming_the_file(case: int) -> None:
    make, message = MALFORMED[case]
    with pytest.raises(BatchError) as caught:
        decode(make())
    text = str(caught.value)
    assert text.startswith(f"{SOURCE}: ")
    assert message in text
    assert "\n" not in text


def test_the_good_file_the_malformed_cases_start_from_decodes() -> None:
    assert [s.rollout_id for s in decode(_good()).samples] == ["r1", "r2", "r3"]
    assert decode(edited(lambda header: None)).tokens == 12


def test_read_batch_file_names_a_file_it_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(BatchError, match=r"batch\.bin: cannot read: No such file"):
        read_batch_file(tmp_path / "batch.bin")
    (tmp_path / "dir.bin").mkdir()
    with pytest.raises(BatchError, match=r"dir\.bin: cannot read: not a regular file"):
        read_batch_file(tmp_path / "dir.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(BatchError, match=r"empty\.bin: 0 bytes, too short"):
        read_batch_file(tmp_path / "empty.bin")
