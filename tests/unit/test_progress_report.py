"""The progress line: every `report_interval_s`, the batch being filled, samples ready and
needed, rollouts in flight and per second, and the discards and failures since the
previous line; pure arithmetic first, then the service on trio's virtual clock."""

from __future__ import annotations

import math
from collections.abc import MutableMapping, Sequence
from typing import Any

import structlog.testing
import trio
import trio.testing

from orchestrator.core.rollouts import Discard
from orchestrator.daemon.reporting.progress_report import (
    ProgressReporter,
    progress_line,
    serve_progress_report,
)
from orchestrator.daemon.reporting.run_snapshot import RunSnapshot
from orchestrator.daemon.reporting.stall import DISCARD_HINTS, StallWatch

NO_DISCARDS = dict.fromkeys((d.value for d in Discard), 0)


def tally(
    *,
    completed: int = 0,
    inflight: int = 32,
    queued: int = 5,
    discards: dict[str, int] | None = None,
    failures: dict[str, int] | None = None,
    idle: bool = False,
    limit: int = 96,
    scored: dict[str, int] | None = None,
    reward_sums: dict[str, float] | None = None,
    discarded_bytes: int = 0,
    cpu_s: float = 0.0,
) -> RunSnapshot:
    return RunSnapshot(
        step=3,
        queued=queued,
        needed=16,
        gate_open=True,
        applied_version=1,
        idle=idle,
        discards={**NO_DISCARDS, **(discards or {})},
        failures=failures or {},
        inflight=inflight,
        completed=completed,
        inflight_limit=limit,
        scored=scored or {},
        reward_sums=reward_sums or {},
        discarded_bytes=discarded_bytes,
        cpu_s=cpu_s,
    )


# -- the line's fields ---------------------------------------------------------------------


def test_a_line_has_the_state_now_and_the_rate_and_deltas_since_before() -> None:
    before = tally(completed=100, discards={"untrainable": 40}, failures={"http_5xx": 2})
    now = tally(
        completed=400,
        inflight=64,
        limit=80,
        queued=7,
        discards={"untrainable": 340, "stale": 3},
        failures={"http_5xx": 2, "malformed": 9},
    )
    line = progress_line(before, now, 30.0)
    assert (line.step, line.queued_samples, line.needed_samples) == (3, 7, 16)
    # The rollouts in flight now, and the limit the dispatcher obeys now.
    assert (line.inflight_rollouts, line.inflight_limit) == (64, 80)
    assert (line.interval_s, line.rollouts_per_s) == (30.0, 10.0)
    # Only the reasons and kinds that grew, by how much.
    assert line.discards == {"untrainable": 300, "stale": 3}
    assert line.failures == {"malformed": 9}


def test_the_daemon_cpu_per_rollout_is_over_the_interval() -> None:
    before = tally(completed=100, cpu_s=12.0)
    assert progress_line(before, tally(completed=400, cpu_s=18.0), 30.0).cpu_s_per_rollout == 0.02
    # No rollout completed: no figure, rather than a division by nothing.
    assert progress_line(before, tally(completed=100, cpu_s=13.0), 30.0).cpu_s_per_rollout is None


def test_the_rate_is_rounded_and_zero_over_no_time() -> None:
    assert progress_line(tally(), tally(completed=1), 3.0).rollouts_per_s == 0.33
    assert progress_line(tally(), tally(completed=5), 0.0).rollouts_per_s == 0.0
    quiet = progress_line(tally(completed=5), tally(completed=5), 30.0)
    assert (quiet.rollouts_per_s, quiet.discards, quiet.failures) == (0.0, {}, {})


def test_the_log_fields_are_the_json_fields() -> None:
    line = progress_line(
        tally(discarded_bytes=10),
        tally(completed=30, discards={"pruned": 2}, discarded_bytes=4106),
        30.0,
    )
    assert line.to_json() == {
        "step": 3,
        "queued_samples": 5,
        "needed_samples": 16,
        "inflight_rollouts": 32,
        "interval_s": 30.0,
        "rollouts_per_s": 1.0,
        "discards": {"pruned": 2},
        "failures": {},
        "inflight_limit": 96,
        "scored": {},
        "mean_reward": {},
        "discarded_bytes": 4096,
        "cpu_s_per_rollout": 0.0,
    }
    assert type(line).from_json(line.to_json()) == line


def test_rewards_by_env_are_the_means_of_the_rollouts_scored_in_the_interval() -> None:
    before = tally(scored={"arith": 10, "chat": 4}, reward_sums={"arith": 9.0, "chat": 1.0})
    now = tally(
        scored={"arith": 30, "chat": 4, "code": 2},
        reward_sums={"arith": 14.0, "chat": 1.0, "code": 0.5},
    )
    line = progress_line(before, now, 30.0)
    # 20 arith rollouts scored 5.0 between the two: 0.25, not the run's 14/30; chat scored
    # nothing in the interval and is left out; code is new.
    assert line.scored == {"arith": 20, "code": 2}
    assert line.mean_reward == {"arith": 0.25, "code": 0.25}
    again = type(line).from_json(line.to_json())
    assert (again.scored, again.mean_reward) == (line.scored, line.mean_reward)


