"""prompt_routing_donors: a sibling's prompt rows fill a prefix-cache gap, as few donors
as cover what the siblings cover."""

from __future__ import annotations

import numpy as np

from orchestrator.core.samples import prompt_routing_donors
from orchestrator.core.turns import TurnOutput
from orchestrator.payload import PayloadSegment

DIGEST = "0" * 32


def turn(pos: int, rows: int, *, poisoned: str | None = None) -> TurnOutput:
    segment = PayloadSegment("routed_experts", f"r{pos}.bin", 0, pos, (rows, 2, 2), "uint8", DIGEST)
    return TurnOutput(
        (1,), (0.0,), "length", pos, segments={"routed_experts": segment}, poisoned=poisoned
    )


def spans(donors: list) -> list[tuple[int, int]]:
    return [(d.segment.pos, d.segment.pos + d.segment.rows) for d in donors]


def test_one_sibling_from_position_zero_is_the_only_donor() -> None:
    # Siblings served from the cache start late; the first one ran the whole prompt.
    first_turns = [turn(12, 5), turn(0, 17), turn(12, 5), turn(12, 5)]
    assert spans(prompt_routing_donors(first_turns, prompt_len=12)) == [(0, 12)]


def test_donors_are_clipped_to_the_prompt_and_chained_to_cover_it() -> None:
    first_turns = [turn(6, 20), turn(3, 2), turn(0, 4), turn(4, 1)]
    # (0, 4) first; (3, 5) extends it; (4, 5) adds nothing; (6, 26) clipped to (6, 10).
    assert spans(prompt_routing_donors(first_turns, prompt_len=10)) == [(0, 4), (3, 5), (6, 10)]


def test_poisoned_turns_and_rows_past_the_prompt_give_nothing() -> None:
    first_turns = [turn(0, 9, poisoned="bad segment"), turn(10, 3)]
    assert prompt_routing_donors(first_turns, prompt_len=10) == []


def test_inline_donors_are_sliced_to_the_prompt() -> None:
    rows = np.arange(2 * 10 * 2).reshape(10, 2, 2)
    inline = TurnOutput((1,), (0.0,), "length", 0, inline={"routed_experts": (rows, 0)})
    (donor,) = prompt_routing_donors([inline, inline], prompt_len=6)
    assert donor.array is not None
    array, pos = donor.array
    assert pos == 0 and array.shape == (6, 2, 2)
    assert np.array_equal(array, rows[:6])
