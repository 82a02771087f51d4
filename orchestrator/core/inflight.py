"""The in-flight limit: how many rollouts may run at once (docs/design.md §3, "Dispatching
only what can finish fresh").

With more rollouts in flight than the fleet turns around within a trainer step, requests
queue at the servers, groups take longer than the staleness limits allow and are dropped
when they end: safe (their files are deleted), but wasted work and disk. The adaptive
limit dispatches only what can finish fresh, from what it observes of each group the sink
takes:

- its *turnaround*: from dispatch to the moment the sink takes it (waiting for admission
  included);
- its *allowance*: how many batches may ship while it is in flight before it is stale,
  `last_step(start version) - the batch being filled at its dispatch` (at least `m - a`);
- and the *step time*, the moving average of the interval between shipped batches: the
  clock staleness is counted in.

A group has about `allowance + 1/2` step times before it goes stale (the next batch ships
half a step time after its dispatch, on average), so `turnaround / ((allowance + 1/2) x
step time)` is the share of its slack it used. After each shipped batch, with enough
groups seen since the last decision, the limit is moved towards the in-flight count at
which the 90th percentile of that share is 1. By Little's law the rollouts in flight over
the window are the groups' total time in flight over the window's length; once the fleet
is saturated, turnaround grows in proportion to them, so `in flight / p90 share` is the
count that meets it. The step is damped (half of it, in log scale; at most halved or
raised by half at once), and a window in which more than 5% of the groups arrived stale
cuts the limit by a fifth whatever the shares say. The limit never goes below one group or
above `inference.max_inflight`. With `inference.inflight_limit = "fixed"` it stays at
`max_inflight`.

Pure: the caller passes the clock's readings in.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import attrs

InflightMode = Literal["adaptive", "fixed"]
INFLIGHT_MODES: tuple[InflightMode, ...] = get_args(InflightMode)

#: Groups a decision needs at least; fewer are carried into the next window.
MIN_GROUPS_PER_DECISION = 8
#: The share of groups arriving stale above which the limit is cut regardless.
STALE_SHARE_CUT = 0.05
#: The factor that cut applies.
STALE_CUT_FACTOR = 0.8
#: The furthest one decision moves the limit, down and up.
MAX_DECREASE = 0.5
MAX_INCREASE = 1.5
#: The weight of the newest interval in the step time's moving average.
STEP_TIME_WEIGHT = 0.3
#: Which quantile of the share of slack used must stay within 1.
TURNAROUND_QUANTILE = 0.9


@attrs.frozen
class LimitDecision:
    """One decision of the adaptive limit and what it was made from. `slack_used_p90` is
    the 90th percentile of the share of their slack the window's groups used (1: as late
    as they could be and still fresh, on average)."""

    limit: int
    previous: int
    turnaround_p90_s: float
    slack_used_p90: float
    step_time_s: float
    inflight_mean: float
    groups: int
    stale_groups: int
    min_allowance: int = 0
    previous_min_allowance: int = 0

    @property
    def changed(self) -> bool:
        return self.limit != self.previous or self.min_allowance != self.previous_min_allowance


@attrs.frozen
class _Admitted:
    turnaround_s: float
    allowance: int  # batches that may ship while it is in flight


@attrs.define
class InflightLimit:
    """The limit the dispatcher gate reads (`limit`), and what it learns from.

    `group_admitted` is called for every group the sink takes, `shipped` after every
    shipped batch; `shipped` returns the decision it made, if any.
    """

    mode: InflightMode
    ceiling: int  # inference.max_inflight
    group_size: int
    limit: int = attrs.field(init=False)
    # The least allowance a group dispatched now should have: the batches a typical
    # group sees ship while it runs (see `_decide`). 0: no hold.
    min_allowance: int = attrs.field(init=False, default=0)
    step_time_s: float | None = attrs.field(init=False, default=None)
    last: LimitDecision | None = attrs.field(init=False, default=None)
    _last_ship: float | None = attrs.field(init=False, default=None)
    _window_start: float | None = attrs.field(init=False, default=None)
    _groups: list[_Admitted] = attrs.field(init=False, factory=list)
    _stale: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if self.ceiling < 1 or self.group_size < 1:
            raise ValueError("ceiling and group_size must be >= 1")
        self.limit = self.ceiling

    @property
    def floor(self) -> int:
        """One group: the dispatcher never stops altogether."""
        return min(self.group_size, self.ceiling)

    def started(self, now: float) -> None:
        """Dispatching starts at `now`: the first window opens."""
        self._window_start = now

    def group_admitted(self, turnaround_s: float, *, allowance: int, stale: bool) -> None:
        """A group reached the sink `turnaround_s` after its dispatch; `allowance`: the
        batches that could ship meanwhile before it went stale; `stale`: too old to ship
        by then."""
        self._groups.append(_Admitted(max(turnaround_s, 0.0), max(allowance, 0)))
        self._stale += stale

    def shipped(self, now: float) -> LimitDecision | None:
        """A batch shipped at `now`: learn the step time and, with enough groups seen,
        decide the limit. Returns the decision, or None when none was made."""
        if self._last_ship is not None and now > self._last_ship:
            interval = now - self._last_ship
            self.step_time_s = (
                interval
                if self.step_time_s is None
                else STEP_TIME_WEIGHT * interval + (1 - STEP_TIME_WEIGHT) * self.step_time_s
            )
        self._last_ship = now
        if self._window_start is None:
            self._window_start = now
        window_s = now - self._window_start
        if (
            self.mode == "fixed"
            or self.step_time_s is None
            or len(self._groups) < MIN_GROUPS_PER_DECISION
            or window_s <= 0
        ):
            return None
        decision = self._decide(window_s, self.step_time_s)
        self.limit = decision.limit
        self.min_allowance = decision.min_allowance
        self.last = decision
        self._window_start = now
        self._groups.clear()
        self._stale = 0
        return decision

    def _decide(self, window_s: float, step_time_s: float) -> LimitDecision:
        turnarounds = sorted(g.turnaround_s for g in self._groups)
        used = sorted(g.turnaround_s / ((g.allowance + 0.5) * step_time_s) for g in self._groups)
        p90 = _quantile(used, TURNAROUND_QUANTILE)
        # Little's law: rollouts in flight = their total time in flight / the window.
        inflight = sum(turnarounds) * self.group_size / window_s
        previous = self.limit
        wanted = inflight / max(p90, 1e-9)
        if p90 <= 1:
            # In time: never lower, and higher only when the limit held the count back.
            wanted = max(previous, wanted)
        # Half the step in log scale: turnaround answers a change a turnaround late.
        proposed = math.sqrt(previous * max(wanted, 1.0))
        if self._stale / len(self._groups) > STALE_SHARE_CUT:
            proposed = min(proposed, previous * STALE_CUT_FACTOR)
        proposed = min(max(proposed, previous * MAX_DECREASE), previous * MAX_INCREASE)
        # A group dispatched with less allowance than the typical one needs would most
        # likely go stale: the dispatcher holds it until a new version gives more.
        median = _quantile(turnarounds, 0.5)
        min_allowance = max(0, math.ceil(median / step_time_s - 0.5))
        return LimitDecision(
            min_allowance=min_allowance,
            previous_min_allowance=self.min_allowance,
            limit=min(max(int(proposed), self.floor), self.ceiling),
            previous=previous,
            turnaround_p90_s=_quantile(turnarounds, TURNAROUND_QUANTILE),
            slack_used_p90=p90,
            step_time_s=step_time_s,
            inflight_mean=inflight,
            groups=len(self._groups),
            stale_groups=self._stale,
        )


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
