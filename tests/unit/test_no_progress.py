"""Progress or stop: the watch stops a run whose rollouts keep finishing with nothing
trainable, for `stop_s` counted from the first such discard and at least `min_units` of
them, with one line naming the reason, its count, an example and what to try; a run that
waits (a slow trainer, the staleness gate) or that queues a trainable sample now and then
never stops. The sink tells where equal rewards lay (the task solved). The service runs
on trio's virtual clock."""

from __future__ import annotations

import pytest
import structlog.testing
import trio
import trio.testing

from orchestrator.core.rollouts import Discard, GroupResult, RolloutResult
from orchestrator.core.sink import SinkLimits, TrainSink
from orchestrator.core.staleness import Staleness
from orchestrator.daemon.reporting.no_progress import (
    NoProgress,
    ProgressWatch,
    RewardRange,
    serve_progress_watch,
)
from orchestrator.daemon.reporting.run_snapshot import RunSnapshot
from orchestrator.daemon.run_state import RunState

RANGE = RewardRange(0.0, 1.0)


def figures(
    *,
    trainable: int = 0,
    discards: dict[str, int] | None = None,
    failures: dict[str, int] | None = None,
    texts: dict[tuple[str, str], int] | None = None,
    reward_texts: dict[tuple[str, str], int] | None = None,
    no_signal_at: dict[str, int] | None = None,
    discarded_bytes: int = 0,
    idle: bool = False,
) -> RunSnapshot:
    return RunSnapshot(
        step=1,
        queued=0,
        needed=16,
        gate_open=True,
        applied_version=7,
        idle=idle,
        discards=discards or {},
        failures=failures or {},
        texts=texts or {},
        trainable=trainable,
        no_signal_at=no_signal_at or {},
        reward_texts=reward_texts or {},
        discarded_bytes=discarded_bytes,
    )


def stopped(watch: ProgressWatch, *looks: tuple[float, RunSnapshot]) -> NoProgress | None:
    found = None
    for now, snapshot in looks:
        found = watch.check(now, snapshot)
    return found


def test_no_signal_at_the_bottom_stops_after_the_window_with_its_count_and_bytes() -> None:
    watch = ProgressWatch(stop_s=600.0, min_units=64, rewards=RANGE)
    assert watch.check(0.0, figures()) is None  # the baseline
    # Rollouts start finishing (all discarded) at 300 s: the window counts from there.
    first = figures(discards={"no_signal": 8}, no_signal_at={"bottom": 8})
    assert watch.check(300.0, first) is None
    late = figures(
        discards={"no_signal": 247_056, "stale": 40},
        no_signal_at={"bottom": 247_056},
        discarded_bytes=11 * 2**30,
    )
    assert watch.check(899.0, late) is None
    found = watch.check(900.0, late)
    assert found is not None and found.by == "no progress"
    assert found.line == (
        "error: nothing trainable for 600 s: 247,056 of the 247,056 rollouts that finished "
        "were discarded as no_signal, every group's rewards all 0 (the bottom, "
        "batch.curriculum_min_mean_reward): the model never earned a reward; 11.0 GiB of "
        "payload files written and deleted for them. Try: score a known-good answer with "
        "your reward functions, check that the servers serve the model [model] names, and "
        "read a few completions (max_tokens, the chat template)"
    )


def test_every_group_at_the_top_is_the_task_solved() -> None:
    watch = ProgressWatch(stop_s=10.0, min_units=4, rewards=RewardRange(0.0, 1.75))
    solved = figures(discards={"no_signal": 64}, no_signal_at={"top": 64})
    found = stopped(watch, (0.0, figures()), (1.0, solved), (11.0, solved))
    assert found is not None and found.by == "solved"
    assert found.line.startswith(
        "stopped: the task is solved: for 10 s every group's rewards were all at the top "
        "(1.75, batch.curriculum_max_mean_reward), 64 rollouts without a learning signal. "
    )
    assert "v7" in found.line
    # Equal rewards between the two ends are neither.
    watch = ProgressWatch(stop_s=10.0, min_units=4, rewards=RANGE)
    half = figures(discards={"no_signal": 64}, no_signal_at={"top": 60})
    found = stopped(watch, (0.0, figures()), (1.0, half), (11.0, half))
    assert found is not None and found.by == "no progress"
    assert "each group's rewards all equal" in found.line and "batch.group_size" in found.line


def test_every_reward_failing_names_the_most_common_failure() -> None:
    watch = ProgressWatch(stop_s=100.0, min_units=4, rewards=RANGE)
    text = "ModuleNotFoundError: No module named 'reasoning_gym'"
    failing = figures(
        discards={"reward_failed": 45_072},
        reward_texts={("raised", text): 45_000, ("timeout", "no score within 30 s"): 72},
    )
    found = stopped(watch, (0.0, figures()), (13.0, failing), (113.0, failing))
    assert found is not None and found.by == "no progress"
    assert found.line.startswith(
        "error: nothing trainable for 100 s: 45,072 of the 45,072 rollouts that finished "
        f"were discarded as reward_failed, most often raised: {text}. Try: the log's "
        "`reward failed` line has the traceback"
    )


