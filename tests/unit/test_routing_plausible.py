"""Routing that no router can have chosen is refused: a row (one token, one layer) that
names an expert twice. Upstream vLLM's CPU build, compiled rather than eager, answered
routing of the right shape in which every id was 0, and the daemon accepted it."""

from __future__ import annotations

import base64
import io
import json

import numpy as np

from orchestrator.payload import CHECKED_ROUTING_ROWS, repeated_ids_problem
from orchestrator.wire import parse_generate_response


def distinct_rows(positions: int, layers: int = 2, top_k: int = 2, experts: int = 8) -> np.ndarray:
    scores = np.random.default_rng(positions).random((positions, layers, experts))
    return np.argsort(scores, axis=-1)[..., :top_k].astype(np.uint8)


def test_distinct_rows_pass_and_a_repeat_is_named_with_its_position() -> None:
    # A turn of at most CHECKED_ROUTING_ROWS positions has every row checked.
    ids = distinct_rows(CHECKED_ROUTING_ROWS)
    assert repeated_ids_problem(ids, 16) is None
    ids[7, 1] = [5, 5]
    problem = repeated_ids_problem(ids, 16)
    assert problem is not None
    assert "position 23, layer 1: [5, 5]" in problem
    assert f"1 of {CHECKED_ROUTING_ROWS * 2} rows checked" in problem
    assert problem.startswith("routing no router chose: a broken capture")


def test_all_zero_rows_name_the_compiled_cpu_server() -> None:
    problem = repeated_ids_problem(np.zeros((12, 2, 2), np.uint8), 0)
    assert problem is not None
    assert problem.startswith("all-zero routing: a vLLM CPU server compiled")
    assert "--enforce-eager" in problem[:100]


def test_long_turns_are_checked_on_spread_rows_only() -> None:
    ids = distinct_rows(5000)
    # The first and the last position are always among the rows checked.
    ids[-1, 0] = [3, 3]
    problem = repeated_ids_problem(ids, 0)
    assert problem is not None and f"of {CHECKED_ROUTING_ROWS * 2} rows checked" in problem
    # One top-1 model, or no rows: nothing to compare.
    assert repeated_ids_problem(np.zeros((4, 2, 1), np.uint8), 0) is None
    assert repeated_ids_problem(np.zeros((0, 2, 2), np.uint8), 0) is None


def npy(array: np.ndarray) -> str:
    out = io.BytesIO()
    np.save(out, array)
    return base64.b64encode(out.getvalue()).decode()


def test_an_upstream_reply_with_all_zero_routing_is_poisoned_with_the_reason() -> None:
    # vLLM 0.30.0 compiled: routing over prompt + completion - 1 positions, all zeros.
    prompt, completion = list(range(100, 108)), [5, 6, 7]
    choice = {
        "index": 0,
        "token_ids": completion,
        "finish_reason": "length",
        "logprobs": {
            "content": [
                {"token": f"token_id:{t}", "logprob": -1.0, "bytes": None, "top_logprobs": []}
                for t in completion
            ]
        },
        "routed_experts": npy(np.zeros((10, 2, 2), np.uint8)),
    }
    body = json.dumps({"request_id": "generate-tokens-r", "choices": [choice]}).encode()
    turn = parse_generate_response(
        body, prompt_len=len(prompt), routing_start=0, payload_dir=None, fields=("routed_experts",)
    )
    assert turn.poisoned is not None and "--enforce-eager" in turn.poisoned
