"""The adaptive in-flight limit (orchestrator/core/inflight.py): pure, on a made-up clock."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.core.dispatch_gate import DispatchGate, Pipe
from orchestrator.core.inflight import (
    MIN_GROUPS_PER_DECISION,
    InflightLimit,
    InflightMode,
)
from orchestrator.core.staleness import Staleness

GROUP = 8


def limit(mode: InflightMode = "adaptive", ceiling: int = 256) -> InflightLimit:
    control = InflightLimit(mode, ceiling=ceiling, group_size=GROUP)
    control.started(0.0)
    return control


def window(
    control: InflightLimit,
    now: float,
    turnarounds: list[float],
    stale: int = 0,
    allowance: int = 1,
) -> float:
    """Groups admitted, then a batch shipped at `now`. With the default allowance of one
    batch, a group has 1.5 step times of slack."""
    for index, turnaround in enumerate(turnarounds):
        control.group_admitted(turnaround, allowance=allowance, stale=index < stale)
    control.shipped(now)
    return now


def test_it_starts_at_the_ceiling_and_fixed_stays_there() -> None:
    control = limit("fixed")
    assert control.limit == 256
    now = 0.0
    for _ in range(10):
        now = window(control, now + 1.0, [30.0] * 20, stale=20)
    assert control.limit == 256 and control.last is None


def test_no_decision_without_a_step_time_or_enough_groups() -> None:
    control = limit()
    # The first shipped batch gives no interval yet.
    assert control.shipped(1.0) is None
    for _ in range(MIN_GROUPS_PER_DECISION - 1):
        control.group_admitted(10.0, allowance=1, stale=True)
    assert control.shipped(2.0) is None
    assert control.limit == 256
    # The groups carry over: one more is enough.
    control.group_admitted(10.0, allowance=1, stale=False)
    decision = control.shipped(3.0)
    assert decision is not None and decision.limit < 256


def test_the_slack_is_the_allowance_and_half_a_step() -> None:
    """A group with an allowance of one batch that took 1.5 step times used all of its
    slack; one with an allowance of three took a third of its slack in the same time."""
    control = limit()
    window(control, 1.0, [1.5] * 8, allowance=1)
    window(control, 2.0, [1.5] * 8, allowance=1)
    assert control.last is not None and control.last.slack_used_p90 == pytest.approx(1.0)
    window(control, 3.0, [1.5] * 8, allowance=3)
    assert control.last.slack_used_p90 == pytest.approx(1.5 / 3.5)
    # No allowance at all (a group dispatched when its last batch was being filled):
    # half a step time.
    window(control, 4.0, [0.5] * 8, allowance=0)
    assert control.last.slack_used_p90 == pytest.approx(1.0)


def test_slow_turnaround_lowers_the_limit_damped() -> None:
    control = limit()
    # 256 rollouts (32 groups) in flight, each group taking 3 s: about 10 groups end in
    # each 1 s window. The first shipped batch only starts the step time's clock.
    window(control, 1.0, [3.0] * 10)
    # Each used 3 / 1.5 = twice its slack: half as many in flight (128) would be in time;
    # half the step in log scale is 181.
    window(control, 2.0, [3.0] * 11)
    decision = control.last
    assert decision is not None
    assert decision.inflight_mean == pytest.approx(252)
    assert (decision.turnaround_p90_s, decision.slack_used_p90, decision.step_time_s) == (
        3,
        2,
        1,
    )
    assert decision.previous == 256 and decision.limit == int((256 * 126) ** 0.5)
    assert decision.changed


def test_a_saturated_fleet_settles_where_turnaround_meets_the_target() -> None:
    """A fleet of 100 rollouts/s: with N rollouts in flight a group takes N / 100 s (at
    least 0.2 s). Steps ship every second and each group may see one batch ship: 1.5 s
    of slack, so the limit should settle near 150 and stay within the bounds on the
    way."""
    control = limit()
    capacity, step = 100.0, 1.0
    now = 0.0
    window(control, now, [])
    seen = []
    for _ in range(30):
        inflight = control.limit
        turnaround = max(inflight / capacity, 0.2)
        groups = round(inflight / GROUP * step / turnaround)
        now = window(control, now + step, [turnaround] * groups)
        seen.append(control.limit)
        assert GROUP <= control.limit <= 256
    assert seen[-1] == pytest.approx(150, rel=0.1)
    # Never below half of where it ends: the damping does not overshoot wildly.
    assert min(seen) >= 75


def test_a_fast_fleet_keeps_the_ceiling() -> None:
    control = limit()
    now = window(control, 0.0, [])
    for _ in range(10):
        now = window(control, now + 1.0, [0.3] * 32)
    assert control.limit == 256


def test_the_limit_climbs_back_once_turnaround_recovers() -> None:
    control = limit()
    now = window(control, 0.0, [])
    for _ in range(6):
        # As many in flight as the limit allows, each group taking 5 s.
        now = window(control, now + 1.0, [5.0] * max(control.limit // GROUP // 5, 1))
    assert control.limit < 100
    for _ in range(20):
        # The limit binds: as many in flight as it allows, each group quick.
        now = window(control, now + 1.0, [0.25] * (control.limit * 4 // GROUP))
    assert control.limit == 256


def test_many_stale_groups_cut_the_limit_whatever_the_turnaround() -> None:
    control = limit()
    now = window(control, 0.0, [])
    # Turnaround well within the target, but 3 of 20 groups (15%) arrived stale.
    now = window(control, now + 1.0, [0.5] * 20, stale=3)
    decision = control.last
    assert decision is not None and decision.stale_groups == 3
    assert control.limit <= 256 * 0.8
    # One stale group in 40 (2.5%) is below the share that cuts.
    before = control.limit
    window(control, now + 1.0, [0.5] * 40, stale=1)
    assert control.limit >= before


@given(
    ceiling=st.integers(1, 1024),
    windows=st.lists(
        st.tuples(
            st.floats(0.01, 30.0),  # interval between shipped batches
            st.lists(st.floats(0.0, 600.0), max_size=40),  # turnarounds
            st.integers(0, 40),  # stale among them
        ),
        max_size=25,
    ),
)
def test_the_limit_stays_between_one_group_and_the_ceiling(
    ceiling: int, windows: list[tuple[float, list[float], int]]
) -> None:
    control = InflightLimit("adaptive", ceiling=ceiling, group_size=GROUP)
    control.started(0.0)
    now = 0.0
    for interval, turnarounds, stale in windows:
        now = window(control, now + interval, turnarounds, stale=min(stale, len(turnarounds)))
        assert min(GROUP, ceiling) <= control.limit <= ceiling


def test_bad_construction_is_refused() -> None:
    with pytest.raises(ValueError):
        InflightLimit("adaptive", ceiling=0, group_size=GROUP)


def test_groups_are_held_until_they_have_the_allowance_a_typical_group_needs() -> None:
    control = limit()
    window(control, 1.0, [1.2] * 8)
    # A typical group takes 1.2 step times: one dispatched with no batch to spare (half
    # a step time of slack, on average) would go stale; one batch is enough.
    window(control, 2.0, [1.2] * 8)
    assert control.min_allowance == 1
    assert control.last is not None and control.last.changed
    # 2.4 step times: two batches (2 + 1/2 step times of slack).
    window(control, 3.0, [2.4] * 8)
    assert control.min_allowance == 2
    # Quick groups need none.
    window(control, 4.0, [0.3] * 8)
    assert control.min_allowance == 0


def test_a_fixed_limit_never_holds() -> None:
    control = limit("fixed")
    for now in range(1, 6):
        window(control, float(now), [9.0] * 8)
    assert control.min_allowance == 0


def test_the_dispatcher_holds_only_up_to_what_a_caught_up_trainer_gives() -> None:
    """The gate compares the allowance a group would have now with the hold, capped at
    `m`: once the trainer has caught up (next_step = applied + 1) the allowance is `m`,
    so even a hold above it lets dispatch go on."""
    staleness = Staleness(2, 2)
    gate = DispatchGate(staleness, batch_size=16, group_size=4)
    # At the gate's furthest (next_step = applied + 1 + a): no batch to spare.
    assert staleness.allowance(5, 8) == 0
    assert gate.enough_allowance(staleness.allowance(5, 8), 0)
    assert not gate.enough_allowance(staleness.allowance(5, 8), 1)
    # A version applied: one batch to spare.
    assert gate.enough_allowance(staleness.allowance(6, 8), 1)
    # Caught up, and a hold far above m: still dispatching.
    assert gate.enough_allowance(staleness.allowance(7, 8), 10)
    pipe = Pipe(applied_version=5, next_step=8, inflight_rollouts=0, queued_samples=0, limit=64)
    assert gate.may_start(pipe)
    assert not gate.may_start(attrs.evolve(pipe, min_allowance=1))
    assert gate.may_start(attrs.evolve(pipe, applied_version=7, min_allowance=10))


@pytest.mark.parametrize(
    ("limits", "next_step", "fresh_batches"),
    [
        # m = a: at the gate's furthest only the batch being filled can take a new group,
        # a batch back two, caught up all a + 1.
        ((2, 2), 8, 1),
        ((2, 2), 7, 2),
        ((2, 2), 6, 3),
        # m > a: a new group always has a batch to spare, and the a + 1 batches bind.
        ((2, 1), 7, 2),
        ((2, 1), 6, 2),
    ],
)
def test_work_in_the_pipe_is_bounded_by_the_batches_a_new_group_can_still_go_into(
    limits: tuple[int, int], next_step: int, fresh_batches: int
) -> None:
    gate = DispatchGate(Staleness(*limits), batch_size=16, group_size=4)
    # What is queued and what is in flight count alike; the last group that fits starts.
    pipe = Pipe(
        applied_version=5,
        next_step=next_step,
        inflight_rollouts=16 * fresh_batches - 1 - 8,
        queued_samples=8,
        limit=1000,
    )
    assert gate.may_start(pipe)
    assert not gate.may_start(attrs.evolve(pipe, inflight_rollouts=pipe.inflight_rollouts + 1))
    # Nothing starts once the run is ending, or above the in-flight limit.
    assert not gate.may_start(attrs.evolve(pipe, ending=True))
    assert not gate.may_start(attrs.evolve(pipe, limit=pipe.inflight_rollouts + 3))


@pytest.mark.parametrize("batches_left", [1, 2])
def test_work_in_the_pipe_is_bounded_by_the_batches_the_run_has_left(batches_left: int) -> None:
    # Caught up with m = a = 2 the gate would take three batches' worth; a run with
    # `batches_left` batches to go takes only those, and no group beyond them is started
    # to be stopped when the last batch ships.
    gate = DispatchGate(Staleness(2, 2), batch_size=16, group_size=4)
    pipe = Pipe(
        applied_version=5,
        next_step=6,
        inflight_rollouts=16 * batches_left - 1 - 8,
        queued_samples=8,
        limit=1000,
        batches_left=batches_left,
    )
    assert gate.may_start(pipe)
    assert not gate.may_start(attrs.evolve(pipe, inflight_rollouts=pipe.inflight_rollouts + 1))
    # Without a last step, or with more batches left than the staleness bound allows, the
    # bound is the staleness rule's.
    for unbounded in (None, 3, 10):
        more = attrs.evolve(pipe, batches_left=unbounded, inflight_rollouts=16 * 3 - 1 - 8)
        assert gate.may_start(more)
        assert not gate.may_start(attrs.evolve(more, inflight_rollouts=16 * 3 - 8))