# -- when a line is due --------------------------------------------------------------------


def test_one_line_per_interval_each_counting_since_the_previous() -> None:
    reporter = ProgressReporter(30.0)
    reporter.start(100.0, tally())
    assert reporter.next_check(100.0) == 130.0
    assert reporter.check(129.9, tally(completed=50)) is None
    first = reporter.check(130.0, tally(completed=300, discards={"untrainable": 10}))
    assert first is not None
    assert (first.rollouts_per_s, first.discards) == (10.0, {"untrainable": 10})
    assert (reporter.last, reporter.last_at) == (first, 130.0)
    assert reporter.check(140.0, tally(completed=400)) is None
    assert reporter.next_check(140.0) == 160.0
    # Late by 10 s: the rate is over the 40 s that passed.
    second = reporter.check(170.0, tally(completed=700, discards={"untrainable": 30}))
    assert second is not None
    assert (second.interval_s, second.rollouts_per_s) == (40.0, 10.0)
    assert second.discards == {"untrainable": 20}
    assert reporter.next_check(170.0) == 200.0


def test_zero_turns_the_line_off() -> None:
    reporter = ProgressReporter(0.0)
    reporter.start(0.0, tally())
    assert reporter.check(1e9, tally(completed=5)) is None
    assert reporter.next_check(0.0) == math.inf
    assert reporter.last is None


def test_nothing_left_to_ship_logs_no_line_but_moves_the_baseline() -> None:
    reporter = ProgressReporter(10.0)
    reporter.start(0.0, tally())
    assert reporter.check(10.0, tally(completed=100, idle=True)) is None
    assert reporter.last is None
    line = reporter.check(20.0, tally(completed=150))
    assert line is not None and line.rollouts_per_s == 5.0


# -- the line and the stall warning agree ---------------------------------------------------


def test_the_line_and_the_stall_warning_name_the_same_things() -> None:
    start, now = tally(), tally(discards={"untrainable": 4512}, failures={"malformed": 903})
    watch = StallWatch(stall_s=60.0, started_at=0.0)
    warning = watch.check(60.0, now)
    reporter = ProgressReporter(60.0)
    reporter.start(0.0, start)
    line = reporter.check(60.0, now)
    assert warning is not None and line is not None
    # Both since the start here: the same counts under the same keys.
    warned, logged = warning.log_fields(), line.to_json()
    for key in ("step", "queued_samples", "needed_samples", "discards", "failures"):
        assert logged[key] == warned[key], key
    assert "untrainable" in warned["hint"]


def test_the_stall_warning_has_a_hint_for_every_discard_reason() -> None:
    assert set(DISCARD_HINTS) == {reason.value for reason in Discard}


# -- the service, on virtual time ------------------------------------------------------------


async def test_the_service_logs_every_interval_and_saves_progress(
    autojump_clock: trio.testing.MockClock,
) -> None:
    reporter = ProgressReporter(30.0)
    current = tally()
    saves: list[float] = []

    async def save() -> None:
        saves.append(trio.current_time())

    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_progress_report, reporter, lambda: current, save)
            await trio.sleep(29)
            assert lines(logs) == []
            current = tally(completed=600, discards={"untrainable": 600})
            await trio.sleep(2)
            assert len(lines(logs)) == 1
            current = tally(completed=750, discards={"untrainable": 700}, failures={"timeout": 1})
            await trio.sleep(60)
            nursery.cancel_scope.cancel()
    logged = lines(logs)
    assert saves == [30.0, 60.0, 90.0]
    assert [entry["log_level"] for entry in logged] == ["info"] * 3
    first, second, third = logged
    assert first["step"] == 3 and first["queued_samples"] == 5 and first["needed_samples"] == 16
    assert (first["rollouts_per_s"], first["discards"]) == (20.0, {"untrainable": 600})
    assert (second["rollouts_per_s"], second["discards"]) == (5.0, {"untrainable": 100})
    assert second["failures"] == {"timeout": 1}
    assert (third["rollouts_per_s"], third["discards"], third["failures"]) == (0.0, {}, {})
    assert reporter.last is not None and reporter.last.to_json() == {
        k: v for k, v in third.items() if k not in ("event", "log_level")
    }


async def test_the_service_off_logs_nothing(autojump_clock: trio.testing.MockClock) -> None:
    saves: list[float] = []

    async def save() -> None:
        saves.append(trio.current_time())

    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_progress_report, ProgressReporter(0.0), tally, save)
            await trio.sleep(3600)
            nursery.cancel_scope.cancel()
    assert lines(logs) == [] and saves == []


def lines(logs: Sequence[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == "progress"]