def test_failed_requests_and_untrainable_samples_name_their_example() -> None:
    watch = ProgressWatch(stop_s=1.0, min_units=4, rewards=RANGE)
    malformed = figures(
        discards={"failed": 7932},
        failures={"malformed": 7932},
        texts={("malformed", "response has 1 choices for n = 8"): 7932},
    )
    found = stopped(watch, (0.0, figures()), (1.0, malformed), (2.0, malformed))
    assert found is not None
    assert "7,932 rollouts that finished were discarded as failed, most often malformed: " in (
        found.line
    )
    assert "§ Faults says what each kind (malformed) means" in found.line
    watch = ProgressWatch(stop_s=1.0, min_units=4, rewards=RANGE)
    long = figures(discards={"untrainable": 90, "no_signal": 30})
    found = stopped(watch, (0.0, figures()), (1.0, long), (2.0, long))
    assert found is not None
    assert "90 of the 120 rollouts that finished were discarded as untrainable" in found.line
    assert "batch.max_seq_len" in found.line


def test_a_trainable_sample_starts_the_window_again() -> None:
    watch = ProgressWatch(stop_s=60.0, min_units=4, rewards=RANGE)
    watch.check(0.0, figures())
    watch.check(1.0, figures(discards={"no_signal": 50}))
    # One group with signal at 59 s: its samples were queued.
    assert watch.check(59.0, figures(trainable=4, discards={"no_signal": 90})) is None
    assert watch.check(61.0, figures(trainable=4, discards={"no_signal": 95})) is None
    assert watch.check(119.0, figures(trainable=4, discards={"no_signal": 200})) is None
    assert watch.check(121.5, figures(trainable=4, discards={"no_signal": 201})) is not None


@pytest.mark.parametrize(
    "quiet",
    [
        # Waiting for a slow trainer, or behind the staleness gate: nothing finishes.
        figures(),
        # Only groups gone stale or swept: the run's timing, not the task.
        figures(discards={"stale": 500, "swept": 90, "pruned": 3}),
        # Nothing left to ship.
        figures(discards={"no_signal": 10_000}, idle=True),
    ],
)
def test_a_run_that_waits_never_stops(quiet: RunSnapshot) -> None:
    watch = ProgressWatch(stop_s=60.0, min_units=4, rewards=RANGE)
    assert all(watch.check(float(t), quiet) is None for t in range(0, 3600, 30))


def test_too_few_rollouts_do_not_stop_a_slow_run_and_zero_is_off() -> None:
    # A GPU run whose groups take minutes: three of them without signal in ten minutes
    # are no verdict (min_units is a few batches' worth).
    watch = ProgressWatch(stop_s=600.0, min_units=64, rewards=RANGE)
    watch.check(0.0, figures())
    watch.check(300.0, figures(discards={"no_signal": 16}))
    assert watch.check(1200.0, figures(discards={"no_signal": 48})) is None
    assert watch.check(1500.0, figures(discards={"no_signal": 64})) is not None
    off = ProgressWatch(stop_s=0.0, min_units=1, rewards=RANGE)
    busy = figures(discards={"failed": 10**6})
    assert stopped(off, (0.0, figures()), (1.0, busy), (10**6, busy)) is None


def group(rewards: list[float]) -> GroupResult:
    return GroupResult(
        "g", 0, tuple(RolloutResult(f"g-r{i}", 0, reward=r) for i, r in enumerate(rewards))
    )


def test_the_sink_tells_where_equal_rewards_lay() -> None:
    limits = SinkLimits(
        batch_size=4,
        constant_size=False,
        staleness=Staleness(max_off_policy_steps=1, max_async_steps=1),
        curriculum_min_mean_reward=0.0,
        curriculum_max_mean_reward=1.75,
        max_seq_len=64,
    )
    sink = TrainSink(limits)
    sink.admit(group([1.75] * 4), 1)
    sink.admit(group([0.0] * 4), 1)
    sink.admit(group([0.0] * 3), 1)
    sink.admit(group([0.5] * 4), 1)
    assert sink.counters[Discard.NO_SIGNAL.value] == 15
    assert sink.no_signal_at == {"top": 4, "bottom": 7}
    assert sink.trainable == 0


async def test_the_service_halts_the_run_once_on_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    started = trio.current_time()
    state = RunState.new(Staleness(max_off_policy_steps=1, max_async_steps=1))
    counts = {"no_signal": 0}

    def snapshot() -> RunSnapshot:
        counts["no_signal"] += 8
        return figures(discards=dict(counts), no_signal_at={"bottom": counts["no_signal"]})

    watch = ProgressWatch(stop_s=30.0, min_units=16, rewards=RANGE)
    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_progress_watch, watch, snapshot, state)
            await state.dispatch.halted.wait()
            halted_at = trio.current_time() - started
    halt = state.dispatch.halt_reason
    assert halt is not None and halt.by == "no progress"
    assert halt.line.startswith("error: nothing trainable for 30 s: ")
    assert state.dispatch.stopping
    # The first look is the baseline, the second starts the window, 30 s later it stops.
    assert halted_at == 32.0
    assert [e["event"] for e in logs] == ["nothing trainable: ending the run"]
