"""By-handle segments on the wire (orchestrator/wire/segments.py): prime-rl's form
``{field, file, offset, pos, rows, dtype, shape}`` (+ our optional ``digest``) to the
daemon's `PayloadSegment` and back, and every segment that must not be trusted refused
with its reason before any path is used."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.payload import BadSegment, PayloadSegment
from orchestrator.wire.segments import (
    SEGMENT_KEYS,
    decode_segments,
    segment_from_wire,
    segment_to_wire,
)

PAYLOAD_DIR = Path("/data/run/payloads/v3")
NAME = "449c7816a3ec4d3eb1c51e7206126925.bin"
DIGEST = "0123456789abcdef0123456789abcdef"


def routing(**changes: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "field": "routed_experts",
        "file": f"{PAYLOAD_DIR}/{NAME}",
        "offset": 0,
        "pos": 0,
        "rows": 40,
        "dtype": "uint8",
        "shape": [48, 8],
    }
    obj.update(changes)
    return obj


def mask(**changes: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "field": "sampling_mask",
        "file": f"{PAYLOAD_DIR}/{NAME}",
        "offset": 15360,
        "pos": 40,
        "rows": 1,
        "dtype": "int32",
        "shape": [4],
    }
    obj.update(changes)
    return obj


def from_reply(obj: object, payload_dir: Path = PAYLOAD_DIR) -> PayloadSegment:
    """`obj` as a reply's payload holds it: JSON, decoded by `decode_segments`."""
    decoded = decode_segments(json.dumps([obj]).encode())
    assert isinstance(decoded, list)
    return segment_from_wire(decoded[0], payload_dir)


def refused(obj: object, reason: str, payload_dir: Path = PAYLOAD_DIR) -> BadSegment:
    """`obj` refused with `reason`, and with the same words from a reply's JSON (typed
    by msgspec when its keys and types are a segment's, checked in Python otherwise)."""
    with pytest.raises(BadSegment) as info:
        segment_from_wire(obj, payload_dir)
    assert info.value.reason == reason, str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(BadSegment) as decoded:
        from_reply(obj, payload_dir)
    assert (decoded.value.reason, str(decoded.value)) == (reason, str(info.value))
    return info.value


def test_a_reply_decodes_to_typed_segments_only_when_every_item_is_one() -> None:
    good = [routing(), mask(digest=DIGEST), routing(digest=None)]
    typed = decode_segments(json.dumps(good).encode())
    assert isinstance(typed, list)
    assert not any(isinstance(item, dict) for item in typed)
    assert [segment_from_wire(item, PAYLOAD_DIR) for item in typed] == [
        segment_from_wire(item, PAYLOAD_DIR) for item in good
    ]
    # One item with a bool for an int: every item is plain JSON, checked in Python.
    assert decode_segments(json.dumps([*good, routing(pos=True)]).encode()) == [
        *good,
        routing(pos=True),
    ]


def test_the_keys_are_prime_rls_in_order() -> None:
    assert SEGMENT_KEYS == ("field", "file", "offset", "pos", "rows", "dtype", "shape")


def test_a_routing_segment_becomes_a_bare_name_with_its_rows_in_the_shape() -> None:
    segment = segment_from_wire(routing(offset=16, pos=3, rows=37), PAYLOAD_DIR)
    assert segment == PayloadSegment(
        field="routed_experts",
        file=NAME,
        offset=16,
        pos=3,
        shape=(37, 48, 8),
        dtype="uint8",
        digest=None,
    )
    assert segment.rows == 37 and segment.row_nbytes == 48 * 8
    assert segment.fill is None and segment.digest_offset is None


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int16", "int32"])
def test_every_routing_dtype_is_accepted(dtype: str) -> None:
    assert segment_from_wire(routing(dtype=dtype), PAYLOAD_DIR).dtype == dtype


def test_a_mask_segment_and_its_digest() -> None:
    segment = segment_from_wire(mask(digest=DIGEST), PAYLOAD_DIR)
    assert segment == PayloadSegment("sampling_mask", NAME, 15360, 40, (1, 4), "int32", DIGEST)
    assert segment.nbytes == 16


def test_zero_rows_are_a_valid_segment() -> None:
    assert segment_from_wire(routing(rows=0), PAYLOAD_DIR).shape == (0, 48, 8)


@pytest.mark.parametrize("obj", [routing(), mask(), mask(digest=DIGEST), routing(rows=0)])
def test_the_wire_form_round_trips(obj: dict[str, Any]) -> None:
    segment = segment_from_wire(obj, PAYLOAD_DIR)
    assert segment_to_wire(segment, PAYLOAD_DIR, digest=True) == obj
    without = segment_to_wire(segment, PAYLOAD_DIR)
    assert "digest" not in without
    assert without == {k: v for k, v in obj.items() if k != "digest"}
    assert list(without) == list(SEGMENT_KEYS)


