"""Conformance with the real peers: golden generate documents (golden/README.md) parsed
by the daemon, their values checked against expectations computed here (literal values
and hashes for the captured documents, the documented formula for the hand-written ones),
by-handle rows read twice (with the daemon's reader and with an independent reader that
follows prime-rl's rules) and compared bitwise, and the daemon's own requests checked
against the captured ones."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pytest
from payload_gc import PayloadRootFiles

from orchestrator.core.samples import build_sample
from orchestrator.core.turns import TurnOutput
from orchestrator.daemon.inference.client import check_turn_files
from orchestrator.payload import (
    PayloadCorrupt,
    PayloadMissing,
    RoutingShape,
    read_sample_payload,
    read_segment,
)
from orchestrator.wire import build_generate_request, parse_generate_response

GOLDEN = Path(__file__).parent / "golden"
FIELDS = ("routed_experts", "sampling_mask")

#: The captured documents, byte for byte as the peers produced them.
CAPTURED_SHA256 = {
    "primerl_by_handle.json": "b21bd7123925531dd88a367a1096aae8e69d794026536529ce23401312aa8f60",
    "primerl_by_handle_449c7816a3ec4d3eb1c51e7206126925.bin": (
        "c3fd2b3459706e90016200899439097f807f8054e331ea09959d7b9c239553ba"
    ),
    "primerl_inline.json": "e4f0ea2c31f5d8fb3f93907c93119d3b63a9a9c71de997b5a26b48b286e0854c",
    "vllm_upstream_inline.json": "4ebbfe56d77f53acb69935560880b273bbc2aa8cbc333c263c30c61e1bf90684",
}
# What the captured documents hold (48 layers, top-8 of 128 experts, random ids): the
# sha256 of the routing rows' bytes, the first and last (layer, top-k) entries.
CAPTURED_ROUTING_40_ROWS = "7b7bcbee87565d3c2fd4b8d65c207a3cb2a5ef971d45410b9efbbc06ce21c48f"
CAPTURED_INLINE_24_ROWS = "d556fb10018b54e8d559bf1f0a2f1c458839cc3a3b432bdda1d3dc2a78c1a2f9"
CAPTURED_FIRST_ROW = [43, 114, 39, 111, 36, 38, 15, 41]
CAPTURED_PROMPT = list(range(100, 140))
QWEN3_30B = RoutingShape(48, 8, 128)

PROMPT = list(range(100, 108))
TOY = RoutingShape(2, 2)


def golden(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((GOLDEN / name).read_bytes())
    return doc


def choice_of(doc: dict[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = doc["reply"]["choices"][0]
    return choice


def parse(
    doc: dict[str, Any],
    *,
    payload_dir: Path | None = None,
    fields: Sequence[str] = FIELDS,
    routing_start: int | None = None,
    routing_shape: RoutingShape | None = None,
) -> TurnOutput:
    """Parse a golden reply as the daemon would after sending its request."""
    request = doc["request"]
    if routing_start is None:
        routing_start = request["sampling_params"].get("routed_experts_prompt_start", 0)
    return parse_generate_response(
        json.dumps(doc["reply"]).encode(),
        prompt_len=len(request["token_ids"]),
        routing_start=routing_start,
        payload_dir=payload_dir,
        fields=fields,
        routing_shape=routing_shape,
    )


def trusted(turn: TurnOutput) -> TurnOutput:
    assert turn.poisoned is None, turn.poisoned
    return turn


def experts(first: int, last: int, modulo: int, base: int = 0, dtype: str = "uint8") -> np.ndarray:
    """The hand-written goldens' routing ids for positions ``first .. last - 1``:
    ``base + (7p + 3l + k) % modulo`` (golden/README.md)."""
    out = np.empty((last - first, 2, 2), dtype=dtype)
    for p in range(first, last):
        for layer in range(2):
            for k in range(2):
                out[p - first, layer, k] = base + (7 * p + 3 * layer + k) % modulo
    return out


def sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def test_the_captured_documents_are_kept_byte_for_byte() -> None:
    for name, digest in CAPTURED_SHA256.items():
        assert hashlib.sha256((GOLDEN / name).read_bytes()).hexdigest() == digest, name


# --- requests -------------------------------------------------------------------------


def request_docs() -> list[tuple[str, dict[str, Any]]]:
    docs = [
        (name, golden(name)["request"])
        for name in (
            "primerl_by_handle.json",
            "primerl_inline.json",
            "vllm_upstream_inline.json",
            "vllm_upstream_generate_logprobs.json",
            "primerl_inline_bare_csr.json",
            "primerl_by_handle_digest.json",
        )
    ]
    turns = golden("primerl_two_turns_uint8_then_uint16.json")["turns"]
    docs += [(f"two_turns[{i}]", turn["request"]) for i, turn in enumerate(turns)]
    return docs


@pytest.mark.parametrize(("name", "captured"), [pytest.param(*d, id=d[0]) for d in request_docs()])
def test_the_daemons_request_has_the_peers_keys(name: str, captured: dict[str, Any]) -> None:
    sampling = captured["sampling_params"]
    payload_dir = sampling.get("extra_args", {}).get("payload_dir")
    built = build_generate_request(
        request_id=captured["request_id"],
        token_ids=captured["token_ids"],
        max_tokens=sampling["max_tokens"],
        seed=sampling["seed"],
        payload_dir=None if payload_dir is None else Path(payload_dir),
        routing_start=sampling.get("routed_experts_prompt_start"),
        model=captured.get("model", ""),
    )
    assert set(built) == set(captured)
    # The daemon stops on the model's EOS by itself: it sends no stop_token_ids.
    assert set(built["sampling_params"]) == set(sampling) - {"stop_token_ids"}
    for key in ("request_id", "model", "token_ids"):
        assert built[key] == captured[key]
    for key, value in built["sampling_params"].items():
        assert value == sampling[key], key
    assert json.loads(json.dumps(built)) == built


# --- captured inline replies ----------------------------------------------------------


def test_captured_upstream_vllm_reply() -> None:
    doc = golden("vllm_upstream_inline.json")
    assert doc["request"]["token_ids"] == CAPTURED_PROMPT
    turn = trusted(parse(doc, routing_shape=QWEN3_30B))
    assert turn.completion_ids.tolist() == [
        2,
    ]
    assert turn.finish_reason == "stop"
    assert (
        turn.logprobs.tolist()
        == np.float32(
            [
                -0.8429284691810608,
            ]
        ).tolist()
    )
    routing, pos = turn.inline["routed_experts"]
    # A .npy over the whole sequence: 40 rows ending at the last token run forward.
    assert pos == 0 and routing.shape == (40, 48, 8) and routing.dtype == np.uint8
    assert sha256(routing) == CAPTURED_ROUTING_40_ROWS
    assert routing[0, 0].tolist() == CAPTURED_FIRST_ROW
    # The same rows as prime-rl's by-handle file of the same request.
    raw = (GOLDEN / "primerl_by_handle_449c7816a3ec4d3eb1c51e7206126925.bin").read_bytes()
    assert routing.tobytes() == raw[: 40 * 48 * 8]
    assert "sampling_mask" not in turn.inline  # upstream sent none: no kept set

    sample, dropped = build_sample(
        "r",
        [*CAPTURED_PROMPT, 2],
        [(40, turn)],
        payload_dir=None,
        fields=FIELDS,
        final_token_route="repeat",
    )
    assert not dropped and sample.untrainable is None
    assert sample.inline is not None
    stitched = sample.inline["routed_experts"]
    np.testing.assert_array_equal(stitched[:40], routing)
    np.testing.assert_array_equal(stitched[40], routing[39])
    # No turn had a kept set: the sample carries no mask (as by handle).
    assert "sampling_mask" not in sample.inline


def test_captured_upstream_reply_to_a_by_handle_request_is_poisoned(tmp_path: Path) -> None:
    # Upstream vLLM ignores extra_args.payload_dir: its answer is inline whatever was asked.
    turn = parse(golden("vllm_upstream_inline.json"), payload_dir=tmp_path / "v3")
    assert turn.poisoned is not None and "extra_args.payload_dir" in turn.poisoned
    assert turn.files == frozenset()


CAPTURED_MASK_IDS = [798, 11403, 974, 15970, 13704, 17886, 14, 17910]
CAPTURED_MASK_IDS += [24711, 23725, 3149, 12543, 597, 28850, 12061, 7560]


def test_captured_primerl_inline_reply() -> None:
    doc = golden("primerl_inline.json")
    assert doc["request"]["sampling_params"]["routed_experts_prompt_start"] == 16
    turn = trusted(parse(doc, routing_shape=QWEN3_30B))
    assert turn.completion_ids.tolist() == [
        2,
    ]
    # completion_logprobs are float32: the value is the float32 nearest -0.521658.
    assert (
        turn.logprobs.tolist()
        == np.float32(
            [
                -0.5216580033302307,
            ]
        ).tolist()
    )
    assert turn.logprobs[0] == float(np.float32(-0.521658))
    routing, pos = turn.inline["routed_experts"]
    assert pos == 16 and routing.shape == (24, 48, 8) and routing.dtype == np.uint8
    assert sha256(routing) == CAPTURED_INLINE_24_ROWS
    assert routing[0, 0].tolist() == CAPTURED_FIRST_ROW
    mask, mask_pos = turn.inline["sampling_mask"]
    assert mask_pos == 40 and mask.dtype == np.int32
    assert mask.tolist() == [CAPTURED_MASK_IDS]


def test_captured_primerl_routing_must_start_by_the_requested_start() -> None:
    doc = golden("primerl_inline.json")
    trusted(parse(doc, routing_start=20))  # rows from 16 cover a request from 20
    poisoned = parse(doc, routing_start=15).poisoned
    assert poisoned is not None and "16..40" in poisoned
    # Ids of 128 experts are not a 100-expert model's; 48 x 8 rows are not a toy's.
    assert parse(doc, routing_shape=RoutingShape(48, 8, 100)).poisoned is not None
    assert parse(doc, routing_shape=TOY).poisoned is not None


# --- by handle: captured, and with our digest -----------------------------------------


def mapped(name: str, root: Path) -> tuple[dict[str, Any], Path]:
    """The by-handle golden `name` with its payload directory mapped onto ``root/v<k>``
    (request and reply rewritten), its .bin copied there under the segment's name."""
    doc = golden(name)
    extra_args = doc["request"]["sampling_params"]["extra_args"]
    original = PurePosixPath(extra_args["payload_dir"])
    payload_dir = root / original.name
    payload_dir.mkdir(parents=True)
    extra_args["payload_dir"] = str(payload_dir)
    for segment in choice_of(doc)["payload"]:
        file = PurePosixPath(segment["file"])
        assert file.parent == original
        (stored,) = GOLDEN.glob(f"*_{file.name}")
        shutil.copyfile(stored, payload_dir / file.name)
        segment["file"] = str(payload_dir / file.name)
    return doc, payload_dir


