"""Short passes of the event loop: work that finds the current pass long waits for the next.

Trio runs every runnable task once per pass of its loop and looks at timers and sockets
only between passes, so a pass's length is the lag every waiting task sees. When many
replies arrive together, their parses and sample builds run back to back in one pass:
twenty of them are about 12 ms of Python, stretched to 40 ms when the core is shared with
the fleet (docs/benchmarks.md, the scale benchmark on every core). A `PassBudget`, a trio
instrument that notes when each pass starts, lets a task ask between two pieces of its
work whether the pass has run past its budget; if it has, the task checkpoints and the
rest of its work runs in a later pass, after the timers and sockets.

`keep_passes_short` installs one for the daemon's run; `yield_if_pass_is_long` is the
question (free when no budget is installed: tests and tools that drive the pieces alone).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import trio
from trio.lowlevel import RunVar

#: How long a pass may run before a task that asks yields: a tenth of the lag goal.
PASS_BUDGET_S = 0.002

_BUDGET: RunVar[PassBudget | None] = RunVar("pass_budget", default=None)


class PassBudget(trio.abc.Instrument):
    """Notes the start of each pass (trio calls `after_io_wait` right before it)."""

    def __init__(self, budget_s: float = PASS_BUDGET_S) -> None:
        self.budget_s = budget_s
        self.pass_started = time.perf_counter()
        # Whether a task that asked went on in this pass: the first always does, so that
        # every pass makes progress however slow the machine.
        self.granted = False
        self.yields = 0  # how often a task yielded to a later pass (for the benchmarks)

    def after_io_wait(self, timeout: float) -> None:
        self.pass_started = time.perf_counter()
        self.granted = False

    def spent(self) -> bool:
        return self.granted and time.perf_counter() - self.pass_started > self.budget_s


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


async def yield_if_pass_is_long() -> None:
    """Checkpoint until a pass has budget left (a cancellation point only when the current
    one has run past it). Asked again in each later pass: twenty tasks deferred together
    must not all run in the next one."""
    budget = _BUDGET.get()
    if budget is None:
        return
    while budget.spent():
        budget.yields += 1
        await trio.lowlevel.checkpoint()
    budget.granted = True
