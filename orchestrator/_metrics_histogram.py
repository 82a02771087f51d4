"""A fixed-bucket histogram: what Prometheus needs to compute quantiles server-side."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable

import attrs


def _check_bounds(_: object, attribute: attrs.Attribute[tuple[float, ...]], value: object) -> None:
    assert isinstance(value, tuple)
    if not value:
        raise ValueError(f"{attribute.name} must hold at least one bucket bound")
    if not all(math.isfinite(bound) for bound in value):
        raise ValueError(f"{attribute.name} must be finite (+Inf is implied): {value}")
    if any(low >= high for low, high in itertools.pairwise(value)):
        raise ValueError(f"{attribute.name} must be strictly increasing: {value}")


def _float_tuple(bounds: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(bound) for bound in bounds)


@attrs.frozen
class HistogramSnapshot:
    """A histogram at one moment: `cumulative_counts[i]` observations were `<= bounds[i]`;
    `count` and `sum` cover every observation (the implied `+Inf` bucket is `count`)."""

    bounds: tuple[float, ...]
    cumulative_counts: tuple[int, ...]
    count: int
    sum: float


@attrs.define
class Histogram:
    """Counts observations into buckets with the given upper bounds (`le`, inclusive).

    Raises `ValueError` for bounds that are empty, not finite or not strictly increasing.
    """

    bounds: tuple[float, ...] = attrs.field(converter=_float_tuple, validator=_check_bounds)
    # Per bucket, not cumulative: one increment per observation; the last one is +Inf.
    _counts: list[int] = attrs.field(init=False)
    _sum: float = attrs.field(default=0.0, init=False)

    def __attrs_post_init__(self) -> None:
        self._counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Count one observation."""
        # bisect_left: a value equal to a bound belongs to that bound's bucket (`le`).
        # NaN compares false with everything: count it in +Inf rather than in the first.
        index = len(self.bounds) if math.isnan(value) else bisect.bisect_left(self.bounds, value)
        self._counts[index] += 1
        self._sum += value

    @property
    def count(self) -> int:
        """Observations so far."""
        return sum(self._counts)

    def snapshot(self) -> HistogramSnapshot:
        """The current counts, as an immutable value."""
        cumulative: list[int] = []
        running = 0
        for count in self._counts[:-1]:
            running += count
            cumulative.append(running)
        return HistogramSnapshot(self.bounds, tuple(cumulative), self.count, self._sum)
