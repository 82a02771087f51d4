"""Fault injection for the simulated server: which fault, if any, a request gets.

Pure logic. Each request draws one uniform number per knob from the server's seeded
generator, always the same count in the same order, so a run with the same fault seed
and the same request order injects the same faults, and knobs do not influence each other.
"""

from __future__ import annotations

import enum

import attrs
import numpy as np

__all__ = ["Fault", "FaultDraw", "FaultRates", "draw_fault"]


class Fault(enum.Enum):
    """The faults a request can get; values are the names used on `/health` and the CLI."""

    HTTP_500 = "http_500"
    HANG = "hang"
    MALFORMED = "malformed"
    BAD_SEGMENT = "bad_segment"
    PAYLOAD_ERROR = "payload_error"


_rate = attrs.validators.and_(attrs.validators.ge(0.0), attrs.validators.le(1.0))


@attrs.frozen
class FaultRates:
    """Per-request probability of each fault, each in [0, 1].

    Checked in this order, first hit wins: `http_500` (HTTP 500 with vLLM's error body,
    nothing generated), `hang` (no answer until the client gives up), `malformed`
    (status 200, truncated JSON), then, for by-handle requests only (prime-rl's form with
    a `payload_dir`), `bad_segment` (the first segment of the first choice names a file
    outside the payload directory, or an offset past the end of its file) and
    `payload_error` (the first choice reports a write failure: `"payload_error"` and a
    null `payload`). A `malformed` reply is generated (and its payload files written)
    before the body is cut, as when a proxy drops the end of a real reply: the files are
    left to the version collector.
    """

    http_500: float = attrs.field(default=0.0, validator=_rate)
    hang: float = attrs.field(default=0.0, validator=_rate)
    malformed: float = attrs.field(default=0.0, validator=_rate)
    bad_segment: float = attrs.field(default=0.0, validator=_rate)
    payload_error: float = attrs.field(default=0.0, validator=_rate)

    def rate(self, fault: Fault) -> float:
        """The probability of `fault`."""
        rate: float = getattr(self, fault.value)
        return rate


@attrs.frozen
class FaultDraw:
    """The faults one request drew: the fault it gets, and a coin for faults with variants."""

    fault: Fault | None
    variant: float


def draw_fault(rng: np.random.Generator, rates: FaultRates, *, by_handle: bool) -> FaultDraw:
    """Draw the fault for one request (None: serve it normally).

    Always consumes the same numbers from `rng`, whatever the outcome.
    """
    draws = rng.random(len(Fault) + 1)
    for fault, draw in zip(Fault, draws, strict=False):
        if fault in (Fault.BAD_SEGMENT, Fault.PAYLOAD_ERROR) and not by_handle:
            continue
        if draw < rates.rate(fault):
            return FaultDraw(fault=fault, variant=float(draws[-1]))
    return FaultDraw(fault=None, variant=float(draws[-1]))
