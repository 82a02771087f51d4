"""How the report writes durations, shares and verdicts."""

from __future__ import annotations

import math


def ms(seconds: float) -> str:
    return "inf" if math.isinf(seconds) else f"{seconds * 1e3:,.1f} ms"


def verdict(ok: bool) -> str:
    return "met" if ok else "**MISSED**"


def share(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole > 0 else "-"
