"""The pass budget: a task yields to a later pass only when the current one ran long."""

from __future__ import annotations

import time

import attrs
import trio
import trio.testing

from orchestrator.daemon.pass_budget import keep_passes_short, yield_if_pass_is_long


async def test_without_a_budget_asking_is_free() -> None:
    with trio.testing.assert_no_checkpoints():
        await yield_if_pass_is_long()


async def test_a_fresh_pass_goes_on_and_a_long_one_yields_until_a_new_pass() -> None:
    with keep_passes_short(budget_s=3600.0) as budget:
        with trio.testing.assert_no_checkpoints():
            await yield_if_pass_is_long()
        assert budget.yields == 0
        # The pass has run past its budget: the task yields, and goes on in a later pass
        # (trio's I/O wait between the two starts a new one).
        budget.budget_s = 0.0005
        budget.pass_started = time.perf_counter() - 1.0
        assert budget.granted  # the first to ask in a pass goes on, whatever the time
        with trio.testing.assert_checkpoints():
            await yield_if_pass_is_long()
        assert budget.yields >= 1


def _busy(seconds: float) -> None:
    """Work on the loop's thread for `seconds` (a reply's parse, say)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@attrs.frozen
class _Deferred:
    worked_in: list[int]  # the pass each task's work ran in, in the order they worked
    steps: int  # the tasks' steps, all told
    yields: int  # the budget's count of deferrals


async def _deferred_together(count: int) -> _Deferred:
    """`count` tasks that ask in a pass already past its 2 ms budget, then work 1 ms
    each; counted by a trio instrument."""
    passes = steps = 0
    workers: set[trio.lowlevel.Task] = set()
    worked_in: list[int] = []

    class Count(trio.abc.Instrument):
        def after_io_wait(self, timeout: float) -> None:
            nonlocal passes
            passes += 1

        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            nonlocal steps
            steps += task in workers

    async def work() -> None:
        workers.add(trio.lowlevel.current_task())
        await yield_if_pass_is_long()
        worked_in.append(passes)
        _busy(0.001)

    counter = Count()
    trio.lowlevel.add_instrument(counter)
    try:
        with trio.fail_after(10), keep_passes_short(budget_s=0.002) as budget:
            budget.pass_started = time.perf_counter() - 1.0  # this pass is long already
            budget.granted = True
            async with trio.open_nursery() as nursery:
                for _ in range(count):
                    nursery.start_soon(work)
    finally:
        trio.lowlevel.remove_instrument(counter)
    assert len(worked_in) == count
    return _Deferred(worked_in, steps, budget.yields)


async def test_tasks_deferred_together_are_spread_over_passes() -> None:
    # Ten tasks, 1 ms of work each after the question, a 2 ms budget: no pass runs all
    # of them.
    deferred = await _deferred_together(10)
    worked_in = deferred.worked_in
    # About budget / 1 ms + 1 tasks' work per pass (fewer on a busy machine), never all.
    assert max(worked_in.count(n) for n in set(worked_in)) <= 4
    # Each task that did not go on in the first pass was deferred, once.
    assert deferred.yields == sum(1 for n in worked_in if n != min(worked_in))


async def test_deferred_tasks_wait_in_line_and_are_woken_once_not_every_pass() -> None:
    # Forty tasks deferred together take about twenty passes. Checkpointing until a pass
    # has room would step each task in every pass until its turn (some four hundred
    # steps); in line, a task steps when it asks, when woken and, at most, once more when
    # the tasks before it in the batch spent the pass.
    deferred = await _deferred_together(40)
    assert deferred.yields >= 30
    assert deferred.steps <= 3 * 40


async def test_tasks_cancelled_in_line_leave_it_and_the_line_goes_on() -> None:
    asked: list[int] = []
    went: list[int] = []

    async def work(index: int, scope: trio.CancelScope) -> None:
        with scope:
            asked.append(index)
            await yield_if_pass_is_long()
            went.append(index)
            _busy(0.003)  # past the budget: one task a pass

    async def deferred_together(count: int, cancel: int) -> set[int]:
        """`count` tasks deferred together, `cancel` of them cancelled while they wait;
        the indices of those cancelled."""
        asked.clear()
        went.clear()
        scopes = [trio.CancelScope() for _ in range(count)]
        budget.pass_started = time.perf_counter() - 1.0
        budget.granted = True
        async with trio.open_nursery() as nursery:
            for index, scope in enumerate(scopes):
                nursery.start_soon(work, index, scope)
            while len(asked) < count:
                await trio.lowlevel.checkpoint()
            waiting = [index for index in range(count) if index not in went]
            assert len(waiting) >= count - 2  # one goes on a pass
            for index in waiting[:cancel]:
                scopes[index].cancel()
        return set(waiting[:cancel])

    # Whether a cancelled task was parked, awake or woken when cancelled (trio's batch
    # order decides), the others go on, and the line works for the next tasks: a task
    # that left it uncounted would leave later ones parked with nobody to wake them.
    with trio.fail_after(10), keep_passes_short(budget_s=0.002) as budget:
        for _ in range(5):
            cancelled = await deferred_together(8, 4)
            assert set(range(8)) - cancelled <= set(went)
        await deferred_together(4, 0)
        assert sorted(went) == [0, 1, 2, 3]


async def test_the_budget_is_uninstalled_after_the_block() -> None:
    with keep_passes_short(budget_s=0.0) as budget:
        budget.pass_started = time.perf_counter() - 1.0
        budget.granted = True
    with trio.testing.assert_no_checkpoints():
        await yield_if_pass_is_long()
