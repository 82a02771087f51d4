"""Short passes of the event loop: work that finds the current pass long waits for the next.

Trio runs every runnable task once per pass of its loop and looks at timers and sockets
only between passes, so a pass's length is the lag every waiting task sees. When many
replies arrive together, their parses and sample builds run back to back in one pass:
twenty of them are about 12 ms of Python, stretched to 40 ms when the core is shared with
the fleet (docs/benchmarks.md, the scale benchmark on every core). A `PassBudget`, a trio
instrument that notes when each pass starts, lets a task ask between two pieces of its
work whether the pass has run past its budget; if it has, the task waits in the
budget's line and the rest of its work runs in a later pass, after the timers and
sockets.

`keep_passes_short` installs one for the daemon's run; `yield_if_pass_is_long` is the
question (free when no budget is installed: tests and tools that drive the pieces alone).
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Iterator

import trio
from trio.lowlevel import RunVar

#: How long a pass may run before a task that asks yields: a tenth of the lag goal.
PASS_BUDGET_S = 0.002

_BUDGET: RunVar[PassBudget | None] = RunVar("pass_budget", default=None)


class PassBudget(trio.abc.Instrument):
    """Notes the start and end of each pass (trio calls `after_io_wait` right before a pass
    and `before_io_wait` right after it) and keeps the line of tasks waiting for a later
    pass.

    A task that finds the pass spent parks in the line rather than checkpointing in every
    pass until it finds one with budget left: with fifty replies deferred together, fifty
    wake-ups a pass were the loop's own largest cost and lengthened the very passes they
    waited on. At each pass's start as many tasks are taken out of the line as went on in
    the last pass (twice as many when that pass ended with budget left), and one of them is
    always awake while the line is not empty: a parked task has no timer or socket to wake
    the loop, so an awake task (runnable, it keeps the loop's next I/O wait at zero) stands
    for the line. The wake-ups are `trio.lowlevel.reschedule` calls from `after_io_wait`,
    which trio makes before it takes the pass's batch of runnable tasks, so the tasks woken
    run in that very pass.
    """

    def __init__(self, budget_s: float = PASS_BUDGET_S) -> None:
        self.budget_s = budget_s
        self.pass_started = time.perf_counter()
        # Whether a task that asked went on in this pass: the first always does, so that
        # every pass makes progress however slow the machine.
        self.granted = False
        self.yields = 0  # how often a task was deferred to a later pass (for the benchmarks)
        self._line: collections.deque[trio.lowlevel.Task] = collections.deque()
        self._awake = 0  # taken out of the line (or never parked) and not gone on yet
        self._went = 0  # tasks that asked and went on in this pass
        self._to_wake = 1  # tasks to have awake when the next pass starts

    def before_io_wait(self, timeout: float) -> None:
        room = time.perf_counter() - self.pass_started < self.budget_s
        self._to_wake = max(1, self._went) * (2 if room else 1)

    def after_io_wait(self, timeout: float) -> None:
        self.pass_started = time.perf_counter()
        self.granted = False
        self._went = 0
        self._wake(self._to_wake - self._awake)

    def spent(self) -> bool:
        return self.granted and time.perf_counter() - self.pass_started > self.budget_s

    def close(self) -> None:
        """No pass is long from now on; every task in line goes on (the budget is off)."""
        self.budget_s = math.inf
        self._wake(len(self._line))

    def go(self) -> None:
        self.granted = True
        self._went += 1

    async def wait_for_a_pass(self) -> None:
        """Wait for a later pass with budget left, in line (see the class docstring)."""
        self.yields += 1
        parked = bool(self._awake)
        if parked:
            task = trio.lowlevel.current_task()
            self._line.append(task)

            def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
                self._line.remove(task)
                return trio.lowlevel.Abort.SUCCEEDED

            # Woken by `_wake` (and counted awake there) in a later pass's batch.
            await trio.lowlevel.wait_task_rescheduled(abort)
        else:
            self._awake += 1  # no task stands for the line: this one does
        try:
            if not parked:
                await trio.lowlevel.checkpoint()
            while self.spent():  # tasks earlier in the batch spent the pass
                await trio.lowlevel.checkpoint()
        finally:
            self._awake -= 1
            if not self._awake:
                self._wake(1)
        self.go()

    def _wake(self, count: int) -> None:
        while count > 0 and self._line:
            trio.lowlevel.reschedule(self._line.popleft())
            self._awake += 1
            count -= 1


@contextlib.contextmanager
def keep_passes_short(budget_s: float = PASS_BUDGET_S) -> Iterator[PassBudget]:
    """Install a `PassBudget` on the running trio loop for the duration of the block."""
    budget = PassBudget(budget_s)
    previous = _BUDGET.get()
    trio.lowlevel.add_instrument(budget)
    _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.set(previous)
        trio.lowlevel.remove_instrument(budget)
        budget.close()


async def yield_if_pass_is_long() -> None:
    """Go on, or wait in line for a later pass with budget left when the current one has
    run past it (a cancellation point only then): twenty tasks deferred together do not
    all run in the next pass (`PassBudget`)."""
    budget = _BUDGET.get()
    if budget is None:
        return
    if budget.spent():
        await budget.wait_for_a_pass()
    else:
        budget.go()
