"""PayloadSegment: wire form round trip and every malformed object from_json rejects."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.payload import BadSegment, PayloadSegment

DIGEST = "0123456789abcdef0123456789abcdef"


def wire(**changes: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "field": "routed_experts",
        "file": "a.bin",
        "offset": 16,
        "pos": 3,
        "shape": [5, 4, 2],
        "dtype": "uint16",
        "digest": DIGEST,
    }
    obj.update(changes)
    return {k: v for k, v in obj.items() if v is not None}


def test_round_trip_and_sizes() -> None:
    segment = PayloadSegment.from_json(wire())
    assert segment == PayloadSegment(
        field="routed_experts",
        file="a.bin",
        offset=16,
        pos=3,
        shape=(5, 4, 2),
        dtype="uint16",
        digest=DIGEST,
    )
    assert segment.rows == 5
    assert segment.row_nbytes == 16
    assert segment.nbytes == 80
    assert segment.digest_range == (16, 80)
    assert not segment.is_fill
    assert segment.to_json() == wire()


def test_optional_keys_round_trip() -> None:
    obj = wire(digest_offset=0, digest_nbytes=200)
    segment = PayloadSegment.from_json(obj)
    assert segment.digest_range == (0, 200)
    assert segment.to_json() == obj
    fill = {k: v for k, v in wire(file="", offset=0, fill=-1).items() if k != "digest"}
    assert PayloadSegment.from_json(fill).is_fill
    assert PayloadSegment.from_json(fill).to_json() == fill


def test_the_digest_is_optional() -> None:
    # A real server's segment carries no digest: nothing is verified, nothing is invented.
    obj = {k: v for k, v in wire().items() if k != "digest"}
    segment = PayloadSegment.from_json(obj)
    assert segment.digest is None
    assert segment.to_json() == obj


def test_shape_list_is_converted_to_tuple() -> None:
    segment = PayloadSegment("sampling_mask", "a.bin", 0, 0, [2, 3], "int32", DIGEST)
    assert segment.shape == (2, 3)


@pytest.mark.parametrize(
    ("obj", "reason", "words"),
    [
        ([1, 2], "malformed", "JSON object"),
        ("segment", "malformed", "JSON object"),
        ({k: v for k, v in wire().items() if k not in {"pos", "shape"}}, "malformed", "pos, shape"),
        (wire(extra=1), "malformed", "unknown key(s) extra"),
        (wire(offset=True), "malformed", "offset must be an integer"),
        (wire(pos=False), "malformed", "pos must be an integer"),
        (wire(offset="16"), "malformed", "offset must be an integer"),
        (wire(pos=1.0), "malformed", "pos must be an integer"),
        (wire(file=7), "malformed", "file must be a string"),
        (wire(field=None), "malformed", "missing key(s) field"),
        (wire(dtype=["uint8"]), "malformed", "dtype must be a string"),
        (wire(digest=0), "malformed", "digest must be a string"),
        (wire(shape=[5, True, 2]), "malformed", "shape"),
        (wire(shape=[]), "malformed", "shape"),
        (wire(shape="5,4,2"), "malformed", "shape"),
        (wire(shape=[5.0, 4, 2]), "malformed", "shape"),
        (wire(fill=True), "malformed", "fill must be an integer"),
        (wire(digest_offset="0"), "malformed", "digest_offset must be an integer"),
        (wire(field="logprobs"), "field", "unknown field 'logprobs'"),
        (wire(dtype="float32"), "dtype", "unknown dtype 'float32'"),
    ],
)
def test_from_json_rejects(obj: object, reason: str, words: str) -> None:
    with pytest.raises(BadSegment) as info:
        PayloadSegment.from_json(obj)
    assert info.value.reason == reason
    message = str(info.value)
    assert words in message
    assert "\n" not in message
    if isinstance(obj, dict) and isinstance(obj.get("file"), str):
        assert repr(obj["file"]) in message