def primerl_read(
    segments: Sequence[dict[str, Any]], field: str, lo: int, hi: int, fill: int, dtype: str
) -> np.ndarray | None:
    """Rows ``[lo, hi)`` of `field` from wire segments, by prime-rl's reader rules
    (src/prime_rl/transports/payload.py), written independently of the daemon's reader:
    clip each segment to ``[lo, hi)`` by rows, ``row_bytes = itemsize * prod(row shape)``,
    ``pread`` each clipped segment at ``offset + (start - pos) * row_bytes``, fill the
    rest; the row shape is the widest of the field's segments."""
    chosen = [s for s in segments if s["field"] == field]
    if not chosen:
        return None
    row_shape = [max(dims) for dims in zip(*(s["shape"] for s in chosen), strict=True)]
    out = np.full((hi - lo, *row_shape), fill, dtype=dtype)
    for segment in chosen:
        pos, rows = segment["pos"], segment["rows"]
        start, end = max(pos, lo), min(pos + rows, hi)
        if start >= end:
            continue
        item = np.dtype(segment["dtype"]).newbyteorder("<")
        row_bytes = item.itemsize * math.prod(segment["shape"])
        fd = os.open(segment["file"], os.O_RDONLY)
        try:
            data = os.pread(
                fd, (end - start) * row_bytes, segment["offset"] + (start - pos) * row_bytes
            )
        finally:
            os.close(fd)
        assert len(data) == (end - start) * row_bytes, "short read"
        block = np.frombuffer(data, dtype=item).reshape(end - start, *segment["shape"])
        out[(slice(start - lo, end - lo), *(slice(0, d) for d in segment["shape"]))] = block
    return out


