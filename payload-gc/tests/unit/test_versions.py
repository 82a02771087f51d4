"""The staleness bound and version directory names (docs/design.md §3), pure."""

from __future__ import annotations

import pytest
from payload_gc import (
    EntryKind,
    KeepReason,
    RootEntry,
    min_fresh_version,
    parse_version,
    plan_collection,
)


def test_bound_is_step_minus_one_minus_m() -> None:
    assert min_fresh_version(11, 2) == 8
    assert min_fresh_version(1, 0) == 0
    assert min_fresh_version(5, 0) == 4


def test_bound_may_be_negative_early_in_a_run() -> None:
    # No clamp: batch 1 with m = 3 admits any start version.
    assert min_fresh_version(1, 3) == -3
    assert min_fresh_version(0, 0) == -1


def test_negative_max_off_policy_steps_is_an_error() -> None:
    with pytest.raises(ValueError, match="max_off_policy_steps must be >= 0, got -1"):
        min_fresh_version(3, -1)


@pytest.mark.parametrize(
    ("name", "version"),
    [("v0", 0), ("v3", 3), ("v10", 10), ("v123456789012", 123456789012)],
)
def test_parse_canonical_names(name: str, version: int) -> None:
    assert parse_version(name) == version


@pytest.mark.parametrize(
    "name",
    [
        "",
        "v",
        "v-1",
        "v+1",
        "v3a",
        "v 3",
        "v3 ",
        "v3\n",
        "V3",
        "3",
        "vv3",
        "v3.0",
        "v٣",  # ARABIC-INDIC DIGIT THREE: str.isdigit accepts it, we do not
        "v³",  # SUPERSCRIPT THREE
        "v007",  # leading zeros: not the canonical name of version 7
        "v00",
        ".v3",
        "v3/",
    ],
)
def test_parse_rejects_everything_else(name: str) -> None:
    assert parse_version(name) is None


def _keep_reason(name: str) -> KeepReason:
    """Why a directory named `name` stays in a collection at bound 0 (which deletes
    nothing)."""
    (kept,) = plan_collection([RootEntry(name, EntryKind.DIRECTORY)], 0).keep
    return kept.reason


@pytest.mark.parametrize("name", ["v00", "v007", "v010", "v0000000000001"])
def test_leading_zeros_look_like_a_version_but_are_not_canonical(name: str) -> None:
    assert parse_version(name) is None
    assert _keep_reason(name) is KeepReason.NOT_CANONICAL


@pytest.mark.parametrize(
    "name", ["v0", "v7", "v10", "", "v", "0", "00", "V007", "v0a", "v-07", "v0٣", "v 07", "x007"]
)
def test_canonical_and_other_names_are_not_noncanonical_versions(name: str) -> None:
    assert _keep_reason(name) is not KeepReason.NOT_CANONICAL
