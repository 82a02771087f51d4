"""From a rollout's turns to a sample (orchestrator/core/samples.py): delta replay covers
the sample's positions turn after turn, and a run whose servers kept no mask for any
token gets samples without a mask, by handle as inline, never a crash."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sample_kit import train_sample

from orchestrator.core.rollouts import TrainSample
from orchestrator.core.samples import build_sample
from orchestrator.core.turns import TurnOutput
from orchestrator.payload import PayloadSegment

FIELDS = ("routed_experts", "sampling_mask")
PAYLOAD_DIR = Path("/root/payloads/v3")


def routing_segment(pos: int, rows: int, name: str) -> PayloadSegment:
    return PayloadSegment("routed_experts", name, 0, pos, (rows, 2, 2), "uint8")


def two_turns(*, masks: bool) -> list[tuple[int, TurnOutput]]:
    """A 6-token prompt, 3 completion tokens, a 2-token env reply, 3 more completion
    tokens: turn 1 asked for rows 0.., turn 2 for rows 8.. (delta replay)."""
    turns = []
    for prompt_len, pos, name in ((6, 0, "a.bin"), (11, 8, "b.bin")):
        segments = {"routed_experts": routing_segment(pos, prompt_len + 3 - 1 - pos, name)}
        if masks:
            segments["sampling_mask"] = PayloadSegment(
                "sampling_mask", name, 64, prompt_len, (3, 4), "int32"
            )
        turn = TurnOutput(
            np.arange(3), np.full(3, -0.5), "length", segments=segments, files=frozenset()
        )
        turns.append((prompt_len, turn))
    return turns


def sample_of(turns: list[tuple[int, TurnOutput]], payload_dir: Path | None) -> TrainSample:
    sample, dropped = build_sample(
        "r0",
        np.arange(14),
        turns,
        payload_dir=payload_dir,
        fields=FIELDS,
        final_token_route="repeat",
    )
    assert not dropped and sample.untrainable is None, sample.untrainable
    return train_sample(
        version=3,
        rollout_id=sample.rollout_id,
        token_ids=sample.token_ids,
        loss_mask=sample.loss_mask,
        logprobs=sample.logprobs,
        payload=sample.payload,
        payload_dir=sample.payload_dir if sample.payload else None,
        inline=sample.inline,
    )


def test_delta_replay_turns_cover_the_sample_once() -> None:
    sample = sample_of(two_turns(masks=True), PAYLOAD_DIR)
    routing = sample.payload["routed_experts"]
    # Rows 0..7 from turn 1, 8..12 from turn 2, and the final token's row repeated.
    assert [(s.file, s.pos, s.rows) for s in routing] == [
        ("a.bin", 0, 8),
        ("b.bin", 8, 5),
        ("b.bin", 13, 1),
    ]
    assert sample.loss_mask.tolist() == [False] * 6 + [True] * 3 + [False] * 2 + [True] * 3
    assert sample.token_ids.dtype == np.int32 and not sample.token_ids.flags.writeable


def test_no_kept_set_anywhere_means_no_mask_by_handle() -> None:
    sample = sample_of(two_turns(masks=False), PAYLOAD_DIR)
    assert set(sample.payload) == {"routed_experts"}


def test_no_kept_set_anywhere_means_no_mask_inline() -> None:
    turns = []
    for prompt_len, turn in two_turns(masks=False):
        routing = turn.segments["routed_experts"]
        ids = np.zeros((routing.rows, 2, 2), dtype=np.uint8)
        turns.append(
            (
                prompt_len,
                TurnOutput(
                    turn.completion_ids,
                    turn.logprobs,
                    "length",
                    inline={"routed_experts": (ids, routing.pos)},
                ),
            )
        )
    sample = sample_of(turns, None)
    assert sample.inline is not None and set(sample.inline) == {"routed_experts"}
    assert sample.inline["routed_experts"].shape == (14, 2, 2)


def test_frozen_arrays_refuse_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="int32"):
        TurnOutput(np.array([2**40]), np.zeros(1), "stop")
    with pytest.raises(ValueError, match="integers"):
        TurnOutput(np.array([1.5]), np.zeros(1), "stop")
