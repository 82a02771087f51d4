"""cProfile figures as the report shows them: (own seconds, cumulative seconds, function),
the daemon's files named from `orchestrator/`."""

from __future__ import annotations

import cProfile
import pstats
import re
from collections.abc import Callable

from _scale.workload import TOP_FUNCTIONS


def profile_of(fn: Callable[[], object]) -> list[tuple[float, float, str]]:
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    return profile_rows(profile)[:TOP_FUNCTIONS]


def profile_rows(profile: cProfile.Profile) -> list[tuple[float, float, str]]:
    """(own seconds, cumulative seconds, function) of every function, most own time first."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = [
        (own, cumulative, function_name(file, line, name))
        for (file, line, name), (_, _, own, cumulative, _) in stats.items()
    ]
    rows.sort(reverse=True)
    return rows


def function_name(file: str, line: int, name: str) -> str:
    if file == "~":
        return name  # a C function: "<built-in method ...>"
    if "/site-packages/" in file:
        file = file.split("/site-packages/", 1)[1]
    elif "/orchestrator/" in file:
        file = "orchestrator/" + file.rsplit("/orchestrator/", 1)[1]
    else:
        file = re.sub(r"^.*/lib/python3\.\d+/", "", file)
    return f"{name} ({file}:{line})"