def read_both(
    doc: dict[str, Any], turn: TurnOutput, payload_dir: Path, window: range, *, verify: bool
) -> None:
    """Read the turn's one-turn sample in `window` with the daemon's reader and with the
    independent one, and compare them bitwise."""
    prompt = doc["request"]["token_ids"]
    tokens = prompt + turn.completion_ids.tolist()
    sample, dropped = build_sample(
        "r",
        tokens,
        [(len(prompt), turn)],
        payload_dir=payload_dir,
        fields=FIELDS,
        final_token_route="repeat",
    )
    assert not dropped and sample.untrainable is None
    ours = read_sample_payload(payload_dir, sample.payload, len(tokens), rows=window, verify=verify)
    segments = choice_of(doc)["payload"]
    lo, hi = window.start, window.stop
    routing = ours["routed_experts"]
    theirs = primerl_read(segments, "routed_experts", lo, hi, 0, routing.dtype.name)
    assert theirs is not None and routing.dtype == theirs.dtype
    # Rows up to the last token run forward come from the file; the final token's row is
    # the daemon's own (a copy of the row before it: "repeat").
    forwarded = max(0, min(hi, len(tokens) - 1) - lo)
    assert routing[:forwarded].tobytes() == theirs[:forwarded].tobytes()
    if hi == len(tokens) and len(window) >= 2:
        assert routing[-1].tobytes() == routing[-2].tobytes()
    mask = ours["sampling_mask"]
    their_mask = primerl_read(segments, "sampling_mask", lo, hi, -1, "int32")
    assert their_mask is not None
    assert mask.dtype == their_mask.dtype and mask.shape == their_mask.shape
    assert mask.tobytes() == their_mask.tobytes()


