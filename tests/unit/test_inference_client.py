"""The generate API of real servers (orchestrator/wire/generate.py): the request the
daemon sends (vLLM's `GenerateRequest`), and every reply form parsed into a `TurnOutput`
with the right values, or refused: a reply that cannot be read is a `malformed` failure
(not retried), a payload that cannot be trusted poisons the turn, and only validated file
names are ever offered for deletion. Also the on-disk check of a turn's files
(`check_turn_files`).

Replies are built here from the peers' schemas with numpy and base64 alone, not with the
daemon's encoders, so a decoder and an encoder cannot agree on a mistake.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from payload_gc import PayloadRootFiles

from orchestrator.core.turns import TurnOutput
from orchestrator.daemon.inference.client import check_turn_files, encode_generate_request
from orchestrator.payload import PayloadSegment, RoutingShape, write_payload_file
from orchestrator.wire import (
    REQUEST_KEYS,
    SAMPLING_KEYS,
    InferenceFailure,
    build_generate_request,
    encoded_token_ids,
    parse_choice,
    parse_generate_response,
    reply_choices,
)

FIELDS = ("routed_experts", "sampling_mask")
PROMPT_LEN = 10
COMPLETION = [5, 6, 7, 8]
#: Routing rows end at the last token run forward: every token but the last sampled one.
ROUTING_END = PROMPT_LEN + len(COMPLETION) - 1
LOGPROBS = [-0.5, -0.25, -1.125, -3.0]  # exact in float32
LAYERS, TOP_K = 2, 3
#: Kept sets per completion token: {5, 11}, {6}, {} and {8, 9, 10}.
MASK_LISTS = [[5, 11], [6], [], [8, 9, 10]]
MASK = np.array([[5, 11, -1], [6, -1, -1], [-1, -1, -1], [8, 9, 10]], dtype=np.int32)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def le(array: np.ndarray) -> bytes:
    """The array's bytes, C order, little-endian."""
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def packed(array: np.ndarray, **extra: Any) -> dict[str, Any]:
    return {"data": b64(le(array)), "shape": list(array.shape), **extra, "dtype": array.dtype.name}


def npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return b64(buffer.getvalue())


def ids(rows: int, dtype: str = "uint8", seed: int = 0, high: int = 128) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, high, size=(rows, LAYERS, TOP_K)).astype(dtype)


def csr(lists: Sequence[Sequence[int]], *, bare: bool = False) -> dict[str, Any]:
    flat = np.array([t for row in lists for t in row], dtype=np.int32)
    counts = np.array([len(row) for row in lists], dtype=np.int32)
    if bare:
        return {"ids": b64(le(flat)), "counts": b64(le(counts))}
    return {"ids": packed(flat), "counts": packed(counts)}


def primerl_choice(start: int = 0, **extra: Any) -> dict[str, Any]:
    """prime-rl's packed inline choice (logprobs null, its own fields instead)."""
    return {
        "index": 0,
        "token_ids": COMPLETION,
        "finish_reason": "length",
        "logprobs": None,
        "completion_logprobs": packed(np.array(LOGPROBS, dtype=np.float32)),
        "routed_experts": packed(ids(ROUTING_END - start), start=start),
        "sampling_mask": csr(MASK_LISTS),
        "payload": None,
        **extra,
    }


def content(values: Sequence[object], *, form: str = "chat") -> dict[str, Any]:
    """Upstream vLLM's logprobs: ChatCompletionLogProbs entries, or the newer
    GenerateLogProbs entries of the tokens-out endpoint."""
    if form == "chat":
        entries = [
            {"token": f"token_id:{t}", "logprob": v, "bytes": None, "top_logprobs": []}
            for t, v in zip(COMPLETION, values, strict=True)
        ]
    else:
        entries = [
            {
                "token_id": t,
                "logprob": v,
                "rank": 1,
                "top_logprobs": [{"token_id": t, "logprob": v}],
            }
            for t, v in zip(COMPLETION, values, strict=True)
        ]
    return {"content": entries}


def upstream_choice(rows: int = ROUTING_END, form: str = "chat", **extra: Any) -> dict[str, Any]:
    """Upstream vLLM's choice: logprobs.content, routing as a base64 .npy over the rows
    that end at the last token run forward."""
    return {
        "index": 0,
        "logprobs": content(LOGPROBS, form=form),
        "finish_reason": "length",
        "token_ids": COMPLETION,
        "routed_experts": npy(ids(rows)),
        **extra,
    }


def reply(*choices: dict[str, Any]) -> dict[str, Any]:
    return {
        "request_id": "r",
        "choices": list(choices),
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def parse(
    doc: object,
    payload_dir: Path | None = None,
    *,
    routing_start: int = 0,
    fields: Sequence[str] = FIELDS,
    routing_shape: RoutingShape | None = None,
) -> TurnOutput:
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return parse_generate_response(
        raw,
        prompt_len=PROMPT_LEN,
        routing_start=routing_start,
        payload_dir=payload_dir,
        fields=fields,
        routing_shape=routing_shape,
    )


def trusted(turn: TurnOutput) -> TurnOutput:
    assert turn.poisoned is None, turn.poisoned
    return turn


def poisoned(turn: TurnOutput, *words: str) -> str:
    assert turn.poisoned is not None
    assert "\n" not in turn.poisoned
    for word in words:
        assert word in turn.poisoned, turn.poisoned
    # A poisoned turn keeps its tokens: the episode goes on, the rollout is not trained on.
    assert turn.completion_ids.tolist() == list(COMPLETION)
    return turn.poisoned


def routing_of(turn: TurnOutput) -> tuple[np.ndarray, int]:
    return turn.inline["routed_experts"]


# --- the request ----------------------------------------------------------------------

#: The fields of vLLM's `GenerateRequest` (vllm/entrypoints/serve/disagg/protocol.py).
VLLM_GENERATE_REQUEST = {
    "request_id",
    "token_ids",
    "features",
    "sampling_params",
    "model",
    "stream",
    "stream_options",
    "cache_salt",
    "priority",
    "kv_transfer_params",
}
#: The `SamplingParams` fields this client may use (`routed_experts_prompt_start` on
#: routing-capable builds).
VLLM_SAMPLING_PARAMS = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "n",
    "logprobs",
    "stop_token_ids",
    "extra_args",
    "routed_experts_prompt_start",
}


