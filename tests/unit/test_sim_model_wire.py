"""The simulated server's pure parts: request parsing and fault draws."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orchestrator.sim import Fault, FaultRates, SimModel
from orchestrator.sim._faults import draw_fault
from orchestrator.sim._wire import BadRequest, parse_generate_request, parse_weight_update

MODEL = SimModel()


def _body(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "request_id": "r1",
        "token_ids": [1, 2, 3],
        "sampling_params": {
            "max_tokens": 16,
            "temperature": 1.0,
            "top_p": 0.95,
            "top_k": 50,
            "seed": 7,
            "extra_args": {"payload_dir": "/shared/payloads/v3"},
        },
        "return_routed_experts": True,
        "return_sampling_mask": True,
    }
    body.update(changes)
    return body


def _parse(body: object) -> Any:
    return parse_generate_request(json.dumps(body).encode(), MODEL, max_model_len=1000)


def test_parses_the_design_example() -> None:
    request = _parse(_body())
    assert request.request_id == "r1"
    assert request.token_ids == (1, 2, 3)
    assert request.sampling.max_tokens == 16
    assert request.sampling.top_k == 50
    assert request.n == 1
    assert request.payload_dir == Path("/shared/payloads/v3")
    assert request.return_routed_experts
    assert request.return_sampling_mask


def test_defaults_and_unknown_keys() -> None:
    request = _parse(
        {
            "request_id": "x",
            "token_ids": [5],
            "sampling_params": {"max_tokens": 1, "repetition_penalty": 1.1},
            "stream": False,
        }
    )
    assert request.payload_dir is None
    assert request.sampling.temperature == 1.0
    assert request.sampling.seed == 0
    assert not request.return_routed_experts


def _params(**changes: Any) -> dict[str, Any]:
    return {**_body()["sampling_params"], **changes}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1, 2], "JSON object"),
        (_body(request_id=""), "request_id"),
        (_body(token_ids=[]), "token_ids"),
        (_body(token_ids=[1, "2"]), "non-integer"),
        (_body(token_ids=[1, True]), "non-integer"),
        (_body(token_ids=[32000]), "outside the vocabulary"),
        (_body(sampling_params=None), "sampling_params must be an object"),
        (_body(sampling_params=_params(max_tokens=None)), "max_tokens is missing"),
        (_body(sampling_params=_params(max_tokens=0)), "max_tokens must be at least 1"),
        (_body(sampling_params=_params(max_tokens=2.5)), "max_tokens is not an integer"),
        (_body(sampling_params=_params(temperature=-1)), "temperature"),
        (_body(sampling_params=_params(top_p=0)), "top_p"),
        (_body(sampling_params=_params(seed=-3)), "seed"),
        (_body(sampling_params=_params(n=0)), "n must be in"),
        (_body(sampling_params=_params(extra_args=[])), "extra_args must be an object"),
        (_body(sampling_params=_params(extra_args={"payload_dir": "rel/v3"})), "absolute"),
        (_body(sampling_params=_params(max_tokens=999)), "max_model_len"),
        (_body(return_routed_experts="yes"), "return_routed_experts"),
    ],
)
def test_rejects_bad_bodies_with_one_line(body: object, message: str) -> None:
    with pytest.raises(BadRequest, match=message) as caught:
        _parse(body)
    assert "\n" not in str(caught.value)


def test_rejects_non_json() -> None:
    with pytest.raises(BadRequest, match="not JSON"):
        parse_generate_request(b"{", MODEL, max_model_len=100)
    with pytest.raises(BadRequest, match="not JSON"):
        parse_generate_request(b"\xff", MODEL, max_model_len=100)


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
