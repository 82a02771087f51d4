"""The daemon's running account of payload bytes on disk (docs/design.md §8): files enter
it when a group's check finds them, and leave it when a discard deletes them or a
collection removes their version; the peak is its value right before a collection."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from payload_gc import FileRemoval

from orchestrator.daemon.payload_files.account import PayloadAccount, payload_file_key
from orchestrator.daemon.payload_files.ledger import PayloadLedger

ROOT = Path("/runs/x/payloads")


def test_payload_file_key_takes_only_the_daemons_own_paths() -> None:
    assert payload_file_key(str(ROOT), f"{ROOT}/v3/a.bin") == (3, "a.bin")
    assert payload_file_key(str(ROOT), f"{ROOT}/v03/a.bin") is None
    assert payload_file_key(str(ROOT), f"{ROOT}/v3/sub/a.bin") is None
    assert payload_file_key(str(ROOT), f"{ROOT}/v3/") is None
    assert payload_file_key(str(ROOT), "/elsewhere/v3/a.bin") is None


def test_files_enter_once_and_leave_by_discard_or_collection() -> None:
    account = PayloadAccount()
    account.add({(1, "a"): 100, (1, "b"): 50, (2, "c"): 7})
    account.add({(1, "a"): 120})  # counted again: once, at its latest size
    assert (account.files, account.bytes) == (3, 177)
    assert account.remove([(1, "b"), (1, "never counted"), (9, "x")]) == (1, 50)
    assert (account.files, account.bytes) == (2, 127)
    assert account.remove_below(2) == (1, 120)
    assert account.versions() == [2]
    assert account.remove_below(5, keep=[2]) == (0, 0)
    assert account.remove_below(5) == (1, 7)
    assert (account.files, account.bytes, account.versions()) == (0, 0, [])


def test_the_peak_is_the_account_right_before_a_collection() -> None:
    ledger = PayloadLedger()
    ledger.record_written({(0, "a"): 1000, (0, "b"): 500}, collected_below=None)
    ledger.record_written({(1, "c"): 300}, collected_below=None)
    assert (ledger.bytes, ledger.peak_bytes) == (1800, 1800)
    ledger.record_collected(1)
    assert (ledger.bytes, ledger.peak_bytes) == (300, 1800)
    assert (ledger.files_written, ledger.bytes_written) == (3, 1800)
    ledger.record_written({(1, "d"): 2000}, collected_below=None)
    assert ledger.peak_bytes == 2300


def test_discards_take_out_what_they_deleted_and_nothing_else() -> None:
    ledger = PayloadLedger()
    ledger.record_written(
        {(4, "a.bin"): 10, (4, "b.bin"): 20, (4, "c.bin"): 40}, collected_below=None
    )
    paths = [f"{ROOT}/v4/a.bin", f"{ROOT}/v4/b.bin", f"{ROOT}/v4/unchecked.bin", "/else/x"]
    # b.bin could not be deleted: it stays on disk, and in the account.
    removal = FileRemoval(2, 10, ("b.bin: Permission denied",), 1, left=((4, "b.bin"),))
    ledger.record_files_deleted(ROOT, paths, removal, reason="discard")
    assert ledger.bytes == 60
    assert sorted(ledger.account.versions()) == [4]


def test_a_check_that_ends_after_its_version_was_collected_adds_nothing() -> None:
    ledger = PayloadLedger()
    ledger.record_written({(3, "a"): 10}, collected_below=None)
    ledger.record_collected(4)
    # The check stat-ed v3's file just before the collection removed it.
    ledger.record_written({(3, "late"): 99, (4, "new"): 5}, collected_below=4)
    assert ledger.bytes == 5
    assert ledger.account.versions() == [4]
    assert ledger.bytes_written == 10 + 99 + 5


def test_a_version_the_collection_could_not_delete_stays_counted() -> None:
    ledger = PayloadLedger()
    ledger.record_written({(1, "a"): 10, (2, "b"): 20, (3, "c"): 40}, collected_below=None)
    ledger.record_collected(3, failed=[2])
    assert ledger.account.versions() == [2, 3]
    assert ledger.bytes == 60


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("write"),
            st.dictionaries(
                st.tuples(st.integers(0, 6), st.sampled_from("abcde")),
                st.integers(0, 1000),
                max_size=4,
            ),
        ),
        st.tuples(
            st.just("discard"),
            st.lists(st.tuples(st.integers(0, 6), st.sampled_from("abcdef")), max_size=4),
        ),
        st.tuples(st.just("collect"), st.integers(0, 7)),
    ),
    max_size=30,
)


@settings(max_examples=200)
@given(ops=OPS)
def test_the_account_is_what_a_model_of_the_disk_holds(ops: list[tuple[str, object]]) -> None:
    """Against a model of the disk: the files written, minus those deleted."""
    ledger = PayloadLedger()
    disk: dict[tuple[int, str], int] = {}
    bound: int | None = None
    peak_before_collections = 0
    for op, arg in ops:
        if op == "write":
            assert isinstance(arg, dict)
            disk.update({k: v for k, v in arg.items() if bound is None or k[0] >= bound})
            ledger.record_written(arg, collected_below=bound)
        elif op == "discard":
            assert isinstance(arg, list)
            paths = [f"{ROOT}/v{v}/{name}" for v, name in arg]
            for key in arg:
                disk.pop(key, None)
            ledger.record_files_deleted(ROOT, paths, FileRemoval(0, 0), reason="discard")
        else:
            assert isinstance(arg, int)
            peak_before_collections = max(peak_before_collections, ledger.bytes)
            bound = arg if bound is None else max(bound, arg)
            disk = {k: v for k, v in disk.items() if k[0] >= arg}
            ledger.record_collected(arg)
        assert ledger.bytes == sum(disk.values())
        assert ledger.account.files == len(disk)
        assert ledger.peak_bytes >= max(peak_before_collections, ledger.bytes)