def request(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "request_id": "g1-r0-t0",
        "token_ids": (1, 2, 3),
        "max_tokens": 6,
        "seed": 11,
        "payload_dir": None,
        "routing_start": None,
        **overrides,
    }
    return build_generate_request(**kwargs)


def all_keys(obj: object) -> set[str]:
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in all_keys(v)}
    if isinstance(obj, list):
        return {k for v in obj for k in all_keys(v)}
    return set()


def test_the_key_sets_are_vllms() -> None:
    assert REQUEST_KEYS <= VLLM_GENERATE_REQUEST
    assert {"request_id", "token_ids", "sampling_params"} <= REQUEST_KEYS
    assert SAMPLING_KEYS <= VLLM_SAMPLING_PARAMS


@pytest.mark.parametrize("payload_dir", [None, Path("/shared/run/payloads/v3")])
@pytest.mark.parametrize("routing_start", [None, 0, 17])
@pytest.mark.parametrize("model", ["", "Qwen/Qwen3-30B-A3B"])
def test_requests_hold_only_vllm_keys(
    payload_dir: Path | None, routing_start: int | None, model: str
) -> None:
    body = request(payload_dir=payload_dir, routing_start=routing_start, model=model)
    assert set(body) <= REQUEST_KEYS
    assert set(body["sampling_params"]) <= SAMPLING_KEYS
    assert not {"return_routed_experts", "return_sampling_mask"} & all_keys(body)
    assert json.loads(json.dumps(body)) == body
    assert body["request_id"] == "g1-r0-t0"
    assert body["token_ids"] == [1, 2, 3]
    sampling = body["sampling_params"]
    assert sampling["max_tokens"] == 6 and sampling["seed"] == 11
    # The sampled token's logprob is asked for: without it vLLM sends no logprobs.
    assert sampling["logprobs"] == 1


def test_ids_encoded_once_give_the_same_request_bytes() -> None:
    # A group's members share their first prompt's JSON (`encoded_token_ids`): the bytes
    # sent must be those of the ids given as they are, whatever form they came in.
    ids = np.array([0, 7, 151_643, 2**31 - 1], dtype=np.int32)
    plain = encode_generate_request(request(token_ids=ids))
    assert encode_generate_request(request(token_ids=encoded_token_ids(ids))) == plain
    assert encode_generate_request(request(token_ids=ids.tolist())) == plain
    assert json.loads(plain)["token_ids"] == ids.tolist()


def test_routing_start_is_sent_only_when_routing_is_wanted() -> None:
    assert "routed_experts_prompt_start" not in request()["sampling_params"]
    assert request(routing_start=0)["sampling_params"]["routed_experts_prompt_start"] == 0
    assert request(routing_start=17)["sampling_params"]["routed_experts_prompt_start"] == 17


def test_the_payload_dir_is_sent_only_by_handle() -> None:
    by_handle = request(payload_dir=Path("/shared/run/payloads/v3"))
    assert by_handle["sampling_params"]["extra_args"] == {"payload_dir": "/shared/run/payloads/v3"}
    assert "extra_args" not in request()["sampling_params"]


def test_n_is_sent_only_for_a_groups_choices() -> None:
    assert "n" not in request()["sampling_params"]
    assert "n" not in request(choices=1)["sampling_params"]
    assert request(choices=8)["sampling_params"]["n"] == 8


def test_the_choices_of_one_reply_are_parsed_apart() -> None:
    # A group's first turn: choice i is member i's; one bad choice fails only itself.
    bad = upstream_choice(token_ids=[1, "two"])
    raw = json.dumps(reply(upstream_choice(), bad, upstream_choice(rows=3))).encode()
    parts = reply_choices(raw, 3)
    assert len(parts) == 3
    kwargs: dict[str, Any] = {
        "prompt_len": PROMPT_LEN,
        "routing_start": 0,
        "payload_dir": None,
        "fields": FIELDS,
    }
    assert trusted(parse_choice(parts[0], 0, **kwargs)).completion_ids.tolist() == COMPLETION
    with pytest.raises(InferenceFailure, match=r"^malformed: choices\[1\]") as info:
        parse_choice(parts[1], 1, **kwargs)
    assert not info.value.transient
    poisoned(parse_choice(parts[2], 2, **kwargs), "routed_experts", "span")
    # Fewer choices than asked for fail the whole reply.
    with pytest.raises(InferenceFailure, match="2 choices for n = 3"):
        reply_choices(json.dumps(reply(upstream_choice(), bad)).encode(), 3)


