"""`FairBudget`: an amount shared by concurrent tasks, served first come, first served.

`reserve(n)` waits until `n` fits under the capacity and no earlier waiter is still in
line, `release(n)` gives it back. A waiter holds nothing while it waits (so two can never
each hold part of what they need), and one whose wait is cancelled takes nothing. The
daemon's HTTP client shares its reply bytes this way; the local fleet its sequences
(vLLM's `max_num_seqs`, a request's `n` choices taking `n`).
"""

from __future__ import annotations

import collections

import attrs
import trio


@attrs.define(eq=False)
class FairBudget:
    """`capacity` units shared by concurrent tasks (module docstring). `peak` is the most
    ever reserved at once."""

    capacity: int
    reserved: int = attrs.field(init=False, default=0)
    peak: int = attrs.field(init=False, default=0)
    _waiters: collections.deque[_Waiter] = attrs.field(init=False, factory=collections.deque)

    async def reserve(self, amount: int) -> None:
        if amount > self.capacity:
            raise ValueError(f"cannot reserve {amount} of {self.capacity}")
        if not self._waiters and self.reserved + amount <= self.capacity:
            self._take(amount)
            return
        waiter = _Waiter(amount)
        self._waiters.append(waiter)
        try:
            await waiter.granted.wait()
        except BaseException:
            if waiter.granted.is_set():  # granted, then interrupted before it could be used
                self.release(amount)
            else:
                self._waiters.remove(waiter)
                self._grant()  # it may have been first in line, blocking smaller ones
            raise

    def release(self, amount: int) -> None:
        self.reserved -= amount
        self._grant()

    def _take(self, amount: int) -> None:
        self.reserved += amount
        self.peak = max(self.peak, self.reserved)

    def _grant(self) -> None:
        while self._waiters and self.reserved + self._waiters[0].amount <= self.capacity:
            waiter = self._waiters.popleft()
            self._take(waiter.amount)
            waiter.granted.set()


@attrs.define(eq=False)
class _Waiter:
    amount: int
    granted: trio.Event = attrs.field(factory=trio.Event)