def test_captured_primerl_by_handle_reply(tmp_path: Path) -> None:
    root = tmp_path / "payloads"
    doc, payload_dir = mapped("primerl_by_handle.json", root)
    turn = trusted(parse(doc, payload_dir=payload_dir, routing_shape=QWEN3_30B))
    assert turn.completion_ids.tolist() == [
        2,
    ]
    assert turn.logprobs.tolist() == [float(np.float32(-0.8429284691810608))]
    name = "449c7816a3ec4d3eb1c51e7206126925.bin"
    assert turn.files == frozenset({f"{payload_dir}/{name}"})
    routing, mask = turn.segments["routed_experts"], turn.segments["sampling_mask"]
    assert (routing.file, routing.offset, routing.pos, routing.shape, routing.dtype) == (
        name,
        0,
        0,
        (40, 48, 8),
        "uint8",
    )
    assert (mask.file, mask.offset, mask.pos, mask.shape, mask.dtype) == (
        name,
        15360,
        40,
        (1, 4),
        "int32",
    )
    assert routing.digest is None and mask.digest is None  # prime-rl sends none

    with PayloadRootFiles(root) as files:
        found = check_turn_files(turn, files=files, version=3)
    assert found.problem is None and found.sizes == {name: 15376}

    rows = read_segment(payload_dir, routing)
    assert sha256(rows) == CAPTURED_ROUTING_40_ROWS
    assert rows[0, 0].tolist() == CAPTURED_FIRST_ROW
    assert read_segment(payload_dir, mask).tolist() == [[24442, 22513, 4312, 8029]]
    for window in (range(41), range(20), range(16, 41), range(39, 41), range(40, 41)):
        read_both(doc, turn, payload_dir, window, verify=False)