def test_the_model_is_sent_only_when_named() -> None:
    assert "model" not in request()
    assert request(model="")["token_ids"] == [1, 2, 3]
    assert "model" not in request(model="")
    assert request(model="Qwen/Qwen3-30B-A3B")["model"] == "Qwen/Qwen3-30B-A3B"


# --- prime-rl's inline replies --------------------------------------------------------


def test_a_primerl_packed_reply_decodes_to_its_values() -> None:
    turn = trusted(parse(reply(primerl_choice())))
    assert turn.completion_ids.tolist() == list(COMPLETION)
    assert turn.logprobs.tolist() == np.float32(LOGPROBS).tolist()
    assert turn.finish_reason == "length"
    routing, pos = routing_of(turn)
    assert pos == 0 and routing.dtype == np.uint8
    np.testing.assert_array_equal(routing, ids(ROUTING_END))
    mask, mask_pos = turn.inline["sampling_mask"]
    assert mask_pos == PROMPT_LEN and mask.dtype == np.int32
    np.testing.assert_array_equal(mask, MASK)
    assert turn.segments == {} and turn.files == frozenset()


def test_a_primerl_mask_with_bare_base64_parts_decodes() -> None:
    turn = trusted(parse(reply(primerl_choice(sampling_mask=csr(MASK_LISTS, bare=True)))))
    np.testing.assert_array_equal(turn.inline["sampling_mask"][0], MASK)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int16", "int32"])
def test_primerl_routing_of_every_dtype_decodes(dtype: str) -> None:
    array = ids(ROUTING_END, dtype, high=300 if dtype != "uint8" else 256)
    turn = trusted(parse(reply(primerl_choice(routed_experts=packed(array, start=0)))))
    routing, _ = routing_of(turn)
    assert routing.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(routing, array)


def test_primerl_routing_starts_where_its_start_says() -> None:
    # Turn 2 asked for rows from 7; the server's prefix cache started them at 4 (at most
    # the requested start is fine: the stitcher takes each row from the first turn).
    for start in (7, 4, 0):
        turn = trusted(parse(reply(primerl_choice(start=start)), routing_start=7))
        routing, pos = routing_of(turn)
        assert pos == start and len(routing) == ROUTING_END - start
        np.testing.assert_array_equal(routing, ids(ROUTING_END - start))


def test_a_missing_logprob_is_accepted_in_both_forms() -> None:
    values = [-0.5, -9999.0, -1.125, -9999.0]
    packed_lp = packed(np.array(values, dtype=np.float32))
    turn = trusted(parse(reply(primerl_choice(completion_logprobs=packed_lp))))
    assert turn.logprobs.tolist() == np.float32(values).tolist()
    for form in ("chat", "generate"):
        turn = trusted(parse(reply(upstream_choice(form=form, logprobs=content(values)))))
        assert turn.logprobs.tolist() == np.float32(values).tolist()


def test_completion_logprobs_win_over_a_null_logprobs() -> None:
    # prime-rl sends logprobs null beside completion_logprobs: the packed ones are read.
    choice = primerl_choice(logprobs=content([-7.0] * 4))
    assert trusted(parse(reply(choice))).logprobs.tolist() == np.float32(LOGPROBS).tolist()


# --- upstream vLLM's replies ----------------------------------------------------------


@pytest.mark.parametrize("form", ["chat", "generate"])
def test_an_upstream_reply_decodes_to_its_values(form: str) -> None:
    turn = trusted(parse(reply(upstream_choice(form=form)), fields=("routed_experts",)))
    assert turn.completion_ids.tolist() == list(COMPLETION)
    assert turn.logprobs.tolist() == np.float32(LOGPROBS).tolist()
    routing, pos = routing_of(turn)
    assert pos == 0
    np.testing.assert_array_equal(routing, ids(ROUTING_END))
    assert "sampling_mask" not in turn.inline


def test_upstream_logprobs_keep_their_double_precision() -> None:
    values = [-0.8429284691810608, -1e-9, -0.1, -2.5]
    turn = trusted(parse(reply(upstream_choice(logprobs=content(values)))))
    assert turn.logprobs.tolist() == np.float32(values).tolist()


def test_upstream_routing_rows_end_at_the_last_token_run_forward() -> None:
    # Upstream vLLM has no start: a reply of fewer rows (a prefix-cache hit) begins at
    # prompt_len + len(completion) - 1 - rows.
    for rows, routing_start in ((ROUTING_END, 0), (6, 7), (6, 12), (0, ROUTING_END)):
        turn = trusted(parse(reply(upstream_choice(rows)), routing_start=routing_start))
        routing, pos = routing_of(turn)
        assert pos == ROUTING_END - rows == PROMPT_LEN + len(COMPLETION) - 1 - rows
        np.testing.assert_array_equal(routing, ids(rows))


def test_an_upstream_list_mask_decodes() -> None:
    turn = trusted(parse(reply(upstream_choice(sampling_mask=MASK_LISTS))))
    mask, pos = turn.inline["sampling_mask"]
    assert pos == PROMPT_LEN
    np.testing.assert_array_equal(mask, MASK)


@pytest.mark.parametrize(
    "mask",
    [
        None,
        [[], [], [], []],
        {"ids": b64(b""), "counts": b64(bytes(16))},
    ],
)
def test_a_mask_with_no_kept_set_gives_no_mask_array(mask: object) -> None:
    turn = trusted(parse(reply(upstream_choice(sampling_mask=mask))))
    assert set(turn.inline) == {"routed_experts"}
    turn = trusted(parse(reply(upstream_choice())))  # no key at all
    assert set(turn.inline) == {"routed_experts"}