@pytest.mark.parametrize(
    "file",
    [
        f"{PAYLOAD_DIR}/../v3/{NAME}",  # resolves inside, but is not spelled plainly
        f"{PAYLOAD_DIR}/../v4/{NAME}",
        f"{PAYLOAD_DIR}/./{NAME}",
        f"{PAYLOAD_DIR}//{NAME}",
        f"/{PAYLOAD_DIR}/{NAME}",  # "//data/...": POSIX keeps two leading slashes
        f"/data/run/payloads/v4/{NAME}",  # another version's directory
        f"/data/run/payloads/{NAME}",
        f"{PAYLOAD_DIR}/sub/{NAME}",
        f"/data/run/payloads/v3x/{NAME}",
        NAME,  # relative names are not accepted: the file is an absolute path
        f"v3/{NAME}",
        f"data/run/payloads/v3/{NAME}",
        "/etc/passwd",
        str(PAYLOAD_DIR),  # the directory itself
    ],
)
def test_files_outside_the_payload_dir_are_traversal(file: str) -> None:
    error = refused(routing(file=file), "traversal")
    assert error.file == file


@pytest.mark.parametrize(
    "file",
    [
        "",
        f"{PAYLOAD_DIR}/",
        f"{PAYLOAD_DIR}/.",
        f"{PAYLOAD_DIR}/..",
        "..",
        f"{PAYLOAD_DIR}/a\\b.bin",
        f"{PAYLOAD_DIR}/a\0.bin",
        # Names a filesystem gives files deleted while open: the collector never deletes
        # them, so a payload under one would keep its version directory for good.
        f"{PAYLOAD_DIR}/.nfs000000000123abcd00000001",
        f"{PAYLOAD_DIR}/.fuse_hidden0000000a00000001",
    ],
)
def test_names_that_are_not_plain_are_refused(file: str) -> None:
    refused(routing(file=file), "not_plain_name")


def test_a_segment_is_checked_against_the_requests_own_directory() -> None:
    obj = routing()
    assert segment_from_wire(obj, PAYLOAD_DIR).file == NAME
    refused(obj, "traversal", payload_dir=Path("/data/run/payloads/v2"))
    refused(obj, "traversal", payload_dir=Path("/data/run"))


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        ("segment", "malformed"),
        ([routing()], "malformed"),
        (None, "malformed"),
        ({k: v for k, v in routing().items() if k != "rows"}, "malformed"),
        ({k: v for k, v in routing().items() if k != "file"}, "malformed"),
        (routing(extra=1), "malformed"),  # a key from a newer writer
        (routing(fill=-1), "malformed"),  # our stitching keys never come from a server
        (routing(digest_offset=0), "malformed"),
        (routing(digest_nbytes=10), "malformed"),
        (routing(field=1), "malformed"),
        (routing(file=None), "malformed"),
        (routing(dtype=None), "malformed"),
        (routing(offset=True), "malformed"),  # a bool is not an integer
        (routing(pos=False), "malformed"),
        (routing(rows=True), "malformed"),
        (routing(offset=1.0), "malformed"),
        (routing(rows="40"), "malformed"),
        (routing(offset=-1), "out_of_range"),
        (routing(pos=-40), "out_of_range"),
        (routing(rows=-1), "out_of_range"),
        (routing(field="logits"), "field"),
        (routing(dtype="float32"), "dtype"),
        (routing(dtype="int64"), "dtype"),
        (routing(dtype="uint32"), "dtype"),
        (mask(dtype="uint8"), "dtype"),  # masks are int32 token ids
        (mask(dtype="bool"), "dtype"),
        (routing(shape=[48]), "shape"),
        (routing(shape=[48, 8, 1]), "shape"),
        (routing(shape=[40, 48, 8]), "shape"),  # the wire shape is one row's
        (routing(shape=[48, 0]), "shape"),  # zero row dimension
        (mask(shape=[0]), "shape"),
        (routing(shape=[48, -8]), "shape"),
        (routing(shape=[48, True]), "shape"),
        (routing(shape=[48, 8.0]), "shape"),
        (routing(shape="48,8"), "shape"),
        (mask(shape=[4, 1]), "shape"),
        (routing(digest="0123456789ABCDEF0123456789ABCDEF"), "digest"),  # lowercase only
        (routing(digest=DIGEST[:-1]), "digest"),
        (routing(digest=DIGEST + "0"), "digest"),
        (routing(digest="g" * 32), "digest"),
        (routing(digest=""), "digest"),
        (routing(digest=12), "digest"),
    ],
)
def test_untrustworthy_segments_are_refused_with_their_reason(obj: object, reason: str) -> None:
    refused(obj, reason)


def test_a_null_digest_is_no_digest() -> None:
    assert segment_from_wire(routing(digest=None), PAYLOAD_DIR).digest is None


def test_a_refused_segment_names_its_file_as_sent() -> None:
    bad = f"{PAYLOAD_DIR}/../../etc/x.bin"
    assert refused(routing(file=bad, dtype="float32"), "dtype").file == bad
    assert refused(routing(file=7, extra=1), "malformed").file == ""
