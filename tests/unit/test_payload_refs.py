"""Reference counts of payload files: holds, pins, orphans and forgetting collected versions."""

from __future__ import annotations

import pytest

from orchestrator.core.payload_refs import PayloadRefs

SHARED = "/root/v3/shared.bin"
A = "/root/v3/a.bin"
B = "/root/v3/b.bin"


def test_release_returns_a_file_when_its_last_hold_goes() -> None:
    refs = PayloadRefs()
    refs.hold([SHARED, A])
    refs.hold([SHARED, B])

    assert refs.release([SHARED, A]) == [A]
    assert refs.is_referenced(SHARED)
    assert refs.release([SHARED, B]) == [SHARED, B]
    assert refs.held_files == 0


def test_release_counts_duplicates_within_one_call() -> None:
    refs = PayloadRefs()
    refs.hold([A, A])

    assert refs.release([A, A]) == [A]
    assert refs.held_files == 0


def test_release_of_an_unheld_file_raises_and_changes_nothing() -> None:
    refs = PayloadRefs()
    refs.hold([A])

    with pytest.raises(ValueError, match=r"released more often than held: /root/v3/b\.bin"):
        refs.release([A, B])
    with pytest.raises(ValueError, match="released more often than held"):
        refs.release([A, A])
    assert refs.is_referenced(A)
    assert refs.release([A]) == [A]


def test_a_pinned_file_is_never_returned() -> None:
    refs = PayloadRefs()
    refs.hold([SHARED, A])
    refs.pin([SHARED])

    assert refs.release([SHARED, A]) == [A]
    assert refs.is_pinned(SHARED)
    assert refs.orphans([SHARED, A, B]) == [A, B]


def test_pinning_twice_is_one_pin() -> None:
    refs = PayloadRefs()
    refs.pin([A])
    refs.pin([A])

    assert refs.pinned_files == 1


def test_orphans_are_neither_held_nor_pinned_in_order_each_once() -> None:
    refs = PayloadRefs()
    refs.hold([A])
    refs.pin([B])

    assert refs.orphans([SHARED, A, B, SHARED, "/root/v4/c.bin"]) == [
        SHARED,
        "/root/v4/c.bin",
    ]


def test_drop_versions_below_forgets_pins_of_collected_directories_only() -> None:
    refs = PayloadRefs()
    refs.pin(["/root/v2/x.bin", "/root/v2/y.bin", "/root/v4/z.bin", "/root/v5/w.bin"])
    # Not a canonical version name: the collector never removes it, so neither do we.
    refs.pin(["/root/v03/q.bin", "/root/other/r.bin"])

    assert refs.drop_versions_below(5) == 3
    assert not refs.is_pinned("/root/v2/x.bin")
    assert not refs.is_pinned("/root/v4/z.bin")
    assert refs.is_pinned("/root/v5/w.bin")
    assert refs.is_pinned("/root/v03/q.bin")
    assert refs.is_pinned("/root/other/r.bin")
    assert refs.pinned_files == 3


def test_drop_versions_below_keeps_holds() -> None:
    refs = PayloadRefs()
    refs.hold(["/root/v1/held.bin"])
    refs.pin(["/root/v1/held.bin"])

    assert refs.drop_versions_below(2) == 1
    assert refs.is_referenced("/root/v1/held.bin")
    # The collector removed v1 already; deleting the file again is harmless.
    assert refs.release(["/root/v1/held.bin"]) == ["/root/v1/held.bin"]


def test_pins_stay_bounded_over_a_long_run() -> None:
    refs = PayloadRefs()
    m = 2
    for step in range(1, 2001):
        refs.pin([f"/root/v{step - 1}/{step}-{i}.bin" for i in range(8)])
        # After v{step} is applied the collector removes every v<k> below
        # min_fresh_version(step + 1, m) = step - m, so only v{step - m} .. v{step - 1} stay.
        refs.drop_versions_below(step - m)
        assert refs.pinned_files <= 8 * m
    assert refs.pinned_files == 8 * m