def test_only_the_fields_the_run_trains_with_are_kept() -> None:
    turn = trusted(parse(reply(primerl_choice()), fields=("sampling_mask",)))
    assert set(turn.inline) == {"sampling_mask"}
    turn = trusted(parse(reply(primerl_choice()), fields=("routed_experts",)))
    assert set(turn.inline) == {"routed_experts"}
    # No field: the payload is not even looked at.
    garbage = primerl_choice(routed_experts="junk", sampling_mask=7, payload="x")
    turn = trusted(parse(reply(garbage), fields=()))
    assert turn.inline == {} and turn.logprobs.tolist() == np.float32(LOGPROBS).tolist()


# --- routing spans --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "rows", "routing_start"),
    [
        (8, ROUTING_END - 8, 7),  # begins after the requested start: a gap
        (0, ROUTING_END - 1, 0),  # ends one row short
        (0, ROUTING_END + 1, 0),  # one row past the last token run forward
        (2, ROUTING_END, 2),  # right length, wrong place
        (0, 0, 0),
    ],
)
def test_primerl_routing_that_does_not_span_the_turn_poisons_it(
    start: int, rows: int, routing_start: int
) -> None:
    choice = primerl_choice(routed_experts=packed(ids(rows), start=start))
    poisoned(parse(reply(choice), routing_start=routing_start), "routed_experts rows")


def test_upstream_routing_that_starts_after_the_requested_start_poisons_the_turn() -> None:
    # 5 rows end at 13: they begin at 8, but rows from 7 on were asked for.
    poisoned(parse(reply(upstream_choice(5)), routing_start=7), "do not span")


def test_upstream_routing_with_more_rows_than_positions_poisons_the_turn() -> None:
    # 15 rows cannot end at 13 from a position >= 0.
    turn = parse(reply(upstream_choice(ROUTING_END + 2)))
    poisoned(turn, "routed_experts rows")


def test_routing_is_not_wanted_then_not_checked() -> None:
    choice = primerl_choice(routed_experts=packed(ids(3), start=9))
    assert trusted(parse(reply(choice), fields=("sampling_mask",))).inline.keys() == {
        "sampling_mask"
    }


# --- missing or misplaced payloads ----------------------------------------------------


@pytest.mark.parametrize("choice", [primerl_choice(routed_experts=None), upstream_choice()])
def test_missing_routing_names_the_server_setting(choice: dict[str, Any]) -> None:
    choice = {k: v for k, v in choice.items() if k != "routed_experts" or v is None}
    reason = poisoned(parse(reply(choice)), "enable_return_routed_experts")
    assert turn_is_bare(parse(reply(choice)))
    assert "routed_experts" in reason


def turn_is_bare(turn: TurnOutput) -> bool:
    return turn.inline == {} and turn.segments == {} and turn.files == frozenset()


def test_missing_routing_by_handle_names_the_server_setting(tmp_path: Path) -> None:
    choice = upstream_choice()
    del choice["routed_experts"]
    poisoned(parse(reply(choice), tmp_path / "v0"), "enable_return_routed_experts")
    choice["payload"] = []
    poisoned(parse(reply(choice), tmp_path / "v0"), "enable_return_routed_experts")


@pytest.mark.parametrize("choice", [upstream_choice(), primerl_choice()])
def test_a_by_handle_request_answered_inline_poisons_the_turn(
    tmp_path: Path, choice: dict[str, Any]
) -> None:
    # Upstream vLLM ignores extra_args.payload_dir and answers inline.
    turn = parse(reply(choice), tmp_path / "v0")
    poisoned(turn, "inline", "extra_args.payload_dir")
    assert turn_is_bare(turn)


def test_a_mask_only_by_handle_request_answered_inline_poisons_the_turn(
    tmp_path: Path,
) -> None:
    choice = upstream_choice(sampling_mask=MASK_LISTS)
    del choice["routed_experts"]
    turn = parse(reply(choice), tmp_path / "v0", fields=("sampling_mask",))
    poisoned(turn, "inline")


