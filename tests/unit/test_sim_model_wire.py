"""The simulated server's pure parts: request parsing, reply bodies and fault draws."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orchestrator.reply_form_names import REPLY_FORM_NAMES
from orchestrator.sim import (
    REPLY_FORMS,
    Fault,
    FaultRates,
    SamplingParams,
    SimModel,
    sample_completion,
)
from orchestrator.sim._faults import draw_fault
from orchestrator.sim._response import TRAVERSAL_FILE_NAME, corrupt_segment, render_response
from orchestrator.sim._wire import (
    GENERATE_REQUEST_KEYS,
    BadRequest,
    ModelNotFound,
    parse_generate_request,
    parse_weight_update,
)
from orchestrator.sim.reply_forms.primerl import PRIME_RL, PrimeRLByHandle, narrow_routing
from orchestrator.sim.reply_forms.upstream import UPSTREAM
from orchestrator.wire import REQUEST_KEYS, SAMPLING_KEYS, error_body, parse_generate_response

MODEL = SimModel()


def _body(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "request_id": "r1",
        "model": "sim-moe",
        "token_ids": [1, 2, 3],
        "sampling_params": {
            "max_tokens": 16,
            "temperature": 1.0,
            "top_p": 0.95,
            "top_k": 50,
            "seed": 7,
            "logprobs": 1,
            "stop_token_ids": [2],
            "routed_experts_prompt_start": 1,
            "extra_args": {"payload_dir": "/shared/payloads/v3"},
        },
    }
    body.update(changes)
    return body


def _parse(body: object, max_model_len: int = 1000) -> Any:
    return parse_generate_request(
        json.dumps(body).encode(), MODEL, max_model_len=max_model_len, served_model_name="sim-moe"
    )


def test_parses_a_prime_rl_request() -> None:
    request = _parse(_body())
    assert request.request_id == "r1"
    assert request.model == "sim-moe"
    assert request.token_ids == (1, 2, 3)
    assert request.sampling == SamplingParams(
        max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=7, stop_token_ids=(2,)
    )
    assert request.n == 1
    assert request.logprobs
    assert request.routing_start == 1
    assert request.payload_dir == Path("/shared/payloads/v3")


def test_the_daemon_sends_only_keys_this_server_knows() -> None:
    assert REQUEST_KEYS <= GENERATE_REQUEST_KEYS
    request = _parse(_body(sampling_params=dict.fromkeys(SAMPLING_KEYS)))
    assert request.routing_start == 0


def test_vllm_defaults_and_ignored_keys() -> None:
    request = _parse(
        {
            "token_ids": [5, 6],
            "sampling_params": {"repetition_penalty": 1.1, "min_tokens": 3, "seed": None},
            "stream": False,
            "priority": 0,
            "cache_salt": "x",
        },
        max_model_len=100,
    )
    # vLLM's defaults: a random request id, max_tokens filling the context.
    assert len(request.request_id) == 32
    assert request.sampling.max_tokens == 98
    assert request.payload_dir is None
    assert request.model is None
    assert not request.logprobs
    assert request.routing_start == 0
    assert request.sampling.temperature == 1.0
    assert request.sampling.seed == 0
    assert request.sampling.stop_token_ids == ()
    other = _parse({"token_ids": [5], "sampling_params": {"max_tokens": 1}}, max_model_len=100)
    assert other.request_id != request.request_id


def test_logprobs_zero_still_asks_for_the_sampled_tokens() -> None:
    assert _parse(_body(sampling_params=_params(logprobs=0))).logprobs


def _params(**changes: Any) -> dict[str, Any]:
    params: dict[str, Any] = {**_body()["sampling_params"], **changes}
    return params


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1, 2], "JSON object"),
        (_body(return_routed_experts=True), "unknown key 'return_routed_experts'"),
        (_body(return_sampling_mask=True, zzz=1), "unknown key 'return_sampling_mask'"),
        (_body(stream=True), "streaming is not simulated"),
        (_body(stream="no"), "stream must be"),
        (_body(request_id=3), "request_id must be a string"),
        (_body(model=3), "model must be a string"),
        (_body(token_ids=[]), "token_ids"),
        (_body(token_ids=[1, "2"]), "non-integer"),
        (_body(token_ids=[1, True]), "non-integer"),
        (_body(token_ids=[32000]), "outside the vocabulary"),
        (_body(sampling_params=None), "sampling_params must be an object"),
        (_body(sampling_params=_params(max_tokens=0)), "max_tokens must be at least 1"),
        (_body(sampling_params=_params(max_tokens=2.5)), "max_tokens is not an integer"),
        (_body(sampling_params=_params(temperature=-1)), "temperature"),
        (_body(sampling_params=_params(top_p=0)), "top_p"),
        (_body(sampling_params=_params(seed=-3)), "seed"),
        (_body(sampling_params=_params(n=0)), "n must be in"),
        (_body(sampling_params=_params(logprobs=-2)), "logprobs"),
        (_body(sampling_params=_params(logprobs=True)), "logprobs"),
        (_body(sampling_params=_params(stop_token_ids=2)), "stop_token_ids"),
        (_body(sampling_params=_params(stop_token_ids=[2.0])), "stop_token_ids"),
        (_body(sampling_params=_params(routed_experts_prompt_start=3)), "in \\[0, 3\\)"),
        (_body(sampling_params=_params(routed_experts_prompt_start=-1)), "prompt_start"),
        (_body(sampling_params=_params(routed_experts_prompt_start="0")), "prompt_start"),
        (_body(sampling_params=_params(extra_args=[])), "extra_args must be an object"),
        (_body(sampling_params=_params(extra_args={"payload_dir": "rel/v3"})), "absolute"),
        (_body(sampling_params=_params(max_tokens=998)), "max_model_len"),
        (_body(token_ids=[1] * 1000, sampling_params={}), "no room"),
    ],
)
def test_rejects_bad_bodies_with_one_line(body: object, message: str) -> None:
    with pytest.raises(BadRequest, match=message) as caught:
        _parse(body)
    assert "\n" not in str(caught.value)
    assert caught.value.status == 400


def test_another_model_is_not_found() -> None:
    with pytest.raises(ModelNotFound, match="`Qwen/Qwen3-30B-A3B` does not exist") as caught:
        _parse(_body(model="Qwen/Qwen3-30B-A3B"))
    assert (caught.value.status, caught.value.kind) == (404, "NotFoundError")


def test_rejects_non_json() -> None:
    for body in (b"{", b"\xff", b"[" * 100_000):
        with pytest.raises(BadRequest, match="not JSON"):
            parse_generate_request(body, MODEL, max_model_len=100, served_model_name="m")


def test_error_body_is_vllms_error_response() -> None:
    assert error_body(404, "The model `x`\n does not exist.") == {
        "error": {
            "message": "The model `x` does not exist.",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
    }
    assert error_body(400, "x")["error"]["type"] == "BadRequestError"
    assert error_body(413, "x")["error"]["type"] == "BadRequestError"
    assert error_body(500, "x")["error"]["type"] == "InternalServerError"


# --- reply bodies, read back by the daemon's own parser -----------------------------

PROMPT_LEN = 30
FIELDS = ("routed_experts", "sampling_mask")


GOLDEN_VLLM = (
    Path(__file__).resolve().parents[1] / "conformance" / "golden" / "vllm_0_30_0_generate.json"
)


def _completion() -> Any:
    return sample_completion(MODEL, 42, SamplingParams(max_tokens=12, top_k=8, seed=1), 0)


def _ids(rows: int, high: int = 128) -> np.ndarray:
    """Random routing: 8 distinct experts of `high` per position and layer, as a router
    chooses them."""
    scores = np.random.default_rng(rows).random((rows, 48, high))
    ids: np.ndarray = np.argsort(scores, axis=-1)[..., :8]
    return ids.astype(np.uint16)


def _parsed(choice: dict[str, Any], start: int) -> Any:
    body = json.dumps(render_response("r", [choice], PROMPT_LEN)).encode()
    return parse_generate_response(
        body, prompt_len=PROMPT_LEN, routing_start=start, payload_dir=None, fields=FIELDS
    )


@pytest.mark.parametrize("start", [0, 20])
def test_prime_rl_and_upstream_choices_parse_to_the_same_turn(start: int) -> None:
    completion = _completion()
    rows = PROMPT_LEN + len(completion.token_ids) - 1 - start
    ids = _ids(rows)
    narrowed = narrow_routing(ids)
    assert narrowed.dtype == np.uint8
    mask = completion.sampling_mask
    primerl = PRIME_RL.inline_choice(
        0, completion, logprobs=True, routing=ids, routing_start=start, mask=mask
    )
    upstream = UPSTREAM.inline_choice(
        0, completion, logprobs=True, routing=ids, routing_start=start, mask=mask
    )
    assert list(primerl) == [
        "index",
        "token_ids",
        "finish_reason",
        "logprobs",
        "completion_logprobs",
        "routed_experts",
        "sampling_mask",
        "payload",
    ]
    assert primerl["logprobs"] is None
    assert primerl["routed_experts"]["start"] == start
    token, logprob = f"token_id:{completion.token_ids[0]}", float(completion.logprobs[0])
    # As vLLM 0.30.0 answers logprobs = 1: the sampled token again as the top-1 entry.
    assert upstream["logprobs"]["content"][0] == {
        "token": token,
        "logprob": logprob,
        "bytes": None,
        "top_logprobs": [{"token": token, "logprob": logprob, "bytes": None}],
    }
    turns = [_parsed(primerl, start), _parsed(upstream, start)]
    for turn in turns:
        assert turn.poisoned is None
        assert turn.completion_ids.tolist() == completion.token_ids.tolist()
        assert turn.logprobs.tolist() == completion.logprobs.tolist()
        assert turn.finish_reason == completion.finish_reason
        routed, pos = turn.inline["routed_experts"]
        assert pos == start
        np.testing.assert_array_equal(routed, ids)
        mask_rows, mask_pos = turn.inline["sampling_mask"]
        assert mask_pos == PROMPT_LEN
        np.testing.assert_array_equal(mask_rows, mask)
    # Upstream keeps the model's dtype; prime-rl narrows per reply.
    assert turns[0].inline["routed_experts"][0].dtype == np.uint8
    assert turns[1].inline["routed_experts"][0].dtype == np.uint16


def test_routing_narrows_only_when_every_id_fits() -> None:
    assert narrow_routing(_ids(3, high=256)).dtype == np.uint8
    wide = _ids(3, high=300)
    wide[0, 0, 0] = 256
    assert narrow_routing(wide).dtype == np.uint16


def test_nothing_captured_or_asked_is_null() -> None:
    completion = _completion()
    primerl = PRIME_RL.inline_choice(
        1, completion, logprobs=False, routing=None, routing_start=0, mask=None
    )
    assert primerl["index"] == 1
    for key in ("logprobs", "completion_logprobs", "routed_experts", "sampling_mask", "payload"):
        assert primerl[key] is None, key
    assert "payload_error" not in primerl
    upstream = UPSTREAM.inline_choice(
        1, completion, logprobs=False, routing=None, routing_start=0, mask=None
    )
    for key in ("logprobs", "routed_experts", "sampling_mask"):
        assert upstream[key] is None, key
    assert "payload" not in upstream


def test_the_registry_holds_one_form_for_each_name() -> None:
    # The config checks `[sim] reply_form` against the names; the server looks them up.
    assert tuple(REPLY_FORMS) == REPLY_FORM_NAMES
    assert [form.name for form in REPLY_FORMS.values()] == list(REPLY_FORM_NAMES)
    assert REPLY_FORMS["prime-rl"].by_handle is not None
    assert REPLY_FORMS["upstream"].by_handle is None  # upstream ignores payload_dir


def test_payload_error_choice() -> None:
    choice = PrimeRLByHandle().choice(
        0, _completion(), logprobs=True, payload=None, payload_error="disk full"
    )
    assert choice["payload"] is None
    assert choice["payload_error"] == "disk full"


def test_response_has_vllms_keys_and_usage() -> None:
    completion = _completion()
    choices = [
        PRIME_RL.inline_choice(
            i, completion, logprobs=True, routing=None, routing_start=0, mask=None
        )
        for i in range(2)
    ]
    response = render_response("req", choices, 30, model="m")
    # Key for key (and in order) what a real vLLM 0.30.0 answered.
    captured = json.loads((GOLDEN_VLLM).read_text())["reply"]
    assert list(response) == list(captured)
    assert list(response["usage"]) == list(captured["usage"])
    assert response["request_id"] == "generate-tokens-req"
    assert response["model"] == "m"
    tokens = len(completion.token_ids)
    usage = response["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (30, 2 * tokens)
    assert usage["total_tokens"] == 30 + 2 * tokens


def test_corrupt_segment_leaves_the_directory_or_the_file() -> None:
    segment = {"field": "routed_experts", "file": "/p/v3/a.bin", "offset": 0, "rows": 2}
    escaped = corrupt_segment(segment, Path("/p/v3"), 100, 0.2)
    assert escaped["file"] == f"/p/v3/{TRAVERSAL_FILE_NAME}"
    assert escaped["offset"] == 0
    past = corrupt_segment(segment, Path("/p/v3"), 100, 0.7)
    assert past["file"] == "/p/v3/a.bin"
    assert past["offset"] > 100
    assert segment["offset"] == 0, "the original is not changed"


# --- weight updates and faults ------------------------------------------------------


@pytest.mark.parametrize(
    ("weight_dir", "version"),
    [
        ("/run/weights/step_000007", 7),
        ("/run/weights/step_12/", 12),
        ("/run/weights/latest", None),
        ("/run/step_3/weights", None),
    ],
)
def test_weight_update_version_comes_from_a_trailing_step_dir(
    weight_dir: str, version: int | None
) -> None:
    update = parse_weight_update(json.dumps({"weight_dir": weight_dir}).encode())
    assert update.weight_dir == weight_dir
    assert update.version == version


@pytest.mark.parametrize("body", [b"{}", b'{"weight_dir": 3}', b"[]", b"nope"])
def test_weight_update_rejects_bad_bodies(body: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_weight_update(body)


@pytest.mark.parametrize("fault", list(Fault))
def test_rate_one_always_draws_its_fault(fault: Fault) -> None:
    rates = FaultRates(**{fault.value: 1.0})
    rng = np.random.default_rng(0)
    draws = {draw_fault(rng, rates, by_handle=True).fault for _ in range(20)}
    assert draws == {fault}


@pytest.mark.parametrize("fault", [Fault.BAD_SEGMENT, Fault.PAYLOAD_ERROR])
def test_payload_faults_need_a_payload_dir(fault: Fault) -> None:
    rates = FaultRates(**{fault.value: 1.0})
    assert draw_fault(np.random.default_rng(0), rates, by_handle=False).fault is None


def test_fault_draws_reproduce_and_follow_the_rate() -> None:
    rates = FaultRates(http_500=0.3, hang=0.1)
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    first = [draw_fault(rng_a, rates, by_handle=True).fault for _ in range(2000)]
    second = [draw_fault(rng_b, rates, by_handle=True).fault for _ in range(2000)]
    assert first == second
    share = first.count(Fault.HTTP_500) / len(first)
    assert 0.25 < share < 0.35
    assert first.count(None) > 0


def test_rates_outside_zero_one_are_rejected() -> None:
    with pytest.raises(ValueError, match="hang"):
        FaultRates(hang=1.5)
