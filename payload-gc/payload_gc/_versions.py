"""Version directory names and the staleness bound (docs/design.md §3), pure arithmetic."""

from __future__ import annotations


def min_fresh_version(step: int, max_off_policy_steps: int) -> int:
    """The oldest start version a rollout of batch `step` may have: `(step - 1) - m`.

    After every inference server has applied `v{s}`, every `v<k>` with
    `k < min_fresh_version(s + 1, m)` can be deleted: batches `<= s` were read, and every
    later batch only holds rollouts dispatched at or above that bound. The result may be
    negative early in a run (then nothing is below it); it is deliberately not clamped.

    Raises `ValueError` if `max_off_policy_steps` is negative.
    """
    if max_off_policy_steps < 0:
        raise ValueError(f"max_off_policy_steps must be >= 0, got {max_off_policy_steps}")
    return (step - 1) - max_off_policy_steps


def parse_version(name: str) -> int | None:
    """The version `k` of a directory named `v<k>`, or `None` for any other name.

    Only the canonical spelling `f"v{k}"` counts: `v` followed by ASCII digits, with no
    sign, no suffix, lower-case `v`, and no leading zero (`v0` is version 0, but `v007`
    and `v00` are not versions). Writers name directories `f"v{k}"`, so every version
    has exactly one name, and a directory somebody named by hand is never collected.
    """
    digits = name[1:]
    if not name.startswith("v") or not digits.isascii() or not digits.isdigit():
        return None
    if len(digits) > 1 and digits.startswith("0"):
        return None
    return int(digits)


def is_noncanonical_version(name: str) -> bool:
    """Whether `name` looks like a version but is not its canonical spelling: `v`, then
    ASCII digits with a leading zero (`v010`, `v00`). `parse_version` rejects these, so
    they are never collected; this only tells them apart from other names in reports."""
    digits = name[1:]
    return (
        name.startswith("v")
        and len(digits) > 1
        and digits.isascii()
        and digits.isdigit()
        and digits.startswith("0")
    )


def version_name(version: int) -> str:
    """The directory name of version `version` (`3` -> `"v3"`); the inverse of
    `parse_version`."""
    return f"v{version}"


def format_bound(bound: int) -> str:
    """A bound for people: `v8` for 8; a negative bound is shown as the number itself."""
    return version_name(bound) if bound >= 0 else str(bound)