def test_an_inline_request_answered_by_handle_poisons_the_turn(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    choice = by_handle_choice(payload_dir)
    poisoned(parse(reply(choice)), "by handle", "inline")
    # Also when the run trains with masks only: files nobody asked for are not trusted.
    poisoned(parse(reply(choice), fields=("sampling_mask",)), "by handle", "inline")


# --- by-handle replies ----------------------------------------------------------------


def payload_arrays(routing_pos: int = 0) -> dict[str, tuple[np.ndarray, int]]:
    return {
        "routed_experts": (ids(ROUTING_END - routing_pos), routing_pos),
        "sampling_mask": (MASK, PROMPT_LEN),
    }


def wire(segment: PayloadSegment, payload_dir: Path, *, digest: bool = True) -> dict[str, Any]:
    """prime-rl's wire form of a segment (plus our digest), built by hand."""
    obj: dict[str, Any] = {
        "field": segment.field,
        "file": f"{payload_dir}/{segment.file}",
        "offset": segment.offset,
        "pos": segment.pos,
        "rows": segment.shape[0],
        "dtype": segment.dtype,
        "shape": list(segment.shape[1:]),
    }
    if digest:
        obj["digest"] = segment.digest
    return obj


def by_handle_choice(
    payload_dir: Path, *, routing_pos: int = 0, digest: bool = True, **extra: Any
) -> dict[str, Any]:
    """A prime-rl by-handle choice whose file was really written into `payload_dir`."""
    segments = write_payload_file(payload_dir, payload_arrays(routing_pos))
    return {
        "index": 0,
        "token_ids": COMPLETION,
        "finish_reason": "length",
        "logprobs": None,
        "completion_logprobs": packed(np.array(LOGPROBS, dtype=np.float32)),
        "routed_experts": None,
        "sampling_mask": None,
        "payload": [wire(s, payload_dir, digest=digest) for s in segments],
        **extra,
    }


def only_file(payload_dir: Path) -> str:
    (path,) = payload_dir.iterdir()
    return path.name


@pytest.mark.parametrize("digest", [True, False])
def test_a_good_by_handle_turn_is_trusted(tmp_path: Path, digest: bool) -> None:
    payload_dir = tmp_path / "v0"
    turn = trusted(parse(reply(by_handle_choice(payload_dir, digest=digest)), payload_dir))
    assert (
        turn.completion_ids.tolist() == list(COMPLETION)
        and turn.logprobs.tolist() == np.float32(LOGPROBS).tolist()
    )
    name = only_file(payload_dir)
    routing_nbytes = ROUTING_END * LAYERS * TOP_K
    assert turn.segments["routed_experts"] == PayloadSegment(
        "routed_experts",
        name,
        0,
        0,
        (ROUTING_END, LAYERS, TOP_K),
        "uint8",
        turn.segments["routed_experts"].digest,
    )
    assert turn.segments["sampling_mask"] == PayloadSegment(
        "sampling_mask",
        name,
        routing_nbytes,
        PROMPT_LEN,
        (len(COMPLETION), 3),
        "int32",
        turn.segments["sampling_mask"].digest,
    )
    assert (turn.segments["routed_experts"].digest is not None) is digest
    assert turn.files == frozenset({f"{payload_dir}/{name}"})
    assert turn.inline == {}


def test_by_handle_routing_may_start_before_the_requested_start(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    doc = reply(by_handle_choice(payload_dir, routing_pos=4))
    assert trusted(parse(doc, payload_dir, routing_start=7)).segments["routed_experts"].pos == 4
    poisoned(parse(doc, payload_dir, routing_start=3), "do not span")


def test_by_handle_keeps_only_the_fields_the_run_trains_with(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    doc = reply(by_handle_choice(payload_dir))
    turn = trusted(parse(doc, payload_dir, fields=("sampling_mask",)))
    assert set(turn.segments) == {"sampling_mask"}
    # The routing file is the same file: it is still the turn's to delete.
    assert turn.files == frozenset({f"{payload_dir}/{only_file(payload_dir)}"})


def test_a_by_handle_turn_without_a_mask_segment_has_no_kept_set(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    choice = by_handle_choice(payload_dir)
    choice["payload"] = choice["payload"][:1]
    assert set(trusted(parse(reply(choice), payload_dir)).segments) == {"routed_experts"}


def test_payload_error_poisons_the_turn(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    choice = by_handle_choice(payload_dir, payload_error="disk full")
    turn = parse(reply(choice), payload_dir)
    poisoned(turn, "payload_error", "disk full")
    # What the server did write is still the turn's to delete.
    assert turn.files == frozenset({f"{payload_dir}/{only_file(payload_dir)}"})
    del choice["payload"]
    turn = parse(reply(choice), payload_dir)
    poisoned(turn, "payload_error: disk full")
    assert turn.files == frozenset()
    long = parse(reply({**choice, "payload_error": "x" * 10_000}), payload_dir)
    assert long.poisoned is not None and len(long.poisoned) < 300


def bad_segment(payload_dir: Path, index: int = 0, **changes: Any) -> dict[str, Any]:
    choice = by_handle_choice(payload_dir)
    choice["payload"][index].update(changes)
    return reply(choice)


@pytest.mark.parametrize(
    ("changes", "valid"),
    [
        ({"file": "{dir}/../{name}"}, False),  # traversal, even back into the directory
        ({"file": "{dir}/../v1/{name}"}, False),
        ({"file": "{root}/v1/{name}"}, False),  # a file in another directory
        ({"file": "{name}"}, False),  # relative
        ({"file": "v0/{name}"}, False),
        ({"file": "{dir}/.."}, False),
        ({"file": ".."}, False),
        ({"file": ""}, False),
        ({"file": "/etc/passwd"}, False),
        ({"extra": 1}, False),  # an unknown key
        ({"fill": -1}, False),  # stitching keys never come from a server
        ({"digest_offset": 0}, False),
        ({"offset": True}, False),  # a bool is not an integer
        ({"rows": True}, False),
        ({"offset": -4}, False),
        ({"rows": -1}, False),
        ({"shape": [LAYERS, 0]}, False),  # a zero row dimension
        ({"shape": "2,3"}, False),
        ({"shape": [LAYERS, TOP_K, 1]}, False),
        ({"dtype": "float64"}, False),
        ({"dtype": "int64"}, False),
        ({"digest": "nothex"}, False),
        ({"digest": "A" * 32}, False),
        ({"pos": 5}, True),  # valid, but rows no longer end at the last forwarded token
        ({"rows": ROUTING_END - 1}, True),
    ],
)
def test_bad_routing_segments_poison_the_turn(
    changes: dict[str, Any], valid: bool, tmp_path: Path
) -> None:
    payload_dir = tmp_path / "v0"
    doc = bad_segment(payload_dir)
    name = only_file(payload_dir)
    segment = doc["choices"][0]["payload"][0]
    for key, value in changes.items():
        if isinstance(value, str):
            value = value.format(dir=payload_dir, root=tmp_path, name=name)
        segment[key] = value
    turn = parse(doc, payload_dir)
    poisoned(turn)
    # The mask segment names the same file: it is deletable whatever the routing's fate,
    # and nothing else ever is.
    assert turn.files == frozenset({f"{payload_dir}/{name}"})
    # A segment that failed its checks is dropped; one that passed is kept, poisoned.
    assert ("routed_experts" in turn.segments) is valid


@pytest.mark.parametrize(
    "changes",
    [
        {"dtype": "uint8"},  # masks are int32 token ids
        {"pos": PROMPT_LEN - 1},  # a mask row per completion token, from prompt_len
        {"rows": len(COMPLETION) - 1},
        {"shape": [0]},
        {"field": "logits"},
    ],
)
def test_bad_mask_segments_poison_the_turn(changes: dict[str, Any], tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    poisoned(parse(bad_segment(payload_dir, 1, **changes), payload_dir))


def test_only_validated_names_are_ever_files(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    choice = by_handle_choice(payload_dir)
    good = only_file(payload_dir)
    outside = str(tmp_path / "v1" / good)
    choice["payload"][0]["file"] = outside
    choice["payload"][1]["file"] = f"{payload_dir}/../v0/{good}"
    turn = parse(reply(choice), payload_dir)
    poisoned(turn, "traversal")
    assert turn.files == frozenset()
    assert turn.segments == {}


def test_two_segments_for_one_field_poison_the_turn(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    choice = by_handle_choice(payload_dir)
    choice["payload"].append(dict(choice["payload"][0]))
    poisoned(parse(reply(choice), payload_dir), "two segments for routed_experts")


@pytest.mark.parametrize("payload", ["x", {"field": "routed_experts"}, 7])
def test_a_payload_that_is_not_a_list_poisons_the_turn(tmp_path: Path, payload: object) -> None:
    choice = by_handle_choice(tmp_path / "v0", payload=payload)
    poisoned(parse(reply(choice), tmp_path / "v0"), "payload must be a list")
    # Also when the run trains with masks only (a missing mask would be no mask at all).
    turn = parse(reply(choice), tmp_path / "v0", fields=("sampling_mask",))
    poisoned(turn, "payload must be a list")


def test_a_segment_that_is_not_an_object_poisons_the_turn(tmp_path: Path) -> None:
    choice = by_handle_choice(tmp_path / "v0")
    choice["payload"].append("segment")
    turn = parse(reply(choice), tmp_path / "v0")
    poisoned(turn, "malformed")
    assert len(turn.files) == 1


# --- malformed replies ----------------------------------------------------------------


def body(choice: dict[str, Any]) -> bytes:
    return json.dumps(reply(choice)).encode()


def without(choice: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in choice.items() if k != key}


NAN_PACKED = packed(np.array([-0.5, np.nan, -1.0, -2.0], dtype=np.float32))
INF_PACKED = packed(np.array([-0.5, -np.inf, -1.0, -2.0], dtype=np.float32))


@pytest.mark.parametrize(
    "raw",
    [
        b'{"choices": [{"token_ids": [1, 2',  # truncated JSON
        b"\xff\xfe not json",
        b"",
        b"[]",
        b"null",
        b"{}",
        b'{"choices": []}',
        b'{"choices": {}}',
        b'{"choices": ["x"]}',
        b"[" * 100_000,  # deeper than the parser goes
        body(without(primerl_choice(), "token_ids")),
        body(primerl_choice(token_ids="abc")),
        body(primerl_choice(token_ids=None)),
        body(primerl_choice(token_ids=[1, True, 2, 3])),
        body(primerl_choice(token_ids=[1, -2, 2, 3])),
        body(primerl_choice(token_ids=[1, 2**31, 2, 3])),  # past int32
        body(primerl_choice(token_ids=[1, 2**70, 2, 3])),  # past int64 too
        body(primerl_choice(token_ids=[1, 2.0, 2, 3])),
        body(without(primerl_choice(), "finish_reason")),
        body(primerl_choice(finish_reason=None)),
        # logprobs
        body(without(primerl_choice(), "completion_logprobs")),  # and logprobs null
        body(primerl_choice(completion_logprobs=packed(np.zeros(3, np.float32)))),
        body(primerl_choice(completion_logprobs=packed(np.zeros(5, np.float32)))),
        body(primerl_choice(completion_logprobs=packed(np.zeros(4, np.float64)))),
        body(primerl_choice(completion_logprobs=packed(np.zeros((4, 1), np.float32)))),
        body(primerl_choice(completion_logprobs={"data": "x", "shape": [4], "dtype": "float32"})),
        body(primerl_choice(completion_logprobs=NAN_PACKED)),
        body(primerl_choice(completion_logprobs=INF_PACKED)),
        body(upstream_choice(logprobs=None)),
        body(upstream_choice(logprobs={"content": None})),
        body(upstream_choice(logprobs=[-0.5] * 4)),  # the old dialect's bare list
        body(upstream_choice(logprobs={"content": content(LOGPROBS)["content"][:3]})),
        body(upstream_choice(logprobs=content(["-0.5", -1.0, -1.0, -1.0]))),
        body(upstream_choice(logprobs=content([None, -1.0, -1.0, -1.0]))),
        body(upstream_choice(logprobs=content([True, -1.0, -1.0, -1.0]))),
        body(upstream_choice(logprobs={"content": [-0.5, -1.0, -1.0, -1.0]})),
        body(upstream_choice(logprobs=content([-0.5, -1.0, -1.0, -1.0]))).replace(b"-0.5", b"NaN"),
        body(upstream_choice(logprobs=content([-0.5, -1.0, -1.0, -1.0]))).replace(
            b"-0.5", b"-Infinity"
        ),
        body(upstream_choice(logprobs=content([-0.5, -1.0, -1.0, -1.0]))).replace(
            b"-0.5", b"Infinity"
        ),
        body(upstream_choice(logprobs=content([-0.5, -1.0, -1.0, -1.0]))).replace(
            b"-0.5", b"-1e999"
        ),
    ],
)
def test_malformed_replies_are_failures_not_retried(raw: bytes, tmp_path: Path) -> None:
    for payload_dir in (None, tmp_path / "v0"):
        with pytest.raises(InferenceFailure) as info:
            parse(raw, payload_dir)
        assert info.value.kind == "malformed"
        assert not info.value.transient
        assert str(info.value).startswith("malformed: ")
        assert "\n" not in str(info.value)


def test_malformed_replies_are_refused_whatever_the_fields() -> None:
    with pytest.raises(InferenceFailure):
        parse(body(primerl_choice(completion_logprobs=NAN_PACKED)), fields=())


@pytest.mark.parametrize(
    ("kind", "transient"),
    [
        ("connect", True),
        ("transport", True),
        ("timeout", True),
        ("http_5xx", True),
        ("http_4xx", False),
        ("malformed", False),
        ("oversized", False),
    ],
)
def test_which_failures_are_transient(kind: str, transient: bool) -> None:
    failure = InferenceFailure(kind, "http://10.0.0.1:8000: detail")
    assert failure.transient is transient
    assert failure.kind == kind and failure.detail == "http://10.0.0.1:8000: detail"
    assert str(failure) == f"{kind}: http://10.0.0.1:8000: detail"


# --- inline payloads that cannot be trusted -------------------------------------------


@pytest.mark.parametrize(
    "routing",
    [
        packed(ids(ROUTING_END).astype(np.float32), start=0),
        packed(ids(ROUTING_END).astype(np.uint32), start=0),
        packed(ids(ROUTING_END).reshape(ROUTING_END, -1), start=0),  # 2 dimensions
        packed(ids(ROUTING_END), start=-1),
        packed(ids(ROUTING_END), start=True),
        packed(ids(ROUTING_END), start="0"),
        packed(ids(ROUTING_END)),  # no start
        {**packed(ids(ROUTING_END), start=0), "data": "!!"},
        {**packed(ids(ROUTING_END), start=0), "shape": [ROUTING_END, LAYERS, TOP_K + 1]},
        npy(ids(ROUTING_END).astype(np.int64)),
        npy(ids(ROUTING_END).reshape(ROUTING_END, -1)),
        "not base64 at all!",
        [[[1, 2, 3]]],
        7,
    ],
)
def test_unreadable_inline_routing_poisons_the_turn(routing: object) -> None:
    poisoned(parse(reply(primerl_choice(routed_experts=routing))), "inline", "routed_experts")


@pytest.mark.parametrize(
    "mask",
    [
        csr([[5], [6], [7]]),  # three counts for four tokens
        {
            "ids": b64(le(np.array([5, 6], np.int32))),
            "counts": b64(le(np.array([1] * 4, np.int32))),
        },
        [[5], [6], [7]],
        [[5], [6], [True], []],
        [[5], [-6], [], []],
        "mask",
    ],
)
def test_unreadable_inline_masks_poison_the_turn(mask: object) -> None:
    poisoned(parse(reply(primerl_choice(sampling_mask=mask))), "inline", "sampling_mask")


# --- the model's routing shape --------------------------------------------------------


def test_inline_routing_of_another_model_poisons_the_turn() -> None:
    doc = reply(primerl_choice())  # ids below 128, 2 layers x top-3, uint8
    trusted(parse(doc, routing_shape=RoutingShape(LAYERS, TOP_K)))
    trusted(parse(doc, routing_shape=RoutingShape(LAYERS, TOP_K, 128)))
    poisoned(parse(doc, routing_shape=RoutingShape(LAYERS, TOP_K + 1)), "[2, 3]", "[2, 4]")
    poisoned(parse(doc, routing_shape=RoutingShape(48, TOP_K)), "layers")
    # The ids run up to 127: a model of 100 experts cannot have routed them.
    highest = int(ids(ROUTING_END).max())
    poisoned(parse(doc, routing_shape=RoutingShape(LAYERS, TOP_K, 100)), f"id {highest}", "100")
    poisoned(parse(doc, routing_shape=RoutingShape(LAYERS, TOP_K, highest)), f"id {highest}")
    trusted(parse(doc, routing_shape=RoutingShape(LAYERS, TOP_K, highest + 1)))


@pytest.mark.parametrize("dtype", ["int16", "int32"])
def test_a_negative_inline_expert_id_poisons_the_turn(dtype: str) -> None:
    array = ids(ROUTING_END, dtype)
    array[3, 1, 2] = -1
    doc = reply(primerl_choice(routed_experts=packed(array, start=0)))
    poisoned(parse(doc), "negative routed expert id -1")
    doc = reply(upstream_choice(routed_experts=npy(array)))
    poisoned(parse(doc), "negative")


def test_by_handle_routing_of_another_model_poisons_the_turn(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    doc = reply(by_handle_choice(payload_dir))
    trusted(parse(doc, payload_dir, routing_shape=RoutingShape(LAYERS, TOP_K, 128)))
    poisoned(parse(doc, payload_dir, routing_shape=RoutingShape(LAYERS, 4, 128)), "[2, 4]")
    poisoned(parse(doc, payload_dir, routing_shape=RoutingShape(48, TOP_K)), "layers")
    # A server narrows each reply to uint8 while its ids fit, whatever the expert count:
    # the dtype alone proves nothing (the trainer's reader sees the ids).
    trusted(parse(doc, payload_dir, routing_shape=RoutingShape(LAYERS, TOP_K, 300)))


def test_a_narrowed_inline_reply_of_a_big_model_is_trusted() -> None:
    array = ids(ROUTING_END, "uint8", high=256)
    doc = reply(primerl_choice(routed_experts=packed(array, start=0)))
    trusted(parse(doc, routing_shape=RoutingShape(LAYERS, TOP_K, 384)))


def test_wide_inline_routing_of_a_big_model_is_trusted() -> None:
    array = ids(ROUTING_END, "uint16", high=384)
    assert int(array.max()) > 255
    doc = reply(primerl_choice(routed_experts=packed(array, start=0)))
    turn = trusted(parse(doc, routing_shape=RoutingShape(LAYERS, TOP_K, 384)))
    np.testing.assert_array_equal(routing_of(turn)[0], array)


# --- a turn's files on disk (check_turn_files) ----------------------------------------


def good_turn(payload_dir: Path, **extra: Any) -> TurnOutput:
    return trusted(parse(reply(by_handle_choice(payload_dir, **extra)), payload_dir))


def files_problem(turn: TurnOutput, root: Path, version: int = 0) -> str | None:
    with PayloadRootFiles(root) as files:
        return check_turn_files(turn, files=files, version=version).problem


def test_file_checks_pass_a_good_turn_and_report_sizes(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    turn = good_turn(payload_dir)
    name = only_file(payload_dir)
    with PayloadRootFiles(tmp_path) as files:
        found = check_turn_files(turn, files=files, version=0)
    assert found.problem is None
    assert found.sizes == {name: (payload_dir / name).stat().st_size}
    assert found.sizes[name] == ROUTING_END * LAYERS * TOP_K + MASK.nbytes


def test_file_checks_catch_bytes_past_the_end(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    far = trusted(parse(bad_segment(payload_dir, 1, offset=10**6), payload_dir))
    problem = files_problem(far, tmp_path)
    assert problem is not None and "past the file" in problem


def test_file_checks_catch_a_truncated_file(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    turn = good_turn(payload_dir)
    name = only_file(payload_dir)
    os_size = (payload_dir / name).stat().st_size
    with open(payload_dir / name, "r+b") as handle:
        handle.truncate(os_size - 1)
    problem = files_problem(turn, tmp_path)
    assert problem is not None and name in problem


def test_file_checks_catch_missing_and_symlinked_files(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    turn = good_turn(payload_dir)
    name = only_file(payload_dir)
    target = tmp_path / "elsewhere.bin"
    (payload_dir / name).rename(target)
    missing = files_problem(turn, tmp_path)
    assert missing is not None and name in missing

    (payload_dir / name).symlink_to(target)
    linked = files_problem(turn, tmp_path)
    assert linked is not None and name in linked
    with PayloadRootFiles(tmp_path) as files:
        assert check_turn_files(turn, files=files, version=0).sizes == {}


def test_file_checks_never_follow_a_linked_version_dir(tmp_path: Path) -> None:
    # The server's files are real, but v0 was swapped for a link to where they are.
    root, outside = tmp_path / "root", tmp_path / "outside" / "v0"
    root.mkdir()
    choice = by_handle_choice(outside)
    for segment in choice["payload"]:
        segment["file"] = segment["file"].replace(str(outside), str(root / "v0"))
    turn = trusted(parse(reply(choice), root / "v0"))
    (root / "v0").symlink_to(outside)
    problem = files_problem(turn, root)
    assert problem is not None and "symbolic link" in problem
    with PayloadRootFiles(root) as files:
        assert check_turn_files(turn, files=files, version=0).sizes == {}


def test_file_checks_look_in_the_turns_own_version(tmp_path: Path) -> None:
    turn = good_turn(tmp_path / "v0")
    problem = files_problem(turn, tmp_path, version=1)
    assert problem is not None


def test_a_poisoned_turns_files_are_sized_not_judged(tmp_path: Path) -> None:
    payload_dir = tmp_path / "v0"
    turn = parse(reply(by_handle_choice(payload_dir, payload_error="disk full")), payload_dir)
    name = only_file(payload_dir)
    with PayloadRootFiles(tmp_path) as files:
        found = check_turn_files(turn, files=files, version=0)
    assert found.problem is None  # poisoned already: nothing more to say
    assert found.sizes == {name: (payload_dir / name).stat().st_size}


def test_an_inline_turn_has_no_files_to_check(tmp_path: Path) -> None:
    (tmp_path / "v0").mkdir()
    turn = trusted(parse(reply(primerl_choice())))
    with PayloadRootFiles(tmp_path) as files:
        found = check_turn_files(turn, files=files, version=0)
    assert found.problem is None and found.sizes == {}
