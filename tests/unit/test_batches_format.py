"""The batch.json format: TrainSample values and strict parsing."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest

from orchestrator.handoff import (
    BATCH_FORMAT,
    BatchError,
    TrainSample,
    decode_batch,
    decode_sample,
    encode_batch,
)
from orchestrator.payload import PayloadSegment, encode_inline

SEGMENT = PayloadSegment(
    field="routed_experts",
    file="0123abcd.bin",
    offset=0,
    pos=0,
    shape=(4, 2, 2),
    dtype="uint8",
    digest="0" * 32,
)


def make_sample(**changes: Any) -> TrainSample:
    fields: dict[str, Any] = {
        "group_id": "g1",
        "rollout_id": "r1",
        "start_version": 2,
        "dispatch_version": 3,
        "reward": 1.0,
        "advantage": 0.5,
        "token_ids": (5, 6, 7, 8),
        "loss_mask": (0, 0, 1, 1),
        "logprobs": (0.0, 0.0, -0.25, -1.5),
    }
    fields.update(changes)
    return TrainSample(**fields)


def by_handle_sample() -> TrainSample:
    return make_sample(payload_dir="/shared/run/payloads/v3", payload={"routed_experts": [SEGMENT]})


def test_sample_json_round_trip_in_all_three_payload_forms() -> None:
    import numpy as np

    inline = {"sampling_mask": encode_inline(np.full((4, 3), -1, dtype=np.int32), 0)}
    for sample in (make_sample(), by_handle_sample(), make_sample(inline=inline)):
        obj = json.loads(json.dumps(sample.to_json()))
        assert decode_sample(obj) == sample


def test_to_json_names_exactly_the_documented_keys() -> None:
    base = {
        "group_id",
        "rollout_id",
        "start_version",
        "dispatch_version",
        "reward",
        "advantage",
        "token_ids",
        "loss_mask",
        "logprobs",
    }
    assert set(make_sample().to_json()) == base
    obj = by_handle_sample().to_json()
    assert set(obj) == base | {"payload_dir", "payload"}
    assert obj["payload"] == {"routed_experts": [SEGMENT.to_json()]}
    assert by_handle_sample().payload_fields == {"routed_experts"}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"token_ids": ()}, "token_ids is empty"),
        ({"loss_mask": (0, 1, 1)}, "differ in length"),
        ({"logprobs": (0.0,)}, "differ in length"),
        ({"loss_mask": (0, 2, 1, 1)}, "other than 0 and 1"),
        ({"start_version": -1}, "start_version <= dispatch_version"),
        ({"start_version": 4}, "start_version <= dispatch_version"),
        ({"payload_dir": "/x/v3"}, "come together"),
        ({"payload": {"routed_experts": [SEGMENT]}}, "come together"),
        ({"payload_dir": "rel/v3", "payload": {"routed_experts": [SEGMENT]}}, "absolute"),
        ({"payload_dir": "/x/v3", "payload": {"routed_experts": []}}, "no segments"),
        ({"payload_dir": "/x/v3", "payload": {"sampling_mask": [SEGMENT]}}, "another field"),
        ({"payload_dir": "/x/v3", "payload": {"logits": [SEGMENT]}}, "unknown payload field"),
        ({"inline": {"logits": {}}}, "unknown inline field"),
        (
            {"payload_dir": "/x/v3", "payload": {"routed_experts": [SEGMENT]}, "inline": {}},
            "not both",
        ),
    ],
)
def test_inconsistent_samples_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_sample(**changes)


def test_batch_document_round_trip() -> None:
    samples = [make_sample(), by_handle_sample()]
    data = encode_batch(7, samples, created_at=1234.5)
    document = decode_batch(data, source="b.json")
    assert document.step == 7
    assert document.created_at == 1234.5
    assert document.samples == tuple(samples)
    assert json.loads(data)["format"] == BATCH_FORMAT


def test_encode_refuses_step_zero_and_non_finite_numbers() -> None:
    with pytest.raises(ValueError, match="count from 1"):
        encode_batch(0, [], created_at=0.0)
    with pytest.raises(ValueError, match="not JSON compliant"):
        encode_batch(1, [make_sample(reward=float("nan"))], created_at=0.0)


def _document(**changes: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "format": BATCH_FORMAT,
        "step": 7,
        "created_at": 1.0,
        "samples": [by_handle_sample().to_json()],
    }
    document.update(changes)
    return document


def _with_sample(**changes: Any) -> bytes:
    sample = by_handle_sample().to_json()
    for key, value in changes.items():
        if value is _DELETE:
            del sample[key]
        else:
            sample[key] = value
    return json.dumps(_document(samples=[sample])).encode()


_DELETE = object()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "invalid JSON at line 1 column 1"),
        (json.dumps(_document())[:-20].encode(), "invalid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[1, 2]", "expected a JSON object, got a list"),
        (json.dumps(_document(format="rollout-orchestrator.batch/2")).encode(), "unknown format"),
        (json.dumps({"format": BATCH_FORMAT}).encode(), "missing key(s) created_at, samples"),
        (json.dumps(_document(extra=1)).encode(), "unknown key(s) extra"),
        (json.dumps(_document(step="7")).encode(), "step: expected an integer, got a string"),
        (json.dumps(_document(step=7.0)).encode(), "step: expected an integer, got a number"),
        (json.dumps(_document(step=True)).encode(), "step: expected an integer, got a boolean"),
        (json.dumps(_document(step=0)).encode(), "step: batches count from 1"),
        (json.dumps(_document(created_at=None)).encode(), "created_at: expected a number"),
        (json.dumps(_document(samples={})).encode(), "samples: expected a list"),
        (json.dumps(_document(samples=[3])).encode(), "samples[0]: expected a JSON object"),
        (_with_sample(group_id=1), "samples[0]: group_id: expected a string"),
        (_with_sample(start_version=False), "start_version: expected an integer, got a boolean"),
        (_with_sample(reward="1"), "reward: expected a number, got a string"),
        (
            b'{"format": "rollout-orchestrator.batch/1", "step": 7, "created_at": NaN, '
            b'"samples": []}',
            "created_at: expected a finite number",
        ),
        (_with_sample(token_ids=[1, 2, "3", 4]), "samples[0]: token_ids[2]: expected an integer"),
        (_with_sample(token_ids=[1, 2, 3.0, 4]), "token_ids[2]: expected an integer"),
        (_with_sample(loss_mask=[0, 0, 1, True]), "loss_mask[3]: expected an integer"),
        (_with_sample(loss_mask=[0, 0, 1, 3]), "other than 0 and 1"),
        (_with_sample(logprobs=[0.0, None, 0.0, 0.0]), "logprobs[1]: expected a number, got null"),
        (_with_sample(logprobs=[0, 0, 0]), "samples[0]: token_ids, loss_mask and logprobs differ"),
        (_with_sample(token_ids=_DELETE), "samples[0]: missing key(s) token_ids"),
        (_with_sample(weight=1), "samples[0]: unknown key(s) weight"),
        (_with_sample(payload_dir=7), "payload_dir: expected a string, got a number"),
        (_with_sample(payload_dir=_DELETE), "payload_dir and payload come together"),
        (_with_sample(payload=[]), "payload: expected an object, got a list"),
        (_with_sample(payload={"logits": []}), "payload: unknown field 'logits'"),
        (_with_sample(payload={"routed_experts": {}}), "payload.routed_experts: expected a list"),
        (
            _with_sample(payload={"routed_experts": [{"field": "routed_experts"}]}),
            "payload.routed_experts[0]: bad payload segment",
        ),
        (_with_sample(inline=[]), "inline: expected an object, got a list"),
        (_with_sample(inline={"sampling_mask": 1}), "inline.sampling_mask: expected an object"),
    ],
)
def test_malformed_batches_raise_one_line_naming_the_file(data: bytes, message: str) -> None:
    with pytest.raises(BatchError) as caught:
        decode_batch(data, source="/runs/a/batches/step_000007/batch.json")
    text = str(caught.value)
    assert text.startswith("/runs/a/batches/step_000007/batch.json: ")
    assert message in text
    assert "\n" not in text


def test_sample_from_json_names_its_source() -> None:
    with pytest.raises(BatchError, match=r"^b\.json: samples\[2\]: reward: expected a number"):
        decode_sample({**make_sample().to_json(), "reward": "x"}, source="b.json: samples[2]")


def test_train_sample_is_frozen() -> None:
    sample = make_sample()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        sample.reward = 2.0  # type: ignore[misc]
    assert attrs.evolve(sample, reward=2.0).reward == 2.0


def test_numpy_values_are_normalised_so_the_batch_serialises() -> None:
    import numpy as np

    sample = make_sample(
        token_ids=np.arange(5, 9),
        loss_mask=np.array([False, False, True, True]),
        logprobs=np.array([0.0, 0.0, -0.25, -1.5], dtype=np.float32),
    )
    assert sample == make_sample()
    assert all(type(x) is int for x in sample.token_ids + sample.loss_mask)
    assert all(type(x) is float for x in sample.logprobs)
    data = encode_batch(1, [sample], created_at=0.0)
    assert decode_batch(data, source="b.json").samples == (make_sample(),)
    with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
        make_sample(token_ids=(5.0, 6, 7, 8))


def test_the_server_key_is_optional_a_string_and_round_trips() -> None:
    server = "http://10.0.0.7:8000"
    samples = [make_sample(server=server), attrs.evolve(by_handle_sample(), server=server)]
    for sample in samples:
        obj = sample.to_json()
        assert obj["server"] == server
        assert decode_sample(json.loads(json.dumps(obj))) == sample
    document = decode_batch(encode_batch(3, samples, created_at=1.0), source="b.json")
    assert [sample.server for sample in document.samples] == [server, server]
    # Absent when unknown, and a batch without it still reads (server None).
    assert "server" not in make_sample().to_json()
    assert decode_sample(make_sample().to_json()).server is None
    for bad, kind in ((None, "null"), (7, "a number"), (["x"], "a list")):
        with pytest.raises(
            BatchError, match=rf"^b\.json: samples\[0\]: server: expected a string, got {kind}$"
        ):
            decode_batch(_with_sample(server=bad), source="b.json")