def test_captured_by_handle_reply_outside_the_requested_dir_is_poisoned(tmp_path: Path) -> None:
    # Unmapped, the segments name /data/run/payloads/v3: not the request's directory.
    doc = golden("primerl_by_handle.json")
    turn = parse(doc, payload_dir=tmp_path / "v3")
    assert turn.poisoned is not None and "traversal" in turn.poisoned
    assert turn.files == frozenset() and turn.segments == {}


DIGEST_MASK = [[41, 50, -1], [-1, -1, -1], [43, 44, 45]]


def test_by_handle_reply_with_digests(tmp_path: Path) -> None:
    root = tmp_path / "payloads"
    doc, payload_dir = mapped("primerl_by_handle_digest.json", root)
    turn = trusted(parse(doc, payload_dir=payload_dir, routing_shape=RoutingShape(2, 2, 16)))
    assert turn.completion_ids.tolist() == [41, 42, 43]
    assert turn.logprobs.tolist() == np.float32([-0.375, -1.75, -0.03125]).tolist()
    assert turn.finish_reason == "stop"
    name = "5f0c2a9e7b3d4e1f8a6b9c0d1e2f3a4b.bin"
    raw = (payload_dir / name).read_bytes()
    expected_routing = experts(0, 10, 16)
    expected_mask = np.array(DIGEST_MASK, dtype="<i4")
    assert raw == expected_routing.tobytes() + expected_mask.tobytes()
    # Each digest is blake2b-128 of its segment's bytes, as the golden says.
    routing, mask = turn.segments["routed_experts"], turn.segments["sampling_mask"]
    assert routing.digest == hashlib.blake2b(raw[:40], digest_size=16).hexdigest()
    assert mask.digest == hashlib.blake2b(raw[40:], digest_size=16).hexdigest()
    assert (mask.offset, mask.pos, mask.shape) == (40, 8, (3, 3))

    np.testing.assert_array_equal(read_segment(payload_dir, routing, verify=True), expected_routing)
    assert read_segment(payload_dir, mask, verify=True).tolist() == DIGEST_MASK
    for window in (range(11), range(8), range(7, 11), range(9, 11), range(10, 11)):
        read_both(doc, turn, payload_dir, window, verify=True)

    sample, _ = build_sample(
        "r",
        [*PROMPT, 41, 42, 43],
        [(8, turn)],
        payload_dir=payload_dir,
        fields=FIELDS,
        final_token_route="repeat",
    )
    whole = read_sample_payload(payload_dir, sample.payload, 11, verify=True)
    np.testing.assert_array_equal(whole["routed_experts"][:10], expected_routing)
    np.testing.assert_array_equal(whole["routed_experts"][10], expected_routing[9])
    assert whole["sampling_mask"].tolist() == [[-1, -1, -1]] * 8 + DIGEST_MASK

    # A flipped byte is caught by the digest; a short file is missing bytes.
    (payload_dir / name).write_bytes(raw[:45] + bytes([raw[45] ^ 1]) + raw[46:])
    with pytest.raises(PayloadCorrupt):
        read_sample_payload(payload_dir, sample.payload, 11, verify=True)
    (payload_dir / name).write_bytes(raw[:-1])
    with pytest.raises(PayloadMissing):
        read_sample_payload(payload_dir, sample.payload, 11)
    with PayloadRootFiles(root) as files:
        problem = check_turn_files(turn, files=files, version=5).problem
    assert problem is not None and name in problem


# --- hand-written inline replies ------------------------------------------------------


