"""The staleness rule in one value: the bound a batch's groups must meet, the batch gate,
and the collection bound, with the test vector of docs/design.md §3."""

from __future__ import annotations

import pytest

from orchestrator.core.staleness import Staleness


def test_the_bounds_follow_the_two_limits() -> None:
    staleness = Staleness(max_off_policy_steps=2, max_async_steps=1)
    # Batch 11 may hold groups started at v8 or later.
    assert staleness.min_fresh_version(11) == 8
    # v10 applied: every v<k> below v8 goes (keep v8..v11 of v0..v11).
    assert staleness.collection_bound(10) == 8
    # Early in a run the bound is negative: nothing is below it.
    assert staleness.collection_bound(0) == -2
    # Batch 5 ships once v3 is applied, not before.
    assert staleness.may_ship(5, 3) and not staleness.may_ship(5, 2)
    assert staleness.batches_in_flight == 2


@pytest.mark.parametrize(
    ("m", "a", "message"),
    [
        (-1, 0, "'max_off_policy_steps' must be >= 0"),
        (2, -1, "'max_async_steps' must be >= 0"),
        (1, 2, "must not exceed max_off_policy_steps"),
    ],
)
def test_limits_out_of_range_are_rejected(m: int, a: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Staleness(m, a)


@pytest.mark.parametrize(("m", "a"), [(0, 0), (2, 1), (2, 2), (5, 3)])
def test_fresh_and_allowance_agree_with_the_bound(m: int, a: int) -> None:
    """`is_fresh` is `min_fresh_version` read the other way round, and the allowance is
    how many batches after `step` are still fresh for the group."""
    staleness = Staleness(m, a)
    for start_version in range(0, 8):
        for step in range(1, 14):
            fresh = start_version >= staleness.min_fresh_version(step)
            assert staleness.is_fresh(start_version, step) is fresh
            allowance = staleness.allowance(start_version, step)
            later_fresh = [s for s in range(step + 1, 20) if staleness.is_fresh(start_version, s)]
            assert max(allowance, 0) == len(later_fresh) or not fresh
