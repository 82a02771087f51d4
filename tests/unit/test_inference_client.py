"""Parsing generate responses: every malformed or hostile answer is a retry or a poisoned
turn, never a crash, and only validated file names are ever offered for deletion."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from payload_gc import PayloadRootFiles

from orchestrator.core.turns import TurnOutput
from orchestrator.daemon.inference_client import check_turn_files
from orchestrator.payload import RoutingShape, encode_inline, write_payload_file
from orchestrator.wire import InferenceFailure, build_generate_request, parse_generate_response

FIELDS = ("routed_experts", "sampling_mask")
PROMPT_LEN = 10
COMPLETION = [5, 6, 7, 8]


def arrays(routing_pos: int = 0) -> dict[str, tuple[np.ndarray, int]]:
    rows = PROMPT_LEN + len(COMPLETION) - 1 - routing_pos
    routing = np.arange(rows * 2 * 3, dtype=np.uint8).reshape(rows, 2, 3)
    mask = np.full((len(COMPLETION), 4), -1, dtype=np.int32)
    mask[:, 0] = COMPLETION
    return {"routed_experts": (routing, routing_pos), "sampling_mask": (mask, PROMPT_LEN)}


def choice(**extra: Any) -> dict[str, Any]:
    return {
        "index": 0,
        "token_ids": COMPLETION,
        "logprobs": [-0.5] * len(COMPLETION),
        "finish_reason": "stop",
        "routed_experts_prompt_start": 0,
        "prompt_len": PROMPT_LEN,
        **extra,
    }


def by_handle_body(payload_dir: Path, **overrides: Any) -> dict[str, Any]:
    segments = write_payload_file(payload_dir, arrays())
    body = choice(payload=[s.to_json() for s in segments])
    body.update(overrides)
    return {"request_id": "r", "choices": [body]}


def parse(
    doc: object, payload_dir: Path | None, routing_shape: RoutingShape | None = None
) -> TurnOutput:
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return parse_generate_response(
        raw,
        prompt_len=PROMPT_LEN,
        payload_dir=payload_dir,
        fields=FIELDS,
        routing_shape=routing_shape,
    )


def files_problem(turn: TurnOutput, root: Path, version: int = 0) -> str | None:
    with PayloadRootFiles(root) as files:
        return check_turn_files(turn, files=files, version=version).problem


def test_request_carries_payload_dir_only_by_handle(tmp_path: Path) -> None:
    by_handle = build_generate_request(
        request_id="x", token_ids=[1, 2], max_tokens=4, seed=3, payload_dir=tmp_path, fields=FIELDS
    )
    inline = build_generate_request(
        request_id="x", token_ids=[1, 2], max_tokens=4, seed=3, payload_dir=None, fields=FIELDS
    )
    assert by_handle["sampling_params"]["extra_args"] == {"payload_dir": str(tmp_path)}
    assert "extra_args" not in inline["sampling_params"]
    assert inline["return_routed_experts"] and inline["return_sampling_mask"]


def test_a_good_by_handle_turn_is_trusted(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    turn = parse(by_handle_body(payload_dir), payload_dir)
    assert turn.poisoned is None
    assert turn.completion_ids == tuple(COMPLETION)
    assert set(turn.segments) == set(FIELDS)
    (name,) = {s.file for s in turn.segments.values()}
    assert turn.files == frozenset({str(payload_dir / name)})


def inline_fields() -> dict[str, Any]:
    return {field: encode_inline(a, pos) for field, (a, pos) in arrays().items()}


def test_a_good_inline_turn_decodes() -> None:
    turn = parse({"choices": [choice(**inline_fields())]}, None)
    assert turn.poisoned is None
    np.testing.assert_array_equal(turn.inline["routed_experts"][0], arrays()["routed_experts"][0])


@pytest.mark.parametrize(
    "body",
    [
        b'{"choices": [{"token_ids": [1, 2',  # truncated JSON
        b"\xff\xfe not json",
        b"[]",
        b'{"choices": []}',
        b'{"choices": ["x"]}',
        json.dumps({"choices": [choice(token_ids="abc")]}).encode(),
        json.dumps({"choices": [choice(token_ids=[1, True])]}).encode(),
        json.dumps({"choices": [choice(logprobs=[0.1])]}).encode(),  # wrong length
        json.dumps({"choices": [choice(logprobs=["a"] * 4)]}).encode(),
        json.dumps({"choices": [choice(finish_reason=None)]}).encode(),
        json.dumps({"choices": [choice(routed_experts_prompt_start=-1)]}).encode(),
    ],
)
def test_malformed_responses_are_transient_failures(body: bytes, tmp_path: Path) -> None:
    with pytest.raises(InferenceFailure) as info:
        parse(body, tmp_path / "v0")
    assert info.value.kind == "malformed" and info.value.transient
    assert "\n" not in str(info.value)


def bad_segment(payload_dir: Path, **changes: Any) -> dict[str, Any]:
    doc = by_handle_body(payload_dir)
    doc["choices"][0]["payload"][0].update(changes)
    return doc


@pytest.mark.parametrize(
    ("changes", "deletable"),
    [
        ({"file": "../../etc/passwd"}, False),
        ({"file": "/etc/passwd"}, False),
        ({"file": "a/b.bin"}, False),
        ({"file": ""}, False),
        ({"file": ".."}, False),
        ({"dtype": "float64"}, True),
        ({"dtype": "int32"}, True),
        ({"shape": [3, 2]}, True),
        ({"shape": [1, 2, 3, 4]}, True),
        ({"offset": -4}, True),
        ({"digest": "nothex"}, True),
        ({"pos": 5}, True),  # rows no longer end at the last forwarded token
        ({"shape": "13,2,3"}, True),
    ],
)
def test_bad_segments_poison_the_turn(
    changes: dict[str, Any], deletable: bool, tmp_path: Path
) -> None:
    payload_dir = tmp_path / "v0"
    turn = parse(bad_segment(payload_dir, **changes), payload_dir)
    assert turn.poisoned is not None
    # Whatever happens, nothing outside the payload directory is ever offered for deletion.
    assert all(Path(f).parent == payload_dir for f in turn.files)
    if not deletable:
        assert str(payload_dir / changes["file"]) not in turn.files


def test_payload_error_and_missing_payload_poison_the_turn(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    turn = parse(by_handle_body(payload_dir, payload_error="disk full"), payload_dir)
    assert turn.poisoned is not None and "disk full" in turn.poisoned
    turn = parse({"choices": [choice()]}, payload_dir)
    assert turn.poisoned == "no payload segments"


def test_a_segment_from_another_version_dir_never_leaves_it(tmp_path: Path) -> None:
    # The server wrote into v1 but the rollout runs under v0: the name is plain, so it is
    # looked up (and found missing) in v0, and only v0 paths are ever deletable.
    doc = by_handle_body(tmp_path / "v1")
    turn = parse(doc, tmp_path / "v0")
    assert all(Path(f).parent == tmp_path / "v0" for f in turn.files)


def test_file_checks_catch_out_of_range_missing_and_symlinked_files(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    good = parse(by_handle_body(payload_dir), payload_dir)
    assert files_problem(good, tmp_path) is None

    far = parse(bad_segment(payload_dir, offset=10**6), payload_dir)
    assert files_problem(far, tmp_path) is not None

    (name,) = {Path(f).name for f in good.files}
    target = tmp_path / "elsewhere.bin"
    (payload_dir / name).rename(target)
    missing = files_problem(good, tmp_path)
    assert missing is not None and name in missing

    (payload_dir / name).symlink_to(target)
    assert files_problem(good, tmp_path) is not None


def test_file_checks_never_follow_a_linked_version_dir(tmp_path: Path) -> None:
    # The server's files are real, but v0 was swapped for a link to where they are.
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    good = parse(by_handle_body(outside), root / "v0")
    (root / "v0").symlink_to(outside)
    problem = files_problem(good, root)
    assert problem is not None and "symbolic link" in problem
    with PayloadRootFiles(root) as files:
        assert check_turn_files(good, files=files, version=0).sizes == {}


def test_file_checks_report_the_sizes_on_disk(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    good = parse(by_handle_body(payload_dir), payload_dir)
    (name,) = {Path(f).name for f in good.files}
    with PayloadRootFiles(tmp_path) as files:
        found = check_turn_files(good, files=files, version=0)
    assert found.sizes == {name: (payload_dir / name).stat().st_size}


@pytest.mark.parametrize("key", ["fill", "digest_offset", "digest_nbytes"])
def test_stitching_keys_from_a_server_poison_the_turn(tmp_path: Path, key: str) -> None:
    # A fill segment with an empty file once made the daemon unlink its version dir.
    payload_dir = tmp_path / "v0"
    doc = by_handle_body(payload_dir)
    segment = doc["choices"][0]["payload"][0]
    segment[key] = -1 if key == "fill" else 0
    if key == "fill":
        segment.update(file="", offset=0, digest="")
    turn = parse(doc, payload_dir)
    assert turn.poisoned is not None and key in turn.poisoned
    assert all(Path(f).name for f in turn.files)
    assert str(payload_dir) not in {f.rstrip("/") for f in turn.files}


def test_routing_of_another_model_poisons_the_turn(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    doc = by_handle_body(payload_dir)
    assert parse(doc, payload_dir, RoutingShape(2, 3, 128)).poisoned is None
    wrong_k = parse(doc, payload_dir, RoutingShape(2, 4, 128)).poisoned
    assert wrong_k is not None and "[2, 4]" in wrong_k
    wrong_layers = parse(doc, payload_dir, RoutingShape(48, 3)).poisoned
    assert wrong_layers is not None and "layers" in wrong_layers
    too_narrow = parse(doc, payload_dir, RoutingShape(2, 3, 300)).poisoned
    assert too_narrow is not None and "uint8" in too_narrow


def test_inline_routing_of_another_model_poisons_the_turn() -> None:
    doc = {"request_id": "r", "choices": [choice(**inline_fields())]}
    assert parse(doc, None, RoutingShape(2, 3)).poisoned is None
    assert parse(doc, None, RoutingShape(2, 8)).poisoned is not None
    # The ids run up to 77: a model of 50 experts cannot have routed them.
    few_experts = parse(doc, None, RoutingShape(2, 3, 50)).poisoned
    assert few_experts is not None and "experts" in few_experts


def test_a_zero_sized_row_poisons_the_turn(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    doc = by_handle_body(payload_dir)
    segment = doc["choices"][0]["payload"][0]
    segment["shape"] = [segment["shape"][0], 0, 3]
    turn = parse(doc, payload_dir)
    assert turn.poisoned is not None and "zero" in turn.poisoned
