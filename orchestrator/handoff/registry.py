"""The trainer hand-off formats by name: what `[trainer] format` may say.

Every place that depends on the format (the daemon's shipping and start-up, the config's
checks, `check-config`, the local trainer) asks `handoff_format` for one. Adding a format
is a folder beside `native/` and `primerl/` whose face exports a `HandoffFormat`, and its
entry here.
"""

from __future__ import annotations

from orchestrator.handoff.contract import HandoffFormat
from orchestrator.handoff.native import NATIVE_FORMAT
from orchestrator.handoff.primerl import PRIME_RL_FORMAT

__all__ = [
    "HANDOFF_FORMATS",
    "UnknownFormat",
    "format_names",
    "handoff_format",
]

# The registry. Tests may add a format for their duration (`monkeypatch.setitem`).
HANDOFF_FORMATS: dict[str, HandoffFormat] = {
    handoff.name: handoff
    for handoff in (
        NATIVE_FORMAT,
        PRIME_RL_FORMAT,
    )
}


class UnknownFormat(ValueError):
    """No format of that name is registered; the message lists those that are."""

    def __init__(self, name: str) -> None:
        known = ", ".join(f'"{known}"' for known in format_names())
        super().__init__(f'unknown trainer format "{name}" (known: {known})')
        self.name = name


def format_names() -> tuple[str, ...]:
    """The registered formats' names, in registration order ("native" first)."""
    return tuple(HANDOFF_FORMATS)


def handoff_format(name: str) -> HandoffFormat:
    """The format registered as `name`. Raises `UnknownFormat` (a ValueError) naming the
    known ones."""
    try:
        return HANDOFF_FORMATS[name]
    except KeyError:
        raise UnknownFormat(name) from None
