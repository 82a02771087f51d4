"""The collection plan, pure: which direct children go and why the others stay."""

from __future__ import annotations

from payload_gc import (
    EntryKind,
    KeepReason,
    RootEntry,
    Usage,
    min_fresh_version,
    plan_collection,
    unmarked_root_refusal,
)


def _dirs(*names: str) -> list[RootEntry]:
    return [RootEntry(name, EntryKind.DIRECTORY) for name in names]


def test_design_test_vector() -> None:
    # m = 2, directories v0..v11, v10 applied everywhere: keep v8..v11, delete v0..v7.
    entries = _dirs(*(f"v{k}" for k in range(12)))
    bound = min_fresh_version(10 + 1, 2)
    assert bound == 8
    plan = plan_collection(entries, bound)
    assert [d.name for d in plan.delete] == [f"v{k}" for k in range(8)]
    assert [k.name for k in plan.keep] == ["v8", "v9", "v10", "v11"]
    assert {k.reason for k in plan.keep} == {KeepReason.AT_OR_ABOVE_BOUND}


def test_negative_and_zero_bounds_delete_nothing() -> None:
    entries = _dirs("v0", "v1", "v2")
    for bound in (-5, -1, 0):
        plan = plan_collection(entries, bound)
        assert plan.delete == ()
        assert [k.name for k in plan.keep] == ["v0", "v1", "v2"]


def test_order_is_numeric_not_lexical() -> None:
    plan = plan_collection(_dirs("v10", "v2", "v1", "v20"), 15)
    assert [d.version for d in plan.delete] == [1, 2, 10]
    assert [k.name for k in plan.keep] == ["v20"]


def test_every_kept_entry_has_its_reason() -> None:
    entries = [
        RootEntry("v1", EntryKind.DIRECTORY, usage=Usage(3, 30)),
        RootEntry("v2", EntryKind.SYMLINK, usage=Usage(0, 0)),
        RootEntry("v3", EntryKind.FILE),
        RootEntry("v4", EntryKind.DIRECTORY, same_filesystem=False),
        RootEntry("v5", EntryKind.OTHER),
        RootEntry("v9", EntryKind.DIRECTORY),
        RootEntry("vx", EntryKind.DIRECTORY),
        RootEntry("v007", EntryKind.DIRECTORY),
        RootEntry("notes.txt", EntryKind.FILE),
        RootEntry(".payload-gc", EntryKind.DIRECTORY),
        RootEntry(".payload-root", EntryKind.FILE),
    ]
    plan = plan_collection(entries, 9)
    assert [(d.name, d.kind) for d in plan.delete] == [
        ("v1", EntryKind.DIRECTORY),
        ("v2", EntryKind.SYMLINK),
    ]
    assert plan.files == 3
    assert plan.bytes == 30
    reasons = {k.name: k.reason for k in plan.keep}
    assert reasons == {
        "v3": KeepReason.NOT_A_DIRECTORY,
        "v4": KeepReason.MOUNT_POINT,
        "v5": KeepReason.NOT_A_DIRECTORY,
        "v9": KeepReason.AT_OR_ABOVE_BOUND,
        "vx": KeepReason.NOT_A_VERSION,
        "v007": KeepReason.NOT_CANONICAL,
        "notes.txt": KeepReason.NOT_A_VERSION,
        ".payload-gc": KeepReason.CONTROL,
        ".payload-root": KeepReason.CONTROL,
    }
    assert plan.marked
    assert set(plan.foreign) == {"v3", "v5", "vx", "v007", "notes.txt"}


def test_a_symlink_below_the_bound_goes_with_no_files() -> None:
    plan = plan_collection([RootEntry("v3", EntryKind.SYMLINK, usage=Usage(0, 0))], 4)
    assert len(plan.delete) == 1
    assert plan.delete[0].usage == Usage(0, 0)


def test_marker_must_be_a_regular_file() -> None:
    plan = plan_collection([RootEntry(".payload-root", EntryKind.DIRECTORY)], 1)
    assert not plan.marked
    assert plan.foreign == ()


def test_only_versions_and_control_entries_are_not_foreign() -> None:
    plan = plan_collection([*_dirs("v0", "v5"), RootEntry(".payload-gc", EntryKind.DIRECTORY)], 3)
    assert plan.foreign == ()
    assert not plan.marked


def test_an_unmarked_root_with_foreign_entries_is_refused_in_one_line() -> None:
    entries = [*_dirs("v0", "v1"), RootEntry("notes.txt", EntryKind.FILE)]
    assert unmarked_root_refusal("/r", plan_collection(entries, 1)) == (
        "/r has no .payload-root marker and holds entries that are not version directories "
        "(e.g. 'notes.txt'); if it really is a payload root, mark it with "
        "`payload-gc --root /r --init`"
    )
    marked = plan_collection([*entries, RootEntry(".payload-root", EntryKind.FILE)], 1)
    assert unmarked_root_refusal("/r", marked) is None
    assert unmarked_root_refusal("/r", marked, wipe=True) is None


def test_a_wipe_refuses_any_unmarked_entry_a_collection_only_foreign_ones() -> None:
    control = RootEntry(".payload-gc", EntryKind.DIRECTORY)
    plan = plan_collection([*_dirs("v3", "v0"), control], 2)
    assert unmarked_root_refusal("/r", plan) is None
    assert unmarked_root_refusal("/r", plan, wipe=True) == (
        "/r has no .payload-root marker and holds entries a wipe would delete (e.g. 'v0'); "
        "if it really is a payload root, mark it with `payload-gc --root /r --init`"
    )
    assert unmarked_root_refusal("/r", plan_collection([control], 2), wipe=True) is None