def test_upstream_reply_with_generate_logprobs_and_list_masks() -> None:
    doc = golden("vllm_upstream_generate_logprobs.json")
    entry = choice_of(doc)["logprobs"]["content"][0]
    assert set(entry) == {"token_id", "logprob", "rank", "top_logprobs"}
    turn = trusted(parse(doc, routing_shape=RoutingShape(2, 2, 16)))
    assert turn.completion_ids.tolist() == [11, 12, 13, 14]
    assert turn.logprobs.tolist() == np.float32([-0.125, -2.5, -0.0625, -9999.0]).tolist()
    assert turn.finish_reason == "length"
    routing, pos = turn.inline["routed_experts"]
    assert pos == 0 and routing.dtype == np.uint8
    np.testing.assert_array_equal(routing, experts(0, 11, 16))
    mask, mask_pos = turn.inline["sampling_mask"]
    assert mask_pos == 8
    assert mask.tolist() == [[11, 40, -1], [12, -1, -1], [-1, -1, -1], [14, 15, 16]]

    sample, _ = build_sample(
        "r",
        [*PROMPT, 11, 12, 13, 14],
        [(8, turn)],
        payload_dir=None,
        fields=FIELDS,
        final_token_route="repeat",
    )
    assert sample.inline is not None
    stitched = sample.inline["sampling_mask"]
    assert stitched.tolist() == [[-1, -1, -1]] * 8 + mask.tolist()
    assert sample.logprobs[8:].tolist() == np.float32([-0.125, -2.5, -0.0625, -9999.0]).tolist()


def test_primerl_reply_with_a_bare_base64_csr_mask() -> None:
    doc = golden("primerl_inline_bare_csr.json")
    assert all(isinstance(v, str) for v in choice_of(doc)["sampling_mask"].values())
    turn = trusted(parse(doc, routing_shape=RoutingShape(2, 2, 16)))
    assert turn.completion_ids.tolist() == [21, 22, 23]
    assert turn.logprobs.tolist() == np.float32([-0.5, -9999.0, -1.25]).tolist()
    routing, pos = turn.inline["routed_experts"]
    assert pos == 4
    np.testing.assert_array_equal(routing, experts(4, 10, 16))
    mask, mask_pos = turn.inline["sampling_mask"]
    assert mask_pos == 8
    assert mask.tolist() == [[21, 30, -1], [22, -1, -1], [23, 24, 25]]


@pytest.mark.parametrize(
    ("route", "dtype", "last_row"),
    [("repeat", np.uint16, "copy"), ("sentinel", np.int32, "sentinel")],
)
def test_two_turns_uint8_then_uint16_stitch_to_the_wider_dtype(
    route: Any, dtype: type[np.integer[Any]], last_row: str
) -> None:
    doc = golden("primerl_two_turns_uint8_then_uint16.json")
    first, second = doc["turns"]
    env = doc["environment_reply"]
    t1 = trusted(parse(first, routing_shape=TOY))
    t2 = trusted(parse(second, routing_shape=TOY))
    # Turn 2's request is turn 1's tokens + completion + the environment's reply, asking
    # for routing from where turn 1's rows ended.
    tokens_1 = first["request"]["token_ids"]
    assert second["request"]["token_ids"] == tokens_1 + t1.completion_ids.tolist() + env
    start_2 = second["request"]["sampling_params"]["routed_experts_prompt_start"]
    assert start_2 == len(tokens_1) + len(t1.completion_ids) - 1 == 10

    r1, pos1 = t1.inline["routed_experts"]
    r2, pos2 = t2.inline["routed_experts"]
    assert (r1.dtype.name, pos1, r2.dtype.name, pos2) == ("uint8", 0, "uint16", 10)
    expected_1 = experts(0, 10, 200)
    expected_2 = experts(10, 15, 128, base=256, dtype="uint16")
    np.testing.assert_array_equal(r1, expected_1)
    np.testing.assert_array_equal(r2, expected_2)
    assert int(r2.max()) > 255  # the reason for uint16
    assert t1.inline.keys() == t2.inline.keys() == {"routed_experts"}  # masks null

    tokens = second["request"]["token_ids"] + t2.completion_ids.tolist()
    sample, dropped = build_sample(
        "r",
        tokens,
        [(len(tokens_1), t1), (len(second["request"]["token_ids"]), t2)],
        payload_dir=None,
        fields=FIELDS,
        final_token_route=route,
    )
    assert not dropped and sample.untrainable is None and sample.inline is not None
    stitched, pos = sample.inline["routed_experts"], 0
    assert pos == 0 and stitched.dtype == dtype and stitched.shape == (16, 2, 2)
    # Both turns' ids, turn 1's promoted losslessly.
    np.testing.assert_array_equal(stitched[:10], expected_1)
    np.testing.assert_array_equal(stitched[10:15], expected_2)
    if last_row == "copy":
        np.testing.assert_array_equal(stitched[15], expected_2[-1])
    else:
        assert (stitched[15] == -1).all()
    assert "sampling_mask" not in sample.inline
    assert sample.loss_mask.tolist() == [False] * 8 + [True] * 3 + [False] * 2 + [True] * 3
    assert sample.logprobs[8:11].tolist() == np.float32([-0.25, -0.5, -0.75]).tolist()
    assert sample.logprobs[13:].tolist() == np.float32([-1.0, -1.5, -2.0]).tolist()


# -- captured from a real vLLM 0.30.0 (tests/vllm/capture_goldens.py) ---------------------

VLLM_0_30 = "vllm_0_30_0_generate.json"


def test_a_real_vllm_reply_parses_to_its_tokens_and_routing() -> None:
    doc = golden(VLLM_0_30)
    assert doc["server"]["vllm"] == "0.30.0"
    assert "--enforce-eager" in doc["server"]["flags"]
    prompt = doc["request"]["token_ids"]
    reply = doc["reply"]
    assert reply["request_id"] == "generate-tokens-" + doc["request"]["request_id"]
    turn = parse_generate_response(
        json.dumps(reply).encode(),
        prompt_len=len(prompt),
        routing_start=0,
        payload_dir=None,
        fields=("routed_experts",),
    )
    assert turn.poisoned is None
    assert turn.completion_ids.tolist() == reply["choices"][0]["token_ids"]
    ids, start = turn.inline["routed_experts"]
    # From position 0 to the last token run forward, 2 layers, top-2 of 8, in uint8.
    assert (start, ids.shape, ids.dtype) == (
        0,
        (len(prompt) + len(turn.completion_ids) - 1, 2, 2),
        np.uint8,
    )
    assert int(ids.max()) < 8 and (ids[..., 0] != ids[..., 1]).all()
    content = reply["choices"][0]["logprobs"]["content"]
    assert turn.logprobs.tolist() == pytest.approx([entry["logprob"] for entry in content])


def test_the_fleets_upstream_form_answers_in_the_captured_keys() -> None:
    from orchestrator.sim._model import SamplingParams, SimModel, sample_completion
    from orchestrator.sim._response import render_response
    from orchestrator.sim.reply_forms import REPLY_FORMS

    captured = golden(VLLM_0_30)["reply"]
    model = SimModel(layers=2, top_k=2, num_experts=8, vocab_size=1024)
    completion = sample_completion(model, 7, SamplingParams(max_tokens=4, seed=1), 0)
    rows = np.array([[[0, 1], [2, 3]]] * 20, dtype=np.uint8)
    choice = REPLY_FORMS["upstream"].inline_choice(
        0, completion, logprobs=True, routing=rows, routing_start=0, mask=None
    )
    reply = render_response("r", [choice], 17)
    assert list(reply) == list(captured)
    assert set(choice) == set(captured["choices"][0])
    entry, real = choice["logprobs"]["content"][0], captured["choices"][0]["logprobs"]["content"][0]
    assert entry.keys() == real.keys()
    assert entry["top_logprobs"][0].keys() == real["top_logprobs"][0].keys()
    assert choice["routed_experts"][:8] == captured["choices"][0]["routed_experts"][:8]
